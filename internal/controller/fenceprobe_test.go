package controller

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

func TestJudgeFenceProbe(t *testing.T) {
	gr := schema.GroupResource{Group: "ipwarden.io", Resource: "ippools"}
	denied := apierrors.NewForbidden(gr, "p", fmt.Errorf("ValidatingAdmissionPolicy '%s' with binding '%s' denied request: fenced", FencePolicyName, FencePolicyName))
	rbac := apierrors.NewForbidden(gr, "p", errors.New("User cannot patch resource"))
	down := errors.New("connection refused")
	for _, tc := range []struct {
		name        string
		ours, stale error
		ok          bool
		why         string
	}{
		{"ours admitted, the stale one denied by the fence", nil, denied, true, ""},
		{"ours denied by the fence (frozen view of the Lease)", denied, denied, false, "kubernetes/kubernetes#130887"},
		{"ours failed otherwise", down, denied, false, "connection refused"},
		{"the stale one admitted", nil, nil, false, "would not deny a stale leader's writes"},
		{"the stale one refused by RBAC, not the fence", nil, rbac, false, "not by the fence policy"},
		{"the stale one failed on the network", nil, down, false, "not by the fence policy"},
	} {
		ok, why := JudgeFenceProbe(tc.ours, tc.stale)
		if ok != tc.ok || !strings.Contains(why, tc.why) || (ok && why != "") {
			t.Errorf("%s: JudgeFenceProbe = %v, %q; want %v with %q", tc.name, ok, why, tc.ok, tc.why)
		}
	}
}

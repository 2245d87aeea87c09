package controller

import (
	"strings"
	"testing"
)

func TestCheckFencePolicy(t *testing.T) {
	good := FenceBinding{Name: FencePolicyName, PolicyName: FencePolicyName, ParamNamespace: "ipwarden-system", ParamName: "ipwarden-controller"}
	other := FenceBinding{Name: "b2", PolicyName: FencePolicyName, ParamNamespace: "kube-system", ParamName: "ipwarden-controller"}
	unrelated := FenceBinding{Name: "x", PolicyName: "something-else", ParamNamespace: "ipwarden-system", ParamName: "ipwarden-controller"}
	for _, tc := range []struct {
		name string
		view FencePolicyView
		want string // "" for no error
	}{
		{"policy and binding for the Lease", FencePolicyView{PolicyExists: true, Bindings: []FenceBinding{unrelated, good}}, ""},
		{"one of two bindings reads the Lease", FencePolicyView{PolicyExists: true, Bindings: []FenceBinding{other, good}}, ""},
		{"no policy", FencePolicyView{Bindings: []FenceBinding{good}}, "is missing"},
		{"no binding", FencePolicyView{PolicyExists: true, Bindings: []FenceBinding{unrelated}}, "has no ValidatingAdmissionPolicyBinding"},
		{"binding reads another Lease", FencePolicyView{PolicyExists: true, Bindings: []FenceBinding{other}}, "b2 reads Lease kube-system/ipwarden-controller"},
		{"binding without a paramRef", FencePolicyView{PolicyExists: true, Bindings: []FenceBinding{{Name: "b3", PolicyName: FencePolicyName}}}, "do not read this controller's Lease"},
	} {
		err := CheckFencePolicy(tc.view, "ipwarden-system", "ipwarden-controller")
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: %v, want an error with %q", tc.name, err, tc.want)
		}
	}
}

package integration

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// A leader-elected controller whose Lease the fence policy's binding does not name refuses to
// lead: the API server would not fence its writes (a stale leader's would land). It says why in
// its log, in a Warning event on its Lease and in ipwarden_controller_fence_policy_ok, and it
// never takes the Lease. (The test control plane installs deploy/'s policy, whose binding names
// ipwarden-system/ipwarden-controller; leading with it is what every other leader-elected test does.)
func TestControllerRefusesToLeadWithoutItsFence(t *testing.T) {
	metrics := freeAddr(t)
	ctrl := startController(t, "--leader-elect=true", "--leader-election-namespace=ipwarden-system",
		"--leader-election-id=ipwarden-elsewhere", "--metrics-bind-address="+metrics)
	eventually(t, 30*time.Second, "the controller to refuse to lead, saying why", func() error {
		if !ctrl.logContains("refusing to lead") || !ctrl.logContains("ipwarden-system/ipwarden-controller") {
			return fmt.Errorf("not logged yet")
		}
		body, err := httpGet("http://" + metrics + "/metrics")
		if err != nil {
			return err
		}
		if v := metricValue(t, body, "ipwarden_controller_fence_policy_ok"); v != 0 {
			return fmt.Errorf("ipwarden_controller_fence_policy_ok = %v", v)
		}
		var events corev1.EventList
		if err := k8s.List(context.Background(), &events, client.InNamespace("ipwarden-system")); err != nil {
			return err
		}
		for _, e := range events.Items {
			if e.Reason == "FenceInvalid" && e.InvolvedObject.Name == "ipwarden-elsewhere" && strings.Contains(e.Message, "refuses to lead") {
				return nil
			}
		}
		return fmt.Errorf("no FenceInvalid event on Lease ipwarden-elsewhere")
	})
	if ctrl.logContains(`"msg":"leading"`) {
		t.Fatal("the controller led without a fence for its Lease")
	}
	if err := k8s.Get(context.Background(), client.ObjectKey{Namespace: "ipwarden-system", Name: "ipwarden-elsewhere"}, &coordinationv1.Lease{}); !apierrors.IsNotFound(err) {
		t.Fatalf("the controller's Lease exists (or cannot be read: %v): it campaigned", err)
	}
}

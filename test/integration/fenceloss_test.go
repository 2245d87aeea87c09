package integration

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/controller"
	"github.com/ipwarden/ipwarden/internal/controlplane"
)

// The fence weakened under running controllers (issue 31). Two leader-elected replicas run as
// the controller's service account with the shipped policy; one leads and serves, the other
// waits. Then the fence is weakened in one of four ways. The leader stops writing and steps down,
// saying so in its log, a FenceLost event on the Lease and its metrics (the process lives on and
// campaigns again); the standby, started while the fence held, never takes the Lease, saying why
// (log, FenceInvalid event, ipwarden_controller_fence_policy_ok 0). While the fence is weak both
// keep trying to take the free Lease and are refused, and a node's new request is not served.
// Once the fence is restored, one of them leads and serves it.
func TestFenceWeakenedUnderRunningControllers(t *testing.T) {
	applyYAML(t, "deploy/kustomize/namespace.yaml")
	applyYAML(t, "deploy/kustomize/controller-rbac.yaml")
	kc, _ := impersonating(t, "ipwarden-system", "ipwarden-controller")
	cases := []struct {
		name   string
		reason controller.FenceProblem
		weaken func(t *testing.T)
		// opens: a write with another holder's fence lands while the fence is weak (with
		// failurePolicy Ignore it takes an error in the check, such as a missing Lease).
		opens bool
	}{
		{"policy deleted", controller.FencePolicyMissing, func(t *testing.T) {
			deleteFenceObject(t, &admissionv1.ValidatingAdmissionPolicy{ObjectMeta: metav1.ObjectMeta{Name: controller.FencePolicyName}})
		}, true},
		{"binding deleted", controller.FenceBindingMissing, func(t *testing.T) {
			deleteFenceObject(t, &admissionv1.ValidatingAdmissionPolicyBinding{ObjectMeta: metav1.ObjectMeta{Name: controller.FencePolicyName}})
		}, true},
		{"Warn-only binding", controller.FenceNotDenying, func(t *testing.T) {
			editFence(t, &admissionv1.ValidatingAdmissionPolicyBinding{}, func(o client.Object) {
				o.(*admissionv1.ValidatingAdmissionPolicyBinding).Spec.ValidationActions = []admissionv1.ValidationAction{admissionv1.Warn}
			})
		}, true},
		{"Ignore policy", controller.FenceFailsOpen, func(t *testing.T) {
			editFence(t, &admissionv1.ValidatingAdmissionPolicy{}, func(o client.Object) {
				ignore := admissionv1.Ignore
				o.(*admissionv1.ValidatingAdmissionPolicy).Spec.FailurePolicy = &ignore
			})
		}, false},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Cleanup(func() { restoreFence(t) }) // also when the case fails half way
			fenceLossScenario(t, i, kc, tc.reason, tc.weaken, tc.opens)
		})
	}
}

func fenceLossScenario(t *testing.T, n int, kc string, reason controller.FenceProblem, weaken func(*testing.T), opens bool) {
	freeLease(t)
	w := watchStatuses(t)
	metricsA, metricsB := freeAddr(t), freeAddr(t)
	args := []string{"--kubeconfig", kc, "--leader-elect=true", "--leader-election-namespace=ipwarden-system",
		"--leader-election-id=ipwarden-controller", "--claim-settle=100ms",
		"--leader-election-lease-duration=2s", "--leader-election-renew-deadline=1500ms", "--leader-election-retry-period=200ms"}
	a := startController(t, append(args, "--metrics-bind-address="+metricsA)...)
	b := startController(t, append(args, "--metrics-bind-address="+metricsB)...)

	pool := fmt.Sprintf("fenceloss-%d", n)
	createPool(t, pool, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{ipwardenv1.CIDR(fmt.Sprintf("10.121.%d.0/26", n))},
		Scaling: ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 0, MaxPerNode: 64}, ReuseCooldown: metav1.Duration{}})
	node := fmt.Sprintf("fenceloss-%d", n)
	createNode(t, node, nil)
	waitAllocation(t, node)
	request(t, node, pool, 8, addr.Set{})
	waitHeld(t, node, pool, 8)

	const serving, leading = `"msg":"controller serving"`, `"msg":"leading"`
	leader, standby, leaderMetrics, standbyMetrics := a, b, metricsA, metricsB
	if b.logContains(serving) {
		leader, standby, leaderMetrics, standbyMetrics = b, a, metricsB, metricsA
	}
	holder, _ := leaseHolder(t)
	if !leader.logContains(serving) || standby.logContains(serving) || !leader.logContains(holder) {
		t.Fatalf("want one serving replica holding the Lease %q: a=%v b=%v", holder, a.logContains(serving), b.logContains(serving))
	}
	for _, m := range []string{leaderMetrics, standbyMetrics} {
		eventually(t, 30*time.Second, "fence_policy_ok 1 on both replicas", func() error {
			return wantMetric(m, "ipwarden_controller_fence_policy_ok", 1)
		})
	}
	if err := fenceProbe(); err == nil || !strings.Contains(err.Error(), controller.FencePolicyName) {
		t.Fatalf("before the fence was weakened, a write with another holder's fence was not denied by it: %v", err)
	}

	weaken(t)
	lost := fmt.Sprintf(`ipwarden_controller_fence_lost_total{reason="%s"}`, reason)
	eventually(t, 30*time.Second, "the leader to stop writing and step down, saying so", func() error {
		if !leader.logContains(`"msg":"fence lost: stopped writing, stepping down"`) || !leader.logContains(`"reason":"`+string(reason)+`"`) {
			return fmt.Errorf("not logged yet")
		}
		if !leader.logContains(`"msg":"stepped down: campaigning again`) {
			return fmt.Errorf("not stepped down yet")
		}
		if err := wantMetric(leaderMetrics, lost, 1); err != nil {
			return err
		}
		if err := wantMetric(leaderMetrics, "ipwarden_controller_fence_policy_ok", 0); err != nil {
			return err
		}
		return wantEvent("FenceLost", "ipwarden controller "+holder+" stopped writing and steps down")
	})
	eventually(t, 30*time.Second, "the standby to refuse to lead, saying why", func() error {
		if !standby.logContains(`"msg":"refusing to lead: the fence policy would not deny a stale leader's writes"`) ||
			!standby.logContains(`"reason":"`+string(reason)+`"`) {
			return fmt.Errorf("not logged yet")
		}
		if err := wantMetric(standbyMetrics, "ipwarden_controller_fence_policy_ok", 0); err != nil {
			return err
		}
		id := identityOf(t, standby)
		return wantEvent("FenceInvalid", "ipwarden controller "+id+" refuses to lead")
	})
	if opens {
		// The weakening is real: the API server now lets a stale leader's write through.
		eventually(t, 30*time.Second, "the API server to let a write with another holder's fence through", fenceProbe)
	}

	// No one holds the Lease now; a node asks for more. Both replicas keep trying to take the
	// Lease and are refused; nothing serves the request.
	request(t, node, pool, 12, addr.Set{})
	refusals := func(p *controllerProcess) int {
		log, _ := os.ReadFile(p.log)
		return strings.Count(string(log), "not taking the Lease")
	}
	ra, rb := refusals(leader), refusals(standby)
	eventually(t, 30*time.Second, "both replicas to be refused the free Lease again", func() error {
		if h, _ := leaseHolder(t); h != "" && h != holder { // released, or left to run out
			return fmt.Errorf("the Lease is held by %q", h)
		}
		if refusals(leader) < ra+3 || refusals(standby) < rb+3 {
			return fmt.Errorf("refusals: leader %d (was %d), standby %d (was %d)", refusals(leader), ra, refusals(standby), rb)
		}
		return nil
	})
	if got := size(held(t, node, pool)); got != 8 {
		t.Fatalf("while the fence was weak, the node's status changed to %d addresses", got)
	}
	if standby.logContains(leading) || strings.Count(readLog(leader), leading) != 1 {
		t.Fatalf("a replica led while the fence was weak: standby %v, leader %d times", standby.logContains(leading), strings.Count(readLog(leader), leading))
	}

	restoreFence(t)
	eventually(t, 60*time.Second, "a replica to lead again once the fence is back, and serve the request", func() error {
		if size(held(t, node, pool)) != 12 {
			return fmt.Errorf("node holds %d", size(held(t, node, pool)))
		}
		return nil
	})
	newHolder, _ := leaseHolder(t)
	if newHolder == "" || newHolder == holder {
		t.Fatalf("after the fence came back the Lease is held by %q (was %q)", newHolder, holder)
	}
	for _, m := range []string{leaderMetrics, standbyMetrics} {
		eventually(t, 30*time.Second, "fence_policy_ok 1 again", func() error { return wantMetric(m, "ipwarden_controller_fence_policy_ok", 1) })
	}
	w.check(t)
}

func readLog(p *controllerProcess) string { b, _ := os.ReadFile(p.log); return string(b) }

// identityOf is a controller's Lease holder identity of its latest campaign, from its log.
func identityOf(t *testing.T, p *controllerProcess) string {
	t.Helper()
	log := readLog(p)
	i := strings.LastIndex(log, `"msg":"leader election"`)
	if i < 0 {
		t.Fatal("no leader election in the log")
	}
	_, rest, ok := strings.Cut(log[i:], `"identity":"`)
	id, _, _ := strings.Cut(rest, `"`)
	if !ok || id == "" {
		t.Fatal("no identity in the log")
	}
	return id
}

func wantMetric(addr, series string, want float64) error {
	body, err := httpGet("http://" + addr + "/metrics")
	if err != nil {
		return err
	}
	for _, line := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			if strings.TrimSpace(v) != fmt.Sprint(want) {
				return fmt.Errorf("%s = %s, want %v", series, v, want)
			}
			return nil
		}
	}
	return fmt.Errorf("no %s", series)
}

// wantEvent finds a Warning event on the controllers' Lease with reason and message prefix.
func wantEvent(reason, prefix string) error {
	var events corev1.EventList
	if err := k8s.List(context.Background(), &events, client.InNamespace(controlplane.ControllerNamespace)); err != nil {
		return err
	}
	for _, e := range events.Items {
		if e.Reason == reason && e.Type == corev1.EventTypeWarning && e.InvolvedObject.Kind == "Lease" &&
			e.InvolvedObject.Name == controlplane.ControllerLease && strings.HasPrefix(e.Message, prefix) {
			return nil
		}
	}
	return fmt.Errorf("no %s event %q on the Lease", reason, prefix)
}

// fenceProbe is a stale leader's write, dry run: an IPPool status update with another holder's
// fence (epoch 0, so no running controller would take it for a newer leader's). The API server
// runs admission on a dry run and stores nothing. nil: the write would land.
func fenceProbe() error {
	var pools ipwardenv1.IPPoolList
	if err := k8s.List(context.Background(), &pools); err != nil {
		return err
	}
	if len(pools.Items) == 0 {
		return fmt.Errorf("no pool to probe")
	}
	p := pools.Items[0]
	p.Status.Fence = &ipwardenv1.Fence{Holder: "fence-probe-stale-leader", Epoch: 0}
	return k8s.Status().Update(context.Background(), &p, client.DryRunAll)
}

func deleteFenceObject(t *testing.T, obj client.Object) {
	t.Helper()
	if err := k8s.Delete(context.Background(), obj); err != nil {
		t.Fatal(err)
	}
}

// editFence changes the fence policy or binding (obj's kind) named FencePolicyName.
func editFence(t *testing.T, obj client.Object, edit func(client.Object)) {
	t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := k8s.Get(context.Background(), client.ObjectKey{Name: controller.FencePolicyName}, obj); err != nil {
			return err
		}
		edit(obj)
		return k8s.Update(context.Background(), obj)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// restoreFence puts back the shipped fence policy and binding and waits until the API server
// enforces them again (a write with another holder's fence is denied), for the tests after.
func restoreFence(t *testing.T) {
	t.Helper()
	for _, obj := range []client.Object{
		&admissionv1.ValidatingAdmissionPolicyBinding{ObjectMeta: metav1.ObjectMeta{Name: controller.FencePolicyName}},
		&admissionv1.ValidatingAdmissionPolicy{ObjectMeta: metav1.ObjectMeta{Name: controller.FencePolicyName}},
	} {
		if err := k8s.Delete(context.Background(), obj); err != nil && !apierrors.IsNotFound(err) {
			t.Fatal(err)
		}
		eventually(t, 30*time.Second, "the weakened fence object gone", func() error {
			if err := k8s.Get(context.Background(), client.ObjectKeyFromObject(obj), obj); !apierrors.IsNotFound(err) {
				return fmt.Errorf("still there (%v)", err)
			}
			return nil
		})
	}
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "the shipped fence policy installed", func() error {
		return controlplane.InstallFencePolicy(context.Background(), restConfig, root)
	})
	eventually(t, 30*time.Second, "the API server to enforce the fence policy again", func() error {
		if err := fenceProbe(); err == nil || !strings.Contains(err.Error(), controller.FencePolicyName) {
			if err != nil && strings.Contains(err.Error(), "no pool to probe") {
				return nil // nothing a stale leader could write to; the next test's own checks apply
			}
			return fmt.Errorf("a write with another holder's fence: %v", err)
		}
		return nil
	})
}

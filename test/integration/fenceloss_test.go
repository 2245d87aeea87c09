package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

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
// Once the fence is restored in place, the replica that stepped down leads again in the same
// process and serves it. After a deletion kube-apiserver's view of the Lease is frozen
// (kubernetes/kubernetes#130887): the next leader finds that with its probe and writes nothing,
// saying so, until kube-apiserver restarts.
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
		// deletes: the weakening deletes an object, which freezes kube-apiserver's view of the
		// Lease until it restarts (kubernetes/kubernetes#130887).
		deletes bool
	}{
		{"policy deleted", controller.FencePolicyMissing, func(t *testing.T) {
			deleteFenceObject(t, &admissionv1.ValidatingAdmissionPolicy{ObjectMeta: metav1.ObjectMeta{Name: controller.FencePolicyName}})
		}, true, true},
		{"binding deleted", controller.FenceBindingMissing, func(t *testing.T) {
			deleteFenceObject(t, &admissionv1.ValidatingAdmissionPolicyBinding{ObjectMeta: metav1.ObjectMeta{Name: controller.FencePolicyName}})
		}, true, true},
		{"Warn-only binding", controller.FenceNotDenying, func(t *testing.T) {
			editFence(t, &admissionv1.ValidatingAdmissionPolicyBinding{}, func(o client.Object) {
				o.(*admissionv1.ValidatingAdmissionPolicyBinding).Spec.ValidationActions = []admissionv1.ValidationAction{admissionv1.Warn}
			})
		}, true, false},
		{"Ignore policy", controller.FenceFailsOpen, func(t *testing.T) {
			editFence(t, &admissionv1.ValidatingAdmissionPolicy{}, func(o client.Object) {
				ignore := admissionv1.Ignore
				o.(*admissionv1.ValidatingAdmissionPolicy).Spec.FailurePolicy = &ignore
			})
		}, false, false},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			// Also when the case fails half way, and after its controllers were killed: the tests
			// after this one need a fence that works.
			t.Cleanup(func() { restoreFence(t, tc.deletes) })
			fenceLossScenario(t, i, kc, tc.reason, tc.weaken, tc.opens, tc.deletes)
		})
	}
}

func fenceLossScenario(t *testing.T, n int, kc string, reason controller.FenceProblem, weaken func(*testing.T), opens, deletes bool) {
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

	if !deletes {
		// Only the replica that stepped down is left to lead: the same process campaigns again.
		standby.kill()
	}
	restoreFenceObjects(t)
	if deletes {
		// kube-apiserver's view of the Lease froze when the object was deleted: the replica that
		// takes the Lease now probes the fence, finds its own fence denied, and writes nothing,
		// saying so. Only a kube-apiserver restart mends it (then, as a Deployment would, a
		// controller is started again: the running ones lose their short leases meanwhile).
		var waiting *controllerProcess
		eventually(t, 60*time.Second, "the new leader to find the API server's fence frozen and write nothing", func() error {
			// (Right after the policy is created again, the API server may not apply it yet:
			// then the probe's stale write is admitted, and the leader says that first.)
			for _, p := range []*controllerProcess{leader, standby} {
				if p.logContains(`"msg":"leading, but writing nothing: the API server's fence does not work for this leader",`+
					`"why":"the API server denies a write carrying this leader's own fence`) && p.logContains("kubernetes/kubernetes#130887") {
					waiting = p
				}
			}
			if waiting == nil {
				return fmt.Errorf("not logged yet")
			}
			m := leaderMetrics
			if waiting == standby {
				m = standbyMetrics
			}
			if err := wantMetric(m, "ipwarden_controller_fence_unenforced", 1); err != nil {
				return err
			}
			h, _ := leaseHolder(t)
			return wantEvent("FenceNotEnforced", "ipwarden controller "+h+" leads but writes nothing")
		})
		if got := size(held(t, node, pool)); got != 8 {
			t.Fatalf("a leader whose fence the API server does not apply wrote: the node holds %d", got)
		}
		leader.kill()
		standby.kill()
		restartAPIServer(t)
		waitFenceCurrent(t)
		startController(t, append(args, "--metrics-bind-address="+freeAddr(t))...)
	}
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
	if !deletes {
		if !leader.Running() || strings.Count(readLog(leader), leading) != 2 || !leader.logContains(newHolder) {
			t.Fatalf("the replica that stepped down does not lead again as %s (running %v)", newHolder, leader.Running())
		}
		if err := wantMetric(leaderMetrics, "ipwarden_controller_fence_policy_ok", 1); err != nil {
			t.Fatal(err)
		}
		if err := wantMetric(leaderMetrics, lost, 1); err != nil {
			t.Fatal(err)
		}
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
//
// The controllers write the pool's status meanwhile, so a probe built from a read that is no
// longer current gets a conflict, which says nothing about the fence: it reads again and retries.
func fenceProbe() error {
	for try := 0; ; try++ {
		var pools ipwardenv1.IPPoolList
		if err := k8s.List(context.Background(), &pools); err != nil {
			return err
		}
		if len(pools.Items) == 0 {
			return fmt.Errorf("no pool to probe")
		}
		p := pools.Items[0]
		p.Status.Fence = &ipwardenv1.Fence{Holder: "fence-probe-stale-leader", Epoch: 0}
		err := k8s.Status().Update(context.Background(), &p, client.DryRunAll)
		if apierrors.IsConflict(err) && try < 20 {
			continue
		}
		return err
	}
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

// restoreFenceObjects puts back the shipped fence policy and binding: edited in place when they
// exist (deleting one would freeze kube-apiserver's view of the Lease), created when not.
func restoreFenceObjects(t *testing.T) {
	t.Helper()
	p, b := shippedFenceObjects(t)
	for _, want := range []client.Object{p, b} {
		err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			cur := want.DeepCopyObject().(client.Object)
			switch err := k8s.Get(context.Background(), client.ObjectKeyFromObject(want), cur); {
			case apierrors.IsNotFound(err):
				return k8s.Create(context.Background(), want.DeepCopyObject().(client.Object))
			case err != nil:
				return err
			}
			switch c := cur.(type) {
			case *admissionv1.ValidatingAdmissionPolicy:
				c.Spec = want.(*admissionv1.ValidatingAdmissionPolicy).Spec
			case *admissionv1.ValidatingAdmissionPolicyBinding:
				c.Spec = want.(*admissionv1.ValidatingAdmissionPolicyBinding).Spec
			}
			return k8s.Update(context.Background(), cur)
		})
		if err != nil {
			t.Fatal(err)
		}
	}
}

// shippedFenceObjects reads deploy/kustomize/fence-policy.yaml.
func shippedFenceObjects(t *testing.T) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
	t.Helper()
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(filepath.Join(root, controlplane.FencePolicyFile))
	if err != nil {
		t.Fatal(err)
	}
	p, b := &admissionv1.ValidatingAdmissionPolicy{}, &admissionv1.ValidatingAdmissionPolicyBinding{}
	for _, doc := range strings.Split(string(raw), "\n---\n") {
		var meta metav1.TypeMeta
		if err := yaml.Unmarshal([]byte(doc), &meta); err != nil {
			t.Fatal(err)
		}
		var into any
		switch meta.Kind {
		case "ValidatingAdmissionPolicy":
			into = p
		case "ValidatingAdmissionPolicyBinding":
			into = b
		default:
			continue
		}
		if err := yaml.Unmarshal([]byte(doc), into); err != nil {
			t.Fatal(err)
		}
	}
	if p.Name == "" || b.Name == "" {
		t.Fatalf("%s lacks the policy or the binding", controlplane.FencePolicyFile)
	}
	return p, b
}

// restoreFence puts the shipped fence back and, after a deletion, restarts kube-apiserver (its
// view of the Lease froze); then it waits until the API server applies the fence to the Lease as
// it is, for the tests after. The case's controllers are gone by then.
func restoreFence(t *testing.T, deleted bool) {
	t.Helper()
	restoreFenceObjects(t)
	if deleted {
		restartAPIServer(t)
	}
	waitFenceCurrent(t)
}

func restartAPIServer(t *testing.T) {
	t.Helper()
	if err := controlPlane.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := controlPlane.RestartAPIServer(ctx); err != nil {
		t.Fatal(err)
	}
}

// waitFenceCurrent waits until the API server admits a dry-run status write carrying the
// Lease's holder and epoch and denies one carrying another holder's: the fence works and sees
// the Lease as it is. A free Lease gets a probe holder for the check (no controller runs) and
// is freed again.
func waitFenceCurrent(t *testing.T) {
	t.Helper()
	holder, epoch := leaseHolder(t)
	if holder == "" {
		holder = "fence-test-probe-holder"
		setLeaseHolder(t, holder)
		defer freeLease(t)
	}
	eventually(t, 60*time.Second, "the API server to apply the fence to the Lease as it is", func() error {
		var pools ipwardenv1.IPPoolList
		if err := k8s.List(context.Background(), &pools); err != nil {
			return err
		}
		if len(pools.Items) == 0 {
			return nil // nothing to probe with; nothing a stale leader could write either
		}
		probe := func(holder string) error {
			p := pools.Items[0].DeepCopy()
			p.Status.Fence = &ipwardenv1.Fence{Holder: holder, Epoch: int64(epoch)}
			return k8s.Status().Update(context.Background(), p, client.DryRunAll)
		}
		if err := probe(holder); err != nil {
			return fmt.Errorf("the Lease holder's own fence: %v", err)
		}
		if err := probe("fence-probe-stale-leader"); err == nil || !strings.Contains(err.Error(), controller.FencePolicyName) {
			return fmt.Errorf("another holder's fence: %v", err)
		}
		return nil
	})
}

func setLeaseHolder(t *testing.T, holder string) {
	t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var l coordinationv1.Lease
		if err := k8s.Get(context.Background(), client.ObjectKey{Namespace: controlplane.ControllerNamespace, Name: controlplane.ControllerLease}, &l); err != nil {
			return err
		}
		l.Spec.HolderIdentity = &holder
		return k8s.Update(context.Background(), &l)
	})
	if err != nil {
		t.Fatal(err)
	}
}

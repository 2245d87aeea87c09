package integration

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
)

// A new or grown pool waits for the nodes whose pods may use its addresses, not for every node
// (issue 31): 20 nodes another pool selects have their NodeIPAllocations but no running agent (a
// DaemonSet still rolling out, or nodes that are down), one node the new pool selects has none
// either, and one node runs its agent. A pool that selects the running node and the down one
// serves the running node's first ADD within --address-wait (10 s), with --pool-settle at 60 s;
// so does the pool grown by a CIDR. Then a pod of the previous IPAM runs on one silent node with
// an address inside a new pool that does not select it: that pool still waits for that node (its
// agent would claim the address), for --pool-settle, and names it alone.
func TestPoolSettleWaitsOnlyForNodesThatMayUseIt(t *testing.T) {
	ctx := context.Background()
	const silent = 20 // nodes of another pool
	agentPool(t, "psettle-other", "psettle-other", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.140.0.0/24"},
		Scaling: ipwardenv1.Scaling{BatchSize: 2, BufferPercent: 0, MaxPerNode: 16}, ReuseCooldown: cooldown(0)})
	var silentNodes []string
	for i := range silent {
		n := fmt.Sprintf("psettle-silent-%02d", i)
		agentNode(t, n, "psettle-other")
		silentNodes = append(silentNodes, n)
	}
	// The running node draws from a base pool, so its agent serves before the new pool exists;
	// so would the down node's.
	agentNode(t, "psettle-run", "psettle")
	agentNode(t, "psettle-down", "psettle")
	silentNodes = append(silentNodes, "psettle-down")
	agentPool(t, "psettle-base", "psettle", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.140.1.0/28"},
		Scaling: ipwardenv1.Scaling{BatchSize: 2, BufferPercent: 0, MaxPerNode: 16}, ReuseCooldown: cooldown(0)})
	// A pod of the previous IPAM on the first silent node, with an address no pool has yet.
	old := createBoundPod(t, "psettle-old", "psettle-silent-00")
	setPodIP(t, old, "10.143.0.1")

	ctrl := startController(t, "--pool-settle=60s")
	for _, n := range silentNodes {
		waitAllocation(t, n)
	}
	a := startAgent(t, "psettle-run", "", "--address-wait=10s")
	a.waitServing(t)
	for _, n := range silentNodes {
		if obs := nipa(t, n).Spec.ObservedPools; len(obs) != 0 {
			t.Fatalf("silent node %s has observed pools %+v: it has no agent", n, obs)
		}
	}

	// addWithin creates a pod on the running node and ADDs it from pool, measuring from since. An
	// ADD the agent refuses because it has not seen the pool yet is tried again, as a runtime
	// retries a sandbox; any other failure (the address wait ran out) fails the test.
	addWithin := func(pod, pool string, since time.Time) (string, time.Duration) {
		t.Helper()
		p := createBoundPod(t, pod, "psettle-run")
		var got string
		eventually(t, 30*time.Second, "the agent to know pool "+pool, func() error {
			r, e := cni(t, "ADD", pluginConf("1.1.0", a.socket, pool), pod, podArgs("default", p.Name, string(p.UID)))
			if e != nil && strings.Contains(e.Msg, "is not an IPPool the agent knows") {
				return e
			}
			if e != nil {
				t.Fatalf("ADD of %s from pool %s failed %s after the pool changed: %v", pod, pool, time.Since(since).Round(time.Millisecond), e)
			}
			got = addrOf(t, r.IPs[0].Address).String()
			return nil
		})
		return got, time.Since(since)
	}
	scaling := ipwardenv1.Scaling{BatchSize: 1, BufferPercent: 0, MaxPerNode: 16, ReleaseDelay: &metav1.Duration{}}
	pool := &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: "psettle"}, Spec: ipwardenv1.IPPoolSpec{
		CIDRs: []ipwardenv1.CIDR{"10.141.0.1/32"}, Scaling: scaling, ReuseCooldown: cooldown(0),
		NodeSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"ipwarden.test/agent": "psettle"}}}}

	// The new pool: the first ADD is served well within --address-wait (the 60 s settle would fail it).
	created := time.Now()
	if err := k8s.Create(ctx, pool); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), pool) })
	got, took := addWithin("psettle-new1", "psettle", created)
	if got != "10.141.0.1" || took > 10*time.Second {
		t.Fatalf("the new pool's first ADD got %s after %s, want 10.141.0.1 within the 10 s address wait", got, took)
	}
	t.Logf("new pool: first ADD answered %s after the pool was created (--pool-settle 60s)", took.Round(time.Millisecond))

	// The pool grows by a CIDR while its only address is in use: the next ADD needs the new one.
	grown := time.Now()
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error { // the controller writes its status
		if err := k8s.Get(ctx, client.ObjectKeyFromObject(pool), pool); err != nil {
			return err
		}
		pool.Spec.CIDRs = append(pool.Spec.CIDRs, "10.141.0.2/32")
		return k8s.Update(ctx, pool)
	}); err != nil {
		t.Fatal(err)
	}
	got, took = addWithin("psettle-new2", "psettle", grown)
	if got != "10.141.0.2" || took > 10*time.Second {
		t.Fatalf("the grown pool's ADD got %s after %s, want 10.141.0.2 within the 10 s address wait", got, took)
	}
	t.Logf("grown pool: ADD answered %s after the CIDR was added (--pool-settle 60s)", took.Round(time.Millisecond))
	if n := settleLines(t, ctrl, "psettle"); n != 2 {
		t.Fatalf("the controller logged %d settles of pool psettle, want 2 (created, grown)", n)
	}

	// A pool over the silent node's old pod's address, selecting only the running node: it waits
	// for that node, and for no other, until --pool-settle (8 s here) passes.
	ctrl.kill()
	<-ctrl.done
	ctrl = startController(t, "--pool-settle=8s")
	// The pool must appear while the controller leads (a pool it finds when it starts leading is
	// covered by the leader settle instead).
	eventually(t, 30*time.Second, "the new controller to serve", func() error {
		if !ctrl.logContains(`"msg":"controller serving"`) {
			return fmt.Errorf("not serving yet")
		}
		return nil
	})
	taken := &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: "psettle-taken"}, Spec: ipwardenv1.IPPoolSpec{
		CIDRs: []ipwardenv1.CIDR{"10.143.0.0/29"}, Scaling: scaling, ReuseCooldown: cooldown(0),
		NodeSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"ipwarden.test/agent": "psettle"}}}}
	created = time.Now()
	if err := k8s.Create(ctx, taken); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), taken) })
	got, took = addWithin("psettle-new3", "psettle-taken", created)
	if took < 8*time.Second {
		t.Fatalf("the pool over a silent node's pod's address served an ADD (%s) after %s, before its 8 s settle", got, took)
	}
	// (After the bound the pool fills anyway: the silent node's agent never claimed its pod's
	// address, so it may go to the new pod; that is the bound's known cost, docs/design.md.)
	t.Logf("pool over a silent node's pod's address: ADD answered %s (%s) after creation (--pool-settle 8s)", got, took.Round(time.Millisecond))
	var evs corev1.EventList
	if err := k8s.List(ctx, &evs); err != nil {
		t.Fatal(err)
	}
	found := false
	for _, e := range evs.Items {
		if e.InvolvedObject.Name == "psettle-taken" && e.Reason == "PoolSettleTimedOut" {
			found = true
			if want := "1 nodes did not report what their pods use in this pool's new addresses within 8s (first: [psettle-silent-00])"; !strings.HasPrefix(e.Message, want) {
				t.Fatalf("PoolSettleTimedOut says %q, want it to name psettle-silent-00 alone", e.Message)
			}
		}
	}
	if !found {
		t.Fatal("no PoolSettleTimedOut event on the pool that waited for the silent node")
	}
}

// settleLines counts the controller's log lines starting a settle of pool.
func settleLines(t *testing.T, c *controllerProcess, pool string) int {
	t.Helper()
	b, err := os.ReadFile(c.log)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, "pool is new or gained addresses") && strings.Contains(l, `"pool":"`+pool+`"`) {
			n++
		}
	}
	return n
}

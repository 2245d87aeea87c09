package integration

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
)

// Taking over from the IPAM a cluster ran before (docs/operations.md, "Moving from another
// IPAM"): pods already run on two nodes with addresses another IPAM gave them (status.podIPs), the
// agents run, and then a pool is created that overlaps those addresses exactly: it has no free
// address at all. Node b asks for addresses at once. The pool's free addresses wait until both
// agents have reported what their pods use (spec.observedPools): every old pod's address is then
// held by its own node (claimed and granted), counted as adopted, and never handed to a new pod,
// also after an agent restart. An old pod that ends gives its address back to the pool, and a new
// pod gets it.
func TestTakeoverFromThePreviousIPAM(t *testing.T) {
	ctx := context.Background()
	for _, n := range []string{"takeover-a", "takeover-b"} {
		agentNode(t, n, "takeover")
	}
	// A pool of other addresses selects the nodes, so the agents have their NodeIPAllocations
	// and serve before the overlapping pool exists.
	agentPool(t, "takeover-base", "takeover", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.131.0.0/28"},
		Scaling: ipwardenv1.Scaling{BatchSize: 2, BufferPercent: 0, MaxPerNode: 16}, ReuseCooldown: cooldown(0)})

	// The previous IPAM's pods: three on node a, one on node b.
	old := map[string]string{"10.131.1.8": "takeover-a", "10.131.1.9": "takeover-a", "10.131.1.10": "takeover-a", "10.131.1.11": "takeover-b"}
	oldPods := map[string]*corev1.Pod{}
	for ip, node := range old {
		p := createBoundPod(t, "takeover-old-"+strings.ReplaceAll(ip, ".", "-"), node)
		setPodIP(t, p, ip)
		oldPods[ip] = p
	}

	startController(t, "--pool-settle=60s")
	a := startAgent(t, "takeover-a", "", "--gc-grace=1s", "--address-wait=2s")
	b := startAgent(t, "takeover-b", "", "--gc-grace=1s", "--address-wait=2s")
	a.waitServing(t)
	b.waitServing(t)
	confB := pluginConf("1.1.0", b.socket, "takeover")

	// The pool overlapping the old pods' addresses exactly.
	var cidrs []ipwardenv1.CIDR
	for ip := range old {
		cidrs = append(cidrs, ipwardenv1.CIDR(ip+"/32"))
	}
	agentPool(t, "takeover", "takeover", ipwardenv1.IPPoolSpec{CIDRs: cidrs,
		Scaling: ipwardenv1.Scaling{BatchSize: 2, BufferPercent: 0, MaxPerNode: 16, ReleaseDelay: &metav1.Duration{Duration: 0}}, ReuseCooldown: cooldown(0)})
	// Node b wants an address of the new pool at once: a pod bound to it, whose ADD waits.
	newPod := createBoundPod(t, "takeover-new", "takeover-b")
	if _, e := cni(t, "ADD", confB, "new1", podArgs("default", newPod.Name, string(newPod.UID))); e == nil {
		t.Fatal("a new pod got an address of a pool whose every address an old pod uses")
	}

	want := map[string]addr.Set{"takeover-a": addr.MustParseSetString("10.131.1.8-10.131.1.10"), "takeover-b": addr.MustParseSetString("10.131.1.11")}
	eventually(t, 30*time.Second, "every old pod's address to be held by its own node", func() error {
		for node, w := range want {
			if h := held(t, node, "takeover"); !h.Equal(w) {
				return fmt.Errorf("%s holds %v of the new pool, want %v", node, h, w)
			}
		}
		return nil
	})
	for node, w := range map[*agentProcess]int{a: 3, b: 1} {
		if p := node.pool(t, "takeover"); p.Adopted != w || p.InUse != w || p.Free != 0 {
			t.Fatalf("agent's view of the new pool: %+v, want %d adopted, in use, none free", p, w)
		}
	}
	for _, n := range []string{"takeover-a", "takeover-b"} {
		obs := nipa(t, n).Spec.ObservedPools
		if !containsPool(obs, "takeover") {
			t.Fatalf("%s's spec.observedPools %+v lacks the new pool", n, obs)
		}
	}
	if !eventHas(t, "takeover", "PoolSettling") {
		t.Fatal("no PoolSettling event on the new pool")
	}

	// Node a's agent restarts: its journal keeps the adopted attachments.
	a.kill()
	<-a.done
	a.start(t, "--gc-grace=1s", "--address-wait=2s")
	a.waitServing(t)
	if p := a.pool(t, "takeover"); p.Adopted != 3 {
		t.Fatalf("after the restart node a's agent adopts %d, want 3: %+v", p.Adopted, p)
	}
	if _, e := cni(t, "ADD", confB, "new2", podArgs("default", newPod.Name, string(newPod.UID))); e == nil {
		t.Fatal("a new pod got an address an old pod uses")
	}

	// An old pod ends: its address leaves with it (the leak collector frees the adopted
	// attachment once the pod is gone), goes back to the pool, and node b's new pod gets it.
	gone := oldPods["10.131.1.8"]
	if err := k8s.Delete(ctx, gone, client.GracePeriodSeconds(0)); err != nil {
		t.Fatal(err)
	}
	eventually(t, 60*time.Second, "node b's new pod to get the ended old pod's address", func() error {
		r, e := cni(t, "ADD", confB, "new3", podArgs("default", newPod.Name, string(newPod.UID)))
		if e != nil {
			return e
		}
		if got := addrOf(t, r.IPs[0].Address).String(); got != "10.131.1.8" {
			return fmt.Errorf("the new pod got %s, the only free address is 10.131.1.8", got)
		}
		return nil
	})
	assertDisjoint(t, map[string]addr.Set{"takeover-a": held(t, "takeover-a", "takeover"), "takeover-b": held(t, "takeover-b", "takeover")})

	// The Nodes show the takeover's progress: node b's one old pod ends, and its condition
	// ipwarden.io/TakeoverComplete turns True; node a still runs two.
	takeoverCondition := func(node string) *corev1.NodeCondition {
		var n corev1.Node
		if err := k8s.Get(ctx, client.ObjectKey{Name: node}, &n); err != nil {
			t.Fatal(err)
		}
		for i, c := range n.Status.Conditions {
			if c.Type == "ipwarden.io/TakeoverComplete" {
				return &n.Status.Conditions[i]
			}
		}
		return nil
	}
	if err := k8s.Delete(ctx, oldPods["10.131.1.11"], client.GracePeriodSeconds(0)); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "node b's takeover condition to turn True and node a's to count its two old pods", func() error {
		b, a := takeoverCondition("takeover-b"), takeoverCondition("takeover-a")
		if b == nil || b.Status != corev1.ConditionTrue || b.Reason != "TakeoverComplete" {
			return fmt.Errorf("node b's condition %+v", b)
		}
		if a == nil || a.Status != corev1.ConditionFalse || !strings.Contains(a.Message, "2 addresses") {
			return fmt.Errorf("node a's condition %+v", a)
		}
		return nil
	})
}

func containsPool(obs []ipwardenv1.ObservedPool, pool string) bool {
	for _, o := range obs {
		if o.Pool == pool {
			return true
		}
	}
	return false
}

// eventHas reports whether an event with reason was recorded for the object named name.
func eventHas(t *testing.T, name, reason string) bool {
	t.Helper()
	var evs corev1.EventList
	if err := k8s.List(context.Background(), &evs); err != nil {
		t.Fatal(err)
	}
	for _, e := range evs.Items {
		if e.InvolvedObject.Name == name && e.Reason == reason {
			return true
		}
	}
	return false
}

// A takeover while one node's agent is down: the new pool hands out nothing free while that node
// has not reported (the waiting node's status says why), and an old pod on the silent node is
// deleted meanwhile. Once the agent is back and reports, the pool fills: the deleted pod's
// address is free again and may be handed out; the running old pod's address never leaves its
// node.
func TestTakeoverWaitsForASilentNode(t *testing.T) {
	ctx := context.Background()
	for _, n := range []string{"silent-a", "silent-b"} {
		agentNode(t, n, "silent")
	}
	agentPool(t, "silent-base", "silent", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.134.0.0/28"},
		Scaling: ipwardenv1.Scaling{BatchSize: 2, BufferPercent: 0, MaxPerNode: 16}, ReuseCooldown: cooldown(0)})
	running := createBoundPod(t, "silent-old-a", "silent-a")
	setPodIP(t, running, "10.134.1.8")
	ended := createBoundPod(t, "silent-old-b", "silent-b")
	setPodIP(t, ended, "10.134.1.9")

	startController(t, "--pool-settle=60s")
	a := startAgent(t, "silent-a", "", "--gc-grace=1s", "--address-wait=2s")
	b := startAgent(t, "silent-b", "", "--gc-grace=1s", "--address-wait=2s")
	a.waitServing(t)
	b.waitServing(t)
	b.kill()
	<-b.done

	agentPool(t, "silent", "silent", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.134.1.8/32", "10.134.1.9/32", "10.134.1.10/32"},
		Scaling: ipwardenv1.Scaling{BatchSize: 2, BufferPercent: 0, MaxPerNode: 16}, ReuseCooldown: cooldown(0)})
	// Node a reports its old pod's address (claimed and granted) but gets nothing free: node b
	// has not reported, and its pod might use any address of the pool.
	eventually(t, 30*time.Second, "node a to hold its old pod's address and wait for node b", func() error {
		if h := held(t, "silent-a", "silent"); !h.Equal(addr.MustParseSetString("10.134.1.8")) {
			return fmt.Errorf("node a holds %v of the new pool, want only its old pod's 10.134.1.8", h)
		}
		for _, c := range nipa(t, "silent-a").Status.Conditions {
			if strings.Contains(c.Message, "wait until every node has reported") {
				return nil
			}
		}
		return fmt.Errorf("node a's status does not say it waits for the other nodes: %+v", nipa(t, "silent-a").Status.Conditions)
	})
	// Node a wants more for a new pod meanwhile: its ADD waits and fails rather than take an
	// address node b's pod may use.
	fresh := createBoundPod(t, "silent-new-a", "silent-a")
	confA := pluginConf("1.1.0", a.socket, "silent")
	if r, e := cni(t, "ADD", confA, "fresh1", podArgs("default", fresh.Name, string(fresh.UID))); e == nil {
		t.Fatalf("a new pod got %v while node b had not reported", r.IPs)
	}

	// Node b's old pod is deleted while its agent is down; then the agent comes back.
	if err := k8s.Delete(ctx, ended, client.GracePeriodSeconds(0)); err != nil {
		t.Fatal(err)
	}
	b.start(t)
	b.waitServing(t)
	eventually(t, 30*time.Second, "node a's new pod to get an address of the new pool", func() error {
		r, e := cni(t, "ADD", confA, "fresh2", podArgs("default", fresh.Name, string(fresh.UID)))
		if e != nil {
			return e
		}
		if got := addrOf(t, r.IPs[0].Address).String(); got == "10.134.1.8" {
			t.Fatalf("the new pod got the running old pod's address %s", got)
		}
		return nil
	})
	if h := held(t, "silent-b", "silent"); h.Contains(addrOf(t, "10.134.1.8/32")) {
		t.Fatalf("node b holds %v, with the running old pod's address of node a", h)
	}
	if !eventHas(t, "silent", "PoolSettling") || eventHas(t, "silent", "PoolSettleTimedOut") {
		t.Fatal("want the PoolSettling event and no PoolSettleTimedOut: node b reported in time")
	}
}

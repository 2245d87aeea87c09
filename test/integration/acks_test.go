package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/controlplane"
)

// A new leader rebuilds its record from the API objects. A node whose NodeIPAllocation was
// deleted by hand just before (controllers down, its agent paused so nobody re-creates it) is
// missing from that record while its pods use addresses: the free pool seems to hold them. The
// leader must fill no other node until that node's agent is back and has acknowledged it with
// its claims. (A 10-minute chaos run found this: the record was deleted between the agent's
// acknowledgement and the new leader's rebuild, and the leader filled another node with the
// addresses.) The settle bound is an hour: only the acknowledgement can end the wait.
func TestNewLeaderWaitsForANodeWhoseRecordIsMissing(t *testing.T) {
	n := startTwoNodes(t, "acks", ipwardenv1.IPPoolSpec{
		CIDRs:         []ipwardenv1.CIDR{"10.123.0.0/26"},
		Scaling:       ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 0, MaxPerNode: 64},
		ReuseCooldown: cooldown(0),
	}, "--gc-grace=1h", "--address-wait=90s", "--lease-namespace="+controlplane.ControllerNamespace)
	ctrl, a, b, confA, confB := n.ctrl, n.a, n.b, n.confA, n.confB
	for i := range 6 {
		mustAdd(t, confA, fmt.Sprintf("ka%d", i))
	}
	used := usedBy(t, a)
	if size(used) != 6 {
		t.Fatalf("node a uses %v", used)
	}

	// Controllers down, node a's agent paused, its record deleted: nothing re-creates it yet.
	ctrl.kill()
	a.proc.Pause()
	resumed := false
	resume := func() {
		if !resumed {
			resumed = true
			a.proc.Resume()
		}
	}
	t.Cleanup(resume)
	obj := nipa(t, "acks-a")
	if err := k8s.Delete(context.Background(), obj, client.Preconditions{UID: &obj.UID}); err != nil {
		t.Fatal(err)
	}

	// Node b asks for 40 addresses: everything the pool has beyond node a's 6 would do.
	for i := range 40 {
		go func() {
			_, _ = cni(t, "ADD", confB, fmt.Sprintf("kb%d", i), podArgs("default", fmt.Sprintf("pod-kb%d", i), fmt.Sprintf("uid-kb%d", i)))
		}()
	}
	freeLease(t)
	leader := startController(t, "--leader-elect=true", "--leader-election-namespace="+controlplane.ControllerNamespace,
		"--leader-election-id="+controlplane.ControllerLease, "--claim-settle=1h")
	// The leader re-creates node a's record (status empty); node b acknowledges; node a cannot.
	eventually(t, 60*time.Second, "the leader to wait for node a only", func() error {
		holder, _ := leaseHolder(t)
		if holder == "" || nipa(t, "acks-b").Spec.AcknowledgedLeader != holder {
			return fmt.Errorf("node b has not acknowledged a leader yet (holder %q)", holder)
		}
		if n := nipa2(t, "acks-a"); n == nil {
			return fmt.Errorf("node a's record not re-created yet")
		}
		return nil
	})
	if hb := held(t, "acks-b", "acks"); hb.Overlaps(used) {
		t.Fatalf("while node a was silent, node b was given %v, which node a's pods use", hb.Intersect(used))
	}

	resume()
	eventually(t, 60*time.Second, "node a to hold every address its pods use again", func() error {
		if h := held(t, "acks-a", "acks"); !h.ContainsSet(used) {
			return fmt.Errorf("holds %v, pods use %v", h, used)
		}
		return nil
	})
	eventually(t, 90*time.Second, "node b to grow once node a acknowledged", func() error {
		if n := size(held(t, "acks-b", "acks")); n < 40 {
			return fmt.Errorf("node b holds %d", n)
		}
		return nil
	})
	if hb := held(t, "acks-b", "acks"); hb.Overlaps(used) {
		t.Fatalf("node b was given %v, which node a's pods use", hb.Intersect(used))
	}
	if ub := usedBy(t, b); ub.Overlaps(used) {
		t.Fatalf("a pod on node b got %v, which a pod on node a uses", ub.Intersect(used))
	}
	if !leader.logContains("every node acknowledged this leader") {
		t.Fatal("the leader's settle did not end by the nodes' acknowledgements")
	}
}

// The settle bound: a node whose agent stays silent (paused) past --claim-settle does not hold
// the new leader up for ever. Once the bound passes the leader fills the other nodes anyway,
// says so in its log and with a Warning event LeaderNotAcknowledged on the silent node's
// NodeIPAllocation; the silent node keeps what its status holds (nothing of it goes elsewhere).
func TestSettleBoundFillsPastASilentNode(t *testing.T) {
	n := startTwoNodes(t, "bound", ipwardenv1.IPPoolSpec{
		CIDRs:         []ipwardenv1.CIDR{"10.124.0.0/26"},
		Scaling:       ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 0, MaxPerNode: 64},
		ReuseCooldown: cooldown(0),
	}, "--gc-grace=1h", "--address-wait=90s", "--lease-namespace="+controlplane.ControllerNamespace)
	ctrl, a, confA, confB := n.ctrl, n.a, n.confA, n.confB
	for i := range 3 {
		mustAdd(t, confA, fmt.Sprintf("sa%d", i))
	}
	heldA := held(t, "bound-a", "bound")

	// The controller goes; node a's agent stops answering; a new leader starts with a short bound.
	ctrl.kill()
	a.proc.Pause()
	t.Cleanup(a.proc.Resume)
	freeLease(t)
	leader := startController(t, "--leader-elect=true", "--leader-election-namespace="+controlplane.ControllerNamespace,
		"--leader-election-id="+controlplane.ControllerLease, "--claim-settle=3s")
	for i := range 8 {
		mustAdd(t, confB, fmt.Sprintf("sb%d", i))
	}
	if !leader.logContains("nodes did not acknowledge this leader within --claim-settle") {
		t.Fatal("node b was filled, but the leader's log does not say the settle bound passed")
	}
	if leader.logContains("every node acknowledged this leader") {
		t.Fatal("the leader says every node acknowledged it, but node a's agent is paused")
	}
	obj := nipa(t, "bound-a")
	waitEvent(t, "LeaderNotAcknowledged", "NodeIPAllocation", "bound-a", string(obj.UID), "did not acknowledge controller")
	if hb := held(t, "bound-b", "bound"); hb.Overlaps(heldA) {
		t.Fatalf("node b was given %v, which silent node a holds", hb.Intersect(heldA))
	}
	if h := held(t, "bound-a", "bound"); !h.ContainsSet(heldA) {
		t.Fatalf("silent node a held %v, now %v", heldA, h)
	}
}

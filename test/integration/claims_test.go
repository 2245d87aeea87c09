package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
)

// usedBy is the set of addresses an agent's attachments use.
func usedBy(t *testing.T, a *agentProcess) addr.Set {
	t.Helper()
	resp, err := a.list(t)
	if err != nil {
		t.Fatal(err)
	}
	var s addr.Set
	for _, att := range resp.Attachments {
		for _, ip := range att.IPs {
			s = s.Union(addr.SetOfAddrs(addrOf(t, ip.Address)))
		}
	}
	return s
}

func claimedBy(t *testing.T, node, pool string) addr.Set {
	t.Helper()
	a := &ipwardenv1.NodeIPAllocation{}
	if err := k8s.Get(context.Background(), client.ObjectKey{Name: node}, a); err != nil {
		return addr.Set{}
	}
	for _, p := range a.Spec.Pools {
		if p.Pool == pool {
			s, _ := addr.ParseSet(blockStrings(p.Claimed))
			return s
		}
	}
	return addr.Set{}
}

// A NodeIPAllocation deleted by hand comes back with the addresses its pods use, with the
// controller running (it restores its record) and with it down (the agent re-creates the object
// and claims them; the restarted controller grants the claims and fills the other node around
// them). The pool's cooldown is 0, so an address that went back to the pool would be handed out
// at once; a watcher over every status change sees no address in two statuses, and the other
// node, which asks for every address there is, never gets one the first node's pods use.
func TestDeletedRecordComesBackWithItsAddresses(t *testing.T) {
	w := watchStatuses(t)
	n := startTwoNodes(t, "claims", ipwardenv1.IPPoolSpec{
		CIDRs:         []ipwardenv1.CIDR{"10.121.0.0/26"},
		Scaling:       ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 0, MaxPerNode: 64},
		ReuseCooldown: cooldown(0),
	}, "--gc-grace=1h")
	ctrl, a, b, confA, confB := n.ctrl, n.a, n.b, n.confA, n.confB
	for i := range 6 {
		mustAdd(t, confA, fmt.Sprintf("ca%d", i))
	}
	used := usedBy(t, a)
	if size(used) != 6 {
		t.Fatalf("node a uses %v", used)
	}

	deleteRecord := func() {
		t.Helper()
		obj := nipa(t, "claims-a")
		if err := k8s.Delete(context.Background(), obj, client.Preconditions{UID: &obj.UID}); err != nil {
			t.Fatal(err)
		}
		eventually(t, 30*time.Second, "a new NodeIPAllocation claims-a", func() error {
			if n := nipa2(t, "claims-a"); n == nil || n.UID == obj.UID {
				return fmt.Errorf("not re-created yet")
			}
			return nil
		})
	}
	waitBack := func() {
		t.Helper()
		eventually(t, 30*time.Second, "node a to hold every address its pods use", func() error {
			if h := held(t, "claims-a", "claims"); !h.ContainsSet(used) {
				return fmt.Errorf("holds %v, pods use %v", h, used)
			}
			return nil
		})
	}

	// Controller running: it re-creates the object and restores the status from its record.
	deleteRecord()
	waitBack()

	// Controller down: the agent re-creates its object and claims what its pods use.
	ctrl.kill()
	deleteRecord()
	eventually(t, 30*time.Second, "node a's spec to claim what its pods use", func() error {
		if c := claimedBy(t, "claims-a", "claims"); !c.Equal(used) {
			return fmt.Errorf("claims %v, pods use %v", c, used)
		}
		return nil
	})
	if !a.logContains("re-created this node's NodeIPAllocation") {
		t.Fatal("the agent did not say it re-created its NodeIPAllocation")
	}
	// The other node asks for every address there is; the restarted controller serves claims
	// first and never gives node b what node a's pods use.
	for i := range 40 {
		go func() {
			_, _ = cni(t, "ADD", confB, fmt.Sprintf("cb%d", i), podArgs("default", fmt.Sprintf("pod-cb%d", i), fmt.Sprintf("uid-cb%d", i)))
		}()
	}
	startController(t)
	waitBack()
	eventually(t, 30*time.Second, "node a's claims to be withdrawn once granted", func() error {
		if c := claimedBy(t, "claims-a", "claims"); !c.IsEmpty() {
			return fmt.Errorf("still claims %v", c)
		}
		return nil
	})
	eventually(t, 60*time.Second, "node b to grow", func() error {
		if n := size(held(t, "claims-b", "claims")); n < 40 {
			return fmt.Errorf("node b holds %d", n)
		}
		return nil
	})
	if hb := held(t, "claims-b", "claims"); hb.Overlaps(used) {
		t.Fatalf("node b was given %v, which node a's pods use", hb.Intersect(used))
	}
	if ub := usedBy(t, b); ub.Overlaps(used) {
		t.Fatalf("a pod on node b got %v, which a pod on node a uses", ub.Intersect(used))
	}
	if u := usedBy(t, a); !u.Equal(used) {
		t.Fatalf("node a's pods now use %v, before %v", u, used)
	}
	w.check(t)
}

// nipa2 is nipa without failing when the object is missing.
func nipa2(t *testing.T, node string) *ipwardenv1.NodeIPAllocation {
	t.Helper()
	a := &ipwardenv1.NodeIPAllocation{}
	if err := k8s.Get(context.Background(), client.ObjectKey{Name: node}, a); err != nil {
		return nil
	}
	return a
}

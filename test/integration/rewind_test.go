package integration

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

// etcd restored from an older snapshot, by Kubernetes' documented procedure (revision bumped
// and compacted, API server restarted), while agents keep running pods whose addresses are newer
// than the snapshot: after the snapshot node a gave addresses back and node b's new pods got
// some of them. The restored statuses show node a holding them again and node b not holding
// them. The controller restarts from the restored record. Node a must never hand them out (it
// sees its record is older than its own last write and gives them back), node b claims them, and
// the system converges with no address on two pods and none in two statuses.
func TestEtcdRewindNeverPutsAnAddressOnTwoPods(t *testing.T) {
	// The agents watch the controller's Lease where the deployment keeps it, to acknowledge
	// each new leader.
	n := startTwoNodes(t, "rewind", ipwardenv1.IPPoolSpec{
		CIDRs: []ipwardenv1.CIDR{"10.122.0.0/28"},
		// No release hysteresis or delay: node a gives back what its pods stop using at once.
		Scaling: ipwardenv1.Scaling{BatchSize: 2, BufferPercent: 0, MaxPerNode: 14,
			ReleaseSlackPercent: ptr.To[int32](0), ReleaseDelay: &metav1.Duration{}},
		ReuseCooldown: cooldown(0),
	}, "--gc-grace=1h", "--address-wait=60s", "--lease-namespace="+controlplane.ControllerNamespace)
	ctrl, a, b, confA, confB := n.ctrl, n.a, n.b, n.confA, n.confB
	for i := range 8 {
		mustAdd(t, confA, fmt.Sprintf("ra%d", i))
	}
	for i := range 2 {
		mustAdd(t, confB, fmt.Sprintf("rb%d", i))
	}
	eventually(t, 30*time.Second, "node a to hold exactly what its pods use", func() error {
		if h, u := held(t, "rewind-a", "rewind"), usedBy(t, a); !h.Equal(u) {
			return fmt.Errorf("holds %v, uses %v", h, u)
		}
		return nil
	})
	beforeA := held(t, "rewind-a", "rewind")

	genAtSnapshot := nipa(t, "rewind-a").Generation
	snap := filepath.Join(t.TempDir(), "etcd.snapshot")
	if err := controlPlane.SnapshotEtcd(context.Background(), snap); err != nil {
		t.Fatal(err)
	}

	// After the snapshot: node a's pods go and it gives addresses back; node b grows into them.
	for i := range 6 {
		mustDel(t, confA, fmt.Sprintf("ra%d", i))
	}
	eventually(t, 30*time.Second, "node a to give back what its pods no longer use", func() error {
		if n := size(held(t, "rewind-a", "rewind")); n > 2 {
			return fmt.Errorf("node a still holds %d", n)
		}
		return nil
	})
	for i := 2; i < 10; i++ {
		mustAdd(t, confB, fmt.Sprintf("rb%d", i))
	}
	usedB := usedBy(t, b)
	moved := usedB.Intersect(beforeA)
	if moved.IsEmpty() {
		t.Fatalf("node b's pods (%v) use none of node a's old addresses (%v): the scenario proves nothing", usedB, beforeA)
	}
	usedA := usedBy(t, a)
	// Node a's spec writes after the snapshot: with one, its first write after the restore would
	// have the generation of its last write before it (the spec write's test of the mark refuses it).
	writesA := nipa(t, "rewind-a").Generation - genAtSnapshot

	// Restore etcd from the snapshot; the controller restarts from the restored record.
	ctrl.kill()
	start := time.Now()
	if err := controlPlane.RestoreEtcd(context.Background(), snap); err != nil {
		t.Fatal(err)
	}
	if h := held(t, "rewind-a", "rewind"); !h.ContainsSet(moved) {
		t.Fatalf("after the restore node a's status holds %v: the restore did not rewind it", h)
	}
	restored := time.Since(start)
	// The controller restarts leader-elected, as deployed. It fills nobody from the free pool
	// until every node's agent has acknowledged it with claims written from a fresh read of its
	// record; the settle bound is set far beyond the test's deadlines, so only the
	// acknowledgements can end the wait.
	freeLease(t)
	ctrl2 := startController(t, "--leader-elect=true", "--leader-election-namespace="+controlplane.ControllerNamespace,
		"--leader-election-id="+controlplane.ControllerLease, "--claim-settle=1h")
	eventually(t, 60*time.Second, "both agents to acknowledge the new leader", func() error {
		holder, _ := leaseHolder(t)
		if holder == "" {
			return fmt.Errorf("no leader yet")
		}
		for _, n := range []string{"rewind-a", "rewind-b"} {
			if got := nipa(t, n).Spec.AcknowledgedLeader; got != holder {
				return fmt.Errorf("node %s acknowledged %q, the leader is %q", n, got, holder)
			}
		}
		return nil
	})

	// While the system converges, node a starts pods: none may get an address node b's pods use.
	// They need a fill (node a gives back what its record wrongly shows), which only the
	// acknowledgements can allow: every ADD must succeed.
	for i := 10; i < 12; i++ {
		r := mustAdd(t, confA, fmt.Sprintf("ra%d", i))
		for _, ip := range r.IPs {
			if usedB.Contains(addrOf(t, ip.Address)) {
				t.Fatalf("node a handed %s to a new pod while a pod on node b uses it", ip.Address)
			}
		}
		if u := usedBy(t, a); u.Overlaps(usedB) {
			t.Fatalf("node a's pods use %v, which node b's pods use", u.Intersect(usedB))
		}
	}
	eventually(t, 60*time.Second, "both nodes to hold what their pods use, and nothing twice", func() error {
		ha, hb := held(t, "rewind-a", "rewind"), held(t, "rewind-b", "rewind")
		if ha.Overlaps(hb) {
			return fmt.Errorf("%v in both statuses", ha.Intersect(hb))
		}
		if !hb.ContainsSet(usedB) {
			return fmt.Errorf("node b holds %v, its pods use %v", hb, usedB)
		}
		if ua := usedBy(t, a); !ha.ContainsSet(ua) {
			return fmt.Errorf("node a holds %v, its pods use %v", ha, ua)
		}
		// A claim granted back leaves the node's spec with the agent's next write, after the
		// controller's status write: part of converging, not a step before it.
		for _, n := range []string{"rewind-a", "rewind-b"} {
			for _, p := range nipa(t, n).Spec.Pools {
				if len(p.Claimed) > 0 {
					return fmt.Errorf("node %s still claims %v", n, p.Claimed)
				}
			}
		}
		return nil
	})
	converged := time.Since(start)
	if u := usedBy(t, a); u.Overlaps(usedB) || !u.ContainsSet(usedA) {
		t.Fatalf("node a's pods use %v (before the restore %v); node b's %v", u, usedA, usedB)
	}
	if !usedBy(t, b).Equal(usedB) {
		t.Fatalf("node b's pods' addresses changed: %v, before %v", usedBy(t, b), usedB)
	}
	if !ctrl2.logContains(`every node acknowledged this leader`) {
		t.Errorf("the controller's settle did not end by the agents' acknowledgements")
	}
	t.Logf("etcd restore took %s; converged %s after the restore began (addresses that had moved from node a to node b: %v; node a's spec writes after the snapshot: %d)",
		restored.Round(time.Millisecond), converged.Round(time.Millisecond), moved, writesA)
}

package check

import (
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
)

func releasing(a ipwardenv1.NodeIPAllocation, blocks ...string) ipwardenv1.NodeIPAllocation {
	var rel []ipwardenv1.AddressBlock
	for _, b := range blocks {
		rel = append(rel, ipwardenv1.AddressBlock(b))
	}
	a.Spec.Pools = []ipwardenv1.NodePoolRequest{{Pool: "v4", Releasing: rel}}
	return a
}

func TestTracker(t *testing.T) {
	tr := NewTracker()
	tr.Reset([]ipwardenv1.NodeIPAllocation{alloc("n1", "v4", "10.0.0.16/30"), alloc("n2", "v4", "10.0.0.32/30")})
	steps := []struct {
		a       ipwardenv1.NodeIPAllocation
		deleted bool
		want    string // substring of a new violation, "" for none
	}{
		{alloc("n1", "v4", "10.0.0.16/29"), false, ""},                            // a fill
		{releasing(alloc("n1", "v4", "10.0.0.16/30"), "10.0.0.20/30"), false, ""}, // a released take-back
		{alloc("n2", "v4", "10.0.0.32/31"), false, "does not release"},            // dropped unreleased
		{alloc("n2", "v4", "10.0.0.32/31", "10.0.0.17"), false, "at once"},        // n1's address
		{alloc("n2", "v4", "10.0.0.32/31"), true, ""},                             // deleted
		{alloc("n3", "v4", "10.0.0.40"), false, ""},
	}
	seen := 0
	for i, s := range steps {
		tr.Observe(&s.a, s.deleted)
		v := tr.Violations()
		switch {
		case s.want == "" && len(v) != seen:
			t.Fatalf("step %d: unexpected violation %v", i, v[seen:])
		case s.want != "" && (len(v) == seen || !strings.Contains(v[len(v)-1], s.want)):
			t.Fatalf("step %d: want a violation with %q, got %v", i, s.want, v[seen:])
		}
		seen = len(v)
	}
	// A relist (after etcd was restored) is a new baseline: no drop is reported across it.
	tr.Reset([]ipwardenv1.NodeIPAllocation{alloc("n1", "v4", "10.0.0.16")})
	if v := tr.Violations(); len(v) != seen {
		t.Fatalf("a reset reported %v", v[seen:])
	}
}

// Pools on different networks may overlap: one address in n1's pod-network pool and n2's storage
// pool is not in two statuses at once (the chaos suite, with net1 on a pool over the pod
// network's CIDR, once reported hundreds of such moments); in n2's pod-network pool it is.
func TestTrackerKeysAddressesByNetwork(t *testing.T) {
	tr := NewTracker()
	tr.SetPoolNetworks(map[string]string{"st": "storage"})
	tr.Reset([]ipwardenv1.NodeIPAllocation{alloc("n1", "v4", "10.0.0.16/30"), alloc("n2", "st", "10.0.0.16/30")})
	st := alloc("n2", "st", "10.0.0.16/29")
	tr.Observe(&st, false)
	if v := tr.Violations(); len(v) != 0 {
		t.Fatalf("overlapping pools on two networks: %v", v)
	}
	both := st
	both.Status.Pools = append(both.Status.Pools, ipwardenv1.NodePoolStatus{Pool: "v4", Addresses: []string{"10.0.0.17"}})
	tr.Observe(&both, false)
	if v := tr.Violations(); len(v) != 1 || !strings.Contains(v[0], "10.0.0.17 in the statuses of nodes n1 and n2") {
		t.Fatalf("violations %v, want 10.0.0.17 on the pod network", v)
	}
	// Dropping the storage pool's addresses unreleased is reported with its network.
	none := alloc("n2", "v4", "10.0.0.17")
	tr.Observe(&none, false)
	if v := tr.Violations(); len(v) < 2 || !strings.Contains(v[0], "on network storage, which its spec does not release") {
		t.Fatalf("violations %v", v)
	}
}

// A live migration's shared grant: one claim address in two nodes' statuses is legal for the
// pair of nodes a pool's status.shared records, whether the tracker sees the pool's status
// before or after the nodes'; the same address with a third node is not.
func TestTrackerSharedGrant(t *testing.T) {
	tr := NewTracker()
	tr.Reset([]ipwardenv1.NodeIPAllocation{alloc("n1", "v4", "10.0.0.16/30"), alloc("n2", "v4", "10.0.0.32/30"), alloc("n3", "v4", "10.0.0.40/30")})
	b := alloc("n2", "v4", "10.0.0.32/30", "10.0.0.17")
	tr.Observe(&b, false)
	if v := tr.Violations(); len(v) != 1 || !strings.Contains(v[0], "no shared grant") {
		t.Fatalf("before the pool's status: %v", v)
	}
	pool := &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: "v4"}, Status: ipwardenv1.IPPoolStatus{
		Shared: []ipwardenv1.SharedClaimAddress{{Address: "10.0.0.17", UID: "u", Nodes: []string{"n1", "n2"}}}}}
	tr.ObservePool(pool)
	if v := tr.Violations(); len(v) != 0 {
		t.Fatalf("with the shared grant seen: %v", v)
	}
	c := alloc("n3", "v4", "10.0.0.40/30", "10.0.0.17")
	tr.Observe(&c, false)
	if v := tr.Violations(); len(v) != 2 {
		t.Fatalf("a third holder: want two violations (with n1 and with n2), got %v", v)
	}
}

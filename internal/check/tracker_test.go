package check

import (
	"strings"
	"testing"

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

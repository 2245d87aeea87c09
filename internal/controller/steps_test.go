package controller

import (
	"net/netip"
	"testing"
	"time"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
)

func kinds(steps []Step) []StepKind {
	out := make([]StepKind, len(steps))
	for i, s := range steps {
		out[i] = s.Kind
	}
	return out
}

// A fill that takes back and fills writes the pool's cooling record before the node's status,
// and each outcome of each step leaves the record where it must be.
func TestFillSequence(t *testing.T) {
	setup := func(t *testing.T) (*State, *ipwardenv1.NodeIPAllocation) {
		s := NewState(DefaultExhaustionMarks)
		a := allocWith("n", "p", "10.0.0.0/29")
		s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/26", time.Minute)}, []ipwardenv1.NodeIPAllocation{a}, t0)
		a.Spec = spec("p", 10, "10.0.0.4/30") // release 4, then grow to 10: 6 more
		return s, &a
	}
	cases := []struct {
		name     string
		outcomes []Outcome // per step, in order
		result   Result
		holds    int  // what the record says n holds afterwards (pending included)
		cooling  bool // the released addresses cool (they left the node)
		pending  bool // new addresses stay reserved for a write that may have landed
	}{
		{"all landed", []Outcome{Landed, Landed}, Committed, 10, true, false},
		{"cooling record refused: nothing leaves, nothing arrives", []Outcome{Rejected}, Failed, 8, false, false},
		{"cooling record unknown: nothing leaves, nothing arrives", []Outcome{Unknown}, Failed, 8, false, false},
		{"node status conflict: retry from a fresh read", []Outcome{Landed, Conflict}, Retry, 8, false, false},
		{"node status rejected (fenced, invalid)", []Outcome{Landed, Rejected}, Failed, 8, false, false},
		{"node status unknown: new addresses stay reserved", []Outcome{Landed, Unknown}, Failed, 14, false, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, a := setup(t)
			q := s.StartFill("n", a, t0)
			if got := kinds(q.Steps()); len(got) != 2 || got[0] != StepPoolStatus || got[1] != StepNodeStatus {
				t.Fatalf("steps %v: want the pool's cooling record before the node status", got)
			}
			for _, o := range tc.outcomes {
				if _, ok := q.Next(); !ok {
					t.Fatal("no step left")
				}
				q.Advance(o)
			}
			if _, ok := q.Next(); ok {
				t.Fatal("a step after the sequence ended")
			}
			if q.Result() != tc.result {
				t.Fatalf("result %v, want %v", q.Result(), tc.result)
			}
			held := 0
			for _, set := range s.HeldBy("n") {
				held += count(set)
			}
			if held != tc.holds {
				t.Fatalf("record holds %d for n, want %d", held, tc.holds)
			}
			if got := s.pool("p").alloc.Cooling().Overlaps(set(t, "10.0.0.4/30")); got != tc.cooling {
				t.Fatalf("released addresses cooling = %v, want %v", got, tc.cooling)
			}
			if s.HasPending("n") != tc.pending {
				t.Fatalf("pending = %v, want %v", s.HasPending("n"), tc.pending)
			}
		})
	}
}

func TestFillSequenceNoChange(t *testing.T) {
	s := NewState(DefaultExhaustionMarks)
	a := allocWith("n", "p", "10.0.0.0/30")
	s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/26", time.Minute)}, []ipwardenv1.NodeIPAllocation{a}, t0)
	a.Spec = spec("p", 4)
	a.Status = NodeStatus(a.Status, a.Spec, a.Generation, s.PlanFill("n", a.Spec, t0))
	s2 := NewState(DefaultExhaustionMarks)
	s2.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/26", time.Minute)}, []ipwardenv1.NodeIPAllocation{a}, t0)
	q := s2.StartFill("n", &a, t0)
	if q.Result() != NoChange {
		t.Fatalf("result %v, steps %v", q.Result(), kinds(q.Steps()))
	}
}

// A deleted node's addresses are recorded cooling in their pools before its object is deleted,
// and leave the record only when that landed.
func TestNodeGoneSequence(t *testing.T) {
	for _, tc := range []struct {
		name     string
		outcomes []Outcome
		result   Result
		forgot   bool
	}{
		{"landed", []Outcome{Landed, Landed}, Committed, true},
		{"cooling record refused", []Outcome{Rejected}, Failed, false},
		{"delete unknown", []Outcome{Landed, Unknown}, Failed, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewState(DefaultExhaustionMarks)
			s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/26", time.Minute)}, []ipwardenv1.NodeIPAllocation{allocWith("n", "p", "10.0.0.0/29")}, t0)
			q := s.StartNodeGone("n", true, t0)
			if got := kinds(q.Steps()); len(got) != 2 || got[0] != StepPoolStatus || got[1] != StepDeleteAllocation {
				t.Fatalf("steps %v", got)
			}
			for _, o := range tc.outcomes {
				q.Advance(o)
			}
			if q.Result() != tc.result || s.Holds("n") == tc.forgot {
				t.Fatalf("result %v holds %v", q.Result(), s.Holds("n"))
			}
		})
	}
}

// Addresses a node gives back cooled (releasingCooled) need no cooling record: the fill is one
// node status write, and they are free for another node at once. The rest of releasing cools.
func TestFillSequenceCooledGiveBack(t *testing.T) {
	s := NewState(DefaultExhaustionMarks)
	a := allocWith("n", "p", "10.0.0.0/29")
	s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/26", time.Minute)}, []ipwardenv1.NodeIPAllocation{a}, t0)
	a.Spec = spec("p", 4, "10.0.0.4/30")
	a.Spec.Pools[0].ReleasingCooled = []ipwardenv1.AddressBlock{"10.0.0.4/30", "10.0.0.32"} // one not releasing: ignored
	q := s.StartFill("n", &a, t0)
	if got := kinds(q.Steps()); len(got) != 1 || got[0] != StepNodeStatus {
		t.Fatalf("steps %v: want only the node status", got)
	}
	q.Advance(Landed)
	if q.Result() != Committed {
		t.Fatalf("result %v", q.Result())
	}
	p := s.pool("p")
	if !p.alloc.Cooling().IsEmpty() || !p.alloc.Usable(t0).ContainsSet(set(t, "10.0.0.4/30")) || p.alloc.Allocated().Contains(netip.MustParseAddr("10.0.0.32")) {
		t.Fatalf("cooling %v allocated %v: want 10.0.0.4/30 free at once", p.alloc.Cooling(), p.alloc.Allocated())
	}

	// Part cooled, part not: the rest gets its cooling record first.
	b := allocWith("m", "p", "10.0.0.8/29")
	s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/26", time.Minute)}, []ipwardenv1.NodeIPAllocation{b}, t0)
	b.Spec = spec("p", 4, "10.0.0.12/30")
	b.Spec.Pools[0].ReleasingCooled = []ipwardenv1.AddressBlock{"10.0.0.12/31"}
	q = s.StartFill("m", &b, t0)
	if got := kinds(q.Steps()); len(got) != 2 || got[0] != StepPoolStatus {
		t.Fatalf("steps %v: want the cooling record of the rest first", got)
	}
	q.Advance(Landed)
	q.Advance(Landed)
	p = s.pool("p")
	if !p.alloc.Cooling().Equal(set(t, "10.0.0.14/31")) || !p.alloc.Usable(t0).ContainsSet(set(t, "10.0.0.12/31")) {
		t.Fatalf("cooling %v: want exactly 10.0.0.14/31, 10.0.0.12/31 free", p.alloc.Cooling())
	}
}

// Regrowth is what the nodes would ask for over their requests if the exhausted flag cleared.
func TestRegrowth(t *testing.T) {
	s := NewState(DefaultExhaustionMarks)
	a, b, c := allocWith("a", "p", "10.0.0.0/29"), allocWith("b", "p", "10.0.0.8/29"), allocWith("c", "p")
	a.Spec, b.Spec, c.Spec = spec("p", 30), spec("p", 0), spec("p", 5)
	s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/24", time.Minute)}, []ipwardenv1.NodeIPAllocation{a, b, c}, t0)
	// Batch 4, buffer 0, release slack 100 %: Keep(d) = d + 4 for each node.
	if got := s.Regrowth("p"); got != 12 {
		t.Fatalf("Regrowth = %d, want 12", got)
	}
	// A node's new request counts once it is planned: b no longer draws from p.
	s.PlanFill("b", spec("q", 1), t0)
	if got := s.Regrowth("p"); got != 8 {
		t.Fatalf("Regrowth after b left the pool = %d, want 8", got)
	}
}

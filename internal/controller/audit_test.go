package controller

import (
	"testing"
	"time"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
)

func TestAudit(t *testing.T) {
	s := NewState(DefaultExhaustionMarks)
	pools := []ipwardenv1.IPPool{testPool("p", "10.0.0.0/24", time.Minute)}
	s.Rebuild(pools, []ipwardenv1.NodeIPAllocation{allocWith("a", "p", "10.0.0.16/28"), allocWith("b", "p", "10.0.0.32/28")}, t0)

	// The record and the API agree: nothing to do.
	r := s.Audit([]ipwardenv1.NodeIPAllocation{allocWith("a", "p", "10.0.0.16/28"), allocWith("b", "p", "10.0.0.32/28")})
	if r.Candidates() != 0 {
		t.Fatalf("clean audit found %+v", r)
	}

	// b's status lost half its addresses (a lost write); someone put a free address and one of
	// a's into c's status; and an allocation leaked in the pool.
	p := s.pools["p"]
	if err := p.alloc.Reserve(set(t, "10.0.0.200")); err != nil {
		t.Fatal(err)
	}
	r = s.Audit([]ipwardenv1.NodeIPAllocation{
		allocWith("a", "p", "10.0.0.16/28"),
		allocWith("b", "p", "10.0.0.32/29"),
		allocWith("c", "p", "10.0.0.100", "10.0.0.17"),
	})
	if !r.Unpublished["b"].Equal(set(t, "10.0.0.40/29")) {
		t.Errorf("unpublished %v", r.Unpublished)
	}
	if !r.Adopted["c"].Equal(set(t, "10.0.0.100")) || !s.HeldBy("c")["p"].Equal(set(t, "10.0.0.100")) {
		t.Errorf("adopted %v, c holds %v", r.Adopted, s.HeldBy("c"))
	}
	if !r.Twice.Equal(set(t, "10.0.0.17")) {
		t.Errorf("twice %v", r.Twice)
	}
	if !r.Leaked.Equal(set(t, "10.0.0.200")) {
		t.Errorf("leaked %v", r.Leaked)
	}
	if got := r.Nodes(); len(got) != 2 || got[0] != "b" || got[1] != "c" {
		t.Errorf("nodes %v", got)
	}
	// The leak is back in the pool.
	if p.alloc.Allocated().Overlaps(set(t, "10.0.0.200")) || !p.alloc.Usable(t0).ContainsSet(set(t, "10.0.0.200")) {
		t.Errorf("leaked address not returned to the pool")
	}
}

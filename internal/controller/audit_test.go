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

// The audit runs while fills are in flight (docs/design.md, "The write protocol"): a fill's new
// addresses are reserved at its plan and the node's status write lands before its commit. An
// audit between the two must neither return them to the pool as leaked (another node could then
// be given them) nor call them held twice; and a status listed before a take-back and a grant
// landed shows an address the record has already moved, which only a second, later list can
// tell from a real double hold (ConfirmTwice).
func TestAuditWhileFillsAreInFlight(t *testing.T) {
	s := NewState(DefaultExhaustionMarks)
	pools := []ipwardenv1.IPPool{testPool("p", "10.0.0.0/24", 0)}
	s.Rebuild(pools, []ipwardenv1.NodeIPAllocation{allocWith("a", "p", "10.0.0.16/30")}, t0)
	s.SetNodeLabels("a", nil)
	s.SetNodeLabels("b", nil)

	// b's first fill is planned (its addresses reserved), its status write not landed yet.
	f := s.PlanFill("b", spec("p", 4), t0)
	added := f.Pools["p"].Added
	if count(added) != 4 {
		t.Fatalf("b's fill adds %v", added)
	}
	before := []ipwardenv1.NodeIPAllocation{allocWith("a", "p", "10.0.0.16/30"), allocWith("b", "p")}
	r := s.Audit(before)
	if !r.Leaked.IsEmpty() || !r.Twice.IsEmpty() {
		t.Fatalf("audit before b's write landed: leaked %v, twice %v; want neither", r.Leaked, r.Twice)
	}
	// The write landed; the commit has not run yet.
	landed := []ipwardenv1.NodeIPAllocation{allocWith("a", "p", "10.0.0.16/30"), allocWith("b", "p", added.Strings()...)}
	r = s.Audit(landed)
	if r.Candidates() != 0 {
		t.Fatalf("audit between b's write and its commit found %+v", r)
	}
	s.Commit(f, t0)
	if r = s.Audit(landed); r.Candidates() != 0 {
		t.Fatalf("audit after the commit found %+v", r)
	}
	// a gave 10.0.0.16/30 back and b was given it (the record, after both commits); a list
	// taken before both writes landed still shows it in a's status and not in b's.
	s = NewState(DefaultExhaustionMarks)
	s.Rebuild(pools, []ipwardenv1.NodeIPAllocation{allocWith("a", "p"), allocWith("b", "p", "10.0.0.16/30", "10.0.0.32/30")}, t0)
	stale := s.Audit([]ipwardenv1.NodeIPAllocation{allocWith("a", "p", "10.0.0.16/30"), allocWith("b", "p", "10.0.0.32/30")})
	if stale.Twice.IsEmpty() {
		t.Fatal("the stale list shows no address held twice: the test would prove nothing")
	}
	fresh := s.Audit([]ipwardenv1.NodeIPAllocation{allocWith("a", "p"), allocWith("b", "p", "10.0.0.16/30", "10.0.0.32/30")})
	if got := ConfirmTwice(stale.Twice, fresh.Twice); !got.IsEmpty() {
		t.Fatalf("ConfirmTwice = %v: a transient of the list raised the alarm", got)
	}
	// A real double hold shows in both lists and is confirmed.
	real := []ipwardenv1.NodeIPAllocation{allocWith("a", "p", "10.0.0.17"), allocWith("b", "p", "10.0.0.16/30", "10.0.0.32/30")}
	if got := ConfirmTwice(s.Audit(real).Twice, s.Audit(real).Twice); !got.Equal(set(t, "10.0.0.17")) {
		t.Fatalf("ConfirmTwice of a real double hold = %v", got)
	}
}

// Pools on different networks may overlap: one address in a pod-network pool on one node and in
// a secondary network's pool on another is not held twice (the audit once logged "held by two
// nodes" and set ipwarden_controller_addresses_twice for every such address: the chaos suite,
// with net1 on a pool over the pod network's CIDR); on one network it still is.
func TestAuditKeysAddressesByNetwork(t *testing.T) {
	s := NewState(DefaultExhaustionMarks)
	storage := testPool("st", "10.0.0.0/24", time.Minute)
	storage.Spec.Network = "storage"
	pools := []ipwardenv1.IPPool{testPool("p", "10.0.0.0/24", time.Minute), storage}
	both := func(name, pod, st string) ipwardenv1.NodeIPAllocation {
		return ipwardenv1.NodeIPAllocation{ObjectMeta: allocWith(name, "p").ObjectMeta, Status: ipwardenv1.NodeIPAllocationStatus{Pools: []ipwardenv1.NodePoolStatus{
			{Pool: "p", Addresses: []string{pod}}, {Pool: "st", Addresses: []string{st}}}}}
	}
	allocs := []ipwardenv1.NodeIPAllocation{both("a", "10.0.0.16/28", "10.0.0.32/28"), both("b", "10.0.0.32/28", "10.0.0.16/28")}
	s.Rebuild(pools, allocs, t0)
	if r := s.Audit(allocs); r.Candidates() != 0 || !r.Twice.IsEmpty() {
		t.Fatalf("overlapping pools on two networks: audit found %+v", r)
	}
	// On one network it is held twice: b's storage status also lists a's 10.0.0.33.
	allocs[1].Status.Pools[1].Addresses = []string{"10.0.0.16/28", "10.0.0.33"}
	if r := s.Audit(allocs); !r.Twice.Equal(set(t, "10.0.0.33")) {
		t.Fatalf("twice %v, want 10.0.0.33", r.Twice)
	}
}

package controller

import (
	"slices"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
)

func testPool(name, cidr string, cooldown time.Duration) ipwardenv1.IPPool {
	return ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: ipwardenv1.IPPoolSpec{
		CIDRs:         []ipwardenv1.CIDR{ipwardenv1.CIDR(cidr)},
		Scaling:       ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 0, MaxPerNode: 64},
		ReuseCooldown: metav1.Duration{Duration: cooldown},
	}}
}

func allocWith(name, pool string, held ...string) ipwardenv1.NodeIPAllocation {
	return ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: name},
		Status: ipwardenv1.NodeIPAllocationStatus{Pools: []ipwardenv1.NodePoolStatus{{Pool: pool, Addresses: held}}}}
}

func spec(pool string, requested int, releasing ...string) ipwardenv1.NodeIPAllocationSpec {
	var rel []ipwardenv1.AddressBlock
	for _, r := range releasing {
		rel = append(rel, ipwardenv1.AddressBlock(r))
	}
	return ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: pool, Requested: int32(requested), Releasing: rel}}}
}

func TestRebuildRestoresHoldingsAndCooling(t *testing.T) {
	pool := testPool("p", "10.0.0.0/28", time.Minute)
	pool.Status.Cooling = []ipwardenv1.CoolingBlock{
		{Addresses: []string{"10.0.0.8/30"}, Until: metav1.NewTime(t0.Add(30 * time.Second))},
		{Addresses: []string{"10.0.0.12"}, Until: metav1.NewTime(t0.Add(-time.Second))},    // already over
		{Addresses: []string{"10.0.0.0"}, Until: metav1.NewTime(t0.Add(30 * time.Second))}, // still held: held wins
	}
	s := NewState(DefaultExhaustionMarks)
	twice := s.Rebuild([]ipwardenv1.IPPool{pool}, []ipwardenv1.NodeIPAllocation{
		allocWith("a", "p", "10.0.0.0/30"),
		allocWith("b", "p", "10.0.0.3-10.0.0.5"),
	}, t0)
	if !twice.Equal(set(t, "10.0.0.3")) {
		t.Fatalf("twice = %v, want 10.0.0.3", twice)
	}
	if got := s.HeldBy("b")["p"]; !got.Equal(set(t, "10.0.0.4-10.0.0.5")) {
		t.Fatalf("b holds %v after rebuild", got)
	}
	// The /28 has 14 usable addresses (.0 and .15 are reserved); minus 3 of a's (its .0 is
	// outside the pool), b's 2 and 4 cooling leaves 5: a request of 7 falls short, and never gets
	// a cooling address.
	f := s.PlanFill("c", spec("p", 7), t0)
	got := f.Pools["p"].Added
	if size := count(got); size != 5 || got.Overlaps(set(t, "10.0.0.8/30", "10.0.0.0/30", "10.0.0.4-10.0.0.5")) {
		t.Fatalf("fill gave %v", got)
	}
	if len(f.Starved) != 1 {
		t.Fatalf("starved = %v, want [p]", f.Starved)
	}
	s.Abort(f, true)
	// After the cooling record ends the addresses are usable.
	f = s.PlanFill("c", spec("p", 9), t0.Add(31*time.Second))
	if n := count(f.Pools["p"].Added); n != 9 {
		t.Fatalf("after the cooldown the fill gave %d, want 9", n)
	}
}

func TestCommitAbortResolve(t *testing.T) {
	s := NewState(DefaultExhaustionMarks)
	s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/28", time.Minute)}, nil, t0)

	// A rejected write returns the addresses at once.
	f := s.PlanFill("n", spec("p", 8), t0)
	s.Abort(f, true)
	if s.Holds("n") {
		t.Fatal("a rejected fill left the node holding addresses")
	}
	// 14 usable addresses in the /28.
	if f2 := s.PlanFill("m", spec("p", 14), t0); count(f2.Pools["p"].Added) != 14 {
		t.Fatal("addresses of a rejected write were not returned at once")
	} else {
		s.Abort(f2, true)
	}

	// An unknown outcome keeps them reserved until the status is read again.
	f = s.PlanFill("n", spec("p", 8), t0)
	added := f.Pools["p"].Added
	s.Abort(f, false)
	if !s.HasPending("n") || s.HasPending("m") {
		t.Fatal("HasPending does not report the unknown write")
	}
	if f2 := s.PlanFill("m", spec("p", 14), t0); count(f2.Pools["p"].Added) != 6 {
		t.Fatalf("pending addresses were handed out again: %v", f2.Pools["p"].Added)
	} else {
		s.Abort(f2, true)
	}
	// The write did land for half of them (say the status shows the first 4).
	landed := added.First(4)
	s.ResolvePending("n", ipwardenv1.NodeIPAllocationStatus{Pools: []ipwardenv1.NodePoolStatus{{Pool: "p", Addresses: landed.Strings()}}})
	if got := s.HeldBy("n")["p"]; !got.Equal(landed) {
		t.Fatalf("after resolve the node holds %v, want %v", got, landed)
	}
	if s.HasPending("n") {
		t.Fatal("still pending after resolve")
	}
	if f2 := s.PlanFill("m", spec("p", 10), t0); count(f2.Pools["p"].Added) != 10 {
		t.Fatalf("unpublished pending addresses not returned: got %v", f2.Pools["p"].Added)
	} else {
		s.Abort(f2, true)
	}

	// Commit a release: the addresses cool, and only released ones leave.
	f = s.PlanFill("n", spec("p", 2, landed.First(2).Strings()...), t0)
	if !f.Pools["p"].Removed.Equal(landed.First(2)) {
		t.Fatalf("removed %v", f.Pools["p"].Removed)
	}
	s.Commit(f, t0)
	cool, _ := s.PoolCounts("p")
	if cool != 2 {
		t.Fatalf("cooling %d, want 2", cool)
	}
}

func TestReleaseNode(t *testing.T) {
	s := NewState(DefaultExhaustionMarks)
	s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/28", time.Second)}, []ipwardenv1.NodeIPAllocation{allocWith("n", "p", "10.0.0.1-10.0.0.8")}, t0)
	rel := s.ReleaseNode("n", t0)
	if !rel["p"].Equal(set(t, "10.0.0.1-10.0.0.8")) || s.Holds("n") {
		t.Fatalf("released %v", rel)
	}
	st, _ := s.PoolStatus("p", ipwardenv1.IPPoolStatus{}, 1, t0)
	if st.Allocated != 8 || st.Nodes != 0 {
		t.Fatalf("status right after release: %+v", st)
	}
	st, _ = s.PoolStatus("p", st, 1, t0.Add(2*time.Second))
	if st.Allocated != 0 || st.Free != 14 {
		t.Fatalf("status after cooldown: %+v", st)
	}
}

func TestNodeStatus(t *testing.T) {
	f := &Fill{Pools: map[string]*PoolFill{
		"b": {Held: set(t, "fd00::/124")},
		"a": {Held: set(t, "10.0.0.0/29", "10.0.0.9"), Reason: "pool a is exhausted: 0 free addresses for a deficit of 3"},
		"c": {Held: addr.Set{}},
	}}
	sp := ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "a", Requested: 12}, {Pool: "b", Requested: 16}}}
	st := NodeStatus(ipwardenv1.NodeIPAllocationStatus{}, sp, 3, f)
	if len(st.Pools) != 2 || st.Pools[0].Pool != "a" || st.Pools[0].Held != 9 || st.Held != 25 {
		t.Fatalf("pools %+v held %d", st.Pools, st.Held)
	}
	if got := st.Pools[0].Addresses; len(got) != 2 || got[0] != "10.0.0.0/29" || got[1] != "10.0.0.9" {
		t.Fatalf("addresses %v", got)
	}
	c := st.Conditions[0]
	if c.Status != metav1.ConditionFalse || c.Reason != "Short" || c.Message != "pool a is exhausted: 0 free addresses for a deficit of 3" {
		t.Fatalf("condition %+v", c)
	}
	if st.Summary != "a 9/12, b 16/16" || st.ObservedGeneration != 3 {
		t.Fatalf("summary %q generation %d", st.Summary, st.ObservedGeneration)
	}
}

// A starved node's status does not change while only the pool's free count moves, so syncing
// starved nodes costs no writes until something they hold changes.
func TestStarvedStatusIsStable(t *testing.T) {
	s := NewState(DefaultExhaustionMarks)
	s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/28", time.Minute)}, []ipwardenv1.NodeIPAllocation{allocWith("a", "p", "10.0.0.1-10.0.0.10")}, t0)
	f1 := s.PlanFill("b", spec("p", 8), t0) // 4 free for a deficit of 8
	st1 := NodeStatus(ipwardenv1.NodeIPAllocationStatus{}, spec("p", 8), 1, f1)
	s.Commit(f1, t0)
	if f1.Pools["p"].Detail != "4 free addresses for a deficit of 8" {
		t.Fatalf("detail %q", f1.Pools["p"].Detail)
	}
	f2 := s.PlanFill("b", spec("p", 8), t0) // 0 free for a deficit of 4
	st2 := NodeStatus(st1, spec("p", 8), 1, f2)
	if f2.Changed() || st1.Conditions[0].Message != st2.Conditions[0].Message || st2.Conditions[0].Message != "pool p is exhausted" {
		t.Fatalf("status moved with the free count: %q -> %q", st1.Conditions[0].Message, st2.Conditions[0].Message)
	}
}

// A starved node is left short from its plan, not its commit: addresses that come back while
// its fill is in flight are followed by a refill that lists it, so the controller looks at it
// again after this sync instead of leaving it to the next return or the full resync (seen on
// real processes before: an equal pool's last pod waited a minute).
func TestRefillListsAStarvedFillInFlight(t *testing.T) {
	s := NewState(DefaultExhaustionMarks)
	// The /28 has 14 usable addresses: b and c hold them all.
	s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/28", time.Minute)}, []ipwardenv1.NodeIPAllocation{
		allocWith("b", "p", "10.0.0.1-10.0.0.10"), allocWith("c", "p", "10.0.0.11-10.0.0.14")}, t0)
	aSpec := spec("p", 4)
	fa := s.PlanFill("a", aSpec, t0) // planned: nothing free
	if len(fa.Starved) != 1 {
		t.Fatalf("a's fill is not starved: %+v", fa)
	}
	cSpec := spec("p", 2, "10.0.0.13-10.0.0.14")
	cSpec.Pools[0].ReleasingCooled = cSpec.Pools[0].Releasing
	fc := s.PlanFill("c", cSpec, t0)
	s.Commit(fc, t0) // free at once (cooled): the pool's refill runs now, a's fill still in flight
	if w := s.Refill("p"); !slices.Equal(w, []string{"a"}) {
		t.Fatalf("refill during a's fill lists %v, want [a]", w)
	}
	s.Commit(fa, t0)
	f := s.PlanFill("a", aSpec, t0) // the look the refill asked for
	if !f.Pools["p"].Added.Equal(set(t, "10.0.0.13-10.0.0.14")) {
		t.Fatalf("a's next fill adds %v", f.Pools["p"].Added)
	}
	s.Commit(f, t0)
	if w := s.Refill("p"); !slices.Equal(w, []string{"a"}) {
		t.Fatalf("a is still short by two; refill lists %v", w)
	}
	// Once a fill gives it all it asks for, it is no longer waiting.
	s.Commit(s.PlanFill("a", spec("p", 2), t0), t0)
	if w := s.Refill("p"); len(w) != 0 {
		t.Fatalf("refill lists %v after a is filled", w)
	}
}

// A node is never handed an address its spec still lists as releasing: it may already have
// forgotten it, and the stale list would make the controller take it away again from a pod.
func TestFillSkipsAddressesTheNodeStillReleases(t *testing.T) {
	s := NewState(DefaultExhaustionMarks)
	s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/28", 0)}, []ipwardenv1.NodeIPAllocation{allocWith("n", "p", "10.0.0.1-10.0.0.4")}, t0)
	// n releases .3 and .4 (cooldown 0: free again at once) and asks for 4 more.
	f := s.PlanFill("n", spec("p", 2, "10.0.0.3-10.0.0.4"), t0)
	s.Commit(f, t0)
	f = s.PlanFill("n", spec("p", 6, "10.0.0.3-10.0.0.4"), t0)
	if added := f.Pools["p"].Added; count(added) != 4 || added.Overlaps(set(t, "10.0.0.3-10.0.0.4")) {
		t.Fatalf("the node got %v back while it still lists 10.0.0.3-10.0.0.4 as releasing", added)
	}
	s.Commit(f, t0)
	// Once its list no longer names them, they are ordinary free addresses again.
	f = s.PlanFill("n", spec("p", 8), t0)
	if added := f.Pools["p"].Added; count(added) != 2 {
		t.Fatalf("added %v, want 2 addresses", added)
	}
}

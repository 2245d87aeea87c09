package ipam

import (
	"slices"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// TestReleaseHysteresisAndDelay: with batch 4, buffer 50 %, slack 100 % and a 1m delay, a node
// keeps up to demand + 6 without a write; beyond that it gives back to its target only after
// the delay, and it asks for what it holds meanwhile (so the request does not change).
func TestReleaseHysteresisAndDelay(t *testing.T) {
	pool := poolV4
	pool.Scaling.ReleaseSlackPercent, pool.Scaling.ReleaseDelay = 100, time.Minute
	h := newHarness(t, pool)
	h.hold("v4", "10.0.0.8/29") // 8 held
	for _, c := range []string{"a", "b", "c"} {
		h.mustAdd(c)
	}
	// Demand 3: target 8, keep 3+6 = 9: nothing to give.
	if plan := h.s.Release(h.now); !plan.Change.IsEmpty() {
		t.Fatalf("released %v at demand 3 holding 8", plan.Marked)
	}
	// Demand 1 (two DELs, cooled): target 4, keep 7 < 8 held: the delay starts.
	h.del("a")
	h.del("b")
	h.now = h.now.Add(time.Minute)
	if plan := h.s.Release(h.now); !plan.Change.IsEmpty() {
		t.Fatalf("released %v before the delay", plan.Marked)
	}
	if spec := h.s.Spec(); spec[0].Requested != 8 {
		t.Fatalf("requested %d during the delay, want 8 (what it holds)", spec[0].Requested)
	}
	if w := h.s.NextRelease(); !w.Equal(h.now.Add(time.Minute)) {
		t.Fatalf("NextRelease = %v, want %v", w, h.now.Add(time.Minute))
	}
	// Demand back to 3 inside the delay: the excess ends, and so does the delay.
	h.mustAdd("d")
	h.mustAdd("e")
	h.now = h.now.Add(30 * time.Second)
	if plan := h.s.Release(h.now); !plan.Change.IsEmpty() || !h.s.NextRelease().IsZero() {
		t.Fatalf("released %v / wake %v with demand back at 3", plan.Marked, h.s.NextRelease())
	}
	// Down to demand 1 again: a fresh delay; after it, give back to the target (4).
	h.del("d")
	h.del("e")
	h.now = h.now.Add(31 * time.Second) // cooled
	if plan := h.s.Release(h.now); !plan.Change.IsEmpty() {
		t.Fatalf("released %v as the new delay started", plan.Marked)
	}
	h.now = h.now.Add(time.Minute)
	plan := h.s.Release(h.now)
	h.commit(plan.Change)
	if n := count(plan.Marked["v4"]); n != 4 {
		t.Fatalf("released %v after the delay, want 4 addresses", plan.Marked["v4"])
	}
	spec := h.s.Spec()
	if spec[0].Requested != 4 || !spec[0].ReleasingCooled.Equal(spec[0].Releasing) {
		t.Fatalf("spec %+v: want requested 4, every released address marked cooled", spec[0])
	}
}

// TestReleaseExhaustedAtOnceAndCooling: under exhaustion the spares go at once, down to demand;
// an address still in its reuse cooldown counts as demand and is not given back, and when the
// node must give one back that is still cooling it is not marked cooled.
func TestReleaseExhaustedAtOnceAndCooling(t *testing.T) {
	pool := poolV4
	pool.Scaling.ReleaseSlackPercent, pool.Scaling.ReleaseDelay = 100, time.Hour
	pool.Exhausted = true
	h := newHarness(t, pool)
	h.hold("v4", "10.0.0.8/29")
	h.mustAdd("a")
	h.mustAdd("b")
	h.del("b") // cooling: counts as demand
	plan := h.s.Release(h.now)
	h.commit(plan.Change)
	// Demand 2 (one in use, one cooling): 6 go at once, none of them the cooling one.
	rel := plan.Marked["v4"]
	if count(rel) != 6 {
		t.Fatalf("released %v under exhaustion, want 6", rel)
	}
	spec := h.s.Spec()
	if spec[0].Requested != 2 || !spec[0].ReleasingCooled.Equal(rel) {
		t.Fatalf("spec %+v: want requested 2 and all 6 cooled", spec[0])
	}
	// A pool that stops selecting the node: everything free goes, the cooling address unmarked.
	h.commit(h.s.SetPools([]Pool{pool}, nil))
	plan = h.s.Release(h.now)
	h.commit(plan.Change)
	spec = h.s.Spec()
	cooling := spec[0].Releasing.Subtract(spec[0].ReleasingCooled)
	if count(cooling) != 1 || count(plan.Marked["v4"]) != 1 {
		t.Fatalf("spec %+v after the pool left: want the one cooling address released, not marked cooled", spec[0])
	}
}

func TestSpecWorthWriting(t *testing.T) {
	s := func(items ...string) addr.Set { return set(t, items...) }
	base := []PoolRequest{{Pool: "a", Requested: 16, Releasing: s("10.0.0.0/30"), ReleasingCooled: s("10.0.0.0/31")}}
	with := func(f func(*PoolRequest)) []PoolRequest {
		r := base[0]
		f(&r)
		return []PoolRequest{r}
	}
	for _, tc := range []struct {
		name    string
		desired []PoolRequest
		want    bool
	}{
		{"same", base, false},
		{"released addresses taken and forgotten: no write", with(func(r *PoolRequest) { r.Releasing, r.ReleasingCooled = addr.Set{}, addr.Set{} }), false},
		{"part of them forgotten: no write", with(func(r *PoolRequest) { r.Releasing, r.ReleasingCooled = s("10.0.0.2/31"), addr.Set{} }), false},
		{"request changed", with(func(r *PoolRequest) { r.Requested = 32 }), true},
		{"more to give back", with(func(r *PoolRequest) { r.Releasing = s("10.0.0.0/29") }), true},
		{"newly marked cooled", with(func(r *PoolRequest) { r.ReleasingCooled = s("10.0.0.0/30") }), true},
		{"a claim", with(func(r *PoolRequest) { r.Claimed = s("10.0.9.9") }), true},
		{"another pool", append(append([]PoolRequest{}, base...), PoolRequest{Pool: "b"}), true},
		{"pool renamed", with(func(r *PoolRequest) { r.Pool = "b" }), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := SpecWorthWriting(base, tc.desired); got != tc.want {
				t.Fatalf("SpecWorthWriting = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestAddPacksLowAddresses: an ADD takes the lowest address that may be handed out, a cooled
// one before a higher fresh one, so pods pack the low end and the node's free addresses gather
// at the high end, where a give-back trims a run instead of splitting it.
func TestAddPacksLowAddresses(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/29")
	if got := h.mustAdd("a"); got[0] != "10.0.0.8" {
		t.Fatalf("first ADD got %v, want 10.0.0.8", got)
	}
	h.mustAdd("b")
	h.del("a")
	if got := h.mustAdd("c"); got[0] != "10.0.0.10" {
		t.Fatalf("ADD during a's cooldown got %v, want the next fresh 10.0.0.10", got)
	}
	h.now = h.now.Add(time.Minute)
	if got := h.mustAdd("d"); got[0] != "10.0.0.8" {
		t.Fatalf("ADD after a's cooldown got %v, want the cooled 10.0.0.8 before fresh 10.0.0.11", got)
	}
}

// TestAddPacksTheLargestRun: with a holding of several runs, an ADD takes the lowest address of
// the largest run first and the smaller runs only when it is full, so a small run's pods drain
// away and the node gives it back whole (one route fewer) instead of spreading pods over every
// run.
func TestAddPacksTheLargestRun(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.2/31", "10.0.0.16/30", "10.0.0.32/29")
	var got []string
	for _, k := range []string{"a", "b", "c", "d", "e", "f", "g", "h", "i"} {
		got = append(got, h.mustAdd(k)[0])
	}
	want := []string{"10.0.0.32", "10.0.0.33", "10.0.0.34", "10.0.0.35", "10.0.0.36", "10.0.0.37", "10.0.0.38", "10.0.0.39", "10.0.0.16"}
	if !slices.Equal(got, want) {
		t.Fatalf("ADDs got %v, want %v", got, want)
	}
	h.del("b")
	h.now = h.now.Add(time.Minute)
	if got := h.mustAdd("j"); got[0] != "10.0.0.33" {
		t.Fatalf("ADD after b's cooldown got %v, want its cooled 10.0.0.33 in the largest run before fresh 10.0.0.17", got)
	}
}

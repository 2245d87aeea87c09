package controller

import (
	"fmt"
	"testing"

	"github.com/ipwarden/ipwarden/internal/addr"
)

func set(t testing.TB, items ...string) addr.Set {
	t.Helper()
	s, err := addr.ParseSet(items)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestPlan(t *testing.T) {
	for _, tc := range []struct {
		name       string
		view       func(t *testing.T) PoolView
		wantAdd    int
		wantRemove []string
		wantExcess int
	}{
		{"empty node requests 32", func(t *testing.T) PoolView {
			return PoolView{Requested: 32, Serving: true}
		}, 32, nil, 0},
		{"holds what it asks", func(t *testing.T) PoolView {
			return PoolView{Held: set(t, "10.0.0.0/27"), Requested: 32, Serving: true}
		}, 0, nil, 0},
		{"partial deficit", func(t *testing.T) PoolView {
			return PoolView{Held: set(t, "10.0.0.0/28"), Requested: 32, Serving: true}
		}, 16, nil, 0},
		{"lowers to 16 releasing 16 named addresses", func(t *testing.T) PoolView {
			return PoolView{Held: set(t, "10.0.0.0/27"), Requested: 16, Releasing: set(t, "10.0.0.16/28"), Serving: true}
		}, 0, []string{"10.0.0.16/28"}, 0},
		{"only released addresses it holds are removed", func(t *testing.T) PoolView {
			return PoolView{Held: set(t, "10.0.0.0/28"), Requested: 12, Releasing: set(t, "10.0.0.12/30", "10.9.9.9"), Serving: true}
		}, 0, []string{"10.0.0.12/30"}, 0},
		{"lowered request without releases leaves excess in place", func(t *testing.T) PoolView {
			return PoolView{Held: set(t, "10.0.0.0/27"), Requested: 16, Serving: true}
		}, 0, nil, 16},
		{"release and refill in one step", func(t *testing.T) PoolView {
			return PoolView{Held: set(t, "10.0.0.0/28"), Requested: 16, Releasing: set(t, "10.0.0.0/30"), Serving: true}
		}, 4, []string{"10.0.0.0/30"}, 0},
		{"pool not serving: no fill, releases still honoured", func(t *testing.T) PoolView {
			return PoolView{Held: set(t, "10.0.0.0/28"), Requested: 32, Releasing: set(t, "10.0.0.15"), Serving: false}
		}, 0, []string{"10.0.0.15"}, 0},
		{"pool no longer listed: held addresses stay until released", func(t *testing.T) PoolView {
			return PoolView{Held: set(t, "10.0.0.0/28")}
		}, 0, nil, 16},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := Plan(tc.view(t))
			if p.Add != tc.wantAdd || !p.Remove.Equal(set(t, tc.wantRemove...)) || p.Excess != tc.wantExcess {
				t.Fatalf("Plan = add %d remove %v excess %d, want add %d remove %v excess %d",
					p.Add, p.Remove, p.Excess, tc.wantAdd, tc.wantRemove, tc.wantExcess)
			}
		})
	}
}

// TestPlanNeverRemovesUnreleased checks invariant 2 over many random views.
func TestPlanNeverRemovesUnreleased(t *testing.T) {
	for held := 0; held < 16; held++ {
		for rel := 0; rel < 16; rel++ {
			for req := 0; req < 24; req += 3 {
				h := set(t, fmt.Sprintf("10.0.0.0-10.0.0.%d", held))
				r := set(t, fmt.Sprintf("10.0.0.%d-10.0.0.20", rel))
				p := Plan(PoolView{Held: h, Requested: req, Releasing: r, Serving: true})
				if !r.ContainsSet(p.Remove) || !h.ContainsSet(p.Remove) {
					t.Fatalf("held %v releasing %v: removes %v", h, r, p.Remove)
				}
				if after := count(h) - count(p.Remove) + p.Add; after < req && p.Excess == 0 && after != req {
					t.Fatalf("held %v releasing %v requested %d: ends with %d", h, r, req, after)
				}
			}
		}
	}
}

func TestMoreUrgent(t *testing.T) {
	ordered := []Need{
		{Deficit: 64}, {Deficit: 16, Surplus: 100}, {Deficit: 16}, {Deficit: 1},
		{Surplus: 48}, {Surplus: 1}, {},
	}
	for i := range ordered {
		for j := range ordered {
			if got, want := MoreUrgent(ordered[i], ordered[j]), i < j; got != want {
				t.Errorf("MoreUrgent(%+v, %+v) = %v, want %v", ordered[i], ordered[j], got, want)
			}
		}
	}
}

func TestNeedOf(t *testing.T) {
	n := NeedOf(map[string]PoolPlan{
		"a": {Add: 16},
		"b": {Remove: set(t, "10.0.0.0/30"), Excess: 2},
	})
	if n != (Need{Deficit: 16, Surplus: 6}) {
		t.Fatalf("NeedOf = %+v", n)
	}
}

func TestExhaustionHysteresis(t *testing.T) {
	m := DefaultExhaustionMarks
	for _, tc := range []struct {
		name             string
		prev             bool
		free, cap, batch int64
		starved          bool
		regrowth         int64
		want             bool
	}{
		// /16 pool, batch 16: low = max(656, 16) = 656, high = max(1311, 32) = 1311.
		{"plenty free", false, 10000, 65536, 16, false, 0, false},
		{"falls below low", false, 655, 65536, 16, false, 0, true},
		{"at low is not below", false, 656, 65536, 16, false, 0, false},
		{"between marks keeps set", true, 1000, 65536, 16, false, 0, true},
		{"between marks keeps clear", false, 1000, 65536, 16, false, 0, false},
		{"at high still set", true, 1311, 65536, 16, false, 0, true},
		{"above high clears", true, 1312, 65536, 16, false, 0, false},
		{"starved fill sets at once", false, 5000, 65536, 16, true, 0, true},
		// /24 pool, batch 16: low = max(3, 16) = 16, high = max(6, 32) = 32.
		{"small pool uses batches: below one batch", false, 15, 256, 16, false, 0, true},
		{"small pool: one batch left is not exhausted", false, 16, 256, 16, false, 0, false},
		{"small pool: clears above two batches", true, 33, 256, 16, false, 0, false},
		{"small pool: two batches keeps it set", true, 32, 256, 16, false, 0, true},
		{"empty pool", false, 0, 0, 16, false, 0, true},
		// Regrowth: the flag clears only when the free addresses cover what the nodes would ask
		// for once it clears, on top of the high mark.
		{"regrowth keeps it set above high", true, 100, 1100, 16, false, 120, true},
		{"regrowth covered: clears", true, 153, 1100, 16, false, 120, false},
		{"regrowth does not set a clear flag", false, 100, 1100, 16, false, 5000, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := m.Exhausted(tc.prev, tc.free, tc.cap, tc.batch, tc.starved, tc.regrowth); got != tc.want {
				low, high := m.Thresholds(tc.cap, tc.batch)
				t.Fatalf("Exhausted(prev=%v, free=%d) = %v, want %v (low %d high %d)", tc.prev, tc.free, got, tc.want, low, high)
			}
		})
	}
}

func TestThresholdsHighAboveLow(t *testing.T) {
	m := ExhaustionMarks{LowPercent: 5, HighPercent: 5}
	low, high := m.Thresholds(100, 0)
	if high <= low {
		t.Fatalf("high %d not above low %d", high, low)
	}
}

func TestDecideLifecycle(t *testing.T) {
	for _, tc := range []struct {
		name string
		f    NodeFacts
		want Lifecycle
	}{
		{"unselected node without object: nothing", NodeFacts{NodeExists: true, NodeUID: "u1"}, Lifecycle{}},
		{"selected node without object: create", NodeFacts{NodeExists: true, NodeUID: "u1", Selected: true}, Lifecycle{Create: true}},
		{"object deleted under a live node that holds addresses: recreate with status",
			NodeFacts{NodeExists: true, NodeUID: "u1", Holds: true}, Lifecycle{Create: true, RestoreStatus: true}},
		{"node gone, object left: confirm with the API server",
			NodeFacts{AllocationExists: true, OwnerUID: "u1"}, Lifecycle{ConfirmGone: true}},
		{"node gone, object gone, addresses held in the record: confirm", NodeFacts{Holds: true}, Lifecycle{ConfirmGone: true}},
		{"node gone, nothing left: nothing", NodeFacts{}, Lifecycle{}},
		{"steady state: fill", NodeFacts{NodeExists: true, NodeUID: "u1", Selected: true, AllocationExists: true, OwnerUID: "u1"}, Lifecycle{Fill: true}},
		{"node recreated under the same name: fix the owner and fill",
			NodeFacts{NodeExists: true, NodeUID: "u2", Selected: true, AllocationExists: true, OwnerUID: "u1"}, Lifecycle{FixOwner: true, Fill: true}},
		{"no owner reference yet: set it", NodeFacts{NodeExists: true, NodeUID: "u1", Selected: true, AllocationExists: true}, Lifecycle{FixOwner: true, Fill: true}},
		{"unselected, idle: delete the orphan", NodeFacts{NodeExists: true, NodeUID: "u1", AllocationExists: true, OwnerUID: "u1"}, Lifecycle{DeleteOrphan: true}},
		{"unselected but holding: keep and honour releases",
			NodeFacts{NodeExists: true, NodeUID: "u1", AllocationExists: true, OwnerUID: "u1", Holds: true}, Lifecycle{Fill: true}},
		{"unselected but asking: keep", NodeFacts{NodeExists: true, NodeUID: "u1", AllocationExists: true, OwnerUID: "u1", Asks: true}, Lifecycle{Fill: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := DecideLifecycle(tc.f); got != tc.want {
				t.Fatalf("DecideLifecycle(%+v) = %+v, want %+v", tc.f, got, tc.want)
			}
		})
	}
}

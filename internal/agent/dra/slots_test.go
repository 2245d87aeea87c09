package dra

import (
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// The slot count follows the headroom in bands: it shrinks at once below what is published,
// grows only a band above it and only once that held for GrowAfter, never drops below the
// reserved slots, and a headroom that moves within a band never changes it.
func TestNextSlots(t *testing.T) {
	t0 := time.Date(2026, 11, 28, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name                      string
		prev                      SlotState
		headroom, reserved, limit int
		now                       time.Time
		want                      SlotState
	}{
		{"first publish, exact with a small limit", SlotState{Published: -1}, 3, 0, 4, t0, SlotState{Published: 3}},
		{"first publish, rounded down to a band", SlotState{Published: -1}, 37, 0, 128, t0, SlotState{Published: 32}},
		{"first publish capped at the limit", SlotState{Published: -1}, 300, 0, 128, t0, SlotState{Published: 128}},
		{"headroom one below: shrink at once to the band below", SlotState{Published: 32}, 31, 0, 128, t0, SlotState{Published: 24}},
		{"headroom within a band above: no rewrite", SlotState{Published: 24}, 31, 0, 128, t0, SlotState{Published: 24}},
		{"headroom a band above: wait", SlotState{Published: 24}, 32, 0, 128, t0, SlotState{Published: 24, GrowSince: t0}},
		{"headroom a band above for less than GrowAfter: wait", SlotState{Published: 24, GrowSince: t0}, 33, 0, 128, t0.Add(GrowAfter - time.Second),
			SlotState{Published: 24, GrowSince: t0}},
		{"headroom a band above for GrowAfter: grow", SlotState{Published: 24, GrowSince: t0}, 33, 0, 128, t0.Add(GrowAfter), SlotState{Published: 32}},
		{"headroom back within the band: the wait starts over", SlotState{Published: 24, GrowSince: t0}, 30, 0, 128, t0.Add(GrowAfter), SlotState{Published: 24}},
		{"shrink never drops reserved slots", SlotState{Published: 32}, 5, 10, 128, t0, SlotState{Published: 10}},
		{"band 1: shrink by one", SlotState{Published: 4}, 3, 1, 4, t0, SlotState{Published: 3}},
		{"band 1: back to full after GrowAfter", SlotState{Published: 3, GrowSince: t0}, 4, 0, 4, t0.Add(GrowAfter), SlotState{Published: 4}},
		{"no headroom", SlotState{Published: 8}, 0, 0, 128, t0, SlotState{Published: 0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := NextSlots(tc.prev, tc.headroom, tc.reserved, tc.limit, tc.now); got != tc.want {
				t.Fatalf("NextSlots(%+v, %d, %d, %d) = %+v, want %+v", tc.prev, tc.headroom, tc.reserved, tc.limit, got, tc.want)
			}
		})
	}
}

// A slot's name leads back to its pool, also for a pool whose name is no DNS label.
func TestSlotNames(t *testing.T) {
	pools := []string{"v4", "v4-s1", "pods.example.com", "v6"}
	for _, p := range pools {
		for _, i := range []int{0, 7, 127} {
			n := SlotName(p, i)
			if got, ok := PoolOfSlot(n, pools); !ok || got != p {
				t.Fatalf("PoolOfSlot(%q) = %q, %v; want %q", n, got, ok, p)
			}
		}
	}
	if _, ok := PoolOfSlot("gpu-0", pools); ok {
		t.Fatal("a foreign device resolved to a pool")
	}
}

// Resources splits the node's devices into slices of at most 128, with the three attributes.
func TestResources(t *testing.T) {
	r := Resources("node-a", []ipam.ClaimCapacity{{Pool: "v4", IPv4: true}, {Pool: "v6", Network: "storage"}}, map[string]int{"v4": 100, "v6": 50})
	pool, ok := r.Pools["node-a"]
	if !ok || len(pool.Slices) != 2 || len(pool.Slices[0].Devices) != 128 || len(pool.Slices[1].Devices) != 22 {
		t.Fatalf("resources %+v", r)
	}
	d := pool.Slices[1].Devices[21]
	if d.Name != "v6-s49" || *d.Attributes[AttrFamily].StringValue != "ipv6" || *d.Attributes[AttrNetwork].StringValue != "storage" || *d.Attributes[AttrPool].StringValue != "v6" {
		t.Fatalf("last device %+v", d)
	}
}

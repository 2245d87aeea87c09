package dra

import (
	"testing"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// The slot count follows the headroom in bands: it shrinks at once below what is published,
// grows only two bands above it, never drops below the reserved slots, and a headroom that moves
// by less than a band around an edge never changes it.
func TestSlots(t *testing.T) {
	for _, tc := range []struct {
		name                                    string
		published, headroom, reserved, maxSlots int
		want                                    int
	}{
		{"first publish, exact with a small max", -1, 3, 0, 4, 3},
		{"first publish, rounded down to a band", -1, 37, 0, 128, 32},
		{"first publish capped at max", -1, 300, 0, 128, 128},
		{"headroom one below: shrink to the band below", 32, 31, 0, 128, 24},
		{"headroom back up by one: no rewrite", 24, 32, 0, 128, 24},
		{"headroom up by less than two bands: no rewrite", 24, 39, 0, 128, 24},
		{"headroom up two bands: grow, one band short", 24, 40, 0, 128, 32},
		{"shrink never drops reserved slots", 32, 5, 10, 128, 10},
		{"exact with band 1: shrink", 4, 3, 1, 4, 3},
		{"exact with band 1: grow by two", 2, 4, 0, 4, 3},
		{"no headroom", 8, 0, 0, 128, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Slots(tc.published, tc.headroom, tc.reserved, tc.maxSlots); got != tc.want {
				t.Fatalf("Slots(%d, %d, %d, %d) = %d, want %d", tc.published, tc.headroom, tc.reserved, tc.maxSlots, got, tc.want)
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

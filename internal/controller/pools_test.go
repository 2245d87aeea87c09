package controller

import (
	"testing"
	"time"
)

func TestOverlaps(t *testing.T) {
	t0 := time.Unix(1000, 0)
	got := Overlaps([]PoolAddresses{
		{"young", t0.Add(2 * time.Second), set(t, "10.0.0.128/25"), ""},
		{"old", t0, set(t, "10.0.0.0/24"), ""},
		{"apart", t0.Add(time.Second), set(t, "10.1.0.0/24"), ""},
		{"v6", t0, set(t, "fd00::/64"), ""},
		{"also-young", t0.Add(3 * time.Second), set(t, "10.0.0.200"), ""},
		// Another network may reuse the addresses; two pools of that network may not.
		{"storage", t0.Add(4 * time.Second), set(t, "10.0.0.0/24"), "storage"},
		{"storage-young", t0.Add(5 * time.Second), set(t, "10.0.0.0/25"), "storage"},
		{"backup", t0.Add(6 * time.Second), set(t, "10.0.0.0/24"), "backup"},
	})
	want := map[string]string{"young": "old", "also-young": "old", "storage-young": "storage"}
	if len(got) != len(want) {
		t.Fatalf("Overlaps = %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Fatalf("Overlaps = %v, want %v", got, want)
		}
	}
}

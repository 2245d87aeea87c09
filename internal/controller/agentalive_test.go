package controller

import (
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/nodelease"
)

func TestDecideAgentAlive(t *testing.T) {
	t0 := time.Date(2026, 11, 25, 8, 0, 0, 0, time.UTC)
	d := 15 * time.Second
	tests := []struct {
		name      string
		rec       *nodelease.Record
		seen, now time.Time
		alive     bool
		recheck   time.Time
	}{
		{"no Lease: the agent never ran or it was deleted", nil, t0, t0, false, time.Time{}},
		{"released on shutdown", &nodelease.Record{Version: "7"}, t0, t0, false, time.Time{}},
		{"held, seen just now", &nodelease.Record{Holder: "agent-a", Version: "7"}, t0, t0, true, t0.Add(d)},
		{"held, unchanged for less than its duration", &nodelease.Record{Holder: "agent-a", Version: "7"}, t0, t0.Add(d - time.Second), true, t0.Add(d)},
		{"held, unchanged for its duration: expired", &nodelease.Record{Holder: "agent-a", Version: "7"}, t0, t0.Add(d), false, time.Time{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			alive, recheck := DecideAgentAlive(tt.rec, tt.seen, tt.now, d)
			if alive != tt.alive || !recheck.Equal(tt.recheck) {
				t.Fatalf("DecideAgentAlive = %v, %v; want %v, %v", alive, recheck, tt.alive, tt.recheck)
			}
		})
	}
}

// A cooling record read by a controller whose clock was stepped back since it was written (or
// another replica's clock runs behind) never keeps addresses cooling longer than one cooldown.
func TestClampCooling(t *testing.T) {
	now := time.Date(2026, 11, 25, 8, 0, 0, 0, time.UTC)
	cd := 30 * time.Second
	for _, tc := range []struct {
		name        string
		until, want time.Time
	}{
		{"within the cooldown", now.Add(10 * time.Second), now.Add(10 * time.Second)},
		{"exactly one cooldown", now.Add(cd), now.Add(cd)},
		{"written an hour ahead (clock stepped back)", now.Add(time.Hour), now.Add(cd)},
		{"already over", now.Add(-time.Minute), now.Add(-time.Minute)},
	} {
		if got := ClampCooling(tc.until, now, cd); !got.Equal(tc.want) {
			t.Errorf("%s: ClampCooling = %s, want %s", tc.name, got, tc.want)
		}
	}
}

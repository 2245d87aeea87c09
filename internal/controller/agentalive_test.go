package controller

import (
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/agent/nodelease"
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

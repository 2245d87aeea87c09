package ipam

import (
	"slices"
	"testing"
	"time"
)

// Clock steps on a node (docs/design.md, "Clock steps"). Within one process the agent measures
// durations on the monotonic clock; the journal's times are wall times. A journal written before
// an NTP correction stepped the clock back an hour holds times an hour in the future: after a
// restart they count from now (ClampFuture), so the addresses they concern are not kept out of
// use for the hour. A step forward makes journaled times older: cooldowns end early, which costs
// no duplicate (an address is cooling only once nothing uses it).
func TestJournalTimesAfterAClockStep(t *testing.T) {
	for _, tc := range []struct {
		name  string
		step  time.Duration // how far the clock moved between the journal write and the restart
		moved int
	}{
		{"stepped back an hour", -time.Hour, 2},
		{"stepped forward an hour", time.Hour, 0},
		{"no step", 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, poolV4) // cooldown 30s
			h.hold("v4", "10.0.0.0/28")
			h.mustAdd("kept")
			h.mustAdd("gone")
			h.del("gone") // 10.0.0.3 cooling from t0
			h.restart()
			now := t0.Add(tc.step) // the restarted agent's wall clock
			if got := h.s.ClampFuture(now); got != tc.moved {
				t.Fatalf("ClampFuture moved %d times, want %d", got, tc.moved)
			}
			// One cooldown after the restart the freed address is usable again, whatever the step.
			h.now = now.Add(30 * time.Second)
			var got []string
			for i := range 13 {
				got = append(got, h.mustAdd("x"+string(rune('a'+i)))...)
			}
			if !slices.Contains(got, "10.0.0.3") {
				t.Fatalf("after a step of %s, 10.0.0.3 was not handed out one cooldown after the restart: %v", tc.step, got)
			}
			for _, a := range h.s.Attachments() {
				if a.Created.After(h.now) {
					t.Fatalf("attachment %s created %s, after now %s", a.Key, a.Created, h.now)
				}
			}
		})
	}
}

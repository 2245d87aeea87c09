package scaling

import (
	"testing"
	"time"
)

func TestKeep(t *testing.T) {
	d := DefaultParams
	for _, tc := range []struct {
		name      string
		demand    int
		p         Params
		exhausted bool
		want      int
	}{
		{"defaults: demand + 16*(0.5+1)", 30, d, false, 54},
		{"no slack: demand + buffer, but never below target", 30, Params{BatchSize: 16, BufferPercent: 50, MaxPerNode: 250}, false, 48},
		{"slack 250 %", 10, Params{BatchSize: 16, BufferPercent: 0, MaxPerNode: 250, ReleaseSlackPercent: 250}, false, 50},
		{"clamped at maxPerNode", 240, d, false, 250},
		{"exhausted: demand", 30, d, true, 30},
		{"odd batch rounds up", 0, Params{BatchSize: 3, BufferPercent: 50, MaxPerNode: 250, ReleaseSlackPercent: 100}, false, 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Keep(tc.demand, tc.p, tc.exhausted); got != tc.want {
				t.Fatalf("Keep(%d, %+v, %v) = %d, want %d", tc.demand, tc.p, tc.exhausted, got, tc.want)
			}
		})
	}
}

func TestDecideRelease(t *testing.T) {
	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	d := DefaultParams // batch 16, buffer 50 %, slack 100 %, delay 3m
	noDelay := d
	noDelay.ReleaseDelay = 0
	for _, tc := range []struct {
		name            string
		holding, demand int
		p               Params
		exhausted       bool
		since, now      time.Time
		want            Release
	}{
		{"growing asks for the target", 32, 30, d, false, time.Time{}, t0, Release{Request: 48}},
		{"at target nothing", 48, 30, d, false, time.Time{}, t0, Release{Request: 48}},
		{"inside the band: keep, request what is held", 64, 40, d, false, time.Time{}, t0, Release{Request: 64}},
		{"at the band's edge: keep", 54, 30, d, false, t0.Add(-time.Hour), t0, Release{Request: 54}},
		{"beyond the band: the delay starts", 64, 30, d, false, time.Time{}, t0,
			Release{Request: 64, ExcessSince: t0, WakeAt: t0.Add(3 * time.Minute)}},
		{"beyond the band, delay running", 64, 30, d, false, t0, t0.Add(time.Minute),
			Release{Request: 64, ExcessSince: t0, WakeAt: t0.Add(3 * time.Minute)}},
		{"beyond the band for the delay: give back to the target", 64, 30, d, false, t0, t0.Add(3 * time.Minute),
			Release{Give: 16, Least: 10, Request: 48}},
		{"a since in the future (clock step back) restarts the delay", 64, 30, d, false, t0.Add(time.Hour), t0,
			Release{Request: 64, ExcessSince: t0, WakeAt: t0.Add(3 * time.Minute)}},
		{"no delay: at once", 64, 30, noDelay, false, time.Time{}, t0, Release{Give: 16, Least: 10, Request: 48}},
		{"exhausted: spares go at once, down to demand", 48, 30, d, true, time.Time{}, t0, Release{Give: 18, Least: 18, Request: 30}},
		{"exhausted and nothing spare", 30, 30, d, true, time.Time{}, t0, Release{Request: 30}},
		{"above maxPerNode (lowered): at once", 64, 10, Params{BatchSize: 16, BufferPercent: 50, MaxPerNode: 32, ReleaseSlackPercent: 100, ReleaseDelay: time.Minute},
			false, time.Time{}, t0, Release{Give: 32, Least: 32, Request: 32}},
		{"empty node holding a batch keeps it", 16, 0, d, false, time.Time{}, t0, Release{Request: 16}},
		{"empty node holding three batches waits, then gives two", 48, 0, d, false, t0, t0.Add(5 * time.Minute), Release{Give: 32, Least: 24, Request: 16}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := DecideRelease(tc.holding, tc.demand, tc.p, tc.exhausted, tc.since, tc.now)
			if got != tc.want {
				t.Fatalf("DecideRelease(%d, %d, %+v, %v, %v, %v) = %+v, want %+v",
					tc.holding, tc.demand, tc.p, tc.exhausted, tc.since, tc.now, got, tc.want)
			}
		})
	}
}

// TestDecideReleaseBounds: over a grid, after a give-back the node holds its target, it never
// gives more than its free excess would allow (holding - target), and what it keeps without
// giving back is at most Keep, the economy bound demand + batch*(buffer+slack).
func TestDecideReleaseBounds(t *testing.T) {
	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, p := range []Params{DefaultParams, {BatchSize: 1, BufferPercent: 0, MaxPerNode: 10, ReleaseSlackPercent: 0},
		{BatchSize: 32, BufferPercent: 100, MaxPerNode: 250, ReleaseSlackPercent: 300, ReleaseDelay: time.Second}} {
		for _, ex := range []bool{false, true} {
			for demand := 0; demand <= 120; demand++ {
				for holding := 0; holding <= 300; holding++ {
					r := DecideRelease(holding, demand, p, ex, t0, t0.Add(p.ReleaseDelay))
					target := Target(demand, p, ex)
					if r.Give < 0 || r.Give > max(holding-target, 0) {
						t.Fatalf("%+v ex=%v holding %d demand %d: gives %d, target %d", p, ex, holding, demand, r.Give, target)
					}
					if r.Give > 0 && holding-r.Give != target {
						t.Fatalf("%+v ex=%v holding %d demand %d: keeps %d after giving, target %d", p, ex, holding, demand, holding-r.Give, target)
					}
					if r.Least < 0 || r.Least > r.Give || (r.Give > 0 && holding-r.Least > Keep(demand, p, ex)) {
						t.Fatalf("%+v ex=%v holding %d demand %d: must give %d of %d, keeping %d beyond Keep %d", p, ex, holding, demand, r.Least, r.Give, holding-r.Least, Keep(demand, p, ex))
					}
					if ex && r.Least != r.Give {
						t.Fatalf("%+v exhausted holding %d demand %d: must give %d of %d; every spare goes back at once", p, holding, demand, r.Least, r.Give)
					}
					if r.Give == 0 && holding > Keep(demand, p, ex) {
						t.Fatalf("%+v ex=%v holding %d demand %d: keeps %d beyond Keep %d after the delay", p, ex, holding, demand, holding, Keep(demand, p, ex))
					}
					if r.Request < target {
						t.Fatalf("%+v ex=%v holding %d demand %d: requests %d below target %d", p, ex, holding, demand, r.Request, target)
					}
				}
			}
		}
	}
}

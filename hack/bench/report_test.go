package main

import (
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/charts"
)

func benchReportForTest() *report {
	ms := func(v ...float64) []time.Duration {
		out := make([]time.Duration, len(v))
		for i, x := range v {
			out[i] = time.Duration(x * float64(time.Millisecond))
		}
		return out
	}
	lat := map[string][]time.Duration{
		"ipwarden":   ms(8.2, 7.9, 8.0, 12.5, 8.1, 8.4, 7.7, 9.0, 8.3, 8.05),
		"host-local": ms(7.1, 7.3, 6.9, 10.2, 7.0, 7.2, 7.4, 7.15, 8.0, 7.05),
	}
	rep := &report{date: time.Date(2026, 11, 28, 0, 0, 0, 0, time.UTC), cni: lat,
		burst: map[string][]burstADD{"bench-burst-node": {
			{at: 0, wait: 200 * time.Millisecond}, {at: time.Millisecond, wait: 310 * time.Millisecond},
			{at: 2 * time.Millisecond, wait: 0}, // failed: not drawn
		}}}
	rep.figures = []figure{cniPooled(lat), {name: "burst: IP wait p50 / p99", value: "200ms / 310ms", goal: "p99 < 1s", ok: true}}
	return rep
}

// The pictures draw the report's own samples: the CNI curve passes through the p50 and p99 the
// text report prints, and the burst's points are its ADDs.
func TestBenchPicturesAreTheReportsNumbers(t *testing.T) {
	rep := benchReportForTest()
	cs := rep.charts()
	if len(cs) != 2 || cs[0].File != "cni-latency.svg" || cs[1].File != "burst-ip-wait.svg" {
		t.Fatalf("charts %+v", cs)
	}
	text := rep.text()
	for i, name := range []string{"ipwarden", "host-local"} {
		s := cs[0].Series[i]
		if !strings.HasPrefix(s.Name, name+" ") || len(s.Points) != len(rep.cni[name]) {
			t.Fatalf("series %d: %q with %d points, want %s's %d pairs", i, s.Name, len(s.Points), name, len(rep.cni[name]))
		}
		for _, q := range []float64{0.5, 0.99} {
			v := quantile(rep.cni[name], q)
			// The text report's pooled figure prints this quantile, and the curve has it at the
			// share of pairs at or below it (quantile takes the value at index q*(n-1)).
			n := len(rep.cni[name])
			share := float64(int(q*float64(n-1))+1) / float64(n)
			if !strings.Contains(text, v.Round(10*time.Microsecond).String()) {
				t.Errorf("the text report does not show %s's p%g %s:\n%s", name, q*100, v, text)
			}
			found := false
			for _, p := range s.Points {
				if p.X == ms(v) && p.Y == share {
					found = true
				}
			}
			if !found {
				t.Errorf("%s's curve does not pass through its p%g (%s)", name, q*100, v)
			}
		}
		for _, p := range s.Points {
			hit := false
			for _, d := range rep.cni[name] {
				hit = hit || ms(d) == p.X
			}
			if !hit {
				t.Errorf("%s's curve has a point at %g ms that is no pair's time", name, p.X)
			}
		}
	}
	got := cs[1].Series
	want := []charts.Point{{X: 0, Y: 200}, {X: 1, Y: 310}}
	if len(got) != 1 || got[0].Name != "bench-burst-node" || len(got[0].Points) != 2 || got[0].Points[0] != want[0] || got[0].Points[1] != want[1] {
		t.Errorf("burst series %+v, want the node's two answered ADDs %v", got, want)
	}
}

func TestBenchReportWritesTextAndPictures(t *testing.T) {
	rep := benchReportForTest()
	dir := filepath.Join(t.TempDir(), "bench")
	if err := rep.write(dir); err != nil {
		t.Fatal(err)
	}
	if err := charts.CheckReport(dir, rep.text(), rep.charts()); err != nil {
		t.Fatal(err)
	}
	// Sections that did not run draw nothing.
	if cs := (&report{}).charts(); len(cs) != 0 {
		t.Errorf("an empty report draws %d charts", len(cs))
	}
}

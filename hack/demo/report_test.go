package main

import (
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/charts"
)

func demoReportForTest() demoReport {
	msec := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	return demoReport{
		Nodes:   []nodeRow{{Name: "demo-1", Pods: 41, Held: 64, InUse: 41}, {Name: "demo-2", Pods: 3, Held: 16, InUse: 3}},
		Started: 250, ControllerWrites: 20, AgentWrites: 12,
		Waits: []time.Duration{msec(12), msec(30), msec(250), msec(14)},
		Burst: map[string][]addSample{"demo-1": {{At: 0, Wait: msec(12)}, {At: msec(1.5), Wait: msec(250)}, {At: msec(2), Wait: msec(30)}}},
		Holdings: []holding{
			{At: 0, Node: "demo-1", Held: 16}, {At: 0, Node: "demo-2", Held: 16}, {At: 0, Node: "demo-3", Held: 16},
			{At: time.Second, Node: "demo-1", Held: 48, InUse: 40}, {At: time.Second, Node: "demo-2", Held: 16, InUse: 3},
			{At: 2 * time.Second, Node: "demo-1", Held: 64, InUse: 41}, {At: 2 * time.Second, Node: "demo-2", Held: 16, InUse: 3},
		},
		Held: 80, CheckedNodes: 2, RunningPods: 44, Attachments: 44,
	}
}

// The pictures draw the report's numbers: the burst's points are its ADDs, whose quantiles the
// text prints; each node's held and in-use lines end at its row of the text's table.
func TestDemoPicturesAreTheReportsNumbers(t *testing.T) {
	r := demoReportForTest()
	cs := r.charts()
	if len(cs) != 2 || cs[0].File != "burst-ip-wait.svg" || cs[1].File != "addresses.svg" {
		t.Fatalf("charts %+v", cs)
	}
	text := r.text()
	if !strings.Contains(text, "the burst on demo-1: 3 ADDs, IP wait p50 30ms, p99 30ms") {
		t.Errorf("the text does not give the burst's quantiles:\n%s", text)
	}
	burst := cs[0].Series
	if len(burst) != 1 || burst[0].Name != "demo-1" || len(burst[0].Points) != 3 {
		t.Fatalf("burst series %+v", burst)
	}
	for i, a := range r.Burst["demo-1"] {
		if p := burst[0].Points[i]; p.X != ms(a.At) || p.Y != ms(a.Wait) {
			t.Errorf("burst point %d is %v, the ADD was sent at %s and waited %s", i, p, a.At, a.Wait)
		}
	}
	lines := map[string]charts.Series{}
	for _, s := range cs[1].Series {
		lines[s.Name] = s
	}
	if len(lines) != 6 { // held and in use for demo-1, demo-2 and the deleted demo-3
		t.Errorf("address lines %v", cs[1].Series)
	}
	for _, row := range r.Nodes {
		h, u := lines[row.Name+" held"], lines[row.Name+" in use"]
		if len(h.Points) == 0 || len(u.Points) == 0 {
			t.Fatalf("no lines for %s", row.Name)
		}
		if last := h.Points[len(h.Points)-1]; last.Y != float64(row.Held) {
			t.Errorf("%s's held line ends at %g, its row says %d", row.Name, last.Y, row.Held)
		}
		if last := u.Points[len(u.Points)-1]; last.Y != float64(row.InUse) {
			t.Errorf("%s's in-use line ends at %g, its row says %d", row.Name, last.Y, row.InUse)
		}
		if !u.Dashed || u.Color != h.Color {
			t.Errorf("%s: in use should be dashed in held's colour: %+v %+v", row.Name, h, u)
		}
	}
}

func TestDemoReportWritesTextAndPictures(t *testing.T) {
	r := demoReportForTest()
	dir := filepath.Join(t.TempDir(), "demo")
	if err := r.write(dir); err != nil {
		t.Fatal(err)
	}
	if err := charts.CheckReport(dir, r.text(), r.charts()); err != nil {
		t.Fatal(err)
	}
}

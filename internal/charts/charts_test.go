package charts

import (
	"path/filepath"
	"strings"
	"testing"

	"gonum.org/v1/plot"
)

func TestWriteDrawsEveryChart(t *testing.T) {
	dir := t.TempDir()
	cs := []Chart{
		{File: "a.svg", Title: "IP wait over the burst", XLabel: "ADD started (ms)", YLabel: "IP wait (ms)",
			Series: []Series{{Name: "node-a", Dots: true, Points: []Point{{0, 1}, {5, 20}, {9, 3}}}}},
		{File: "b.svg", Title: "addresses held and in use", XLabel: "s", YLabel: "addresses",
			Series: []Series{
				{Name: "node-a held", Points: []Point{{0, 16}, {1, 48}}},
				{Name: "node-a in use", Dashed: true, Points: []Point{{0, 0}, {1, 40}}},
				{Name: "node-b held", Color: 1, Points: []Point{{0, 16}, {1, 16}}},
			}},
		{File: "c.svg", Title: "CNI ADD+DEL", XLabel: "ms", YLabel: "share", LogX: true,
			Series: []Series{CDF("ipwarden", []float64{1, 2, 3}), CDF("host-local", []float64{1, 1.5, 2})}},
	}
	out := filepath.Join(dir, "out")
	paths, err := WriteReport(out, "the report\n", cs)
	if err != nil {
		t.Fatal(err)
	}
	if len(paths) != 1+len(cs) || paths[0] != filepath.Join(out, ReportFile) {
		t.Fatalf("wrote %v", paths)
	}
	if err := CheckReport(out, "the report\n", cs); err != nil {
		t.Fatal(err)
	}
	if err := CheckReport(out, "another report\n", cs); err == nil {
		t.Error("CheckReport took another text")
	}
	renamed := append([]Chart(nil), cs...)
	renamed[0].Series = []Series{{Name: "node-b", Dots: true}}
	if err := CheckReport(out, "the report\n", renamed); err == nil {
		t.Error("CheckReport took a picture without its series' name")
	}
}

func TestCDF(t *testing.T) {
	s := CDF("x", []float64{1, 2, 3, 4})
	want := []Point{{1, 0.25}, {2, 0.5}, {3, 0.75}, {4, 1}}
	for i, p := range s.Points {
		if p != want[i] {
			t.Fatalf("points %v, want %v", s.Points, want)
		}
	}
}

// labels are the labelled ticks' labels, space-separated.
func labels(ticks []plot.Tick) string {
	var out []string
	for _, tk := range ticks {
		if tk.Label != "" {
			out = append(out, tk.Label)
		}
	}
	return strings.Join(out, " ")
}

func TestNiceTicks(t *testing.T) {
	if got := labels((niceTicks{}).Ticks(0, 312.5)); got != "0 100 200 300" {
		t.Errorf("labels %q", got)
	}
	if got := labels((niceTicks{}).Ticks(0.2, 1)); got != "0.2 0.4 0.6 0.8 1" {
		t.Errorf("labels %q", got)
	}
}

func TestLogTicks(t *testing.T) {
	if got := labels((logTicks{}).Ticks(3, 300)); got != "5 10 20 50 100 200" {
		t.Errorf("labels %q", got)
	}
}

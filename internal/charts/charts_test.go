package charts

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
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
	paths, err := Write(filepath.Join(dir, "out"), cs)
	if err != nil {
		t.Fatal(err)
	}
	if len(paths) != len(cs) {
		t.Fatalf("wrote %v", paths)
	}
	for i, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		root, texts, err := Texts(b)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		if root != "svg" {
			t.Errorf("%s: root element %q", p, root)
		}
		all := strings.Join(texts, "\n")
		for _, want := range append([]string{cs[i].Title, cs[i].XLabel, cs[i].YLabel}, names(cs[i])...) {
			if !strings.Contains(all, want) {
				t.Errorf("%s shows no %q; its texts: %q", p, want, texts)
			}
		}
	}
}

func names(c Chart) []string {
	var out []string
	for _, s := range c.Series {
		out = append(out, s.Name)
	}
	return out
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

func TestNiceTicks(t *testing.T) {
	var labels []string
	for _, tk := range (niceTicks{}).Ticks(0, 312.5) {
		if tk.Label != "" {
			labels = append(labels, tk.Label)
		}
	}
	if got := strings.Join(labels, " "); got != "0 100 200 300" {
		t.Errorf("labels %q", got)
	}
	labels = labels[:0]
	for _, tk := range (niceTicks{}).Ticks(0.2, 1) {
		if tk.Label != "" {
			labels = append(labels, tk.Label)
		}
	}
	if got := strings.Join(labels, " "); got != "0.2 0.4 0.6 0.8 1" {
		t.Errorf("labels %q", got)
	}
}

func TestLogTicks(t *testing.T) {
	var labels []string
	for _, tk := range (logTicks{}).Ticks(3, 300) {
		if tk.Label != "" {
			labels = append(labels, tk.Label)
		}
	}
	if got := strings.Join(labels, " "); got != "5 10 20 50 100 200" {
		t.Errorf("labels %q", got)
	}
}

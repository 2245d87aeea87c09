package main

import (
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestCNISchedule(t *testing.T) {
	for _, tc := range []struct {
		name              string
		run, pairs, block int
		want              []cniStep
	}{
		{"even run starts with ipwarden", 0, 100, 50, []cniStep{{0, 50}, {1, 50}, {0, 50}, {1, 50}}},
		{"odd run starts with host-local", 1, 100, 50, []cniStep{{1, 50}, {0, 50}, {1, 50}, {0, 50}}},
		{"a short last block", 2, 120, 50, []cniStep{{0, 50}, {1, 50}, {0, 50}, {1, 50}, {0, 20}, {1, 20}}},
		{"fewer pairs than a block", 3, 7, 50, []cniStep{{1, 7}, {0, 7}}},
		{"no block size: one block each", 0, 30, 0, []cniStep{{0, 30}, {1, 30}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := cniSchedule(tc.run, tc.pairs, tc.block)
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("cniSchedule(%d, %d, %d) = %v, want %v", tc.run, tc.pairs, tc.block, got, tc.want)
			}
		})
	}
}

func TestSpreadOf(t *testing.T) {
	for _, tc := range []struct {
		in   []float64
		want spread
	}{
		{nil, spread{}},
		{[]float64{1.1}, spread{1.1, 1.1, 1.1}},
		{[]float64{1.4, 1.0, 1.1, 1.3, 1.05}, spread{1.1, 1.0, 1.4}}, // one bad run does not move the median
		{[]float64{1.2, 1.0, 1.4, 1.1}, spread{1.15, 1.0, 1.4}},      // even: the middle two's mean
	} {
		if got := spreadOf(tc.in); got != tc.want {
			t.Errorf("spreadOf(%v) = %+v, want %+v", tc.in, got, tc.want)
		}
	}
}

func mkRun(ipw50, hl50, ipw99, hl99 time.Duration) cniRun {
	return cniRun{ipw: [2]time.Duration{ipw50, ipw99}, hl: [2]time.Duration{hl50, hl99}}
}

func TestCNIVerdictJudgesTheMedian(t *testing.T) {
	ms := time.Millisecond
	// Run 3's p99 misses 1.3x by itself; the median of the five meets it.
	runs := []cniRun{
		mkRun(6*ms, 5*ms, 8*ms, 7*ms),
		mkRun(6*ms, 5*ms, 9*ms, 7*ms),
		mkRun(6*ms, 5*ms, 14*ms, 7*ms),
		mkRun(5*ms, 5*ms, 7*ms, 7*ms),
		mkRun(7*ms, 5*ms, 8*ms, 8*ms),
	}
	p99 := cniVerdict(runs, 1, cniP99Goal, 1000)
	if !p99.ok {
		t.Fatalf("p99 judged missed: %+v", p99)
	}
	if !strings.Contains(p99.value, "spread 1.00x..2.00x") || !strings.Contains(p99.value, "runs 1.14, 1.29, 2.00, 1.00, 1.00") {
		t.Fatalf("p99 value %q does not show each run and the spread", p99.value)
	}
	p50 := cniVerdict(runs, 0, cniP50Goal, 1000)
	if !p50.ok || !strings.HasPrefix(p50.value, "1.20x") || p50.goal != "median <= 1.2x" {
		t.Fatalf("p50 = %+v, want a met median of 1.20x", p50)
	}
	// Three of five over the goal: the median misses it.
	runs[0].ipw[0], runs[1].ipw[0] = 7*ms, 7*ms
	if p50 := cniVerdict(runs, 0, cniP50Goal, 1000); p50.ok {
		t.Fatalf("p50 judged met with three runs of five over the goal: %+v", p50)
	}
	if f := cniVerdict(nil, 0, cniP50Goal, 1000); f.ok {
		t.Fatalf("no runs judged met: %+v", f)
	}
}

func TestAgentMetricsAddrsDistinct(t *testing.T) {
	seen := map[string]bool{}
	for i := range 5000 {
		a := agentMetricsAddr(i)
		if seen[a] {
			t.Fatalf("agent %d: address %s given twice", i, a)
		}
		seen[a] = true
	}
}

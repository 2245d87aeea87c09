package main

import (
	"fmt"
	"sort"
	"strings"
	"time"
)

// The CNI bench's goals (docs/design.md "Targets"; BENCHMARKS.md, "How the CNI goal is judged").
// One run's ratio moves by more than the goal's margin from run to run on a shared machine, so
// the bench repeats the paired measurement cniRuns times and judges the median of the runs'
// ratios; every run's ratio and the spread are printed beside it.
const (
	// cniRuns is how many times the paired measurement (ipwarden's pairs and host-local's,
	// interleaved) is repeated; the goal is judged on the median of the runs' ratios.
	cniRuns = 5
	// cniP50Goal: the median over the runs of p50(ipwarden) / p50(host-local) is at most this.
	cniP50Goal = 1.2
	// cniP99Goal: the same for p99 (the design target, 1.3x).
	cniP99Goal = 1.3
	// cniBlock is how many pairs one plugin runs before the other takes its turn within a run,
	// so the two share the machine's drift at the scale of a fraction of a second.
	cniBlock = 50
)

// cniStep is one block of a run: plugin (0 ipwarden, 1 host-local) runs pairs ADD+DEL pairs.
type cniStep struct{ plugin, pairs int }

// cniSchedule is run r's order (r from 0): blocks of at most block pairs, the two plugins
// alternating, each reaching pairs in total; even runs start with ipwarden, odd runs with
// host-local, so neither always goes first.
func cniSchedule(r, pairs, block int) []cniStep {
	if block <= 0 {
		block = pairs
	}
	var out []cniStep
	left := [2]int{pairs, pairs}
	first := r % 2
	for left[0] > 0 || left[1] > 0 {
		for _, p := range []int{first, 1 - first} {
			if n := min(block, left[p]); n > 0 {
				out = append(out, cniStep{plugin: p, pairs: n})
				left[p] -= n
			}
		}
	}
	return out
}

// cniRun is one repetition's quantiles of both plugins.
type cniRun struct {
	ipw, hl [2]time.Duration // p50, p99
}

func (r cniRun) ratio(q int) float64 {
	if r.hl[q] <= 0 {
		return 0
	}
	return float64(r.ipw[q]) / float64(r.hl[q])
}

// spread is a set of ratios' median, minimum and maximum.
type spread struct{ median, lo, hi float64 }

// spreadOf is the median (the mean of the middle two for an even count), the minimum and the
// maximum of rs; zero for none.
func spreadOf(rs []float64) spread {
	if len(rs) == 0 {
		return spread{}
	}
	s := append([]float64(nil), rs...)
	sort.Float64s(s)
	m := s[len(s)/2]
	if len(s)%2 == 0 {
		m = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return spread{median: m, lo: s[0], hi: s[len(s)-1]}
}

// cniVerdict is the figure for quantile q (0 p50, 1 p99) over the runs: the median ratio
// judged against goal, with each run's ratio and the spread beside it.
func cniVerdict(runs []cniRun, q int, goal float64, pairs int) figure {
	names := [2]string{"p50", "p99"}
	rs := make([]float64, len(runs))
	each := make([]string, len(runs))
	var ipw, hl []time.Duration
	for i, r := range runs {
		rs[i] = r.ratio(q)
		each[i] = fmt.Sprintf("%.2f", rs[i])
		ipw, hl = append(ipw, r.ipw[q]), append(hl, r.hl[q])
	}
	s := spreadOf(rs)
	return figure{
		name: fmt.Sprintf("CNI ADD+DEL %s, ipwarden vs host-local, median of %d runs (%d pairs each per run, interleaved)", names[q], len(runs), pairs),
		value: fmt.Sprintf("%.2fx (runs %s; spread %.2fx..%.2fx; median %s vs %s)", s.median, strings.Join(each, ", "), s.lo, s.hi,
			medianDuration(ipw).Round(10*time.Microsecond), medianDuration(hl).Round(10*time.Microsecond)),
		goal: fmt.Sprintf("median <= %.1fx", goal),
		ok:   len(runs) > 0 && s.median <= goal,
	}
}

func medianDuration(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	if len(s)%2 == 0 {
		return (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return s[len(s)/2]
}

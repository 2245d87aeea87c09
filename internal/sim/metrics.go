package sim

import (
	"math"
	"slices"
	"time"
)

// Sample is one row of the time series.
type Sample struct {
	// At is the simulated time.
	At time.Duration
	// Capacity is the pool's size; Allocated what nodes hold plus what cools down in the pool.
	Capacity, Allocated int64
	// Held is what the nodes hold (as their agents know it), InUse what pods use, Cooling what
	// the pool keeps back after nodes released it.
	Held, InUse, Cooling int64
	// Running pods have an address; Waiting pods have an ADD waiting for one.
	Running, Waiting int
	// FailedTotal counts pods whose ADD waited beyond --address-wait so far.
	FailedTotal int
	// Exhausted is the pool's exhausted flag as its status says.
	Exhausted bool
	// Queue is the controller's work queue length.
	Queue int
	// AgentWrites, NodeStatusWrites and PoolStatusWrites count API writes so far.
	AgentWrites, NodeStatusWrites, PoolStatusWrites int64
}

// Stats are the mean and order statistics of a quantity.
type Stats struct {
	Mean float64 `json:"mean"`
	P50  float64 `json:"p50"`
	P99  float64 `json:"p99"`
	Max  float64 `json:"max"`
}

// countHist is a histogram of small non-negative integers (addresses per node).
type countHist struct {
	n   []int64
	sum float64
	tot int64
}

func (h *countHist) add(v int) {
	v = max(v, 0)
	if v >= len(h.n) {
		h.n = append(h.n, make([]int64, v+1-len(h.n))...)
	}
	h.n[v]++
	h.sum += float64(v)
	h.tot++
}

// quantile is the nearest-rank q-quantile.
func (h *countHist) quantile(q float64) float64 {
	if h.tot == 0 {
		return 0
	}
	rank := int64(math.Ceil(q * float64(h.tot)))
	rank = min(max(rank, 1), h.tot)
	var c int64
	for v, k := range h.n {
		c += k
		if c >= rank {
			return float64(v)
		}
	}
	return float64(len(h.n) - 1)
}

func (h *countHist) stats() Stats {
	if h.tot == 0 {
		return Stats{}
	}
	return Stats{Mean: round2(h.sum / float64(h.tot)), P50: h.quantile(0.5), P99: h.quantile(0.99), Max: h.quantile(1)}
}

// durationStats summarizes durations in seconds; zeros counts extra observations of 0 not in ds.
func durationStats(ds []time.Duration, zeros int) Stats {
	v := make([]float64, len(ds))
	for i, d := range ds {
		v[i] = d.Seconds()
	}
	st := floatStats(v, zeros)
	return Stats{Mean: round3(st.Mean), P50: round3(st.P50), P99: round3(st.P99), Max: round3(st.Max)}
}

// floatStats is the mean and nearest-rank quantiles of v plus zeros observations of 0.
func floatStats(v []float64, zeros int) Stats {
	n := len(v) + zeros
	if n == 0 {
		return Stats{}
	}
	s := slices.Clone(v)
	slices.Sort(s)
	var sum float64
	for _, x := range s {
		sum += x
	}
	at := func(q float64) float64 {
		rank := min(max(int(math.Ceil(q*float64(n))), 1), n)
		if rank <= zeros {
			return 0
		}
		return s[rank-zeros-1]
	}
	return Stats{Mean: sum / float64(n), P50: at(0.5), P99: at(0.99), Max: at(1)}
}

func round2(v float64) float64 { return math.Round(v*100) / 100 }
func round3(v float64) float64 { return math.Round(v*1000) / 1000 }

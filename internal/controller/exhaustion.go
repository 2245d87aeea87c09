package controller

// ExhaustionMarks are the two free-address thresholds of a pool's exhausted flag: it is set when
// free addresses fall below Low and cleared only when they rise above High. Each mark is the larger
// of a share of the pool's capacity and a number of batches, so small and large pools both get a
// sensible band.
type ExhaustionMarks struct {
	// LowPercent and HighPercent are percentages of capacity (flags --exhausted-below-percent and
	// --exhausted-clear-percent).
	LowPercent, HighPercent float64
	// LowBatches and HighBatches are multiples of the pool's batch size.
	LowBatches, HighBatches int64
}

// DefaultExhaustionMarks: exhausted below max(1 %, 1 batch) free, cleared above max(2 %, 2 batches).
var DefaultExhaustionMarks = ExhaustionMarks{LowPercent: 1, HighPercent: 2, LowBatches: 1, HighBatches: 2}

// Thresholds returns the low and high free-address counts for a pool. High is always above Low.
func (m ExhaustionMarks) Thresholds(capacity, batch int64) (low, high int64) {
	low = max(ceilPercent(capacity, m.LowPercent), m.LowBatches*batch)
	high = max(ceilPercent(capacity, m.HighPercent), m.HighBatches*batch)
	if high <= low {
		high = low + 1
	}
	return low, high
}

// Exhausted applies the hysteresis: given the previous flag and the free count now, is the pool
// exhausted? starved reports a fill that could not be served in full just now; it sets the flag
// whatever the count says.
//
// regrowth is how many more addresses the nodes would ask for the moment the flag cleared (their
// batch targets over their exhausted ones, see State.Regrowth). The flag clears only when the
// free addresses cover that and still stay above the high mark: otherwise clearing would make
// the nodes ask for more than the pool has, starve a fill, and set the flag again, over and over
// (the simulator saw that cycle with a free count moving in a 1-2 % band).
func (m ExhaustionMarks) Exhausted(prev bool, free, capacity, batch int64, starved bool, regrowth int64) bool {
	low, high := m.Thresholds(capacity, batch)
	switch {
	case starved || free < low:
		return true
	case free > high+max(regrowth, 0):
		return false
	default:
		return prev
	}
}

func ceilPercent(n int64, pct float64) int64 {
	if pct <= 0 || n <= 0 {
		return 0
	}
	v := float64(n) * pct / 100
	c := int64(v)
	if float64(c) < v {
		c++
	}
	return c
}

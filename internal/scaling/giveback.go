package scaling

import "time"

// Keep is the most a node holds at rest for a demand: demand + batch*(buffer+slack), where
// slack is ReleaseSlackPercent/100 of a batch (with the defaults demand + batch*(buffer+1)),
// and never more than maxPerNode. Holding up to Keep is within the scale-down hysteresis: the
// node gives nothing back. While the pool is exhausted Keep is the demand itself.
func Keep(demand int, p Params, exhausted bool) int {
	p = p.Effective(exhausted)
	demand = max(demand, 0)
	batch := int64(max(p.BatchSize, 1))
	pct := int64(min(max(p.BufferPercent, 0), 100)) + int64(min(max(p.ReleaseSlackPercent, 0), MaxReleaseSlackPercent))
	keep := int64(demand) + (batch*pct+99)/100
	if maxN := int64(max(p.MaxPerNode, 0)); keep > maxN {
		keep = maxN
	}
	return max(int(keep), Target(demand, p, exhausted))
}

// Release is DecideRelease's answer.
type Release struct {
	// Give is how many free addresses to give back now, at most (0: none).
	Give int
	// Least is how many of them must go now, whatever the cost in runs: Give when the pool is
	// exhausted or the node is over maxPerNode, else only what brings the holding back within
	// Keep. The rest of Give goes only where it does not split one of the node's runs
	// (ChooseReleaseBounded), so the give-back never fragments the holding for addresses the
	// hysteresis would let the node keep.
	Least int
	// Request is what the node publishes as spec.requested: its target when it grows or gives
	// back, else what it keeps holding, so demand moving inside the hysteresis band changes
	// nothing the controller sees (no write).
	Request int
	// ExcessSince is when the holding first went beyond Keep without a break (zero: it is not).
	// The caller keeps it and passes it back on its next call.
	ExcessSince time.Time
	// WakeAt is when to decide again if nothing else changes (zero: no need): the end of the
	// release delay.
	WakeAt time.Time
}

// DecideRelease decides a node's give-back for one pool. holding is what the node holds and is
// not already giving back; demand is Demand; excessSince is the previous answer's ExcessSince.
//
//   - holding <= Target: nothing to give; the node asks for Target.
//   - the pool is exhausted, or holding exceeds maxPerNode: give back down to Target at once.
//   - holding <= Keep (the hysteresis band): keep it all; the request stays at holding.
//   - holding > Keep: give back down to Target once it has been beyond Keep for the release
//     delay without a break (at least down to Keep; see Least); until then keep it and wake at
//     the end of the delay.
func DecideRelease(holding, demand int, p Params, exhausted bool, excessSince, now time.Time) Release {
	target := Target(demand, p, exhausted)
	holding = max(holding, 0)
	switch {
	case holding <= target:
		return Release{Request: target}
	case exhausted || holding > p.MaxPerNode:
		return Release{Give: holding - target, Least: holding - target, Request: target}
	}
	keep := Keep(demand, p, exhausted)
	if holding <= keep {
		return Release{Request: holding}
	}
	if excessSince.IsZero() || excessSince.After(now) {
		excessSince = now
	}
	due := excessSince.Add(max(p.ReleaseDelay, 0))
	if now.Before(due) {
		return Release{Request: holding, ExcessSince: excessSince, WakeAt: due}
	}
	return Release{Give: holding - target, Least: holding - keep, Request: target}
}

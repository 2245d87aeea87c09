package scaling

import (
	"fmt"
	"time"
)

// Params are a pool's scaling settings (IPPool spec.scaling).
type Params struct {
	// BatchSize is the step in which holdings grow and shrink (>= 1).
	BatchSize int
	// BufferPercent is the share of a batch kept free beyond demand (0..100).
	BufferPercent int
	// MaxPerNode caps a node's holding (>= BatchSize).
	MaxPerNode int
	// ReleaseSlackPercent is the scale-down hysteresis, in percent of a batch: a node gives
	// addresses back only while it holds more than demand + batch*(buffer+slack)/100
	// (0..1000; 100 means demand + batch*(buffer+1)). See DecideRelease.
	ReleaseSlackPercent int
	// ReleaseDelay is how long a node must hold more than that before it gives back (>= 0).
	ReleaseDelay time.Duration
}

// DefaultParams are the API defaults: batch 16, buffer 50 %, at most 250 per node, give back
// only beyond demand + batch*(buffer+1) held for 3 minutes.
var DefaultParams = Params{BatchSize: 16, BufferPercent: 50, MaxPerNode: 250, ReleaseSlackPercent: 100, ReleaseDelay: 3 * time.Minute}

// MaxReleaseSlackPercent bounds ReleaseSlackPercent (ten batches).
const MaxReleaseSlackPercent = 1000

// Validate reports the first setting the formula cannot work with.
func (p Params) Validate() error {
	switch {
	case p.BatchSize < 1:
		return fmt.Errorf("batchSize %d: must be at least 1", p.BatchSize)
	case p.BufferPercent < 0 || p.BufferPercent > 100:
		return fmt.Errorf("bufferPercent %d: must be between 0 and 100", p.BufferPercent)
	case p.MaxPerNode < p.BatchSize:
		return fmt.Errorf("maxPerNode %d: must be at least batchSize %d", p.MaxPerNode, p.BatchSize)
	case p.ReleaseSlackPercent < 0 || p.ReleaseSlackPercent > MaxReleaseSlackPercent:
		return fmt.Errorf("releaseSlackPercent %d: must be between 0 and %d", p.ReleaseSlackPercent, MaxReleaseSlackPercent)
	case p.ReleaseDelay < 0:
		return fmt.Errorf("releaseDelay %s: must not be negative", p.ReleaseDelay)
	}
	return nil
}

// Effective returns the parameters the formula uses: while the pool is exhausted the batch is
// one address and there is no buffer, so a node holds exactly its demand and every spare goes
// back to the pool for nodes with waiting pods (docs/design.md, "Scaling and economy"). The
// agent counts pods bound to the node before their ADD arrives, so a new pod's address is
// usually there before it is needed.
func (p Params) Effective(exhausted bool) Params {
	if exhausted {
		p.BatchSize = 1
		p.BufferPercent = 0
		p.ReleaseSlackPercent = 0
		p.ReleaseDelay = 0
	}
	return p
}

// Target is the number of addresses a node should hold from a pool:
//
//	batch * ceil(bufferPercent/100 + demand/batch), clamped at maxPerNode
//
// with batch 1 and buffer 0 while the pool is exhausted. A negative demand counts as 0.
// Params must be valid (see Validate); invalid ones are clamped to the nearest valid value.
func Target(demand int, p Params, exhausted bool) int {
	p = p.Effective(exhausted)
	batch := max(p.BatchSize, 1)
	pct := min(max(p.BufferPercent, 0), 100)
	demand = max(demand, 0)
	// ceil(pct/100 + demand/batch) = ceil((pct*batch + 100*demand) / (100*batch))
	num := int64(pct)*int64(batch) + 100*int64(demand)
	den := 100 * int64(batch)
	batches := (num + den - 1) / den
	target := batches * int64(batch)
	if maxN := int64(max(p.MaxPerNode, 0)); target > maxN {
		target = maxN
	}
	return int(target)
}

// Demand is what a node needs from a pool right now: addresses in use by attachments plus pods
// already bound to the node that have no address yet (counted before their ADD arrives).
func Demand(inUse, pendingPods int) int {
	return max(inUse, 0) + max(pendingPods, 0)
}

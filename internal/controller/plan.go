package controller

import (
	"github.com/ipwarden/ipwarden/internal/addr"
)

// PoolView is what the controller knows about one node's share of one pool.
type PoolView struct {
	// Held is what the node's status holds (the controller's own record).
	Held addr.Set
	// Requested is spec.pools[].requested; 0 when the node does not list the pool.
	Requested int
	// Releasing is spec.pools[].releasing.
	Releasing addr.Set
	// Serving is true when the pool exists, is valid and selects the node: only then is a
	// deficit filled. Releases are honoured either way.
	Serving bool
}

// PoolPlan is one sync's work for one node and pool.
type PoolPlan struct {
	// Remove is what leaves the node: released addresses it holds. Never anything else.
	Remove addr.Set
	// Add is how many addresses to hand the node.
	Add int
	// Excess is how many more than requested the node keeps after Remove; the controller
	// cannot take them until the node lists them in releasing.
	Excess int
}

// Plan decides one node's work for one pool: remove exactly the released addresses the node
// holds, then fill up to the request if the pool serves the node.
func Plan(v PoolView) PoolPlan {
	p := PoolPlan{Remove: v.Releasing.Intersect(v.Held)}
	kept := count(v.Held) - count(p.Remove)
	switch d := v.Requested - kept; {
	case d > 0 && v.Serving:
		p.Add = d
	case d < 0:
		p.Excess = -d
	}
	return p
}

// Empty says whether the plan needs no write.
func (p PoolPlan) Empty() bool { return p.Add == 0 && p.Remove.IsEmpty() }

// count is a node-sized set's size; node holdings are bounded by maxPerNode (<= 65536).
func count(s addr.Set) int {
	n, ok := s.Size().Uint64()
	if !ok || n > 1<<31-1 {
		return 1<<31 - 1
	}
	return int(n)
}

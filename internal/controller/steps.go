package controller

import (
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/api/equality"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
)

// The controller's write protocol as data (docs/design.md, "The write protocol"). A sync decides
// its writes up front, in the order safety needs, and the IO shell performs them one at a time
// and reports each outcome back, as etcd raft's Ready/Advance does: the ordering rules live here,
// not in the statement order of an IO loop, and `ipwarden simulate` drives the same machine.
//
// A node's fill:    [pool status of each pool it releases from (write-ahead cooling record) or
//                   whose claim binding or shared grant it relies on and is not durable yet]
//                   -> node status -> Commit (landed), Abort (rejected: nothing was published),
//                   Abort keeping the new addresses reserved (unknown: the write may have landed).
// A deleted node:   [pool status of each pool it held from (cooling record)] -> delete its
//                   NodeIPAllocation -> ReleaseNode.
// A step that fails stops the sequence: nothing after it is attempted.

// StepKind says what a step writes.
type StepKind int

const (
	// StepPoolStatus writes a pool's status now: it must carry the cooling records added by the
	// sequence before a later step takes the addresses from a node.
	StepPoolStatus StepKind = iota
	// StepNodeStatus writes the node's NodeIPAllocation status (Step.Status).
	StepNodeStatus
	// StepDeleteAllocation deletes the node's NodeIPAllocation.
	StepDeleteAllocation
)

func (k StepKind) String() string {
	switch k {
	case StepPoolStatus:
		return "pool status"
	case StepNodeStatus:
		return "node status"
	case StepDeleteAllocation:
		return "delete NodeIPAllocation"
	}
	return fmt.Sprintf("step(%d)", int(k))
}

// Step is one write.
type Step struct {
	Kind   StepKind
	Pool   string // StepPoolStatus
	Node   string
	Status ipwardenv1.NodeIPAllocationStatus // StepNodeStatus
}

// Outcome is what became of a step's write.
type Outcome int

const (
	// Landed: the API server stored it.
	Landed Outcome = iota
	// Conflict: refused because the object changed since it was read; retry from a fresh read.
	Conflict
	// Rejected: refused for good (invalid, not found, fenced); nothing was stored.
	Rejected
	// Unknown: no answer (timeout, connection lost); it may or may not have been stored.
	Unknown
)

func (o Outcome) String() string {
	return [...]string{"landed", "conflict", "rejected", "unknown"}[o]
}

// Result is how a sequence ended.
type Result int

const (
	// InProgress: steps remain.
	InProgress Result = iota
	// NoChange: nothing to write.
	NoChange
	// Committed: every step landed and the record follows.
	Committed
	// Retry: the node status write met a conflict; the record is as before the sequence; sync
	// again from a fresh read.
	Retry
	// Failed: a step was rejected or its outcome is unknown; the record keeps what may have
	// been published (reservations of an unknown node status write stay pending).
	Failed
)

// Sequence is one sync's ordered writes and what to do with each outcome. Not safe for
// concurrent use; the caller holds the State's lock around Start, Advance and the calls below.
type Sequence struct {
	s      *State
	steps  []Step
	next   int
	result Result
	now    time.Time
	fill   *Fill // a fill sequence
	gone   string
}

// StartFill plans a node's fill and take-back (PlanFill), records the released addresses as
// cooling (except those the node gave back cooled), and returns the writes that publish it: the
// pools' cooling records first, then the node's status. NoChange when the status would stay as it is.
func (s *State) StartFill(name string, alloc *ipwardenv1.NodeIPAllocation, now time.Time) *Sequence {
	f := s.PlanFill(name, alloc.Spec, now)
	status := NodeStatus(alloc.Status, alloc.Spec, alloc.Generation, f)
	status.Fence = alloc.Status.Fence // a new leader does not rewrite every status to stamp it
	q := &Sequence{s: s, fill: f, now: now}
	if !f.Changed() && equalStatus(status, alloc.Status) {
		s.Abort(f, true)
		q.result = NoChange
		return q
	}
	for _, pool := range sortedKeys(f.Pools) {
		// Addresses the node gave back cooled (releasingCooled) need no cooling record, nor do
		// those another node still holds under a shared grant (Dropped). A claim binding or
		// shared grant the fill relies on is recorded before the node's status grants it.
		pf := f.Pools[pool]
		cool := pf.Removed.Subtract(pf.Returned).Subtract(pf.Dropped)
		if !cool.IsEmpty() {
			s.RecordCooling(pool, cool, now.Add(s.CooldownOf(pool)))
		}
		if !cool.IsEmpty() || pf.MustRecord {
			q.steps = append(q.steps, Step{Kind: StepPoolStatus, Pool: pool, Node: name})
		}
	}
	q.steps = append(q.steps, Step{Kind: StepNodeStatus, Node: name, Status: status})
	return q
}

// StartNodeGone returns the writes that return a deleted node's addresses: the pools' cooling
// records first, then the deletion of its NodeIPAllocation (when it exists), then ReleaseNode.
func (s *State) StartNodeGone(name string, allocExists bool, now time.Time) *Sequence {
	q := &Sequence{s: s, gone: name, now: now}
	held := s.HeldBy(name)
	for _, pool := range sortedKeys(held) {
		// A shared grant's address stays with the other node: it does not cool.
		s.RecordCooling(pool, held[pool].Subtract(s.sharedHeld(s.pool(pool), pool, name, held[pool])), now.Add(s.CooldownOf(pool)))
		q.steps = append(q.steps, Step{Kind: StepPoolStatus, Pool: pool, Node: name})
	}
	if allocExists {
		q.steps = append(q.steps, Step{Kind: StepDeleteAllocation, Node: name})
	}
	if len(q.steps) == 0 {
		q.finish()
	}
	return q
}

// Next returns the step to perform now, if any.
func (q *Sequence) Next() (Step, bool) {
	if q.result != InProgress || q.next >= len(q.steps) {
		return Step{}, false
	}
	return q.steps[q.next], true
}

// Advance reports the outcome of the step Next returned.
func (q *Sequence) Advance(o Outcome) {
	if q.result != InProgress || q.next >= len(q.steps) {
		return
	}
	step := q.steps[q.next]
	q.next++
	switch {
	case o == Landed:
		if q.next == len(q.steps) {
			q.finish()
		}
	case step.Kind == StepPoolStatus:
		// The cooling record may not be stored: the node keeps the addresses (nothing was
		// taken), the pool status is written again later.
		q.abort(true)
	case step.Kind == StepNodeStatus && o == Conflict:
		q.abort(true)
		q.result = Retry
	case step.Kind == StepNodeStatus:
		// Rejected: nothing was published. Unknown: the new addresses may be in the node's
		// status already and stay reserved for it until a fresh read settles them.
		q.abort(o == Rejected)
	default:
		// A delete not landed (the shell maps not-found to landed): the node keeps its
		// record and the deletion is tried again later.
		q.abort(true)
	}
}

func (q *Sequence) finish() {
	q.result = Committed
	if q.fill != nil {
		q.s.Commit(q.fill, q.now)
	}
	if q.gone != "" {
		q.s.ReleaseNode(q.gone, q.now)
	}
}

func (q *Sequence) abort(definite bool) {
	q.result = Failed
	if q.fill != nil {
		q.s.Abort(q.fill, definite)
	}
}

// Result says how the sequence stands.
func (q *Sequence) Result() Result { return q.result }

// Fill is the fill a fill sequence carries (nil for a deleted node).
func (q *Sequence) Fill() *Fill { return q.fill }

// Steps lists every step of the sequence, for tests and the simulator's accounting.
func (q *Sequence) Steps() []Step { return append([]Step(nil), q.steps...) }

func equalStatus(a, b ipwardenv1.NodeIPAllocationStatus) bool {
	return equality.Semantic.DeepEqual(a, b)
}

package ipam

import "fmt"

// The one commit protocol of the agent's state: plan, journal, then apply or abort.
//
//  1. Under the caller's lock the state plans a change and reserves what it touches, so that
//     concurrent requests leave it alone: an ADD's addresses are pending, addresses to give back
//     are marked releasing; a DEL reserves nothing (it only takes away).
//  2. Outside the lock the caller journals Plan.Changes(): durability never blocks other
//     requests.
//  3. Under the lock again the caller calls Apply once the journal holds the change, or Abort
//     when the journal refused it (the reservation is undone; nothing was handed out or
//     published).
//
// Every change of the state goes through it (Service.commit in the agent): the CNI verbs, the
// pool monitor and the leak collector (AddPlan, DelPlan, ReleasePlan), the facts read from the
// API server (PoolsPlan, HoldingsPlan, MarkPlan; facts.go) and the attachments rebuilt from pods'
// status.podIPs (RebuildPlan), and the DRA reservations recovered from their claims' status
// after a lost journal (RecoverPlan). So the state never holds what the journal refused: after a
// refusal it is as it was, and a restart finds in the journal what the state held.
//
// SetPools, SetHolding and Rebuild plan and apply at once, for callers that have no journal to
// refuse a change (the simulator, tests).

// Plan is a planned change to the state.
type Plan interface {
	// Changes is what the journal must hold before the plan is applied.
	Changes() Change
}

// AddPlan is an ADD planned by Add: its addresses are pending until applied or aborted.
type AddPlan struct {
	Key    Key
	Change Change
}

// Changes implements Plan.
func (p AddPlan) Changes() Change { return p.Change }

// Changes implements Plan.
func (p DelPlan) Changes() Change { return p.Change }

// Changes implements Plan.
func (p ReleasePlan) Changes() Change { return p.Change }

// Apply makes a journaled plan so.
func (s *State) Apply(p Plan) {
	switch p := p.(type) {
	case AddPlan:
		s.ConfirmAdd(p.Key)
	case DelPlan:
		s.ApplyDel(p)
	case ReleasePlan:
		// The marks made when it was planned are the change.
	case PoolsPlan:
		s.applyPools(p)
	case HoldingsPlan:
		s.applyHoldings(p)
	case MarkPlan:
		s.mark = p.mark
	case HandbackPlan:
		s.handback = p.mark
	case RebuildPlan:
		s.applyRebuild(p)
	case RecoverPlan:
		s.applyRecover(p)
	case Batch:
		for _, q := range p {
			s.Apply(q)
		}
	default:
		panic(fmt.Sprintf("ipam: Apply of an unknown plan %T", p))
	}
}

// Abort undoes the reservation of a plan the journal refused.
func (s *State) Abort(p Plan) {
	switch p := p.(type) {
	case AddPlan:
		s.AbortAdd(p.Key)
	case DelPlan:
		// The attachment stays as it was; it is no longer in flight.
		if p.Found {
			delete(s.pending, p.Key)
		}
	case ReleasePlan:
		s.UnmarkReleasing(p)
	case PoolsPlan, HoldingsPlan, MarkPlan, HandbackPlan:
		// They reserve nothing: the state is as it was.
	case RebuildPlan:
		s.abortRebuild(p)
	case RecoverPlan:
		s.abortRecover(p)
	case Batch:
		for i := len(p) - 1; i >= 0; i-- {
			s.Abort(p[i])
		}
	default:
		panic(fmt.Sprintf("ipam: Abort of an unknown plan %T", p))
	}
}

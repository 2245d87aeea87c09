package ipam

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
// Every change that hands out or frees an address (the CNI verbs, the pool monitor, the leak
// collector) goes through it (Service.commit). Facts read from the API server (pool settings,
// holdings, the record mark) and attachments rebuilt from pods' status.podIPs are applied first
// and journaled best-effort: a restart reads them again.

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
	}
}

// Abort undoes the reservation of a plan the journal refused.
func (s *State) Abort(p Plan) {
	switch p := p.(type) {
	case AddPlan:
		s.AbortAdd(p.Key)
	case DelPlan:
		// A DEL reserves nothing.
	case ReleasePlan:
		s.UnmarkReleasing(p)
	}
}

package ipam

import (
	"cmp"
	"net/netip"
	"slices"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// Facts read from the API server (the pools' settings, what the controller reports the node
// holds, the record mark) follow the commit protocol of plan.go like every other change: a
// plan function reads the state and returns a value describing the change, without touching the
// state and reserving nothing (no request of the CNI verbs, the pool monitor or the leak
// collector can take what such a plan touches; see each plan); the caller journals
// Plan.Changes(), then calls Apply, or Abort (a no-op for these) when the journal refused it,
// and the state is as it was. The caller must not run two of these plans at once (the agent's
// Service serializes them); CNI requests may run between plan and apply.

// PoolsPlan is the pools' configuration from the API, planned by PlanPools.
type PoolsPlan struct {
	Change Change
	// pools are the pools the API lists, with Served set.
	pools []Pool
	// served are the pools that select the node, in ADD order (IPv4 first, then by name).
	served []string
	// gone are known pools the API no longer lists: they drain, keeping their last
	// configuration for the addresses still in use; forget are those of them with nothing
	// left to remember, dropped from the state and the journal.
	gone, forget []string
}

// Changes implements Plan.
func (p PoolsPlan) Changes() Change { return p.Change }

// PlanPools plans replacing the pools' configuration with those from the API and setting the
// pools that select the node (served), which ADD draws from by default: IPv4 pools first, then
// by name. Pools that no longer serve the node drain: their free addresses are released and
// nothing new is handed out from them. The plan's Change journals the configuration, so a
// restart while the API server is away still knows prefix lengths, gateways and cooldowns. A
// known pool the API no longer lists is gone; with nothing in it left to remember it is
// forgotten, from the state and the journal.
func (s *State) PlanPools(pools []Pool, served []string) PoolsPlan {
	var plan PoolsPlan
	seen := map[string]bool{}
	is4 := map[string]bool{}
	for _, pc := range pools {
		seen[pc.Name] = true
		pc.Served = slices.Contains(served, pc.Name)
		is4[pc.Name] = pc.Is4()
		if p, ok := s.pools[pc.Name]; !ok || !p.known || !poolEqual(p.cfg, pc) {
			plan.Change.PutPools = append(plan.Change.PutPools, pc)
		}
		plan.pools = append(plan.pools, pc)
	}
	for _, name := range s.poolNames() {
		p := s.pools[name]
		if seen[name] || !p.known {
			continue
		}
		plan.gone = append(plan.gone, name)
		if p.empty() {
			plan.forget = append(plan.forget, name)
			plan.Change.DeletePools = append(plan.Change.DeletePools, name)
		}
	}
	plan.served = servedOrder(served, func(name string) bool {
		if v, ok := is4[name]; ok {
			return v
		}
		if p, ok := s.pools[name]; ok {
			return p.cfg.Is4()
		}
		return false
	})
	return plan
}

// servedOrder sorts the served pools as ADD draws from them: IPv4 first, then by name.
func servedOrder(served []string, is4 func(string) bool) []string {
	srv := slices.Clone(served)
	slices.SortFunc(srv, func(a, b string) int {
		a4, b4 := is4(a), is4(b)
		if a4 != b4 {
			if a4 {
				return -1
			}
			return 1
		}
		return cmp.Compare(a, b)
	})
	return slices.Compact(srv)
}

func (s *State) applyPools(plan PoolsPlan) {
	for _, pc := range plan.pools {
		p := s.pool(pc.Name)
		p.setConfig(pc)
		p.gone = false
		p.recompute()
	}
	for _, name := range plan.gone {
		if p, ok := s.pools[name]; ok {
			p.gone = true
		}
	}
	for _, name := range plan.forget {
		// Nothing can have entered a gone pool since the plan (no ADD draws from it, and the
		// facts that could are serialized with this plan); checked anyway.
		if p, ok := s.pools[name]; ok && p.empty() {
			delete(s.pools, name)
		}
	}
	s.served = plan.served
	for _, name := range s.served {
		s.pool(name) // a served pool the API did not list: known by name only, as before
	}
}

// HoldingsPlan is what the controller reports the node holds, planned by PlanHoldings.
type HoldingsPlan struct {
	Change Change
	// Distrusted are the addresses marked releasing because a rewound record showed them
	// (the distrust rule, SuspectAddresses), per pool.
	Distrusted map[string]addr.Set
	at         time.Time
	// held is the new holding of each pool whose holding changes.
	held map[string]addr.Set
	// forgetRel and forgetCool are the releasing and cooling addresses the node no longer
	// holds (the controller took them back), per pool.
	forgetRel, forgetCool map[string]addr.Set
}

// Changes implements Plan.
func (p HoldingsPlan) Changes() Change { return p.Change }

// PlanHoldings plans recording what the controller reports the node holds, per pool; pools the
// state knows that holdings lacks hold nothing. Releasing addresses the controller has taken
// back are forgotten, as are cooling addresses no longer held. Attachments whose addresses are
// not held are kept (a running pod never loses its address) and show as conflicts.
//
// With distrust the status comes from a rewound or re-created record (see record.go): first, in
// each pool of holdings, the addresses it shows that the node's last trusted holding (the one it
// journaled) lacks and no attachment uses are marked releasing at now (SuspectAddresses). The
// node gave them back after the record's snapshot, and another node may use them now; the
// controller takes them back. Addresses in use stay (claims cover those the status lacks).
//
// The plan reserves nothing: the addresses it marks or forgets are outside what the node held
// before (distrusted) or outside what it holds after (forgotten), and an ADD hands out only
// held, fresh or cooled addresses.
func (s *State) PlanHoldings(holdings map[string]addr.Set, distrust bool, now time.Time) HoldingsPlan {
	plan := newHoldingsPlan(now)
	for _, name := range sortedNames(holdings) {
		s.planHolding(&plan, name, holdings[name], distrust)
	}
	for _, name := range s.poolNames() {
		if _, ok := holdings[name]; !ok {
			s.planHolding(&plan, name, addr.Set{}, false)
		}
	}
	sortAddresses(plan.Change.DeleteReleasing)
	sortAddresses(plan.Change.DeleteCooling)
	return plan
}

func newHoldingsPlan(now time.Time) HoldingsPlan {
	return HoldingsPlan{at: now, held: map[string]addr.Set{}, forgetRel: map[string]addr.Set{}, forgetCool: map[string]addr.Set{},
		Distrusted: map[string]addr.Set{}}
}

// planHolding adds pool name's holding, held, to plan (distrust: the distrust rule first, SuspectAddresses).
func (s *State) planHolding(plan *HoldingsPlan, name string, held addr.Set, distrust bool) {
	p, ok := s.pools[name]
	if !ok {
		p = &poolState{}
	}
	if distrust {
		suspect := SuspectAddresses(held, p.held, p.heldKnown, p.inUseSet(), p.relSet)
		if !suspect.IsEmpty() {
			plan.Distrusted[name] = suspect
			for _, a := range suspect.Addrs(count(suspect)) {
				if _, cool := p.cooling[a]; cool {
					plan.Change.DeleteCooling = append(plan.Change.DeleteCooling, Address{Pool: name, Addr: a})
				}
				plan.Change.PutReleasing = append(plan.Change.PutReleasing, Releasing{Pool: name, Addr: a, Since: plan.at})
			}
		}
	}
	var rel, cool []netip.Addr
	for a := range p.releasing {
		if !held.Contains(a) {
			rel = append(rel, a)
		}
	}
	for _, c := range p.coolq {
		if !held.Contains(c.Addr) {
			cool = append(cool, c.Addr)
		}
	}
	// With the holding unchanged there is nothing to forget, except what a DEL or a give-back
	// planned before the last holding and applied after it left behind: forgotten now.
	if p.heldKnown && p.held.Equal(held) && len(rel) == 0 && len(cool) == 0 {
		return
	}
	plan.held[name] = held
	for _, a := range rel {
		plan.Change.DeleteReleasing = append(plan.Change.DeleteReleasing, Address{Pool: name, Addr: a})
	}
	for _, a := range cool {
		plan.Change.DeleteCooling = append(plan.Change.DeleteCooling, Address{Pool: name, Addr: a})
	}
	if len(rel) > 0 {
		plan.forgetRel[name] = addr.SetOfAddrs(rel...)
	}
	if len(cool) > 0 {
		plan.forgetCool[name] = addr.SetOfAddrs(cool...)
	}
	plan.Change.PutHoldings = append(plan.Change.PutHoldings, Holding{Pool: name, Addresses: held})
}

func (s *State) applyHoldings(plan HoldingsPlan) {
	s.observe(plan.at)
	touched := map[string]bool{}
	for _, name := range sortedNames(plan.Distrusted) {
		p := s.pool(name)
		suspect := plan.Distrusted[name]
		for _, a := range suspect.Addrs(count(suspect)) {
			if _, used := p.inUse[a]; used {
				continue // never reaches here (an ADD hands out only held addresses); kept in use
			}
			p.releasing[a] = plan.at
			delete(p.cooling, a)
		}
		p.coolq = deleteCooling(p.coolq, suspect)
		touched[name] = true
	}
	for _, name := range sortedNames(plan.held) {
		p := s.pool(name)
		if s.unboundClaimWaits(name) {
			// A claim waits for its binding here: what the grant brings may be its address,
			// seen before the pool's status that binds it (claim.go, claimHeld).
			p.claimHeld = p.claimHeld.Union(plan.held[name].Subtract(p.held))
		}
		p.held, p.heldKnown = plan.held[name], true
		if rel := plan.forgetRel[name]; !rel.IsEmpty() {
			for _, a := range rel.Addrs(count(rel)) {
				delete(p.releasing, a)
			}
		}
		if cool := plan.forgetCool[name]; !cool.IsEmpty() {
			for _, a := range cool.Addrs(count(cool)) {
				delete(p.cooling, a)
			}
			p.coolq = deleteCooling(p.coolq, cool)
		}
		touched[name] = true
	}
	for name := range touched {
		s.pools[name].recompute()
	}
}

// MarkPlan moves the node's record mark (record.go), planned by PlanMark.
type MarkPlan struct {
	Change Change
	mark   RecordMark
}

// Changes implements Plan.
func (p MarkPlan) Changes() Change { return p.Change }

// PlanMark plans recording m as the object the node last wrote (or, after a rewind, the object
// it now trusts as its record). Its Change is empty when m is the mark already.
func (s *State) PlanMark(m RecordMark) MarkPlan {
	if m == s.mark {
		return MarkPlan{mark: m}
	}
	return MarkPlan{mark: m, Change: Change{PutMark: &m}}
}

// NextMarkOnRead decides whether reading the node's record (uid, generation) moves the record
// mark: a rewound record becomes the trusted one; otherwise the mark moves only to a first
// record (no mark yet) or to a later generation of the same object. It returns the new mark
// and whether it moves.
func NextMarkOnRead(cur RecordMark, uid string, generation int64, rewound bool) (RecordMark, bool) {
	next := RecordMark{UID: uid, Generation: generation}
	switch {
	case rewound:
		return next, next != cur
	case uid == "":
		return cur, false
	case cur.UID == "" || (cur.UID == uid && generation > cur.Generation):
		return next, true
	}
	return cur, false
}

// NextMarkOnWrite decides whether the node's own spec write, which produced generation of the
// object uid, moves the record mark: to another object, or to a later generation.
func NextMarkOnWrite(cur RecordMark, uid string, generation int64) (RecordMark, bool) {
	if cur.UID != uid || generation > cur.Generation {
		return RecordMark{UID: uid, Generation: generation}, true
	}
	return cur, false
}

// Batch is plans journaled as one Change and applied (or aborted) together, in order. Each was
// planned against the same state, so they must not touch the same things.
type Batch []Plan

// Changes implements Plan.
func (b Batch) Changes() Change {
	var ch Change
	for _, p := range b {
		ch.Merge(p.Changes())
	}
	return ch
}

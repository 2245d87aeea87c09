package ipam

import (
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/scaling"
)

// MaxReleasingBlocks is the most releasing blocks one pool request publishes (the API's
// MaxItems); the rest wait for the next round.
const MaxReleasingBlocks = 1024

// MaxWanted is the most wanted blocks one pool request publishes (the API's MaxItems).
const MaxWanted = 64

func setOf(a netip.Addr) addr.Set { return addr.SetOfAddrs(a) }

func count(s addr.Set) int {
	n, ok := s.Size().Uint64()
	if !ok || n > uint64(1<<31-1) {
		return 1<<31 - 1
	}
	return int(n)
}

// served reports whether pool name selects the node.
func (s *State) isServed(name string) bool { return slices.Contains(s.served, name) }

// Demand is what the node needs from pool now: addresses in use plus pods bound to the node that
// need an address from it and have none yet, plus ADDs waiting for one (a pod counted once), plus
// freed addresses still in their reuse cooldown: they cannot serve a pod yet, so under churn the
// node asks for more instead of making new pods wait out the cooldown.
func (s *State) Demand(pool string) int {
	p, ok := s.pools[pool]
	inUse := 0
	if ok {
		// held out of use, as if in use
		inUse = len(p.inUse) + count(p.unattributed.Union(p.lost).Subtract(p.inUseSet())) + count(s.previousOut(p))
		for _, freed := range p.cooling {
			if !p.cooled(freed, s.clock) {
				inUse++
			}
		}
	}
	waiting := map[string]bool{}
	if s.isServed(pool) {
		for _, pod := range s.pods {
			if !pod.NeedsAddress() || pod.Ref.UID == "" || s.podHolds(pod.Ref.UID, pool) || !s.podWants(pod, pool) {
				continue
			}
			waiting[pod.Ref.UID] = true
		}
	}
	for k, w := range s.waiters {
		if !slices.Contains(w.pools, pool) {
			continue
		}
		id := w.uid
		if id == "" || s.podHolds(id, pool) {
			id = "key:" + k.String()
		}
		waiting[id] = true
	}
	return scaling.Demand(inUse, len(waiting))
}

// podWants reports whether pod will draw from pool, by the rule its ADD follows (choosePools),
// before its ADD: the pod network's configuration is taken to be the last one an ADD on eth0
// brought (its "pools"; before any, none, so a pod whose annotations name no pool counts in every
// pool that serves the node and admits its namespace); a pod whose choice is refused counts
// nowhere.
func (s *State) podWants(pod Pod, pool string) bool {
	names, err := s.choosePools(s.podMeta(pod), s.configPools, pod.Ref.Namespace, "")
	return err == nil && slices.Contains(names, pool)
}

// podHolds reports whether the pod with uid has an attachment with an address of pool.
func (s *State) podHolds(uid, pool string) bool {
	for k := range s.byPod[uid] {
		for _, a := range s.atts[k].Addresses {
			if a.Pool == pool {
				return true
			}
		}
	}
	return false
}

// Target is the number of addresses the node should hold from pool: the scaling formula over
// Demand for a pool that selects the node, 0 for one that no longer does (it drains).
func (s *State) Target(pool string) int {
	p, ok := s.pools[pool]
	if !ok || !p.known || !s.isServed(pool) {
		return 0
	}
	return scaling.Target(s.Demand(pool), p.cfg.Scaling, p.cfg.Exhausted)
}

// decide is scaling.DecideRelease for pool at the state's clock: what to give back now and what
// to request. A pool that no longer selects the node drains: everything free goes, at once.
// holding is what the node holds and does not give back already.
func (s *State) decide(name string, holding int) scaling.Release {
	p := s.pools[name]
	if !p.known || !s.isServed(name) {
		return scaling.Release{Give: holding, Least: holding}
	}
	return scaling.DecideRelease(holding, s.Demand(name), p.cfg.Scaling, p.cfg.Exhausted, p.excessSince, s.clock)
}

// Request is what the node asks for from pool (spec.pools[].requested): its Target when it grows
// or gives back; inside the scale-down hysteresis, what it holds (so the spec does not change).
func (s *State) Request(pool string) int {
	p, ok := s.pools[pool]
	if !ok || !p.known || !s.isServed(pool) {
		return 0
	}
	return s.decide(pool, count(p.held.Subtract(p.relSet))).Request
}

// NextRelease returns when a pool's release delay ends (the node should decide again then),
// or the zero time if no delay runs.
func (s *State) NextRelease() time.Time {
	var next time.Time
	for _, p := range s.pools {
		if w := p.releaseWake; !w.IsZero() && (next.IsZero() || w.Before(next)) {
			next = w
		}
	}
	return next
}

// ReleasePlan is what Release marked, for the journal and for UnmarkReleasing.
type ReleasePlan struct {
	Change Change
	// Marked holds the addresses marked releasing, per pool.
	Marked map[string]addr.Set
	// wasCooling holds the marked addresses that were cooling down.
	wasCooling []Cooling
}

// Release marks, in every pool, the free addresses the node holds beyond its target as
// releasing: they are never handed out again. The caller journals plan.Change before it
// publishes them (see Spec), and calls UnmarkReleasing if the journal write fails. Addresses in
// use are never chosen; scaling.ChooseRelease picks which free ones go.
func (s *State) Release(now time.Time) ReleasePlan {
	s.observe(now)
	plan := ReleasePlan{Marked: map[string]addr.Set{}}
	for _, name := range s.poolNames() {
		p := s.pools[name]
		if !p.heldKnown || (!p.known && s.isServed(name)) {
			continue
		}
		holding := p.held.Subtract(p.relSet)
		// Static addresses pods here ask for are never given back (static.go).
		free := holding.Subtract(p.inUseSet()).Subtract(p.unattributed).Subtract(s.wanted(name)).
			Subtract(p.lost).               // an older agent's reservations ahead: of unknown owner (lost.go)
			Subtract(s.prevAll).            // reserved by the previous IPAM (previous.go)
			Subtract(s.claimWanted(name)).  // a claim ADD here waits to hold it (claim.go)
			Subtract(s.claimHeldBack(name)) // perhaps a waiting claim's, its binding not seen yet
		// Addresses bound to IPAMClaims follow their claims: given back only when another node
		// asks for them (below), never to meet the target (claim.go).
		bound := free.Intersect(s.claimBound(name))
		free = free.Subtract(bound)
		// Free addresses the pool's current spec no longer covers are given back at once
		// (they are never handed out); addresses in use drain as their pods go (see PlanDel).
		// Addresses of unknown owner (the hold after a rebuild) are neither.
		var rel addr.Set
		if p.usableKnown {
			rel = free.Subtract(p.usable)
			holding, free = holding.Subtract(rel), free.Subtract(rel)
		}
		d := s.decide(name, count(holding))
		p.excessSince, p.releaseWake = d.ExcessSince, d.WakeAt
		if give := min(d.Give, count(holding)); give > 0 {
			// Addresses past their cooldown (or never used) first: those the controller can
			// hand to another node at once.
			cooled := free.Subtract(p.stillCooling(now))
			least := min(d.Least, give)
			pick := scaling.ChooseReleaseBounded(holding, cooled, give, least)
			if n := count(pick); n < give {
				pick = pick.Union(scaling.ChooseReleaseBounded(holding.Subtract(pick), free.Subtract(pick), give-n, least-n))
			}
			rel = rel.Union(pick)
		}
		// Free addresses a pod on another node asks for by name go back, whatever the target,
		// so the controller can move them there (static.go); addresses in use stay.
		rel = rel.Union(free.Union(bound).Intersect(s.elsewhere[name]))
		if rel.IsEmpty() {
			continue
		}
		p.relCooled = p.relCooled.Union(rel.Subtract(p.stillCooling(now)))
		for _, a := range rel.Addrs(count(rel)) {
			p.releasing[a] = now
			if t, cool := p.cooling[a]; cool {
				delete(p.cooling, a)
				plan.wasCooling = append(plan.wasCooling, Cooling{Pool: name, Addr: a, FreedAt: t})
				plan.Change.DeleteCooling = append(plan.Change.DeleteCooling, Address{Pool: name, Addr: a})
			}
			plan.Change.PutReleasing = append(plan.Change.PutReleasing, Releasing{Pool: name, Addr: a, Since: now})
		}
		p.coolq = slices.DeleteFunc(p.coolq, func(c Cooling) bool { return rel.Contains(c.Addr) })
		p.relSet = p.relSet.Union(rel)
		p.fresh = p.fresh.Subtract(rel)
		plan.Marked[name] = rel
	}
	return plan
}

// UnmarkReleasing undoes Release after its journal write failed: the addresses are free again,
// and those that were cooling down cool on from when they were freed.
func (s *State) UnmarkReleasing(plan ReleasePlan) {
	for name, rel := range plan.Marked {
		p := s.pools[name]
		for _, a := range rel.Addrs(count(rel)) {
			delete(p.releasing, a)
		}
	}
	for _, c := range plan.wasCooling {
		s.pools[c.Pool].uncool(c)
	}
	for name := range plan.Marked {
		s.pools[name].recompute()
	}
}

// Spec is the request the node should publish: one entry per pool that selects it or that it
// still holds, uses or releases addresses of, sorted by pool name.
func (s *State) Spec() []PoolRequest {
	var out []PoolRequest
	for _, name := range s.poolNames() {
		p := s.pools[name]
		if !s.isServed(name) && p.empty() {
			continue
		}
		rel := p.relSet
		if rel.NumRanges() > MaxReleasingBlocks {
			rs := rel.Ranges()[:MaxReleasingBlocks]
			rel = addr.NewSet(rs...)
		}
		claimed := p.claimed().Union(s.previousClaims(p))
		if claimed.NumRanges() > MaxReleasingBlocks {
			claimed = addr.NewSet(claimed.Ranges()[:MaxReleasingBlocks]...)
		}
		wanted := s.wanted(name).Subtract(p.held)
		if wanted.NumRanges() > MaxWanted {
			wanted = addr.NewSet(wanted.Ranges()[:MaxWanted]...)
		}
		out = append(out, PoolRequest{Pool: name, Requested: s.Request(name), Releasing: rel,
			ReleasingCooled: p.relCooled.Intersect(rel), Claimed: claimed, Wanted: wanted, Sticky: s.stickyUses(name),
			Claims: s.claimUses(name)})
	}
	return out
}

func (s *State) poolNames() []string {
	names := make([]string, 0, len(s.pools))
	for n := range s.pools {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// PoolStats counts one pool's addresses on the node.
type PoolStats struct {
	Pool   string
	Served bool
	// Held is what the controller reports the node holds.
	Held int
	// InUse counts addresses of attachments (including conflicts).
	InUse int
	// Free counts addresses that could be handed out now.
	Free int
	// Cooling counts freed addresses still inside their cooldown.
	Cooling   int
	Releasing int
	// Requested is what the node asks for (spec.pools[].requested; see Request).
	Requested int
	// Demand is in use plus pods and ADDs waiting for an address.
	Demand int
	// Conflicts counts addresses in use that the node does not hold.
	Conflicts int
	// OutsidePool counts addresses the node holds or uses that the pool's current spec no longer
	// covers (a shrunk pool, a new exclusion): never handed out, they drain as they are freed.
	OutsidePool int
	Exhausted   bool
	// Adopted counts addresses of attachments recorded from pods' status.podIPs (RebuiltKey)
	// rather than by an ADD: pods that were running when the node came to ipwarden (taken over
	// from the previous IPAM) or whose journal was lost. They leave as their pods end.
	Adopted int
	// Unattributed counts held addresses kept out of use by the hold after a rebuild.
	Unattributed int
	// PreviousReserved counts held addresses kept out of use because the previous IPAM reserves
	// them (previous.go).
	PreviousReserved int
}

// Stats returns per-pool counts at now, sorted by pool.
func (s *State) Stats(now time.Time) []PoolStats {
	s.observe(now)
	var out []PoolStats
	for _, name := range s.poolNames() {
		p := s.pools[name]
		st := PoolStats{
			Pool:         name,
			Served:       s.isServed(name),
			Held:         count(p.held),
			InUse:        len(p.inUse),
			Releasing:    len(p.releasing),
			Requested:    s.Request(name),
			Demand:       s.Demand(name),
			Exhausted:    p.cfg.Exhausted,
			Unattributed: count(p.unattributed.Union(p.lost).Subtract(p.inUseSet())),
		}
		st.OutsidePool = count(p.outside())
		for _, k := range p.inUse {
			if k.IsRebuilt() {
				st.Adopted++
			}
		}
		if p.heldKnown {
			prevOut := s.previousOut(p)
			st.PreviousReserved = count(prevOut)
			st.Free = count(p.fresh.Subtract(prevOut))
			st.Conflicts = count(p.inUseSet().Subtract(p.held))
		}
		for _, c := range p.coolq {
			if !p.isUsable(c.Addr) {
				continue
			}
			if p.heldKnown && p.cooled(c.FreedAt, now) {
				if s.prevAll.Contains(c.Addr) {
					continue // counted in PreviousReserved
				}
				st.Free++
			} else {
				st.Cooling++
			}
		}
		out = append(out, st)
	}
	return out
}

// Conflicts returns the addresses in use that pool does not hold, with their attachments.
func (s *State) Conflicts(pool string) map[netip.Addr]Key {
	p, ok := s.pools[pool]
	if !ok || !p.heldKnown {
		return nil
	}
	out := map[netip.Addr]Key{}
	for a, k := range p.inUse {
		if !p.held.Contains(a) {
			out[a] = k
		}
	}
	return out
}

// NextCooled returns the earliest time after now at which a cooling address becomes usable, or
// the zero time if none is cooling.
func (s *State) NextCooled(now time.Time) time.Time {
	s.observe(now)
	var next time.Time
	for _, p := range s.pools {
		for _, c := range p.coolq {
			t := c.FreedAt.Add(p.cfg.Cooldown)
			if !t.After(now) {
				continue
			}
			if next.IsZero() || t.Before(next) {
				next = t
			}
			break // the queue is ordered: the first still cooling is the pool's earliest
		}
	}
	return next
}

// Reason says why pool has no address for an ADD at now, for the CNI error message: what is
// short and what an operator can do.
func (s *State) Reason(pool string, now time.Time) string {
	s.observe(now)
	p, ok := s.pools[pool]
	switch {
	case !ok || !p.known:
		return fmt.Sprintf("the agent has not seen IPPool %s yet", pool)
	case s.recordMissing:
		return recordMissingReason(s.node)
	case !p.heldKnown:
		return fmt.Sprintf("the controller has not answered: NodeIPAllocation %s has no status for pool %s yet (is ipwarden controller running?)", s.node, pool)
	}
	holding := count(p.held.Subtract(p.relSet))
	cooling := 0
	var next time.Time
	for _, c := range p.coolq {
		if !p.cooled(c.FreedAt, now) {
			if cooling == 0 {
				next = c.FreedAt.Add(p.cfg.Cooldown)
			}
			cooling++
		}
	}
	coolNote := ""
	if cooling > 0 {
		coolNote = fmt.Sprintf("; %d freed addresses are cooling down (reuseCooldown %s), the next is free in %s",
			cooling, p.cfg.Cooldown, next.Sub(now).Round(time.Millisecond))
	}
	max := p.cfg.Scaling.MaxPerNode
	switch {
	case max > 0 && holding >= max:
		return fmt.Sprintf("node %s is at the pool's maxPerNode (%d addresses held, all in use or cooling down)%s; raise spec.scaling.maxPerNode of IPPool %s or run fewer pods on the node",
			s.node, max, coolNote, pool)
	case p.cfg.Exhausted:
		return fmt.Sprintf("pool %s is exhausted: the controller has no free address to give node %s (it holds %d)%s; add CIDRs to the IPPool",
			pool, s.node, holding, coolNote)
	default:
		return fmt.Sprintf("the controller has not answered: node %s requested %d addresses of pool %s and holds %d%s; check that ipwarden controller is running",
			s.node, s.Target(pool), pool, holding, coolNote)
	}
}

// SpecWorthWriting says whether the node's desired request differs from the published one in a
// way the controller must see: a pool's requested count or claims changed, or addresses to give
// back (or their cooled mark) were added, or a pool entry came or went. A desired request that
// only drops releasing entries (the controller took them, the node forgot them) is not worth a
// write of its own: the controller never hands a node an address its spec lists as releasing,
// so the stale entries are harmless, and they go with the node's next write. That saves the
// "clear" write after every give-back (and the status write it would cause).
func SpecWorthWriting(published, desired []PoolRequest) bool {
	if len(published) != len(desired) {
		return true
	}
	byPool := make(map[string]PoolRequest, len(published))
	for _, r := range published {
		byPool[r.Pool] = r
	}
	for _, d := range desired {
		p, ok := byPool[d.Pool]
		if !ok || p.Requested != d.Requested || !p.Claimed.Equal(d.Claimed) || !p.Wanted.Equal(d.Wanted) ||
			!slices.Equal(p.Sticky, d.Sticky) || !slices.Equal(p.Claims, d.Claims) ||
			!p.Releasing.ContainsSet(d.Releasing) || !p.ReleasingCooled.ContainsSet(d.ReleasingCooled) {
			return true
		}
	}
	return false
}

// NumReleasing counts the addresses of pool the node gives back and the controller has not
// taken yet.
func (s *State) NumReleasing(pool string) int {
	if p, ok := s.pools[pool]; ok {
		return len(p.releasing)
	}
	return 0
}

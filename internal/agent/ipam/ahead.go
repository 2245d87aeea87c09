package ipam

import (
	"net/netip"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// Addresses reserved ahead.
//
// An ADD's own journal write (a bbolt commit: two fdatasyncs) costs about as much as everything
// else the agent does for it, and the runtime waits for it. So every ADD also journals, in the
// same transaction as its attachment, up to AheadPerPool addresses of each of its pools as
// "reserved ahead": out of the free set, recorded on disk, owned by no attachment yet. The next
// ADD whose every address comes from such records is answered at once: its addresses were
// already out of everyone's reach on disk, and the agent journals the attachment afterwards
// (Early), in one transaction that deletes their records and reserves the next ones.
//
// What that keeps true: every address a runtime was told is, on disk, either in an attachment or
// reserved ahead, so a restarted agent never hands it to another pod. What it costs: after a
// crash (or a refused journal write of such an ADD) the agent cannot tell which of the reserved
// addresses it had answered with. Restore therefore loads every record as "lost": out of use
// until the unattributed hold (hold.go) ends, which waits for every pod on the node to report its
// addresses (an address a pod reports is adopted from its status.podIPs, as after a lost journal)
// or to be gone, at most --rebuild-hold. That is at most AheadPerPool addresses per pool, not
// the whole pool. A clean stop forgets the records (ForgetAhead), so a restart holds nothing.
//
// Ordering: a record is deleted only by the ADD that uses its address (which can only use it
// once the record is journaled) or by PlanForgetAhead, whose addresses stay out of use until its
// deletion is journaled; so a deletion can never land after a newer record of the same address.

// AheadPerPool is how many addresses of each pool an ADD keeps reserved ahead by default
// (agent --reserve-ahead): enough for two ADDs in flight at once to be answered before their
// journal writes.
const AheadPerPool = 2

// SetReserveAhead sets how many addresses of each pool ADDs keep reserved ahead; 0 turns
// reserving ahead off (every ADD is answered after its journal write).
func (s *State) SetReserveAhead(n int) { s.aheadN = max(n, 0) }

// aheadPick returns the address reserved ahead in the pool that next would prefer (the lowest of
// the largest run), never one of wanted (static addresses other pods ask for).
func (p *poolState) aheadPick(wanted addr.Set) (netip.Addr, bool) {
	var best netip.Addr
	var bestSize addr.Count
	ok := false
	for _, a := range p.ahead.Subtract(wanted).Addrs(AheadPerPool * 4) {
		sz := p.runSize(a)
		if c := sz.Cmp(bestSize); !ok || c > 0 || (c == 0 && a.Less(best)) {
			best, bestSize, ok = a, sz, true
		}
	}
	return best, ok
}

// topUp plans reserving ahead, in the change of an ADD, addresses of pool name up to
// AheadPerPool: they leave the free set now and are usable by the next ADDs once the change is
// journaled (ConfirmAdd).
func (s *State) topUp(name string, now time.Time, ch *Change, u *undo) {
	p := s.pools[name]
	if p == nil || s.recordMissing || s.handback != nil {
		return
	}
	wanted := s.reserved(name)
	for n := count(p.ahead) + count(p.aheadPlanned); n < s.aheadN; n++ {
		a, fromCooling, ok := p.next(now, wanted)
		if !ok {
			return
		}
		if fromCooling {
			c := p.uncoolForAhead(a)
			u.aheadFromCooling = append(u.aheadFromCooling, c)
			ch.DeleteCooling = append(ch.DeleteCooling, Address{Pool: name, Addr: a})
		}
		one := setOf(a)
		p.fresh = p.fresh.Subtract(one)
		p.aheadPlanned = p.aheadPlanned.Union(one)
		ad := Address{Pool: name, Addr: a}
		u.aheadPlanned = append(u.aheadPlanned, ad)
		ch.PutAhead = append(ch.PutAhead, ad)
	}
}

// uncoolForAhead takes a, cooled down, off the cooling queue and returns its entry.
func (p *poolState) uncoolForAhead(a netip.Addr) Cooling {
	t := p.cooling[a]
	delete(p.cooling, a)
	for i, c := range p.coolq {
		if c.Addr == a {
			p.coolq = append(p.coolq[:i:i], p.coolq[i+1:]...)
			break
		}
	}
	return Cooling{Pool: p.name, Addr: a, FreedAt: t}
}

// Early reports whether the pending ADD of k drew every address from addresses reserved ahead:
// the caller answers it before its journal write, and AbortAdd then treats its addresses as
// handed out.
func (s *State) Early(k Key) bool {
	u := s.pending[k]
	return u != nil && u.early
}

// confirmAhead takes on the addresses an ADD reserved ahead, once journaled.
func (s *State) confirmAhead(u *undo) {
	touched := map[string]bool{}
	for _, ad := range u.fromAhead {
		p := s.pools[ad.Pool]
		p.recorded = p.recorded.Subtract(setOf(ad.Addr))
	}
	for _, ad := range u.aheadPlanned {
		p := s.pools[ad.Pool]
		one := setOf(ad.Addr)
		p.aheadPlanned = p.aheadPlanned.Subtract(one)
		p.ahead = p.ahead.Union(one)
		p.recorded = p.recorded.Union(one)
		touched[ad.Pool] = true
	}
	for name := range touched {
		s.pools[name].recompute()
	}
}

// abortAhead undoes the reservations ahead of an ADD whose journal write failed. When the ADD
// was answered early its addresses were handed out, and their records are still on disk: they
// are lost (held until the hold ends; see StartLostHold) instead of free.
func (s *State) abortAhead(u *undo) {
	touched := map[string]bool{}
	for _, ad := range u.fromAhead {
		p := s.pools[ad.Pool]
		if u.early {
			p.aheadLost = p.aheadLost.Union(setOf(ad.Addr))
		} else {
			p.ahead = p.ahead.Union(setOf(ad.Addr))
		}
		touched[ad.Pool] = true
	}
	for _, ad := range u.aheadPlanned {
		p := s.pools[ad.Pool]
		p.aheadPlanned = p.aheadPlanned.Subtract(setOf(ad.Addr))
		touched[ad.Pool] = true
	}
	for _, c := range u.aheadFromCooling {
		if p := s.pools[c.Pool]; !isUsed(p, c.Addr) {
			p.uncool(c)
		}
	}
	for name := range touched {
		s.pools[name].recompute()
	}
}

// LostAhead counts the addresses recorded as reserved ahead that an ADD may have handed out
// without its attachment reaching the journal (after a crash or a refused write), and that no
// attachment accounts for now.
func (s *State) LostAhead() int {
	n := 0
	for _, p := range s.pools {
		n += count(p.aheadLost.Subtract(p.inUseSet()))
	}
	return n
}

// StartLostHold starts the unattributed hold for the lost addresses reserved ahead (LostAhead),
// until until at the latest; a hold already on keeps its deadline. It reports whether a hold is
// on.
func (s *State) StartLostHold(until time.Time) bool {
	if s.LostAhead() == 0 {
		return !s.holdUntil.IsZero()
	}
	if s.holdUntil.IsZero() {
		s.holdUntil = until
	}
	return true
}

// AheadPlan forgets records of addresses reserved ahead (PlanForgetAhead, PlanStopAhead).
type AheadPlan struct {
	Change Change
	gone   map[string]addr.Set // the records that go, per pool: no longer lost once journaled
	prior  map[string]addr.Set // a clean stop: what was reserved ahead before (Abort restores it)
	added  map[string]addr.Set // a clean stop: what it made lost while in flight (Abort undoes it)
}

// Changes implements Plan.
func (p AheadPlan) Changes() Change { return p.Change }

// PlanForgetAhead plans deleting the records of the lost addresses reserved ahead once no hold
// is on: those in use are the attachments' now, the rest are free once the deletion is
// journaled (Apply). Without a hold or with nothing lost the plan is empty.
func (s *State) PlanForgetAhead() AheadPlan {
	plan := AheadPlan{gone: map[string]addr.Set{}}
	if !s.holdUntil.IsZero() {
		return plan
	}
	for _, name := range s.poolNames() {
		p := s.pools[name]
		if p.aheadLost.IsEmpty() {
			continue
		}
		plan.forget(name, p.aheadLost)
	}
	return plan
}

// forget adds the deletion of pool name's records of set to the plan.
func (plan *AheadPlan) forget(name string, set addr.Set) {
	plan.gone[name] = set
	for _, a := range set.Addrs(count(set)) {
		plan.Change.DeleteAhead = append(plan.Change.DeleteAhead, Address{Pool: name, Addr: a})
	}
}

// PlanStopAhead plans deleting every record of an address reserved ahead that no attachment
// uses, for a clean stop: the next start then has nothing lost to hold. Those addresses are out
// of use from now on; the caller must have stopped serving ADDs and waited for every ADD answered
// early to be journaled. Records of addresses in use (a static address that was reserved ahead,
// say) go too: the attachment holds the address.
func (s *State) PlanStopAhead() AheadPlan {
	plan := AheadPlan{gone: map[string]addr.Set{}, prior: map[string]addr.Set{}, added: map[string]addr.Set{}}
	for _, name := range s.poolNames() {
		p := s.pools[name]
		rec := p.recorded.Union(p.aheadLost)
		if rec.IsEmpty() {
			continue
		}
		added := rec.Subtract(p.inUseSet()).Subtract(p.aheadLost)
		plan.forget(name, rec)
		plan.prior[name], plan.added[name] = p.ahead, added
		// Out of use while the deletion is in flight (those in use stay so).
		p.aheadLost = p.aheadLost.Union(added)
		p.ahead = addr.Set{}
		p.recompute()
	}
	return plan
}

func (s *State) applyAhead(plan AheadPlan) {
	for name, gone := range plan.gone {
		p := s.pools[name]
		p.aheadLost = p.aheadLost.Subtract(gone)
		p.recorded = p.recorded.Subtract(gone)
		p.recompute()
	}
}

// abortAheadPlan: every record is still on disk, so what the plan took out of use is back as it
// was (those lost before stay lost).
func (s *State) abortAheadPlan(plan AheadPlan) {
	for name := range plan.gone {
		p := s.pools[name]
		p.aheadLost = p.aheadLost.Subtract(plan.added[name])
		p.ahead = p.ahead.Union(plan.prior[name])
		p.recompute()
	}
}

// Ahead returns the addresses of pool reserved ahead and usable by the next ADD (tests, LIST).
func (s *State) Ahead(pool string) addr.Set {
	if p, ok := s.pools[pool]; ok {
		return p.ahead
	}
	return addr.Set{}
}

// AheadLost returns the addresses of pool recorded as reserved ahead that may have been handed
// out (tests, LIST).
func (s *State) AheadLost(pool string) addr.Set {
	if p, ok := s.pools[pool]; ok {
		return p.aheadLost
	}
	return addr.Set{}
}

package ipam

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"k8s.io/apimachinery/pkg/labels"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/sticky"
)

// State is the node's allocation state. The zero value is not usable; see New.
type State struct {
	node  string
	pools map[string]*poolState
	// observed: the pools the last Rebuild recorded the pods' addresses with (Observed).
	observed []ObservedPool
	served   []string // pools that select the node, the default of an ADD, IPv4 first then by name
	atts     map[Key]*Attachment
	byPod    map[string]map[Key]struct{} // pod UID -> attachments
	// pending holds ADDs reserved in memory whose journal write has not finished, with what
	// AbortAdd needs to undo them.
	pending map[Key]*undo
	pods    []Pod
	// delFreed: pods (UIDs) an attachment of which a DEL freed. Their status.podIPs may still
	// show the freed addresses (the kubelet reports the sandbox's end later, and a deleted pod
	// keeps its status until it is gone): Rebuild must not adopt them. Forgotten once the pod
	// is no longer among the node's pods (SetPods).
	delFreed map[string]struct{}
	// namespaces are the namespaces the agent knows, for pool choice (choose.go).
	namespaces map[string]Namespace
	// configPools is the pod network configuration's "pools" from the last ADD on eth0: the
	// demand of bound pods counts them where their ADD will draw (podWants).
	configPools []string
	// refused: wanted addresses the controller refused, per pool, with its reason (static.go).
	refused map[string]map[netip.Addr]string
	// elsewhere: held addresses a pod on another node asks for by name, per pool (static.go).
	elsewhere map[string]addr.Set
	// claimRefused: claims (by UID) the controller refused the node, per pool, with its reason
	// (claim.go).
	claimRefused map[string]map[string]string
	waiters      map[Key]waiter
	// clock is the latest time any call passed in: Demand counts the addresses still cooling
	// then, without a time argument of its own.
	clock time.Time
	// holdUntil is the deadline of the unattributed hold (see hold.go); zero: no hold.
	holdUntil time.Time
	// sandboxes is the last reading of the container runtime's pod sandboxes (sandboxes.go).
	sandboxes NodeSandboxes
	// mark is the NodeIPAllocation the node last wrote (record.go).
	mark RecordMark
	// recordMissing: the NodeIPAllocation is gone; nothing is handed out of the free set.
	recordMissing bool
	// handback is the handback mark (handback.go): while set, every ADD is refused.
	handback *HandbackMark
	// previous: what the previous IPAM of each CNI network reserved at the last reading;
	// prevAll is every reading together, prevLocal those of node-local reservations (previous.go).
	previous           map[string]previousReading
	prevAll, prevLocal addr.Set
}

// observe advances the state's clock to now.
func (s *State) observe(now time.Time) {
	if now.After(s.clock) {
		s.clock = now
	}
}

// poolState is the node's view of one pool.
type poolState struct {
	name      string
	cfg       Pool
	known     bool     // cfg came from an IPPool (or the journal)
	held      addr.Set // status.pools[].addresses
	heldKnown bool     // held came from the controller (or the journal)
	releasing map[netip.Addr]time.Time
	relSet    addr.Set
	inUse     map[netip.Addr]Key
	cooling   map[netip.Addr]time.Time // freed-at, mirrors coolq
	coolq     []Cooling                // oldest freed first
	fresh     addr.Set                 // (held - releasing - inUse - cooling - unattributed) within usable
	// unattributed: held addresses kept out of use by the hold after a rebuild (hold.go).
	unattributed addr.Set
	// lost: addresses an older agent recorded as reserved ahead (lost.go): a sandbox may use
	// one with no record of which, so they stay out of use for as long as their records exist.
	lost addr.Set
	// usable is what the pool's current spec lets the node hand out (see Pool.Usable); when
	// !usableKnown nothing is ruled out. gone is set once the IPPool no longer exists.
	usable      addr.Set
	usableKnown bool
	gone        bool
	// excessSince is when the holding went beyond scaling.Keep (the release delay runs from
	// then); releaseWake is when the delay ends. Zero: not beyond. Memory only.
	excessSince, releaseWake time.Time
	// relCooled is the part of relSet that was past its reuse cooldown on this node (or never
	// used) when it was marked releasing: the controller may hand it to another node at once.
	// Memory only: after a restart every releasing address cools in the pool again.
	relCooled addr.Set
	// nsSel is cfg.NamespaceSelector parsed; nil admits every namespace.
	nsSel labels.Selector
	// reserved is cfg.Reserved by identity (sticky.go).
	reserved map[sticky.Identity]netip.Addr
	// claims is cfg.Claims by UID (claim.go).
	claims map[string]ClaimBinding
	// second is the second attachment of a claim's address during a live migration (claim.go):
	// inUse names the first.
	second map[netip.Addr]Key
	// claimHeld: addresses the holding gained while a claim ADD waited here for its binding,
	// kept from ordinary ADDs and give-backs until no claim waits for a binding (claim.go).
	// Memory only.
	claimHeld addr.Set
}

// setConfig sets the pool's configuration and what it lets the node hand out.
func (p *poolState) setConfig(cfg Pool) {
	p.cfg, p.known = cfg, true
	p.reserved = make(map[sticky.Identity]netip.Addr, len(cfg.Reserved))
	for _, r := range cfg.Reserved {
		p.reserved[r.Identity] = r.Addr
	}
	p.claims = make(map[string]ClaimBinding, len(cfg.Claims))
	for _, b := range cfg.Claims {
		p.claims[b.UID] = b
	}
	p.usable, p.usableKnown = cfg.Usable()
	p.nsSel = nil
	if cfg.NamespaceSelector != "" {
		sel, err := labels.Parse(cfg.NamespaceSelector)
		if err != nil {
			sel = labels.Nothing() // unreadable: admit no namespace rather than every one
		}
		p.nsSel = sel
	}
}

// isUsable reports whether the pool's current spec lets the node hand out a.
func (p *poolState) isUsable(a netip.Addr) bool { return !p.usableKnown || p.usable.Contains(a) }

// outside returns the addresses the node holds or uses from the pool that its current spec
// no longer covers (a shrunk pool, a new exclusion).
func (p *poolState) outside() addr.Set {
	if !p.usableKnown {
		return addr.Set{}
	}
	return p.held.Union(p.inUseSet()).Subtract(p.usable)
}

// waiter is an ADD waiting for addresses; it counts as demand.
type waiter struct {
	uid    string
	pools  []string
	static []Address   // the ADD's static addresses (static.go)
	claims []ClaimWait // the claim ADD's waits (claim.go)
}

// undo is what AbortAdd restores.
type undo struct {
	fromCooling []Cooling
	placeholder *Attachment // the rebuilt attachment the ADD adopted addresses from, before
	configPools *[]string   // the configuration's pools the ADD journals (ConfirmAdd takes them on)
}

// New returns an empty state for node.
func New(node string) *State {
	return &State{
		node:     node,
		pools:    map[string]*poolState{},
		atts:     map[Key]*Attachment{},
		byPod:    map[string]map[Key]struct{}{},
		pending:  map[Key]*undo{},
		waiters:  map[Key]waiter{},
		delFreed: map[string]struct{}{},
	}
}

// Node returns the node name.
func (s *State) Node() string { return s.node }

func (s *State) pool(name string) *poolState {
	p, ok := s.pools[name]
	if !ok {
		p = &poolState{
			name:      name,
			cfg:       Pool{Name: name},
			releasing: map[netip.Addr]time.Time{},
			inUse:     map[netip.Addr]Key{},
			second:    map[netip.Addr]Key{},
			cooling:   map[netip.Addr]time.Time{},
		}
		s.pools[name] = p
	}
	return p
}

// ClampFuture treats journaled times later than now as now: the node's clock was stepped back
// (an NTP correction) since they were written. Within one process durations run on the monotonic
// clock and a step changes nothing; the journal's times are wall times. Without the clamp an
// address freed "in the future" would stay cooling, and a release mark wait its delay, for as long
// as the step, keeping addresses out of use. It reports how many times it moved. Call it after
// Restore, with the time the agent starts.
func (s *State) ClampFuture(now time.Time) int {
	moved := 0
	for _, p := range s.pools {
		for a, t := range p.cooling {
			if t.After(now) {
				p.cooling[a] = now
				moved++
			}
		}
		for i := range p.coolq {
			if p.coolq[i].FreedAt.After(now) {
				p.coolq[i].FreedAt = now
			}
		}
		for a, t := range p.releasing {
			if t.After(now) {
				p.releasing[a] = now
				moved++
			}
		}
	}
	for _, a := range s.atts {
		if a.Created.After(now) {
			a.Created = now
			moved++
		}
	}
	return moved
}

// Restore loads a journal snapshot into an empty state. Records that contradict each other (an
// address in two attachments, or in use and cooling) are kept in the safest reading (in use
// wins, nothing is handed out twice) and reported as problems.
func (s *State) Restore(snap Snapshot) (problems []string) {
	s.mark = snap.Mark
	s.configPools = slices.Clone(snap.ConfigPools)
	s.handback = nil
	if snap.Handback != nil {
		m := *snap.Handback
		s.handback = &m
	}
	var served []string
	for _, pc := range snap.Pools {
		p := s.pool(pc.Name)
		p.setConfig(pc)
		if pc.Served {
			served = append(served, pc.Name)
		}
	}
	s.setServed(served)
	for _, h := range snap.Holdings {
		p := s.pool(h.Pool)
		p.held, p.heldKnown = h.Addresses, true
	}
	for _, r := range snap.Releasing {
		p := s.pool(r.Pool)
		p.releasing[r.Addr] = r.Since
	}
	for _, a := range reservationsFirst(snap.Attachments) {
		att := a
		att.Addresses = slices.Clone(a.Addresses)
		for _, ad := range att.Addresses {
			p := s.pool(ad.Pool)
			if other, dup := p.inUse[ad.Addr]; dup {
				// Two records of one address are one of two sharings, each on its own terms, or a
				// problem: a live migration's two attachments of one claim UID (claim.go), or a
				// DRA reservation and its pod's attachment (dra.go; the reservations come first).
				if _, third := p.second[ad.Addr]; !third {
					if o := s.atts[other]; o != nil && o.Claim != nil && att.Claim != nil {
						if ok, _ := MayShare(*att.Claim, o.Claim, false); ok {
							p.second[ad.Addr] = att.Key // a live migration's two attachments
							continue
						}
					}
				}
				if s.sharesReservation(other, &att, ad) {
					continue // the pod's attachment of a DRA reservation's address (dra.go)
				}
				problems = append(problems, fmt.Sprintf("address %s of pool %s is recorded for both %s and %s",
					ad.Addr, ad.Pool, other, att.Key))
				continue
			}
			p.inUse[ad.Addr] = att.Key
			if _, rel := p.releasing[ad.Addr]; rel {
				problems = append(problems, fmt.Sprintf("address %s of pool %s is in use by %s and also releasing",
					ad.Addr, ad.Pool, att.Key))
			}
		}
		s.putAttachment(&att)
	}
	for _, a := range snap.Ahead {
		// Every record is lost: the agent that wrote it may have handed the address out (lost.go).
		p := s.pool(a.Pool)
		p.lost = p.lost.Union(addr.SetOfAddrs(a.Addr))
	}
	for _, c := range snap.Cooling {
		p := s.pool(c.Pool)
		if k, used := p.inUse[c.Addr]; used {
			problems = append(problems, fmt.Sprintf("address %s of pool %s is in use by %s and also cooling down; kept in use",
				c.Addr, c.Pool, k))
			continue
		}
		if _, rel := p.releasing[c.Addr]; rel {
			continue
		}
		p.cooling[c.Addr] = c.FreedAt
		p.coolq = append(p.coolq, c)
	}
	for _, p := range s.pools {
		slices.SortStableFunc(p.coolq, func(a, b Cooling) int { return a.FreedAt.Compare(b.FreedAt) })
		p.recompute()
	}
	return problems
}

// recompute derives relSet and fresh from the maps.
func (p *poolState) recompute() {
	rel := make([]netip.Addr, 0, len(p.releasing))
	for a := range p.releasing {
		rel = append(rel, a)
	}
	p.relSet = addr.SetOfAddrs(rel...)
	p.relCooled = p.relCooled.Intersect(p.relSet)
	inUse := p.inUseSet()
	p.unattributed = p.unattributed.Intersect(p.held).Subtract(p.relSet).Subtract(inUse)
	p.fresh = p.held.Subtract(p.relSet).Subtract(inUse).Subtract(p.coolingSet()).Subtract(p.unattributed).
		Subtract(p.lost)
	if p.usableKnown {
		p.fresh = p.fresh.Intersect(p.usable)
	}
}

func (p *poolState) inUseSet() addr.Set {
	as := make([]netip.Addr, 0, len(p.inUse))
	for a := range p.inUse {
		as = append(as, a)
	}
	return addr.SetOfAddrs(as...)
}

// stillCooling returns the freed addresses whose reuse cooldown has not passed at now.
func (p *poolState) stillCooling(now time.Time) addr.Set {
	as := make([]netip.Addr, 0, len(p.cooling))
	for a, t := range p.cooling {
		if !p.cooled(t, now) {
			as = append(as, a)
		}
	}
	return addr.SetOfAddrs(as...)
}

func (p *poolState) coolingSet() addr.Set {
	as := make([]netip.Addr, 0, len(p.cooling))
	for a := range p.cooling {
		as = append(as, a)
	}
	return addr.SetOfAddrs(as...)
}

func (s *State) putAttachment(a *Attachment) {
	s.atts[a.Key] = a
	if uid := a.Pod.UID; uid != "" {
		m := s.byPod[uid]
		if m == nil {
			m = map[Key]struct{}{}
			s.byPod[uid] = m
		}
		m[a.Key] = struct{}{}
	}
}

func (s *State) dropAttachment(k Key) {
	a, ok := s.atts[k]
	if !ok {
		return
	}
	delete(s.atts, k)
	if uid := a.Pod.UID; uid != "" {
		delete(s.byPod[uid], k)
		if len(s.byPod[uid]) == 0 {
			delete(s.byPod, uid)
		}
	}
}

// SetPools plans (PlanPools) and applies at once, for callers with no journal that could refuse
// the change (the simulator, tests); the agent journals the plan before it applies it. It
// returns the plan's Change.
func (s *State) SetPools(pools []Pool, served []string) Change {
	plan := s.PlanPools(pools, served)
	s.Apply(plan)
	return plan.Change
}

// setServed sets the pools ADD draws from by default: IPv4 pools first, then by name.
func (s *State) setServed(served []string) {
	s.served = servedOrder(served, func(name string) bool { return s.pool(name).cfg.Is4() })
}

func poolEqual(a, b Pool) bool {
	return a.Name == b.Name && slices.Equal(a.CIDRs, b.CIDRs) && a.Gateway == b.Gateway && slices.Equal(a.Exclude, b.Exclude) &&
		slices.Equal(a.Routes, b.Routes) && a.Scaling == b.Scaling && a.Cooldown == b.Cooldown &&
		a.Exhausted == b.Exhausted && a.Served == b.Served && a.NamespaceSelector == b.NamespaceSelector && a.Network == b.Network &&
		a.Sticky == b.Sticky && slices.Equal(a.Reserved, b.Reserved) && slices.Equal(a.Claims, b.Claims)
}

// CanServeOffline reports whether the state, restored from the journal, can serve ADD before the
// agent has heard from the API server: some pool the node served has a holding the journal kept.
// A new or lost journal cannot (the addresses of running pods are known only from the API).
func (s *State) CanServeOffline() bool {
	for _, name := range s.served {
		if p := s.pools[name]; p != nil && p.heldKnown && !p.held.IsEmpty() {
			return true
		}
	}
	return false
}

// empty reports whether the pool holds nothing the node must remember.
func (p *poolState) empty() bool {
	return p.held.IsEmpty() && len(p.inUse) == 0 && len(p.releasing) == 0 && len(p.cooling) == 0 && p.lost.IsEmpty()
}

// Served returns the pools that select the node, in ADD order.
func (s *State) Served() []string { return slices.Clone(s.served) }

// PoolConfig returns the configuration of pool name and whether it is known.
func (s *State) PoolConfig(name string) (Pool, bool) {
	p, ok := s.pools[name]
	if !ok || !p.known {
		return Pool{}, false
	}
	return p.cfg, true
}

// SetHolding plans (PlanHoldings) what the controller reports the node holds from pool, and
// applies it at once, for callers with no journal that could refuse the change (the simulator,
// tests); the agent journals the plan before it applies it. It returns the plan's Change.
func (s *State) SetHolding(pool string, held addr.Set) Change {
	plan := newHoldingsPlan(s.clock)
	s.planHolding(&plan, pool, held, false)
	sortAddresses(plan.Change.DeleteReleasing)
	sortAddresses(plan.Change.DeleteCooling)
	s.Apply(plan)
	return plan.Change
}

// SetPods records the pods bound to the node; those that need an address and have none yet
// count as demand.
func (s *State) SetPods(pods []Pod) {
	s.pods = slices.Clone(pods)
	if len(s.delFreed) == 0 {
		return
	}
	bound := make(map[string]bool, len(pods))
	for _, p := range pods {
		bound[p.Ref.UID] = true
	}
	for uid := range s.delFreed {
		if !bound[uid] {
			delete(s.delFreed, uid)
		}
	}
}

// Pods returns the pods last set by SetPods.
func (s *State) Pods() []Pod { return slices.Clone(s.pods) }

// Holding returns what the node holds from pool and whether the controller has said so.
func (s *State) Holding(pool string) (addr.Set, bool) {
	p, ok := s.pools[pool]
	if !ok {
		return addr.Set{}, false
	}
	return p.held, p.heldKnown
}

// HasPod reports whether some attachment belongs to the pod with uid.
func (s *State) HasPod(uid string) bool { return len(s.byPod[uid]) > 0 }

// Attachment returns a copy of the attachment k.
func (s *State) Attachment(k Key) (Attachment, bool) {
	a, ok := s.atts[k]
	if !ok {
		return Attachment{}, false
	}
	return *a.clone(), true
}

// NumAttachments returns the number of attachments.
func (s *State) NumAttachments() int { return len(s.atts) }

// Attachments returns copies of all attachments, sorted by key.
func (s *State) Attachments() []Attachment {
	out := make([]Attachment, 0, len(s.atts))
	for _, a := range s.atts {
		out = append(out, *a.clone())
	}
	slices.SortFunc(out, func(a, b Attachment) int {
		return cmp.Or(cmp.Compare(a.Key.ContainerID, b.Key.ContainerID), cmp.Compare(a.Key.IfName, b.Key.IfName))
	})
	return out
}

// Pending reports whether the ADD of attachment k is reserved in memory but not yet journaled
// (between Add and ConfirmAdd or AbortAdd). The leak collector never frees such an attachment.
func (s *State) Pending(k Key) bool { return s.pending[k] != nil }

// PodAttachments returns the keys of the attachments of the pod with uid, sorted.
func (s *State) PodAttachments(uid string) []Key {
	var ks []Key
	for k := range s.byPod[uid] {
		ks = append(ks, k)
	}
	slices.SortFunc(ks, func(a, b Key) int {
		return cmp.Or(cmp.Compare(a.ContainerID, b.ContainerID), cmp.Compare(a.IfName, b.IfName))
	})
	return ks
}

func sortAddresses(as []Address) {
	slices.SortFunc(as, func(a, b Address) int { return cmp.Or(cmp.Compare(a.Pool, b.Pool), a.Addr.Compare(b.Addr)) })
}

// cooled reports whether a cooling address freed at t may be handed out at now.
func (p *poolState) cooled(t, now time.Time) bool { return !now.Before(t.Add(p.cfg.Cooldown)) }

// next returns the address the pool would hand out at now: of the fresh addresses and those
// whose cooldown has passed, never one of wanted (static addresses other pods ask for), the
// lowest in the node's largest run.
//
// Pods pack the low end of the node's largest run, so the free addresses gather at its high end
// and in the node's smaller runs: the node gives back whole small runs and run ends
// (scaling.ChooseRelease) instead of holes that split its runs, and its holding stays few routes.
func (p *poolState) next(now time.Time, wanted addr.Set) (a netip.Addr, fromCooling bool, ok bool) {
	if !p.heldKnown {
		return netip.Addr{}, false, false
	}
	runs := p.held.Ranges()
	runSize := func(a netip.Addr) addr.Count { return runSizeIn(runs, a) }
	var best addr.Count
	consider := func(c netip.Addr, cooling bool) {
		sz := runSize(c)
		if cmp := sz.Cmp(best); !ok || cmp > 0 || (cmp == 0 && c.Less(a)) {
			a, fromCooling, ok, best = c, cooling, true, sz
		}
	}
	for _, r := range p.fresh.Subtract(wanted).Ranges() {
		consider(r.First, false)
	}
	for _, c := range p.coolq {
		if !p.cooled(c.FreedAt, now) {
			break
		}
		if p.held.Contains(c.Addr) && p.isUsable(c.Addr) && !wanted.Contains(c.Addr) && !p.lost.Contains(c.Addr) {
			consider(c.Addr, true)
		}
	}
	return a, fromCooling, ok
}

// runSizeIn is the size of the run of runs that contains a (zero when none does).
func runSizeIn(runs []addr.Range, a netip.Addr) addr.Count {
	i, _ := slices.BinarySearchFunc(runs, a, func(r addr.Range, a netip.Addr) int {
		if r.Last.Less(a) {
			return -1
		}
		if a.Less(r.First) {
			return 1
		}
		return 0
	})
	if i < len(runs) && runs[i].Contains(a) {
		return runs[i].Size()
	}
	return addr.Count{}
}

// take marks a as in use by k, removing it from fresh or the cooling queue.
func (p *poolState) take(a netip.Addr, k Key) (fromCooling *Cooling) {
	p.inUse[a] = k
	if t, ok := p.cooling[a]; ok {
		delete(p.cooling, a)
		i := slices.IndexFunc(p.coolq, func(c Cooling) bool { return c.Addr == a })
		if i >= 0 {
			p.coolq = slices.Delete(p.coolq, i, i+1)
		}
		return &Cooling{Pool: p.name, Addr: a, FreedAt: t}
	}
	p.fresh = p.fresh.Subtract(addr.SetOfAddrs(a))
	p.unattributed = p.unattributed.Subtract(addr.SetOfAddrs(a))
	return nil
}

// free returns a, in use, to the back of the cooling queue at now, or forgets it when the node
// does not hold it (a conflict). It reports whether it was queued.
func (p *poolState) free(a netip.Addr, now time.Time) bool {
	delete(p.inUse, a)
	if _, rel := p.releasing[a]; rel {
		return false
	}
	if p.heldKnown && !p.held.Contains(a) {
		return false
	}
	p.cooling[a] = now
	i := len(p.coolq)
	for i > 0 && now.Before(p.coolq[i-1].FreedAt) {
		i--
	}
	p.coolq = slices.Insert(p.coolq, i, Cooling{Pool: p.name, Addr: a, FreedAt: now})
	return true
}

// uncool puts an address taken from cooling back where it was.
func (p *poolState) uncool(c Cooling) {
	p.cooling[c.Addr] = c.FreedAt
	i, _ := slices.BinarySearchFunc(p.coolq, c.FreedAt, func(e Cooling, t time.Time) int { return e.FreedAt.Compare(t) })
	p.coolq = slices.Insert(p.coolq, i, c)
}

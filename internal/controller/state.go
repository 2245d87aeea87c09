package controller

import (
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/ippool"
	"github.com/ipwarden/ipwarden/internal/scaling"
	"github.com/ipwarden/ipwarden/internal/sticky"
)

// State is the controller's in-memory record of pools and what each node holds. It does no IO:
// the Controller feeds it API objects and writes what it returns. Not safe for concurrent use;
// the Controller serializes access.
type State struct {
	Marks ExhaustionMarks

	pools map[string]*poolState
	nodes map[string]*nodeState
	// settleUntil: until then no node is filled from the free pool; claims are served first
	// (docs/design.md, "Claims"). Set when the controller starts leading.
	settleUntil time.Time
	// statefulSets: the last view of each StatefulSet seen (ReturnSticky), deleted ones too,
	// so a node's late report cannot re-record a reservation already returned (sticky.go).
	statefulSets map[stsKey]sticky.StatefulSet
	// claims: the IPAMClaims the informer knows (ipamclaims.go).
	claims map[ClaimKey]KnownClaim
}

type poolState struct {
	name      string
	created   time.Time
	cfg       ippool.Pool
	parseErr  error  // spec could not be used
	overlaps  string // older pool this one overlaps
	deleted   bool   // IPPool object is gone; kept while nodes hold its addresses
	alloc     *addr.Allocator
	exhausted bool
	starved   bool                             // a fill fell short since the last status flush
	cooling   []coolRecord                     // persisted in status.cooling: written before nodes drop the addresses
	holders   map[string]int                   // node -> addresses held
	waiting   map[string]bool                  // nodes left short because the pool ran out
	dirty     bool                             // status needs a write
	claims    map[string]addr.Set              // node -> addresses it claims (spec.pools[].claimed), only nodes with claims
	wanted    map[string]addr.Set              // node -> addresses its pods ask for by name (spec.pools[].wanted)
	sticky    map[sticky.Identity]netip.Addr   // status.sticky: reserved for StatefulSet pod identities (sticky.go)
	settle    *poolSettle                      // new addresses waiting for the nodes to observe them (poolsettle.go)
	bindings  map[string]*claimBinding         // status.ipamClaims by claim UID (ipamclaims.go)
	shared    map[string]*sharedGrant          // status.shared by claim UID
	uses      map[string][]ipwardenv1.ClaimUse // node -> its spec's claim uses in this pool
}

func (p *poolState) serving() bool { return !p.deleted && p.parseErr == nil && p.overlaps == "" }

type coolRecord struct {
	addrs addr.Set
	until time.Time
}

type nodeState struct {
	held    map[string]addr.Set // the record: equals the node's status after each write
	pending map[string]addr.Set // reserved for a write whose outcome is unknown
	// inflight: reserved by a fill planned but not yet committed or aborted (its status write
	// is under way). The audit counts them as the node's, never as leaked.
	inflight map[string]addr.Set
	claims   map[string]addr.Set // pool -> addresses its pods use that it asked back (spec)
	wanted   map[string]addr.Set // pool -> addresses its pods ask for by name (spec)
	labels   labels.Set
	uses     map[string][]ipwardenv1.ClaimUse // pool -> the claims its pods use or wait for (spec)
	// requested is spec.pools[].requested per pool, as last planned (for Regrowth).
	requested map[string]int
}

// NewState returns an empty state.
func NewState(marks ExhaustionMarks) *State {
	return &State{Marks: marks, pools: map[string]*poolState{}, nodes: map[string]*nodeState{}}
}

// Rebuild replaces the state with what the API objects say: every address in a node's status is
// held by that node; cooling records in pool status not held by any node cool until their time.
// It returns the addresses found in two nodes' status (which it leaves with the first node by
// name) so the caller can report them.
func (s *State) Rebuild(pools []ipwardenv1.IPPool, allocs []ipwardenv1.NodeIPAllocation, now time.Time) (twice addr.Set) {
	s.pools = map[string]*poolState{}
	s.nodes = map[string]*nodeState{}
	for i := range pools {
		s.setPool(&pools[i])
		s.pools[pools[i].Name].restoreClaims(pools[i].Status)
	}
	s.recomputeOverlaps()
	sort.Slice(allocs, func(i, j int) bool { return allocs[i].Name < allocs[j].Name })
	for _, a := range allocs {
		ns := s.node(a.Name)
		s.SetClaims(a.Name, a.Spec)
		ns.noteRequests(a.Spec)
		s.SetWanted(a.Name, a.Spec)
		s.SetClaimUses(a.Name, a.Spec)
		defer s.recordSticky(a.Name, a.Spec) // once every holding is loaded
		for _, ps := range a.Status.Pools {
			held, err := addr.ParseSet(ps.Addresses)
			if err != nil || held.IsEmpty() {
				continue
			}
			p := s.pool(ps.Pool)
			if err := p.alloc.Reserve(held); err != nil {
				dup := held.Intersect(p.alloc.Allocated())
				// A claim address under a shared grant naming this node and the node that
				// holds it already is held by both (a live migration), not twice.
				both := s.sharedHeld(p, ps.Pool, a.Name, dup)
				dup = dup.Subtract(both)
				twice = twice.Union(dup)
				held = held.Subtract(dup)
				_ = p.alloc.Reserve(held.Subtract(both))
			}
			ns.held[ps.Pool] = held
			p.holders[a.Name] = count(held)
		}
	}
	for i := range pools {
		p := s.pools[pools[i].Name]
		p.restoreSticky(pools[i].Status.Sticky)
		blocks := append([]ipwardenv1.CoolingBlock(nil), pools[i].Status.Cooling...)
		sort.SliceStable(blocks, func(a, b int) bool { return blocks[a].Until.Before(&blocks[b].Until) })
		for _, b := range blocks {
			set, err := addr.ParseSet(b.Addresses)
			if err != nil || !b.Until.Time.After(now) {
				continue
			}
			set = set.Subtract(p.alloc.Allocated()).Subtract(p.alloc.Cooling())
			if set.IsEmpty() {
				continue
			}
			until := ClampCooling(b.Until.Time, now, p.cfg.Cooldown)
			freed := until.Add(-p.cfg.Cooldown)
			if p.alloc.Reserve(set) == nil {
				_ = p.alloc.Free(set, freed)
			}
			p.cooling = append(p.cooling, coolRecord{addrs: set, until: until})
		}
		p.exhausted = pools[i].Status.Exhausted
		p.dirty = true
	}
	return twice
}

// pool returns the pool's state, creating a placeholder for a pool with no object (a node's
// status names a deleted pool): it tracks what nodes hold and serves nothing.
func (s *State) pool(name string) *poolState {
	p, ok := s.pools[name]
	if !ok {
		p = &poolState{name: name, deleted: true, alloc: addr.NewAllocator(addr.Set{}, 0), holders: map[string]int{}, waiting: map[string]bool{}, claims: map[string]addr.Set{}, wanted: map[string]addr.Set{}}
		s.pools[name] = p
	}
	return p
}

func (s *State) node(name string) *nodeState {
	n, ok := s.nodes[name]
	if !ok {
		n = &nodeState{held: map[string]addr.Set{}, pending: map[string]addr.Set{}, inflight: map[string]addr.Set{}, claims: map[string]addr.Set{}, wanted: map[string]addr.Set{}, requested: map[string]int{},
			uses: map[string][]ipwardenv1.ClaimUse{}}
		s.nodes[name] = n
	}
	return n
}

// SetPool records a created or changed IPPool. It reports whether the set of nodes the pool
// serves may have changed (selector, validity, overlap), in which case every node needs a sync.
func (s *State) SetPool(obj *ipwardenv1.IPPool) (nodesAffected bool) {
	before := s.servingSnapshot()
	selChanged := s.setPool(obj)
	s.recomputeOverlaps()
	return before != s.servingSnapshot() || selChanged
}

// setPool parses and records a pool; it reports whether its node selector changed.
func (s *State) setPool(obj *ipwardenv1.IPPool) (selectorChanged bool) {
	p, existed := s.pools[obj.Name]
	if !existed {
		p = &poolState{name: obj.Name, holders: map[string]int{}, waiting: map[string]bool{}, claims: map[string]addr.Set{}, wanted: map[string]addr.Set{}}
		s.pools[obj.Name] = p
	}
	oldSel := ""
	if p.cfg.NodeSelector != nil {
		oldSel = p.cfg.NodeSelector.String()
	}
	cfg, err := ippool.Parse(obj.Spec)
	p.created = obj.CreationTimestamp.Time
	p.deleted = false
	p.parseErr = err
	if err == nil {
		p.cfg = cfg
	} else {
		p.cfg.Addresses = addr.Set{}
		p.cfg.NodeSelector = labels.Nothing()
	}
	if p.alloc == nil {
		p.alloc = addr.NewAllocator(p.cfg.Addresses, p.cfg.Cooldown)
		// A node's first addresses come with room for three times as many above them
		// (docs/design.md, "Few runs per node").
		p.alloc.SetRoom(2)
	} else {
		p.alloc.SetPool(p.cfg.Addresses)
		p.alloc.SetCooldown(p.cfg.Cooldown)
	}
	p.dirty = true
	return existed && p.cfg.NodeSelector.String() != oldSel
}

func (s *State) servingSnapshot() string {
	names := make([]string, 0, len(s.pools))
	for n, p := range s.pools {
		if p.serving() {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	return fmt.Sprint(names)
}

func (s *State) recomputeOverlaps() {
	var in []PoolAddresses
	for _, p := range s.pools {
		p.overlaps = ""
		if !p.deleted && p.parseErr == nil {
			in = append(in, PoolAddresses{Name: p.name, Network: p.cfg.Network, Created: p.created, Addresses: p.cfg.Addresses})
		}
	}
	for name, older := range Overlaps(in) {
		s.pools[name].overlaps = older
		s.pools[name].dirty = true
	}
}

// DeletePool records that an IPPool object is gone. Addresses nodes hold from it stay held (their
// pods use them); the pool serves no new requests.
func (s *State) DeletePool(name string) (nodesAffected bool) {
	p, ok := s.pools[name]
	if !ok {
		return false
	}
	p.deleted = true
	if len(p.holders) == 0 {
		delete(s.pools, name)
	}
	s.recomputeOverlaps()
	return true
}

// SetNodeLabels records a node's labels (for pool selection).
func (s *State) SetNodeLabels(name string, l map[string]string) { s.node(name).labels = l }

// Selected says whether some serving pool selects a node with these labels.
func (s *State) Selected(l map[string]string) bool {
	for _, p := range s.pools {
		if p.serving() && p.cfg.NodeSelector.Matches(labels.Set(l)) {
			return true
		}
	}
	return false
}

// Holds says whether the record has the node holding (or maybe holding) any address.
func (s *State) Holds(name string) bool {
	n, ok := s.nodes[name]
	if !ok {
		return false
	}
	for _, h := range n.held {
		if !h.IsEmpty() {
			return true
		}
	}
	for _, h := range n.pending {
		if !h.IsEmpty() {
			return true
		}
	}
	return false
}

// Known lists every node name in the record.
func (s *State) Known() []string {
	out := make([]string, 0, len(s.nodes))
	for n := range s.nodes {
		out = append(out, n)
	}
	return out
}

// Fill is one node sync's planned change, with its new addresses already reserved.
type Fill struct {
	Node    string
	Pools   map[string]*PoolFill
	Need    Need
	Starved []string // pools that could not fill the node's deficit in full
	// Conflicts are claims that cannot be granted because another node holds the address,
	// with this node as claimant or as holder.
	Conflicts []ClaimConflict
}

// PoolFill is a Fill's change to one pool.
type PoolFill struct {
	Plan    PoolPlan
	Added   addr.Set // reserved for the node (claims granted back included)
	Granted addr.Set // the part of Added the node claimed
	Removed addr.Set // released addresses leaving the node
	// Returned is the part of Removed the node listed as cooled (spec releasingCooled): free
	// again at once, with no cooling record. The rest cools for the pool's reuse cooldown.
	Returned addr.Set
	Held     addr.Set // the node's holding after the write
	Reason   string   // why a deficit remains, empty when none; stable while the cause lasts
	// Detail adds the numbers of the moment (for events); the status shows only Reason so a
	// starved node's status is not rewritten every time the pool's free count moves.
	Detail string
	// Refused are wanted addresses the controller cannot move to the node, with the reason.
	Refused []Refusal
	// WantedElsewhere are addresses the node holds that another node's pod asks for by name,
	// or a claim's address another node waits for, or one under a shared grant.
	WantedElsewhere addr.Set
	// Shared is the part of Held granted while another node holds it too (a live migration's
	// shared grant): not reserved in the allocator again.
	Shared addr.Set
	// Dropped is the part of Removed that another node still holds under a shared grant: it
	// leaves this node without cooling and without returning to the pool.
	Dropped addr.Set
	// ClaimAnswers answer the node's waiting claim uses; ClaimRefused is what its status shows.
	ClaimAnswers []ClaimAnswer
	ClaimRefused []ipwardenv1.ClaimRefusal
	// AskedBack are the nodes asked to give a claim's address back (to sync them).
	AskedBack []string
	// MustRecord: a binding or shared grant this fill grants is not durable yet; the pool's
	// status write lands before the node's.
	MustRecord bool
}

// Changed says whether the fill changes any holding.
func (f *Fill) Changed() bool {
	for _, p := range f.Pools {
		if !p.Added.IsEmpty() || !p.Removed.IsEmpty() || !p.Shared.IsEmpty() || p.MustRecord {
			return true
		}
	}
	return false
}

// HasPending says whether a node has addresses reserved for a write whose outcome is unknown.
func (s *State) HasPending(name string) bool {
	n, ok := s.nodes[name]
	if !ok {
		return false
	}
	for _, p := range n.pending {
		if !p.IsEmpty() {
			return true
		}
	}
	return false
}

// ResolvePending settles addresses reserved for a write whose outcome was unknown, given the
// node's status freshly read from the API server: those in it are held; the others were never
// published and go straight back to the pool.
func (s *State) ResolvePending(name string, status ipwardenv1.NodeIPAllocationStatus) {
	n, ok := s.nodes[name]
	if !ok || len(n.pending) == 0 {
		return
	}
	inStatus := map[string]addr.Set{}
	for _, ps := range status.Pools {
		if set, err := addr.ParseSet(ps.Addresses); err == nil {
			inStatus[ps.Pool] = set
		}
	}
	for pool, pend := range n.pending {
		p := s.pool(pool)
		adopted := pend.Intersect(inStatus[pool])
		n.held[pool] = n.held[pool].Union(adopted)
		p.holders[name] = count(n.held[pool])
		var others addr.Set // a shared grant's address: the other node still holds it
		for _, set := range s.holdersOf(pool, pend.Subtract(adopted), name) {
			others = others.Union(set)
		}
		_ = p.alloc.Unreserve(pend.Subtract(adopted).Subtract(others))
		p.dirty = true
	}
	n.pending = map[string]addr.Set{}
	for pool := range inStatus {
		s.endShared(name, pool, addr.Set{})
	}
}

// PlanFill decides and reserves one node's fill and take-back for its spec. The reservation
// holds until Commit or Abort. Claims come first: claimed addresses no other node holds are
// granted back; then the deficit is filled from the free pool, never with an address another
// node claims, and not at all while the controller settles after it started leading.
func (s *State) PlanFill(name string, spec ipwardenv1.NodeIPAllocationSpec, now time.Time) *Fill {
	n := s.node(name)
	s.SetClaims(name, spec)
	n.noteRequests(spec)
	s.SetWanted(name, spec)
	s.SetClaimUses(name, spec)
	s.recordSticky(name, spec)
	f := &Fill{Node: name, Pools: map[string]*PoolFill{}}
	views := map[string]PoolView{}
	for pool, held := range n.held {
		views[pool] = PoolView{Held: held}
	}
	for pool := range n.claims {
		if _, ok := views[pool]; !ok {
			views[pool] = PoolView{}
		}
	}
	cooled := map[string]addr.Set{}
	for pool := range n.uses {
		if _, ok := views[pool]; !ok {
			views[pool] = PoolView{}
		}
	}
	for pool := range n.wanted {
		if _, ok := views[pool]; !ok {
			views[pool] = PoolView{}
		}
	}
	for _, req := range spec.Pools {
		rel, _ := addr.ParseSet(blocks(req.Releasing))
		v := views[req.Pool]
		v.Requested = int(req.Requested)
		v.Releasing = rel
		views[req.Pool] = v
		if len(req.ReleasingCooled) > 0 {
			c, _ := addr.ParseSet(blocks(req.ReleasingCooled))
			cooled[req.Pool] = c.Intersect(rel)
		}
	}
	settling := s.Settling(now)
	plans := map[string]PoolPlan{}
	for _, pool := range sortedKeys(views) {
		v := views[pool]
		p := s.pool(pool)
		granted, conflicts := s.grantClaims(name, pool, v.Held)
		f.Conflicts = append(f.Conflicts, conflicts...)
		f.Conflicts = append(f.Conflicts, s.heldConflicts(name, pool, v.Held)...)
		moved, refused := s.grantWanted(name, pool, v.Held.Union(granted))
		cv := claimsView{node: name, pool: pool, held: v.Held.Union(granted).Union(moved), releasing: v.Releasing, now: now}
		switch {
		case settling:
			cv.settling = "the controller is settling after it started leading"
		case p.settlingAt(now):
			cv.settling = "pool " + pool + " is new or grew and settles"
		}
		co := s.answerClaims(cv)
		held := v.Held.Union(granted).Union(moved).Union(co.granted).Union(co.shared)
		v.Held = held
		v.Serving = p.serving() && p.cfg.NodeSelector.Matches(n.labels)
		plan := Plan(v)
		pf := &PoolFill{Plan: plan, Added: granted.Union(moved).Union(co.granted), Granted: granted, Removed: plan.Remove, Returned: plan.Remove.Intersect(cooled[pool]),
			Held: held.Subtract(plan.Remove), Refused: refused,
			Shared: co.shared, ClaimAnswers: co.answers, ClaimRefused: co.refused, AskedBack: co.asked, MustRecord: co.mustSync}
		pf.Dropped = s.keepShared(name, pool, plan.Remove)
		pf.WantedElsewhere = p.wantedByOthers(name).Union(s.claimWantedElsewhere(name, pool, pf.Held)).Intersect(pf.Held)
		if plan.Add > 0 && settling {
			pf.Reason = "the controller is settling after it started leading: claims are served before fills"
			plan.Add = 0
		}
		if plan.Add > 0 && p.settlingAt(now) {
			pf.Reason = fmt.Sprintf("pool %s is new or grew: its free addresses wait until every node has reported the addresses its running pods use in it, or had its pods read with none using them (--pool-settle)", pool)
			plan.Add = 0
		}
		if plan.Add > 0 {
			// Never hand a node an address its spec still lists as releasing. The node may
			// already have seen it leave and forgotten it; a re-add it reconciles before it
			// republishes its list would be taken away again while a pod uses it. Never hand
			// it an address another node's pods use (claimed) either.
			withheld := p.alloc.Usable(now).Intersect(v.Releasing.Union(p.claimedByOthers(name)).Union(p.wantedByOthers(name)).Union(p.boundAddrs()))
			if !withheld.IsEmpty() {
				_ = p.alloc.Reserve(withheld)
			}
			want := plan.Add
			if room := p.cfg.Scaling.MaxPerNode - count(pf.Held); p.cfg.Scaling.MaxPerNode > 0 && want > room {
				want = max(room, 0)
				pf.Reason = fmt.Sprintf("node is at maxPerNode %d of pool %s", p.cfg.Scaling.MaxPerNode, pool)
			}
			if avail, ok := p.alloc.Available(now).Uint64(); ok && uint64(want) > avail {
				want = int(avail)
				pf.Reason = fmt.Sprintf("pool %s is exhausted", pool)
				pf.Detail = fmt.Sprintf("%d free addresses for a deficit of %d", avail, plan.Add)
				p.starved = true
				p.dirty = true
				// Left short from now, not from its commit: addresses that come back while the
				// fill is in flight refill the node (Refill lists it; the scheduler runs it again
				// after this sync).
				p.waiting[name] = true
				f.Starved = append(f.Starved, pool)
			}
			if want > 0 {
				got, err := p.alloc.Allocate(want, v.Held, now)
				if err == nil {
					pf.Added = pf.Added.Union(got)
					pf.Held = pf.Held.Union(got)
				}
			}
			if !withheld.IsEmpty() {
				_ = p.alloc.Unreserve(withheld)
			}
		} else if v.Requested > count(v.Held.Subtract(plan.Remove)) && !v.Serving {
			pf.Reason = notServingReason(p, pool)
		}
		plans[pool] = plan
		f.Pools[pool] = pf
	}
	sort.Strings(f.Starved)
	f.Need = NeedOf(plans)
	for pool, pf := range f.Pools {
		if add := pf.Added.Union(pf.Shared); !add.IsEmpty() {
			n.inflight[pool] = n.inflight[pool].Union(add)
		}
	}
	return f
}

// land ends a fill's in-flight reservation (Commit, Abort).
func (n *nodeState) land(f *Fill) {
	for pool, pf := range f.Pools {
		if rest := n.inflight[pool].Subtract(pf.Added).Subtract(pf.Shared); rest.IsEmpty() {
			delete(n.inflight, pool)
		} else {
			n.inflight[pool] = rest
		}
	}
}

func notServingReason(p *poolState, pool string) string {
	switch {
	case p.deleted:
		return fmt.Sprintf("pool %s does not exist", pool)
	case p.parseErr != nil:
		return fmt.Sprintf("pool %s is invalid: %v", pool, p.parseErr)
	case p.overlaps != "":
		return fmt.Sprintf("pool %s overlaps pool %s", pool, p.overlaps)
	default:
		return fmt.Sprintf("pool %s does not select this node", pool)
	}
}

// noteRequests records a node's requests, for Regrowth.
func (n *nodeState) noteRequests(spec ipwardenv1.NodeIPAllocationSpec) {
	clear(n.requested)
	for _, req := range spec.Pools {
		n.requested[req.Pool] = int(req.Requested)
	}
}

// Regrowth is how many more addresses the nodes drawing from pool may come to hold if its
// exhausted flag cleared now: for each node, the most it keeps at rest (scaling.Keep: its batch
// target plus the scale-down hysteresis) over what it requests now, taking its request as its
// demand (while the flag is set a node requests its demand). Not just the batch target: a node
// grows by whole batches as its pods come and gives back only beyond Keep, so under churn the
// nodes drift up to Keep, and a flag cleared for less would be set again. The exhausted flag
// stays set until the free addresses cover it (ExhaustionMarks.Exhausted).
func (s *State) Regrowth(pool string) int64 {
	p, ok := s.pools[pool]
	if !ok {
		return 0
	}
	var sum int64
	for _, n := range s.nodes {
		req, ok := n.requested[pool]
		if !ok {
			continue
		}
		sum += int64(max(scaling.Keep(req, p.cfg.Scaling, false)-req, 0))
	}
	return sum
}

// NeedOfNode is a node's current need without reserving anything, for the scheduler.
func (s *State) NeedOfNode(name string, spec ipwardenv1.NodeIPAllocationSpec) Need {
	n := s.node(name)
	s.SetClaims(name, spec)
	n.noteRequests(spec)
	s.SetWanted(name, spec)
	s.SetClaimUses(name, spec)
	plans := map[string]PoolPlan{}
	for _, req := range spec.Pools {
		rel, _ := addr.ParseSet(blocks(req.Releasing))
		p := s.pool(req.Pool)
		plans[req.Pool] = Plan(PoolView{Held: n.held[req.Pool], Requested: int(req.Requested), Releasing: rel,
			Serving: p.serving() && p.cfg.NodeSelector.Matches(n.labels)})
	}
	need := NeedOf(plans)
	for pool, c := range n.claims {
		need.Claims += count(c.Subtract(n.held[pool]))
	}
	for pool, w := range n.wanted {
		need.Claims += count(w.Subtract(n.held[pool]))
	}
	for _, uses := range n.uses {
		for _, u := range uses {
			if !u.Attached {
				need.Claims++
			}
		}
	}
	return need
}

// Commit applies a fill whose status write succeeded: the node holds the new sets and the
// released addresses start cooling.
func (s *State) Commit(f *Fill, now time.Time) {
	n := s.node(f.Node)
	n.land(f)
	for pool, pf := range f.Pools {
		p := s.pool(pool)
		if !pf.Removed.IsEmpty() {
			// A shared address whose other holder gave its copy back meanwhile cools as usual
			// (its cooling record follows in the pool's next status write).
			still := s.othersHave(pool, pf.Dropped, f.Node)
			if lone := pf.Dropped.Subtract(still); !lone.IsEmpty() {
				s.RecordCooling(pool, lone.Subtract(pf.Returned), now.Add(p.cfg.Cooldown))
			}
			_ = p.alloc.Free(pf.Removed.Subtract(pf.Returned).Subtract(still), now)
			_ = p.alloc.Return(pf.Returned.Subtract(still))
		}
		if pf.Held.IsEmpty() {
			delete(n.held, pool)
			delete(p.holders, f.Node)
		} else {
			n.held[pool] = pf.Held
			p.holders[f.Node] = count(pf.Held)
		}
		if !pf.Added.IsEmpty() || !pf.Removed.IsEmpty() {
			p.dirty = true
		}
		s.endShared(f.Node, pool, pf.Dropped)
		if slices.Contains(f.Starved, pool) {
			p.waiting[f.Node] = true
		} else {
			delete(p.waiting, f.Node)
		}
		if p.deleted && len(p.holders) == 0 && len(p.alloc.CoolingBatches()) == 0 {
			delete(s.pools, pool)
		}
	}
}

// Abort undoes a fill whose write failed. definite means the API server rejected the write
// (a conflict): the reserved addresses were never published and return at once. Otherwise the
// outcome is unknown and they stay reserved for the node until ResolvePending.
func (s *State) Abort(f *Fill, definite bool) {
	n := s.node(f.Node)
	n.land(f)
	for pool, pf := range f.Pools {
		if pf.Added.IsEmpty() && pf.Shared.IsEmpty() {
			continue
		}
		p := s.pool(pool)
		if definite {
			_ = p.alloc.Unreserve(pf.Added)
			s.endShared(f.Node, pool, addr.Set{}) // a shared grant it did not get ends
		} else {
			n.pending[pool] = n.pending[pool].Union(pf.Added).Union(pf.Shared)
		}
	}
}

// ClampCooling is when a cooling record written until `until` ends, read at now by a controller
// whose clock may have been stepped back since it was written (an NTP correction, or another
// replica's clock): never later than now plus the pool's cooldown. Otherwise a step back would keep
// the addresses out of use for as long as the step.
func ClampCooling(until, now time.Time, cooldown time.Duration) time.Time {
	if latest := now.Add(cooldown); until.After(latest) {
		return latest
	}
	return until
}

// RecordCooling notes, before a node's status drops them, that addresses will cool in a pool
// until a time; the pool's next status write persists the record.
func (s *State) RecordCooling(pool string, set addr.Set, until time.Time) {
	if set.IsEmpty() {
		return
	}
	p := s.pool(pool)
	p.cooling = append(p.cooling, coolRecord{addrs: set, until: until})
	p.dirty = true
}

// CooldownOf is a pool's reuse cooldown.
func (s *State) CooldownOf(pool string) time.Duration { return s.pool(pool).cfg.Cooldown }

// HeldBy returns what the record says a node holds, pending reservations included.
func (s *State) HeldBy(name string) map[string]addr.Set {
	n, ok := s.nodes[name]
	if !ok {
		return nil
	}
	out := map[string]addr.Set{}
	for pool, h := range n.held {
		out[pool] = h
	}
	for pool, h := range n.pending {
		out[pool] = out[pool].Union(h)
	}
	return out
}

// ReleaseNode returns everything a deleted node held to its pools (cooling from now) and forgets
// the node. It returns what was released per pool.
func (s *State) ReleaseNode(name string, now time.Time) map[string]addr.Set {
	held := s.HeldBy(name)
	for pool, set := range held {
		p := s.pool(pool)
		// A shared grant's address stays with the other node.
		_ = p.alloc.Free(set.Intersect(p.alloc.Allocated()).Subtract(s.sharedHeld(p, pool, name, set)), now)
		delete(p.holders, name)
		p.dirty = true
	}
	for _, p := range s.pools {
		delete(p.waiting, name)
		delete(p.uses, name)
	}
	for _, p := range s.pools {
		for uid, g := range p.shared {
			if g.names(name) {
				delete(p.shared, uid)
				p.dirty = true
			}
		}
	}
	delete(s.nodes, name)
	return held
}

// ForgetNode drops a node that holds nothing from the record.
func (s *State) ForgetNode(name string) {
	if !s.Holds(name) {
		delete(s.nodes, name)
	}
}

// NodeStatus builds a node's status from the record and a fill: per pool the compact address
// list and count, the Ready condition with the reason a deficit remains, and the summary.
func NodeStatus(prev ipwardenv1.NodeIPAllocationStatus, spec ipwardenv1.NodeIPAllocationSpec, generation int64, f *Fill) ipwardenv1.NodeIPAllocationStatus {
	st := ipwardenv1.NodeIPAllocationStatus{ObservedGeneration: generation, Conditions: append([]metav1.Condition(nil), prev.Conditions...)}
	names := make([]string, 0, len(f.Pools))
	for pool := range f.Pools {
		names = append(names, pool)
	}
	sort.Strings(names)
	var reasons []string
	for _, pool := range names {
		pf := f.Pools[pool]
		if pf.Reason != "" {
			reasons = append(reasons, pf.Reason)
		}
		if pf.Held.IsEmpty() && len(pf.Refused) == 0 && pf.WantedElsewhere.IsEmpty() && len(pf.ClaimRefused) == 0 {
			continue
		}
		h := int32(count(pf.Held))
		ps := ipwardenv1.NodePoolStatus{Pool: pool, Addresses: pf.Held.Strings(), Held: h}
		for i, r := range pf.Refused {
			if i == 64 { // the API's MaxItems
				break
			}
			ps.Refused = append(ps.Refused, ipwardenv1.RefusedAddress{Address: ipwardenv1.IPAddress(r.Addr.String()), Reason: r.Reason})
		}
		for i, b := range pf.WantedElsewhere.Strings() {
			if i == 64 { // the API's MaxItems
				break
			}
			ps.WantedElsewhere = append(ps.WantedElsewhere, ipwardenv1.AddressBlock(b))
		}
		ps.ClaimRefused = pf.ClaimRefused
		st.Pools = append(st.Pools, ps)
		st.Held += h
	}
	cond := metav1.Condition{Type: ipwardenv1.ConditionReady, Status: metav1.ConditionTrue, Reason: "Filled",
		Message: "the node holds what it requested", ObservedGeneration: generation}
	if len(reasons) > 0 {
		cond.Status, cond.Reason = metav1.ConditionFalse, "Short"
		cond.Message = joinReasons(reasons)
	}
	meta.SetStatusCondition(&st.Conditions, cond)
	if len(f.Conflicts) > 0 {
		meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: ipwardenv1.ConditionAddressConflict, Status: metav1.ConditionTrue,
			Reason: "HeldByTwoNodes", Message: conflictMessage(f.Conflicts), ObservedGeneration: generation})
	} else {
		meta.RemoveStatusCondition(&st.Conditions, ipwardenv1.ConditionAddressConflict)
	}
	st.Summary = ipwardenv1.Summarize(spec, st)
	return st
}

func joinReasons(rs []string) string {
	out := ""
	for i, r := range rs {
		if i > 0 {
			out += "; "
		}
		out += r
	}
	return out
}

// PoolStatus computes a pool's status from the record and clears its dirty mark. It also applies
// the exhaustion hysteresis and prunes expired cooling records.
func (s *State) PoolStatus(name string, prev ipwardenv1.IPPoolStatus, generation int64, now time.Time) (ipwardenv1.IPPoolStatus, bool) {
	p, ok := s.pools[name]
	if !ok {
		return prev, false
	}
	capacity := p.cfg.Addresses.Size()
	p.alloc.Expire(now)
	inPool := p.alloc.Allocated().Union(p.alloc.Cooling()).Intersect(p.cfg.Addresses)
	allocated := inPool.Size()
	free := capacity.Sub(allocated)
	regrowth := int64(0)
	if p.exhausted {
		regrowth = s.Regrowth(name)
	}
	p.exhausted = s.Marks.Exhausted(p.exhausted, free.Int64Sat(), capacity.Int64Sat(), int64(max(p.cfg.Scaling.BatchSize, 1)), p.starved, regrowth)
	p.starved = false
	kept := p.cooling[:0]
	for _, c := range p.cooling {
		if c.until.After(now) {
			kept = append(kept, c)
		}
	}
	p.cooling = kept
	nodes := 0
	for _, c := range p.holders {
		if c > 0 {
			nodes++
		}
	}
	st := ipwardenv1.IPPoolStatus{
		Fence:              prev.Fence,
		ObservedGeneration: generation,
		Capacity:           capacity.Int64Sat(),
		Allocated:          allocated.Int64Sat(),
		Free:               free.Int64Sat(),
		Nodes:              int32(nodes),
		Exhausted:          p.exhausted,
		Conditions:         append([]metav1.Condition(nil), prev.Conditions...),
	}
	for _, c := range p.cooling {
		// Round up to the second the API stores, so the record never ends early.
		until := c.until.UTC().Truncate(time.Second)
		if until.Before(c.until) {
			until = until.Add(time.Second)
		}
		st.Cooling = append(st.Cooling, ipwardenv1.CoolingBlock{Addresses: c.addrs.Strings(), Until: metav1.NewTime(until)})
	}
	st.Sticky = p.stickyStatus()
	st.IPAMClaims, st.Shared = p.claimStatus()
	conflicts := p.alloc.Conflicts()
	for _, c := range PoolConditions(p.parseErr, p.overlaps, p.exhausted, free.Int64Sat(), count(conflicts), generation) {
		meta.SetStatusCondition(&st.Conditions, c)
	}
	meta.SetStatusCondition(&st.Conditions, StickyCondition(len(p.sticky), generation))
	p.dirty = false
	return st, true
}

// PoolConditions are a pool's Ready, Exhausted and Invalid conditions.
func PoolConditions(parseErr error, overlaps string, exhausted bool, free int64, conflicts int, gen int64) []metav1.Condition {
	invalid := metav1.Condition{Type: ipwardenv1.ConditionInvalid, Status: metav1.ConditionFalse, Reason: "Valid", Message: "the spec is valid", ObservedGeneration: gen}
	ready := metav1.Condition{Type: ipwardenv1.ConditionReady, Status: metav1.ConditionTrue, Reason: "Serving", Message: "nodes draw addresses from this pool", ObservedGeneration: gen}
	switch {
	case parseErr != nil:
		invalid.Status, invalid.Reason, invalid.Message = metav1.ConditionTrue, "InvalidSpec", parseErr.Error()
	case overlaps != "":
		invalid.Status, invalid.Reason = metav1.ConditionTrue, "Overlap"
		invalid.Message = fmt.Sprintf("shares addresses with the older pool %s; this pool serves nothing until the overlap is removed", overlaps)
	}
	if invalid.Status == metav1.ConditionTrue {
		ready.Status, ready.Reason, ready.Message = metav1.ConditionFalse, invalid.Reason, invalid.Message
	} else if conflicts > 0 {
		ready.Reason = "Draining"
		ready.Message = fmt.Sprintf("%d held addresses lie outside the pool after its cidrs or exclusions changed; they stay with their nodes and leave as the nodes release them", conflicts)
	}
	exh := metav1.Condition{Type: ipwardenv1.ConditionExhausted, Status: metav1.ConditionFalse, Reason: "Available", Message: fmt.Sprintf("%d free addresses", free), ObservedGeneration: gen}
	if exhausted {
		exh.Status, exh.Reason = metav1.ConditionTrue, "LowOnAddresses"
		exh.Message = fmt.Sprintf("only %d free addresses: nodes now grow one address at a time; add a CIDR or free addresses", free)
	}
	return []metav1.Condition{ready, exh, invalid}
}

// DirtyPools lists pools whose status needs a write.
func (s *State) DirtyPools() []string {
	var out []string
	for n, p := range s.pools {
		if p.dirty && !p.deleted {
			out = append(out, n)
		}
	}
	sort.Strings(out)
	return out
}

// PoolNames lists the pools with an object.
func (s *State) PoolNames() []string {
	var out []string
	for n, p := range s.pools {
		if !p.deleted {
			out = append(out, n)
		}
	}
	sort.Strings(out)
	return out
}

// PoolMaxPerNode is a pool's maxPerNode (0 if unknown).
func (s *State) PoolMaxPerNode(name string) int {
	if p, ok := s.pools[name]; ok {
		return p.cfg.Scaling.MaxPerNode
	}
	return 0
}

func blocks(bs []ipwardenv1.AddressBlock) []string {
	out := make([]string, len(bs))
	for i, b := range bs {
		out[i] = string(b)
	}
	return out
}

// MarkPoolDirty asks for a pool status write (after a failed one, or for the periodic pass).
func (s *State) MarkPoolDirty(name string) {
	if p, ok := s.pools[name]; ok {
		p.dirty = true
	}
}

// PoolCounts returns a pool's cooling and conflicting address counts.
func (s *State) PoolCounts(name string) (cooling, conflicts int64) {
	p, ok := s.pools[name]
	if !ok {
		return 0, 0
	}
	return p.alloc.Cooling().Size().Int64Sat(), p.alloc.Conflicts().Size().Int64Sat()
}

// MarkExpiredCooling marks dirty the pools with a cooling record or batch that ended by now, so
// their status shows the addresses free again, and returns the nodes left short by those pools:
// they can be filled now.
func (s *State) MarkExpiredCooling(now time.Time) (refill []string) {
	for _, p := range s.pools {
		if len(p.cooling) > 0 && !p.cooling[0].until.After(now) {
			p.dirty = true
		}
		if b := p.alloc.CoolingBatches(); len(b) > 0 && !b[0].Freed.Add(p.alloc.Cooldown()).After(now) {
			p.dirty = true
			p.alloc.Expire(now)
			for n := range p.waiting {
				refill = append(refill, n)
			}
		}
	}
	return refill
}

// Refill returns the nodes left short by a pool, to sync when it has addresses again.
func (s *State) Refill(pool string) []string {
	p, ok := s.pools[pool]
	if !ok {
		return nil
	}
	out := make([]string, 0, len(p.waiting))
	for n := range p.waiting {
		out = append(out, n)
	}
	return out
}

// PoolUsage counts a pool's addresses still cooling at now, and its allocated ones (held by
// nodes or reserved for fills in flight) plus those; it changes nothing.
func (s *State) PoolUsage(name string, now time.Time) (allocated, cooling int64) {
	p, ok := s.pools[name]
	if !ok {
		return 0, 0
	}
	for _, b := range p.alloc.CoolingBatches() {
		if b.Freed.Add(p.alloc.Cooldown()).After(now) {
			cooling += b.Addrs.Size().Int64Sat()
		}
	}
	return p.alloc.Allocated().Size().Int64Sat() + cooling, cooling
}

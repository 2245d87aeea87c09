package controller

import (
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"time"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
)

// Claims (docs/design.md, "Claims"). The API objects are not the only record: a node's agent
// knows which addresses its pods use. When the node's status lacks some of them (etcd restored
// from a backup, the object deleted and re-created, a controller mistake), the agent lists them
// in spec.pools[].claimed. The controller
//
//   - grants a claimed address back to the node when no other node holds it (even while it
//     cools down: a pod uses it, so it is not free);
//   - never hands a claimed address to any other node;
//   - after it starts leading, fills nobody from the free pool until every node's agent has
//     acknowledged it (spec.acknowledgedLeader: claims written from a fresh read of the node's
//     record, conditioned on its resource version), or a settle bound passes for agents that
//     do not answer; without leader election there is no leader to acknowledge and the bound
//     alone applies;
//   - reports a claim it cannot grant, because another node holds the address, as a conflict on
//     both nodes (condition, event, metric): two nodes' pods may use one address and only an
//     operator can say which keeps it.

// ClaimConflict is an address one node claims while another holds it.
type ClaimConflict struct {
	Pool     string
	Addrs    addr.Set
	Claimant string // the node whose pods use it but whose status lacks it
	Holder   string // the node whose status holds it
}

func (c ClaimConflict) String() string {
	return fmt.Sprintf("pool %s: %s used by pods on node %s but held by node %s", c.Pool, c.Addrs.String(), c.Claimant, c.Holder)
}

// SetClaims records the addresses a node claims, from its spec.
func (s *State) SetClaims(name string, spec ipwardenv1.NodeIPAllocationSpec) {
	n := s.node(name)
	s.setPerPool(name, spec, n.claims, func(p *poolState) map[string]addr.Set { return p.claims },
		func(r ipwardenv1.NodePoolRequest) []ipwardenv1.AddressBlock { return r.Claimed })
}

// SetWanted records the addresses a node's pods ask for by name, from its spec.
func (s *State) SetWanted(name string, spec ipwardenv1.NodeIPAllocationSpec) {
	n := s.node(name)
	s.setPerPool(name, spec, n.wanted, func(p *poolState) map[string]addr.Set { return p.wanted },
		func(r ipwardenv1.NodePoolRequest) []ipwardenv1.AddressBlock { return r.Wanted })
}

// setPerPool records one per-pool address list of node name's spec (field) both in the node's
// map (byPool) and in each pool's map by node (of), dropping pools the spec no longer lists.
// Malformed or empty lists count as absent.
func (s *State) setPerPool(name string, spec ipwardenv1.NodeIPAllocationSpec, byPool map[string]addr.Set,
	of func(*poolState) map[string]addr.Set, field func(ipwardenv1.NodePoolRequest) []ipwardenv1.AddressBlock) {
	seen := map[string]bool{}
	for _, req := range spec.Pools {
		set, err := addr.ParseSet(blocks(field(req)))
		if err != nil || set.IsEmpty() {
			continue
		}
		seen[req.Pool] = true
		byPool[req.Pool] = set
		of(s.pool(req.Pool))[name] = set
	}
	for pool := range byPool {
		if !seen[pool] {
			delete(byPool, pool)
			if p, ok := s.pools[pool]; ok {
				delete(of(p), name)
			}
		}
	}
}

// Refusal is a wanted address the controller cannot move to a node.
type Refusal struct {
	Addr   netip.Addr
	Reason string
	// Holder is the node that holds the address, when that is the reason: it is asked to give
	// it back if no pod there uses it (status.pools[].wantedElsewhere).
	Holder string
}

// wantedByOthers is every address of pool that a node other than name wants.
func (p *poolState) wantedByOthers(name string) addr.Set {
	var out addr.Set
	for n, w := range p.wanted {
		if n != name {
			out = out.Union(w)
		}
	}
	return out
}

// grantWanted reserves for node name the addresses its pods ask for by name in pool (static
// addresses, docs/design.md "Static addresses") that the pool hands out and no node holds, and
// refuses, with a stable reason, those another node holds or claims or the pool does not hand
// out. It never takes an address from another node (invariants 1 and 2). An address that is
// cooling down or reserved for an in-flight fill is neither: it waits.
func (s *State) grantWanted(name, pool string, held addr.Set) (granted addr.Set, refused []Refusal) {
	n := s.node(name)
	want := n.wanted[pool].Subtract(held).Subtract(n.pending[pool])
	if want.IsEmpty() {
		return addr.Set{}, nil
	}
	p := s.pool(pool)
	refuse := func(set addr.Set, reason, holder string) {
		for _, a := range set.Addrs(64) {
			refused = append(refused, Refusal{Addr: a, Reason: reason, Holder: holder})
		}
		want = want.Subtract(set)
	}
	if !p.serving() {
		refuse(want, notServingReason(p, pool), "")
		return addr.Set{}, refused
	}
	taken := s.holdersOf(pool, want, name)
	for _, holder := range sortedKeys(taken) {
		refuse(taken[holder], "held by node "+holder, holder)
	}
	for _, other := range sortedKeys(p.claims) {
		if other != name {
			refuse(want.Intersect(p.claims[other]), "used by a pod on node "+other, "")
		}
	}
	for _, a := range want.Intersect(p.boundAddrs()).Addrs(64) {
		_, b := p.boundTo(a)
		refuse(addr.SetOfAddrs(a), "bound to IPAMClaim "+b.key.String(), "")
	}
	refuse(want.Subtract(p.cfg.Addresses), "pool "+pool+" does not hand it out (outside its cidrs, excluded, a network, broadcast or gateway address)", "")
	free := want.Subtract(p.alloc.Allocated())
	if !free.IsEmpty() && p.alloc.Reserve(free) == nil {
		granted = free
	}
	slices.SortFunc(refused, func(a, b Refusal) int { return a.Addr.Compare(b.Addr) })
	return granted, refused
}

// SettleUntil makes PlanFill serve only claims and take-backs until t.
func (s *State) SettleUntil(t time.Time) { s.settleUntil = t }

// EndSettle lets PlanFill fill from the free pool again (every node acknowledged the leader).
func (s *State) EndSettle() { s.settleUntil = time.Time{} }

// Unacknowledged lists, sorted, the nodes whose agent has not acknowledged leader. nodes maps
// every existing Node to whether a serving pool selects it. A node counts when it exists and
//
//   - its NodeIPAllocation's spec.acknowledgedLeader names another controller, or
//   - its NodeIPAllocation is missing or being deleted while a pool selects it: deleted by hand,
//     its record (and the holdings this leader rebuilt from it) is gone while its pods may still
//     use addresses; it waits until the object is back (the agent or this controller re-creates
//     it) and the agent has claimed on it.
//
// A NodeIPAllocation whose Node is gone waits for deletion, not for an agent.
func Unacknowledged(allocs []ipwardenv1.NodeIPAllocation, nodes map[string]bool, leader string) []string {
	var out []string
	has := map[string]bool{}
	for i := range allocs {
		a := &allocs[i]
		if _, exists := nodes[a.Name]; !exists {
			continue
		}
		if a.DeletionTimestamp == nil {
			has[a.Name] = true
			if a.Spec.AcknowledgedLeader == leader {
				continue
			}
		}
		out = append(out, a.Name)
	}
	for name, selected := range nodes {
		if selected && !has[name] && !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	sort.Strings(out)
	return out
}

// Settling says whether fills from the free pool wait at now.
func (s *State) Settling(now time.Time) bool { return now.Before(s.settleUntil) }

// claimedByOthers is every address of pool that a node other than name claims.
func (p *poolState) claimedByOthers(name string) addr.Set {
	var out addr.Set
	for n, c := range p.claims {
		if n != name {
			out = out.Union(c)
		}
	}
	return out
}

// holdersOf maps each node other than except whose record holds part of set to that part.
func (s *State) holdersOf(pool string, set addr.Set, except string) map[string]addr.Set {
	out := map[string]addr.Set{}
	if set.IsEmpty() {
		return out
	}
	p := s.pool(pool)
	for node := range p.holders {
		if node == except {
			continue
		}
		n, ok := s.nodes[node]
		if !ok {
			continue
		}
		if both := n.held[pool].Union(n.pending[pool]).Intersect(set); !both.IsEmpty() {
			out[node] = both
		}
	}
	return out
}

// grantClaims reserves for node name the addresses it claims in pool that no other node holds,
// and returns them with the conflicts: claimed addresses another node holds.
func (s *State) grantClaims(name, pool string, held addr.Set) (granted addr.Set, conflicts []ClaimConflict) {
	n := s.node(name)
	want := n.claims[pool].Subtract(held).Subtract(n.pending[pool])
	if want.IsEmpty() {
		return addr.Set{}, nil
	}
	p := s.pool(pool)
	taken := s.holdersOf(pool, want, name)
	for _, holder := range sortedKeys(taken) {
		conflicts = append(conflicts, ClaimConflict{Pool: pool, Addrs: taken[holder], Claimant: name, Holder: holder})
		want = want.Subtract(taken[holder])
	}
	// What is left is held by no node: free, cooling, or reserved by an in-flight fill of
	// another node (then it stays out until that settles).
	free := want.Subtract(p.alloc.Allocated())
	if !free.IsEmpty() && p.alloc.Reserve(free) == nil {
		granted = free
	}
	return granted, conflicts
}

// heldConflicts lists the addresses node name holds in pool that other nodes claim.
func (s *State) heldConflicts(name, pool string, held addr.Set) []ClaimConflict {
	p := s.pool(pool)
	var out []ClaimConflict
	for _, other := range sortedKeys(p.claims) {
		if other == name {
			continue
		}
		if both := p.claims[other].Intersect(held); !both.IsEmpty() {
			out = append(out, ClaimConflict{Pool: pool, Addrs: both, Claimant: other, Holder: name})
		}
	}
	return out
}

// Conflicts lists every claim conflict in the record, in a stable order.
func (s *State) Conflicts() []ClaimConflict {
	var out []ClaimConflict
	for _, pool := range sortedKeys(s.pools) {
		p := s.pools[pool]
		for _, claimant := range sortedKeys(p.claims) {
			want := p.claims[claimant]
			if n, ok := s.nodes[claimant]; ok {
				want = want.Subtract(n.held[pool])
			}
			taken := s.holdersOf(pool, want, claimant)
			for _, holder := range sortedKeys(taken) {
				out = append(out, ClaimConflict{Pool: pool, Addrs: taken[holder], Claimant: claimant, Holder: holder})
			}
		}
	}
	return out
}

// Wanters lists the nodes whose pods ask for addresses of pool by name (to sync when a holder
// gives one back).
func (s *State) Wanters(pool string) []string {
	p, ok := s.pools[pool]
	if !ok {
		return nil
	}
	return sortedKeys(p.wanted)
}

// Claimants lists the nodes that claim addresses of pool (to sync when the pool changes).
func (s *State) Claimants(pool string) []string {
	p, ok := s.pools[pool]
	if !ok {
		return nil
	}
	return sortedKeys(p.claims)
}

func conflictMessage(cs []ClaimConflict) string {
	parts := make([]string, len(cs))
	for i, c := range cs {
		parts[i] = c.String()
	}
	msg := strings.Join(parts, "; ")
	if len(msg) > 1024 {
		msg = msg[:1000] + fmt.Sprintf("... (%d conflicts; ipwarden check lists them all)", len(cs))
	}
	return msg
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

package controller

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"time"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/ipamclaim"
)

// VM addresses through IPAMClaims (docs/design.md, "VM addresses (IPAMClaim)"). The controller
// keeps, per pool, the binding of an address to each claim UID (status.ipamClaims) and the
// shared grants of a live migration (status.shared), both written in the pool's fenced status
// write before any node status write that grants the address. Nodes list the claims their pods
// use or wait for in spec.pools[].ipamClaims (ClaimUse); the controller answers each waiting use
// in the node's fill (answerClaims): a grant, a hand-back asked of the holder, a shared grant,
// or a refusal (status.pools[].claimRefused). Every decision here is pure over the State.

// ClaimKey names an IPAMClaim.
type ClaimKey struct{ Namespace, Name string }

func (k ClaimKey) String() string { return k.Namespace + "/" + k.Name }

// KnownClaim is what the controller's informer says of an IPAMClaim: its identity and the
// addresses its status names (an import from another IPAM asks for exactly those).
type KnownClaim struct {
	UID string
	IPs []netip.Addr
}

// claimBinding is one claim's address in a pool. durable: a pool status write that carries it
// landed (or it was read from the pool's status); a node status write that grants the address
// waits until it is.
type claimBinding struct {
	addr    netip.Addr
	key     ClaimKey
	durable bool
}

// sharedGrant is a claim address two nodes hold for a live migration.
type sharedGrant struct {
	addr    netip.Addr
	nodes   [2]string
	durable bool
}

func (g *sharedGrant) names(node string) bool { return g.nodes[0] == node || g.nodes[1] == node }

// Claim refusal codes: the claim status condition's reason.
const (
	refusedAttached = "AttachedElsewhere"
	refusedUnknown  = "ClaimNotFound"
)

// ClaimAnswer is the controller's answer to one waiting use of a claim in a fill: granted (the
// address, once the node status write lands) or refused with a reason.
type ClaimAnswer struct {
	UID     string
	Key     ClaimKey
	Pool    string
	Pod     string
	Addr    netip.Addr // granted
	Granted bool
	Shared  bool
	// Attached: the answer restates a grant an attached use holds (no pod preferred as owner);
	// the machine uses it only for a claim it has no answer for yet (after a restart).
	Attached bool
	// Code is the claim condition's reason for a refusal (ipwardenv1.ClaimReason*, or one of
	// the controller's); Reason is the message the node's status and the claim show.
	Code   string
	Reason string
}

// SetClaim records a claim the informer delivered. It reports whether the claim's identity or
// the addresses it asks for changed (the nodes that use it need a sync).
func (s *State) SetClaim(k ClaimKey, c KnownClaim) bool {
	if s.claims == nil {
		s.claims = map[ClaimKey]KnownClaim{}
	}
	old, ok := s.claims[k]
	s.claims[k] = c
	return !ok || old.UID != c.UID || !slices.Equal(old.IPs, c.IPs)
}

// DeleteClaim records that the informer saw the claim go.
func (s *State) DeleteClaim(k ClaimKey) { delete(s.claims, k) }

// ClaimKnown says whether the informer knows a claim of that name with that UID.
func (s *State) ClaimKnown(k ClaimKey, uid string) bool {
	c, ok := s.claims[k]
	return ok && c.UID == uid
}

// SetClaimUses records the claims a node's pods use or wait for, from its spec.
func (s *State) SetClaimUses(name string, spec ipwardenv1.NodeIPAllocationSpec) {
	n := s.node(name)
	seen := map[string]bool{}
	for _, req := range spec.Pools {
		if len(req.IPAMClaims) == 0 {
			continue
		}
		seen[req.Pool] = true
		uses := slices.Clone(req.IPAMClaims)
		n.uses[req.Pool] = uses
		p := s.pool(req.Pool)
		if p.uses == nil {
			p.uses = map[string][]ipwardenv1.ClaimUse{}
		}
		p.uses[name] = uses
	}
	for pool := range n.uses {
		if !seen[pool] {
			delete(n.uses, pool)
			if p, ok := s.pools[pool]; ok {
				delete(p.uses, name)
			}
		}
	}
}

// restoreClaims loads a pool's bindings and shared grants from its status (durable).
func (p *poolState) restoreClaims(st ipwardenv1.IPPoolStatus) {
	p.bindings = map[string]*claimBinding{}
	p.shared = map[string]*sharedGrant{}
	for _, b := range st.IPAMClaims {
		a, err := netip.ParseAddr(string(b.Address))
		if err != nil || b.UID == "" {
			continue
		}
		p.bindings[b.UID] = &claimBinding{addr: a, key: ClaimKey{b.Namespace, b.Name}, durable: true}
	}
	for _, g := range st.Shared {
		a, err := netip.ParseAddr(string(g.Address))
		if err != nil || g.UID == "" || len(g.Nodes) != 2 {
			continue
		}
		p.shared[g.UID] = &sharedGrant{addr: a, nodes: [2]string{g.Nodes[0], g.Nodes[1]}, durable: true}
	}
}

// claimStatus is the pool's bindings and shared grants for its status, sorted.
func (p *poolState) claimStatus() ([]ipwardenv1.ClaimBinding, []ipwardenv1.SharedClaimAddress) {
	var bs []ipwardenv1.ClaimBinding
	for uid, b := range p.bindings {
		bs = append(bs, ipwardenv1.ClaimBinding{Address: ipwardenv1.IPAddress(b.addr.String()), Namespace: b.key.Namespace, Name: b.key.Name, UID: uid})
	}
	slices.SortFunc(bs, func(a, b ipwardenv1.ClaimBinding) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name), cmp.Compare(a.UID, b.UID))
	})
	var gs []ipwardenv1.SharedClaimAddress
	for uid, g := range p.shared {
		gs = append(gs, ipwardenv1.SharedClaimAddress{Address: ipwardenv1.IPAddress(g.addr.String()), UID: uid, Nodes: []string{g.nodes[0], g.nodes[1]}})
	}
	slices.SortFunc(gs, func(a, b ipwardenv1.SharedClaimAddress) int { return cmp.Compare(a.UID, b.UID) })
	return bs, gs
}

// MarkClaimsDurable records that a pool status write carrying st landed: the bindings and shared
// grants it carried may now be granted to nodes.
func (s *State) MarkClaimsDurable(pool string, st ipwardenv1.IPPoolStatus) {
	p, ok := s.pools[pool]
	if !ok {
		return
	}
	for _, b := range st.IPAMClaims {
		if cur := p.bindings[b.UID]; cur != nil && string(b.Address) == cur.addr.String() {
			cur.durable = true
		}
	}
	for _, g := range st.Shared {
		if cur := p.shared[g.UID]; cur != nil && string(g.Address) == cur.addr.String() && len(g.Nodes) == 2 &&
			cur.nodes == [2]string{g.Nodes[0], g.Nodes[1]} {
			cur.durable = true
		}
	}
}

// boundAddrs is every address bound to a claim in the pool.
func (p *poolState) boundAddrs() addr.Set {
	var out addr.Set
	for _, b := range p.bindings {
		out = out.Union(addr.SetOfAddrs(b.addr))
	}
	return out
}

// boundTo returns the UID of the claim bound to a, if any.
func (p *poolState) boundTo(a netip.Addr) (string, *claimBinding) {
	for uid, b := range p.bindings {
		if b.addr == a {
			return uid, b
		}
	}
	return "", nil
}

// usesOf lists every node's use of claim uid in the pool, by node.
func (p *poolState) usesOf(uid string) map[string][]ipwardenv1.ClaimUse {
	out := map[string][]ipwardenv1.ClaimUse{}
	for node, uses := range p.uses {
		for _, u := range uses {
			if u.UID == uid {
				out[node] = append(out[node], u)
			}
		}
	}
	return out
}

func attachedUse(uses []ipwardenv1.ClaimUse) (ipwardenv1.ClaimUse, bool) {
	for _, u := range uses {
		if u.Attached {
			return u, true
		}
	}
	return ipwardenv1.ClaimUse{}, false
}

// claimsView is what answerClaims needs of one node's fill in one pool.
type claimsView struct {
	node string
	pool string
	held addr.Set // what the node holds and gets in this fill so far
	// releasing is what the node's spec releases: never granted to it again while listed (it
	// may have forgotten it already), so a claim's address there waits.
	releasing addr.Set
	settling  string // why no free address may be picked now ("" when it may)
	now       time.Time
}

// claimsOutcome is answerClaims' decision for one node and pool.
type claimsOutcome struct {
	granted  addr.Set // reserved for the node in the allocator (a binding's address no node holds)
	shared   addr.Set // granted while another node holds it (a shared grant): not reserved again
	answers  []ClaimAnswer
	refused  []ipwardenv1.ClaimRefusal
	asked    []string // holders asked to give an address back (wantedElsewhere)
	mustSync bool     // a binding or shared grant this fill relies on is not durable yet
}

// answerClaims answers node v.node's waiting uses of claims in pool v.pool (docs/design.md, "VM
// addresses"): it creates bindings and shared grants in the record (not durable until the pool
// status write lands: mustSync) and reserves what it grants.
func (s *State) answerClaims(v claimsView) claimsOutcome {
	var out claimsOutcome
	p := s.pool(v.pool)
	n := s.node(v.node)
	held := v.held.Union(n.pending[v.pool])
	for _, u := range n.uses[v.pool] {
		key := ClaimKey{u.Namespace, u.Name}
		if u.Attached {
			s.adoptAttached(p, v.node, u, held)
			if b := p.bindings[u.UID]; b != nil && held.Contains(b.addr) {
				if !b.durable {
					out.mustSync = true
				} else if s.ClaimKnown(key, u.UID) {
					out.answers = append(out.answers, ClaimAnswer{UID: u.UID, Key: key, Pool: v.pool, Addr: b.addr, Granted: true, Attached: true})
				}
			}
			continue
		}
		ans := ClaimAnswer{UID: u.UID, Key: key, Pool: v.pool, Pod: u.Pod}
		refuse := func(code, reason string) {
			ans.Code, ans.Reason = code, reason
			out.answers = append(out.answers, ans)
			out.refused = append(out.refused, ipwardenv1.ClaimRefusal{UID: u.UID, Reason: clip(reason, 256)}) // the API's maxLength
		}
		grant := func(a netip.Addr, shared bool) {
			ans.Addr, ans.Granted, ans.Shared = a, true, shared
			out.answers = append(out.answers, ans)
		}
		if !s.ClaimKnown(key, u.UID) {
			refuse(refusedUnknown, fmt.Sprintf("IPAMClaim %s with uid %s is not known to the controller (deleted, re-created, not created yet, or the IPAMClaim CRD is not installed)", key, u.UID))
			continue
		}
		if !p.serving() {
			refuse(ipwardenv1.ClaimReasonInternalError, notServingReason(p, v.pool))
			continue
		}
		b := p.bindings[u.UID]
		if b == nil {
			if other := s.boundElsewhere(p, u.UID); other != "" {
				// One address per claim and family on a network: the agent asks in the pool
				// that records it.
				refuse(ipwardenv1.ClaimReasonInternalError, fmt.Sprintf("IPAMClaim %s's address is recorded in pool %s, not %s", key, other, v.pool))
				continue
			}
			if len(p.bindings) >= ipwardenv1.MaxClaimBindings {
				refuse(ipwardenv1.ClaimReasonInternalError, fmt.Sprintf("pool %s records %d IPAMClaims, its most", v.pool, ipwardenv1.MaxClaimBindings))
				continue
			}
			a, code, reason := s.pickClaimAddress(p, v, u)
			if reason != "" {
				if code == "" {
					continue // waits (an in-flight fill holds the address, or the pool settles)
				}
				refuse(code, reason)
				continue
			}
			b = &claimBinding{addr: a, key: key}
			if p.bindings == nil {
				p.bindings = map[string]*claimBinding{}
			}
			p.bindings[u.UID] = b
			p.dirty = true
			if !held.Contains(a) {
				out.granted = out.granted.Union(addr.SetOfAddrs(a))
			}
			out.mustSync = true
			grant(a, false)
			continue
		}
		a := b.addr
		if v.releasing.Contains(a) {
			continue // leaving the node: granted again once its spec no longer releases it
		}
		if held.Contains(a) {
			out.mustSync = out.mustSync || !b.durable
			grant(a, p.shared[u.UID] != nil)
			continue
		}
		holders := s.holdersOf(v.pool, addr.SetOfAddrs(a), v.node)
		switch len(holders) {
		case 0:
			if p.alloc.Allocated().Contains(a) {
				continue // reserved by an in-flight fill of another node: wait
			}
			if p.alloc.Reserve(addr.SetOfAddrs(a)) != nil {
				continue
			}
			out.granted = out.granted.Union(addr.SetOfAddrs(a))
			out.mustSync = out.mustSync || !b.durable
			grant(a, false)
		case 1:
			x := sortedKeys(holders)[0]
			xUses := p.usesOf(u.UID)[x]
			att, attached := attachedUse(xUses)
			g := p.shared[u.UID]
			switch {
			case g != nil && g.names(v.node) && g.names(x):
				// The grant is recorded (a fill that did not land, or landed unseen): grant again.
				out.shared = out.shared.Union(addr.SetOfAddrs(a))
				out.mustSync = out.mustSync || !g.durable || !b.durable
				grant(a, true)
			case !attached:
				// X holds it but its pods no longer use it: X is asked to give it back
				// (wantedElsewhere) and the use waits.
				out.asked = append(out.asked, x)
			case g == nil && (u.MigrationTarget || att.MigrationTarget) && len(p.shared) >= maxShared:
				refuse(ipwardenv1.ClaimReasonInternalError, fmt.Sprintf("pool %s has %d live migrations in progress, its most", v.pool, maxShared))
			case g == nil && (u.MigrationTarget || att.MigrationTarget):
				if p.shared == nil {
					p.shared = map[string]*sharedGrant{}
				}
				p.shared[u.UID] = &sharedGrant{addr: a, nodes: [2]string{x, v.node}}
				p.dirty = true
				out.shared = out.shared.Union(addr.SetOfAddrs(a))
				out.mustSync = true
				grant(a, true)
			default:
				refuse(refusedAttached, fmt.Sprintf("IPAMClaim %s is attached on node %s", key, x))
			}
		default:
			refuse(refusedAttached, fmt.Sprintf("IPAMClaim %s is attached on nodes %s and %s", key, sortedKeys(holders)[0], sortedKeys(holders)[1]))
		}
	}
	slices.SortFunc(out.refused, func(a, b ipwardenv1.ClaimRefusal) int { return cmp.Compare(a.UID, b.UID) })
	if len(out.refused) > 256 { // the API's MaxItems
		out.refused = out.refused[:256]
	}
	return out
}

// pickClaimAddress chooses the address of a claim with no binding yet: the one the use (or the
// claim's status.ips) asks for, else a free one. A refusal has a code; a reason without a code
// means the use waits.
func (s *State) pickClaimAddress(p *poolState, v claimsView, u ipwardenv1.ClaimUse) (a netip.Addr, code, reason string) {
	key := ClaimKey{u.Namespace, u.Name}
	var ask netip.Addr
	if u.Address != "" {
		ask, _ = netip.ParseAddr(string(u.Address))
	} else if c, ok := s.claims[key]; ok {
		for _, ip := range c.IPs {
			if ip.Is6() == p.cfg.Is6 {
				ask = ip
				break
			}
		}
	}
	if ask.IsValid() && v.releasing.Contains(ask) {
		return netip.Addr{}, "", "the node still releases it"
	}
	if ask.IsValid() {
		conflict := func(why string) (netip.Addr, string, string) {
			return netip.Addr{}, ipwardenv1.ClaimReasonAddressConflict, fmt.Sprintf("IPAMClaim %s asks for %s, which %s", key, ask, why)
		}
		if !p.cfg.Addresses.Contains(ask) {
			return conflict("pool " + v.pool + " does not hand out")
		}
		if other, b := p.boundTo(ask); b != nil && other != u.UID {
			return conflict("is bound to IPAMClaim " + b.key.String())
		}
		if holders := s.holdersOf(v.pool, addr.SetOfAddrs(ask), v.node); len(holders) > 0 {
			return conflict("node " + sortedKeys(holders)[0] + " holds")
		}
		if v.held.Contains(ask) {
			return ask, "", ""
		}
		if p.alloc.Allocated().Contains(ask) {
			return netip.Addr{}, "", "reserved by a fill in flight"
		}
		if p.alloc.Reserve(addr.SetOfAddrs(ask)) != nil {
			return netip.Addr{}, "", "reserved by a fill in flight"
		}
		return ask, "", ""
	}
	if v.settling != "" {
		return netip.Addr{}, "", v.settling
	}
	withheld := p.alloc.Usable(v.now).Intersect(v.releasing.Union(p.claimedByOthers(v.node)).Union(p.wantedByOthers(v.node)).Union(p.boundAddrs()))
	if !withheld.IsEmpty() {
		_ = p.alloc.Reserve(withheld)
		defer func() { _ = p.alloc.Unreserve(withheld) }()
	}
	got, err := p.alloc.Allocate(1, v.held, v.now)
	if err != nil || got.IsEmpty() {
		return netip.Addr{}, ipwardenv1.ClaimReasonSubnetExhausted, fmt.Sprintf("pool %s has no free address for IPAMClaim %s", v.pool, key)
	}
	return got.Addrs(1)[0], "", ""
}

// adoptAttached binds the address of an attached use whose claim has no binding in the pool
// (a record lost to a restore): when the node holds it and no other claim is bound to it.
func (s *State) adoptAttached(p *poolState, node string, u ipwardenv1.ClaimUse, held addr.Set) {
	if p.bindings[u.UID] != nil || !s.ClaimKnown(ClaimKey{u.Namespace, u.Name}, u.UID) {
		return
	}
	a, err := netip.ParseAddr(string(u.Address))
	if err != nil || !held.Contains(a) {
		return
	}
	if other, _ := p.boundTo(a); other != "" {
		return
	}
	if p.bindings == nil {
		p.bindings = map[string]*claimBinding{}
	}
	p.bindings[u.UID] = &claimBinding{addr: a, key: ClaimKey{u.Namespace, u.Name}}
	p.dirty = true
}

// claimWantedElsewhere is what node name holds in pool that it must list in wantedElsewhere for
// claims: a claim address another node waits for while no attachment here uses it, and every
// address under a shared grant naming it (whichever side goes first gives its copy back).
func (s *State) claimWantedElsewhere(name, pool string, held addr.Set) addr.Set {
	p := s.pool(pool)
	var out addr.Set
	for uid, b := range p.bindings {
		if !held.Contains(b.addr) {
			continue
		}
		if g := p.shared[uid]; g != nil && g.names(name) {
			out = out.Union(addr.SetOfAddrs(b.addr))
			continue
		}
		uses := p.usesOf(uid)
		if _, attached := attachedUse(uses[name]); attached {
			continue
		}
		for node, us := range uses {
			if node == name {
				continue
			}
			for _, u := range us {
				if !u.Attached {
					out = out.Union(addr.SetOfAddrs(b.addr))
				}
			}
		}
	}
	return out
}

// keepShared splits the addresses node name releases in pool into those it gives back for good
// and those another node still holds under a shared grant: those leave the node without cooling
// and without returning to the pool (dropped).
func (s *State) keepShared(name, pool string, removed addr.Set) (dropped addr.Set) {
	p := s.pool(pool)
	for _, g := range p.shared {
		if !g.names(name) || !removed.Contains(g.addr) {
			continue
		}
		if s.othersHave(pool, addr.SetOfAddrs(g.addr), name).Contains(g.addr) {
			dropped = dropped.Union(addr.SetOfAddrs(g.addr))
		}
	}
	return dropped
}

// endShared drops the shared grants of pool that name node and address set (the node gave its
// copy back), and those naming node whose address it neither holds nor awaits.
func (s *State) endShared(node, pool string, gone addr.Set) {
	p, ok := s.pools[pool]
	if !ok {
		return
	}
	n := s.nodes[node]
	for uid, g := range p.shared {
		if !g.names(node) {
			continue
		}
		has := n != nil && (n.held[pool].Contains(g.addr) || n.pending[pool].Contains(g.addr) || n.inflight[pool].Contains(g.addr))
		if gone.Contains(g.addr) || !has {
			delete(p.shared, uid)
			p.dirty = true
		}
	}
}

// ReleaseClaims drops the bindings of every claim absent from listed (a fresh LIST of every
// IPAMClaim's UID) that no node's spec uses, and returns them by pool. The addresses become
// ordinary wherever they are.
func (s *State) ReleaseClaims(listed map[string]bool) map[string][]string {
	out := map[string][]string{}
	used := s.usedClaims()
	for _, pool := range sortedKeys(s.pools) {
		p := s.pools[pool]
		for _, uid := range sortedKeys(p.bindings) {
			if listed[uid] || used[uid] {
				continue
			}
			delete(p.bindings, uid)
			delete(p.shared, uid)
			p.dirty = true
			out[pool] = append(out[pool], uid)
		}
	}
	return out
}

// ReleaseCandidates says whether some binding's claim the informer does not know is used by no
// node: a fresh LIST may release it.
func (s *State) ReleaseCandidates() bool {
	var used map[string]bool
	for _, p := range s.pools {
		for uid, b := range p.bindings {
			if s.ClaimKnown(b.key, uid) {
				continue
			}
			if used == nil {
				used = s.usedClaims()
			}
			if !used[uid] {
				return true
			}
		}
	}
	return false
}

// usedClaims is the UID of every claim some node's spec lists a use of.
func (s *State) usedClaims() map[string]bool {
	out := map[string]bool{}
	for _, p := range s.pools {
		for _, uses := range p.uses {
			for _, u := range uses {
				out[u.UID] = true
			}
		}
	}
	return out
}

// HasBindings says whether any pool records a claim binding.
func (s *State) HasBindings() bool {
	for _, p := range s.pools {
		if len(p.bindings) > 0 {
			return true
		}
	}
	return false
}

// ClaimCounts is a pool's number of bindings and of shared grants (metrics).
func (s *State) ClaimCounts(pool string) (bindings, shared int) {
	p, ok := s.pools[pool]
	if !ok {
		return 0, 0
	}
	return len(p.bindings), len(p.shared)
}

// ClaimIPs is the claim's addresses across pools, in its status form (the pool's prefix length),
// sorted; only durable bindings count.
func (s *State) ClaimIPs(uid string) []string {
	var out []string
	for _, pool := range sortedKeys(s.pools) {
		p := s.pools[pool]
		b := p.bindings[uid]
		if b == nil || !b.durable {
			continue
		}
		bits := b.addr.BitLen()
		for _, c := range p.cfg.CIDRs {
			if c.Contains(b.addr) {
				bits = c.Bits()
				break
			}
		}
		out = append(out, ipamclaim.FormatIP(b.addr, bits))
	}
	slices.Sort(out)
	return out
}

// ClaimOwner is the pod the claim's status names: prefer (the pod of the last answer to a
// waiting use) while a node still lists that pod's use; else the migration target among the
// attached uses; else an attached use's pod; else "".
func (s *State) ClaimOwner(uid, prefer string) string {
	var attached, target string
	preferred := false
	for _, pool := range sortedKeys(s.pools) {
		for _, node := range sortedKeys(s.pools[pool].uses) {
			for _, u := range s.pools[pool].uses[node] {
				if u.UID == uid && u.Pod == prefer {
					preferred = true
				}
				if u.UID != uid || !u.Attached || u.Pod == "" {
					continue
				}
				if u.MigrationTarget {
					target = u.Pod
				}
				attached = u.Pod
			}
		}
	}
	if !preferred {
		prefer = "" // that pod no longer uses the claim (a restart): the one that does owns it
	}
	return cmp.Or(prefer, target, attached)
}

// sharedHeld is the part of set that another node already holds in pool under a shared grant
// naming both it and node.
func (s *State) sharedHeld(p *poolState, pool, node string, set addr.Set) addr.Set {
	var out addr.Set
	if len(p.shared) == 0 {
		return out
	}
	for _, g := range p.shared {
		if !set.Contains(g.addr) || !g.names(node) {
			continue
		}
		if s.othersHave(pool, addr.SetOfAddrs(g.addr), node).Contains(g.addr) {
			out = out.Union(addr.SetOfAddrs(g.addr))
		}
	}
	return out
}

// othersHave is the part of set that a node other than except holds, may hold (a write with no
// answer) or is being granted by a fill in flight, in pool: a shared address any of them has
// stays allocated when except gives its copy back.
func (s *State) othersHave(pool string, set addr.Set, except string) addr.Set {
	var out addr.Set
	for name, n := range s.nodes {
		if name == except {
			continue
		}
		out = out.Union(n.held[pool].Union(n.pending[pool]).Union(n.inflight[pool]).Intersect(set))
	}
	return out
}

// boundElsewhere names another pool of p's network and family that records claim uid ("" none).
func (s *State) boundElsewhere(p *poolState, uid string) string {
	for _, name := range sortedKeys(s.pools) {
		q := s.pools[name]
		if q != p && q.bindings[uid] != nil && q.cfg.Network == p.cfg.Network && q.cfg.Is6 == p.cfg.Is6 {
			return name
		}
	}
	return ""
}

// maxShared is the API's maxItems of an IPPool's status.shared.
const maxShared = 1024

// clip cuts s to at most n bytes, marking the cut.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n-3] + "..."
}

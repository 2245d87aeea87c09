package ipam

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// VM addresses (docs/design.md, "VM addresses (IPAMClaim)"): an attachment whose pod references
// an IPAMClaim gets the address its pool's status.ipamClaims binds to the claim's UID, exactly
// as a static address (static.go): taken when held and unused, else waited for while the node
// lists the claim (spec.pools[].ipamClaims) and the controller records and grants it. Without a
// binding the ADD waits too; it never falls back to an ordinary address. Bound addresses are
// journaled with the pool's settings (Pool.Claims), kept out of ordinary ADDs and out of other
// claims' ADDs, and given back only when another node asks for them (wantedElsewhere) and no
// attachment uses them. The one exception to "one address, one attachment": an attachment of the
// same claim UID whose pod, or the holder's, is a live migration's target shares the address
// (two attachments at most, poolState.second); a DEL of one leaves it with the other.

// ClaimRef is the IPAMClaim an attachment's pod references, as the agent read it at ADD.
type ClaimRef struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	// UID is the claim's metadata.uid: its identity.
	UID string `json:"uid"`
	// MigrationTarget: the pod carries the label kubevirt.io/migrationJobUID.
	MigrationTarget bool `json:"migrationTarget,omitempty"`
}

// String returns "namespace/name".
func (c ClaimRef) String() string { return c.Namespace + "/" + c.Name }

// ClaimBinding is one entry of a pool's status.ipamClaims: the address bound to a claim UID.
type ClaimBinding struct {
	Namespace string     `json:"namespace"`
	Name      string     `json:"name"`
	UID       string     `json:"uid"`
	Addr      netip.Addr `json:"addr"`
}

// ClaimUse is one entry of the node's spec.pools[].ipamClaims: a claim an attachment on the node
// uses (Attached, Addr its address) or a waiting ADD asks an address for (Addr the address the
// claim's status.ips names in the pool, if any, else the bound one it waits for).
type ClaimUse struct {
	Claim    ClaimRef
	Pod      string
	Addr     netip.Addr
	Attached bool
}

// MaxClaimUses bounds spec.pools[].ipamClaims (the API's maxItems).
const MaxClaimUses = 256

// ClaimWait is a claim ADD's wait in one pool: for the binding (Bound false) or for the node to
// hold the bound address Addr.
type ClaimWait struct {
	Pool  string
	Claim ClaimRef
	Pod   string
	Addr  netip.Addr
	Bound bool
}

// ClaimError is an ADD of a claim's attachment that cannot be served now (CNI code 11: the
// runtime retries): the claim cannot be read, the controller refused it, or its address is in
// use by an attachment it may not be shared with. Nothing was handed out.
type ClaimError struct{ Msg string }

func (e *ClaimError) Error() string { return e.Msg }

// claimBound is every address pool binds to a claim.
func (s *State) claimBound(pool string) addr.Set {
	p := s.pools[pool]
	if p == nil || len(p.claims) == 0 {
		return addr.Set{}
	}
	as := make([]netip.Addr, 0, len(p.claims))
	for _, b := range p.claims {
		as = append(as, b.Addr)
	}
	return addr.SetOfAddrs(as...)
}

// claimWanted is the addresses of pool that the node's waiting claim ADDs wait to hold: never
// given back, even when another node asks for them (a shared grant lists the address on both).
func (s *State) claimWanted(pool string) addr.Set {
	var as []netip.Addr
	for _, w := range s.waiters {
		for _, c := range w.claims {
			if c.Pool == pool && c.Bound {
				as = append(as, c.Addr)
			}
		}
	}
	return addr.SetOfAddrs(as...)
}

// ClaimBindingOf returns the address pool binds to the claim uid.
func (s *State) ClaimBindingOf(pool, uid string) (netip.Addr, bool) {
	p := s.pools[pool]
	if p == nil {
		return netip.Addr{}, false
	}
	b, ok := p.claims[uid]
	return b.Addr, ok
}

// SetClaimRefused records the claims (by UID) the controller refuses the node, per pool, with
// its reasons (status.pools[].claimRefused).
func (s *State) SetClaimRefused(refused map[string]map[string]string) { s.claimRefused = refused }

// MayShare decides whether an ADD of claim c may take address a, which the attachment holder
// (of claim held, nil when it has none) uses: the holder is of the same claim UID, one of the two
// pods is a live migration's target, and no third attachment uses it (third). The reason names
// what stands in the way when it may not.
func MayShare(c ClaimRef, held *ClaimRef, third bool) (bool, string) {
	switch {
	case held == nil:
		return false, "an attachment that references no IPAMClaim"
	case held.UID != c.UID:
		return false, fmt.Sprintf("an attachment of IPAMClaim %s (uid %s)", held, held.UID)
	case third:
		return false, "two attachments of the claim already (a live migration's source and target)"
	case !c.MigrationTarget && !held.MigrationTarget:
		return false, "another pod of the claim, and neither pod is a live migration's target (label kubevirt.io/migrationJobUID)"
	}
	return true, ""
}

// claimPick decides a claim ADD's address in pool: the bound address to take (share: it stays
// with its holder too), a wait, or an error. ips are the addresses the claim's status.ips names.
func (s *State) claimPick(req AddRequest, name string) (pick netip.Addr, share bool, wait *ClaimWait, err error) {
	c := *req.Meta.Claim
	p := s.pools[name]
	b, bound := p.claims[c.UID]
	if !bound {
		if reason, ok := s.claimRefused[name][c.UID]; ok {
			return netip.Addr{}, false, nil, &ClaimError{Msg: fmt.Sprintf("IPAMClaim %s: %s", c, reason)}
		}
		w := &ClaimWait{Pool: name, Claim: c, Pod: req.Pod.Name}
		for _, a := range req.Meta.ClaimIPs {
			if slices.ContainsFunc(p.cfg.CIDRs, func(pr netip.Prefix) bool { return pr.Contains(a) }) {
				w.Addr = a
				break
			}
		}
		return netip.Addr{}, false, w, nil
	}
	a := b.Addr
	if k, used := p.inUse[a]; used && k != req.Key {
		holder := s.atts[k]
		if s.pending[k] != nil {
			// Its ADD or DEL is being written: decide once it landed.
			return netip.Addr{}, false, nil, &InFlightError{Key: k}
		}
		var held *ClaimRef
		who := k.String()
		if holder != nil {
			held = holder.Claim
			if holder.Pod.String() != "" {
				who = "pod " + holder.Pod.String()
			}
		}
		_, third := p.second[a]
		if ok, why := MayShare(c, held, third); !ok {
			return netip.Addr{}, false, nil, &ClaimError{Msg: fmt.Sprintf("IPAMClaim %s's address %s is in use on node %s by %s (%s)", c, a, s.node, who, why)}
		}
		if k2, ok := p.second[a]; ok && s.pending[k2] != nil {
			return netip.Addr{}, false, nil, &InFlightError{Key: k2}
		}
		return a, true, nil, nil
	}
	if p.lost.Contains(a) {
		return netip.Addr{}, false, nil, &ClaimError{Msg: fmt.Sprintf("IPAMClaim %s's address %s of pool %s is recorded on node %s as possibly in use by a sandbox "+
			"the journal does not name (an older agent's reservation ahead); it stays out of use", c, a, name, s.node)}
	}
	_, rel := p.releasing[a]
	if rel || !p.heldKnown || !p.held.Contains(a) || p.unattributed.Contains(a) || s.prevAll.Contains(a) || s.recordMissing {
		if reason, ok := s.claimRefused[name][c.UID]; ok && !(p.heldKnown && p.held.Contains(a)) {
			return netip.Addr{}, false, nil, &ClaimError{Msg: fmt.Sprintf("IPAMClaim %s's address %s of pool %s cannot move to node %s: %s", c, a, name, s.node, reason)}
		}
		return netip.Addr{}, false, &ClaimWait{Pool: name, Claim: c, Pod: req.Pod.Name, Addr: a, Bound: true}, nil
	}
	return a, false, nil, nil
}

// Holders returns the attachments that use address a of pool: none, one, or two (a claim's
// address during a live migration).
func (s *State) Holders(pool string, a netip.Addr) []Key {
	p := s.pools[pool]
	if p == nil {
		return nil
	}
	var out []Key
	if k, ok := p.inUse[a]; ok {
		out = append(out, k)
	}
	if k, ok := p.second[a]; ok {
		out = append(out, k)
	}
	return out
}

// claimUses lists pool's entries of spec.pools[].ipamClaims: every attachment with a claim (with
// its address) and every waiting claim ADD, sorted, at most MaxClaimUses.
func (s *State) claimUses(pool string) []ClaimUse {
	var out []ClaimUse
	for _, a := range s.atts {
		if a.Claim == nil {
			continue
		}
		for _, ad := range a.Addresses {
			if ad.Pool == pool {
				out = append(out, ClaimUse{Claim: *a.Claim, Pod: a.Pod.Name, Addr: ad.Addr, Attached: true})
			}
		}
	}
	for _, w := range s.waiters {
		for _, c := range w.claims {
			if c.Pool == pool {
				out = append(out, ClaimUse{Claim: c.Claim, Pod: c.Pod, Addr: c.Addr})
			}
		}
	}
	slices.SortFunc(out, func(a, b ClaimUse) int {
		return cmp.Or(cmp.Compare(a.Claim.Namespace, b.Claim.Namespace), cmp.Compare(a.Claim.Name, b.Claim.Name),
			cmp.Compare(a.Claim.UID, b.Claim.UID), -cmpBool(a.Attached, b.Attached), cmp.Compare(a.Pod, b.Pod), a.Addr.Compare(b.Addr))
	})
	out = slices.CompactFunc(out, func(a, b ClaimUse) bool { return a == b })
	if len(out) > MaxClaimUses {
		out = out[:MaxClaimUses]
	}
	return out
}

func cmpBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	}
	return -1
}

// ClaimStats counts the attachments bound to claims and the addresses two of them share.
type ClaimStats struct {
	Attachments int
	Shared      int
}

// ClaimCounts returns the node's ClaimStats.
func (s *State) ClaimCounts() ClaimStats {
	var st ClaimStats
	for _, a := range s.atts {
		if a.Claim != nil {
			st.Attachments++
		}
	}
	for _, p := range s.pools {
		st.Shared += len(p.second)
	}
	return st
}

// ClaimWaitMessage says what a claim ADD waits for in one pool.
func ClaimWaitMessage(c ClaimWait) string {
	if !c.Bound {
		return fmt.Sprintf("waiting for IPAMClaim %s's address to be recorded (pool %s)", c.Claim, c.Pool)
	}
	return fmt.Sprintf("waiting for IPAMClaim %s's address %s of pool %s to be granted to the node", c.Claim, c.Addr, c.Pool)
}

func uidOf(c *ClaimRef) string {
	if c == nil {
		return ""
	}
	return c.UID
}

// claimOf returns the binding of address a in the pool, if a claim's.
func (p *poolState) claimOf(a netip.Addr) (ClaimBinding, bool) {
	for _, b := range p.claims {
		if b.Addr == a {
			return b, true
		}
	}
	return ClaimBinding{}, false
}

// sharedWith reports whether another attachment than k uses a (a live migration's other side).
func (p *poolState) sharedWith(a netip.Addr, k Key) bool {
	k2, ok := p.second[a]
	return ok && (k2 == k || p.inUse[a] == k)
}

// unshare takes k off a shared address a and reports whether it was shared: the other
// attachment keeps it.
func (p *poolState) unshare(a netip.Addr, k Key) bool {
	k2, ok := p.second[a]
	if !ok {
		return false
	}
	switch {
	case k2 == k:
		delete(p.second, a)
	case p.inUse[a] == k:
		p.inUse[a] = k2
		delete(p.second, a)
	default:
		return false
	}
	return true
}

// EarlierClaim returns the IPAMClaim of the pod's attachment on ifname (its earlier sandbox's),
// nil when it has none: an ADD whose pod cannot be read serves the same claim.
func (s *State) EarlierClaim(uid, ifname string) *ClaimRef {
	for _, k := range s.PodAttachments(uid) {
		if a := s.atts[k]; a != nil && k.IfName == ifname && a.Claim != nil {
			c := *a.Claim
			return &c
		}
	}
	return nil
}

// claimAsked is the addresses of pool that the node's waiting claim ADDs ask for: the bound
// address they wait to hold, or, before the binding, the one their claim's status.ips names. The
// controller binds the named address when this node holds it, and the binding reaches the agent
// after the grant or not at all before an ordinary ADD picks: the named address must not go to
// that ADD meanwhile (TestSim seed 17235105627894350811 once handed it out so).
func (s *State) claimAsked(pool string) addr.Set {
	var as []netip.Addr
	for _, w := range s.waiters {
		for _, c := range w.claims {
			if c.Pool == pool && c.Addr.IsValid() {
				as = append(as, c.Addr)
			}
		}
	}
	return addr.SetOfAddrs(as...)
}

// unboundClaimWaits reports whether a claim ADD waits in pool for its binding.
func (s *State) unboundClaimWaits(pool string) bool {
	for _, w := range s.waiters {
		for _, c := range w.claims {
			if c.Pool == pool && !c.Bound {
				return true
			}
		}
	}
	return false
}

// claimHeldBack is what pool holds back for claims that wait for their binding: the addresses
// its holding gained since one started waiting. The binding (the IPPool's status) and the grant
// (the NodeIPAllocation's) reach the agent through two watches in no set order: a grant seen
// first must not go to an ordinary ADD. Once no claim waits for a binding here, they are
// ordinary again.
func (s *State) claimHeldBack(pool string) addr.Set {
	p := s.pools[pool]
	if p == nil || p.claimHeld.IsEmpty() {
		return addr.Set{}
	}
	if !s.unboundClaimWaits(pool) {
		p.claimHeld = addr.Set{}
		return addr.Set{}
	}
	return p.claimHeld
}

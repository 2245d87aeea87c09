package check

import (
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strings"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// VM addresses (docs/design.md, "VM addresses (IPAMClaim)"): an address bound to an IPAMClaim
// (IPPool status.ipamClaims) may be held by two nodes, or used by two running pods or two
// attachments, only for a live migration of that claim: two nodes under a shared grant
// (status.shared) naming both. Everything else is flagged.
const (
	// ClaimOverShared: a claim's address held by more than two nodes, or used by more than two
	// running pods or attachments.
	ClaimOverShared = "ClaimOverShared"
	// ClaimAddressTwice: one address bound to two claims.
	ClaimAddressTwice = "ClaimAddressTwice"
	// ClaimAddressMisused: a claim's address on an attachment of another claim, or of none
	// (seen only where the agent reports each attachment's claim).
	ClaimAddressMisused = "ClaimAddressMisused"
	// ClaimBindingOrphan: a binding whose claim is gone while no node lists a use of it (the
	// controller releases it after its next list of the claims). Checked only when the snapshot
	// has the claims.
	ClaimBindingOrphan = "ClaimBindingOrphan"
)

// ClaimRef is one IPAMClaim in the snapshot.
type ClaimRef struct {
	Namespace, Name, UID string
}

// claimBound is an address bound to a claim, by network.
type claimBound struct {
	pool, uid, name string
	shared          []string // the nodes of its shared grant, if any
}

// claimIndex reads the pools' bindings: network -> address -> binding. It reports addresses bound
// to two claims.
func claimIndex(in Input, network map[string]string, add func(Finding)) map[string]map[netip.Addr]claimBound {
	out := map[string]map[netip.Addr]claimBound{}
	pools := slices.Clone(in.Pools)
	sort.Slice(pools, func(i, j int) bool { return pools[i].Name < pools[j].Name })
	for _, p := range pools {
		net := network[p.Name]
		if out[net] == nil {
			out[net] = map[netip.Addr]claimBound{}
		}
		shared := map[string][]string{}
		for _, g := range p.Status.Shared {
			shared[g.UID] = g.Nodes
		}
		for _, b := range p.Status.IPAMClaims {
			a, err := netip.ParseAddr(string(b.Address))
			if err != nil {
				continue
			}
			cb := claimBound{pool: p.Name, uid: b.UID, name: b.Namespace + "/" + b.Name, shared: shared[b.UID]}
			if prev, ok := out[net][a]; ok && prev.uid != b.UID {
				add(Finding{Kind: ClaimAddressTwice, Addresses: a.String(), Pool: p.Name,
					Detail: fmt.Sprintf("bound to IPAMClaim %s (uid %s, pool %s) and IPAMClaim %s (uid %s)", prev.name, prev.uid, prev.pool, cb.name, cb.uid)})
				continue
			}
			out[net][a] = cb
		}
	}
	return out
}

// sharedHeld says whether the addresses dup, which node holds while others in owners hold them
// too, are each bound to a claim whose shared grant names node and every other holder.
func sharedHeld(bound map[netip.Addr]claimBound, owners []ownedSet, node string, dup addr.Set) bool {
	for _, a := range dup.Addrs(1024) {
		b, ok := bound[a]
		if !ok || !slices.Contains(b.shared, node) {
			return false
		}
		for _, o := range owners {
			if o.set.Contains(a) && !slices.Contains(b.shared, o.node) {
				return false
			}
		}
	}
	return dup.NumRanges() > 0 && count(dup) <= 1024
}

func count(s addr.Set) int {
	n, ok := s.Size().Uint64()
	if !ok || n > 1<<31 {
		return 1 << 31
	}
	return int(n)
}

// claimChecks flags a claim's address held by more than two nodes and bindings whose claim is
// gone while no node uses it.
func claimChecks(in Input, bound map[string]map[netip.Addr]claimBound, owner map[string][]ownedSet, add func(Finding)) {
	for _, net := range sortedNets(bound) {
		addrs := make([]netip.Addr, 0, len(bound[net]))
		for a := range bound[net] {
			addrs = append(addrs, a)
		}
		slices.SortFunc(addrs, func(a, b netip.Addr) int { return a.Compare(b) })
		for _, a := range addrs {
			var nodes []string
			for _, o := range owner[net] {
				if o.set.Contains(a) && !slices.Contains(nodes, o.node) {
					nodes = append(nodes, o.node)
				}
			}
			if len(nodes) > 2 {
				b := bound[net][a]
				add(Finding{Kind: ClaimOverShared, Addresses: a.String(), Nodes: nodes, Pool: b.pool,
					Detail: fmt.Sprintf("IPAMClaim %s's address is held by %d nodes; a live migration shares it between two", b.name, len(nodes))})
			}
		}
	}
	if in.Claims == nil {
		return
	}
	live := map[string]bool{}
	for _, c := range in.Claims {
		live[c.UID] = true
	}
	used := map[string]bool{}
	for _, a := range in.Allocs {
		for _, req := range a.Spec.Pools {
			for _, u := range req.IPAMClaims {
				used[u.UID] = true
			}
		}
	}
	for _, p := range in.Pools {
		for _, b := range p.Status.IPAMClaims {
			if !live[b.UID] && !used[b.UID] {
				add(Finding{Kind: ClaimBindingOrphan, Addresses: string(b.Address), Pool: p.Name,
					Detail: fmt.Sprintf("bound to IPAMClaim %s/%s (uid %s), which is gone, and no node lists a use of it: the controller releases it after its next list of the claims", b.Namespace, b.Name, b.UID)})
			}
		}
	}
}

// claimPair says whether the running pods or attachments sharing address a may: it is bound to
// a claim and they are two at most (the migration's source and target).
func claimPair(bound map[string]map[netip.Addr]claimBound, net string, a netip.Addr, users int) bool {
	_, ok := bound[net][a]
	return ok && users <= 2
}

func sortedNets[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// misused flags an attachment that uses a claim's address for another claim, or for none, when
// the agent says which claim each attachment uses (Attachment.Claims set).
func misused(bound map[string]map[netip.Addr]claimBound, net string, at Attachment, on addr.Set, node, who string, add func(Finding)) {
	if at.Claims == nil {
		return
	}
	var bad []string
	for _, a := range on.Addrs(1024) {
		b, ok := bound[net][a]
		if ok && !slices.Contains(at.Claims, b.uid) {
			bad = append(bad, fmt.Sprintf("%s (IPAMClaim %s)", a, b.name))
		}
	}
	if len(bad) > 0 {
		add(Finding{Kind: ClaimAddressMisused, Addresses: strings.Join(bad, ", "), Nodes: []string{node}, Pod: who,
			Detail: "a claim's address on an attachment that does not reference the claim"})
	}
}

// isBound says whether a is a claim's address on any network.
func isBound(bound map[string]map[netip.Addr]claimBound, a netip.Addr) bool {
	return podNetwork(bound, a) != "\x00"
}

func isBoundOn(bound map[string]map[netip.Addr]claimBound, net string, a netip.Addr) bool {
	_, ok := bound[net][a]
	return ok
}

// podNetwork is the network on which a running pod's address a is bound to a claim ("\x00":
// none). A pod's addresses are not labelled with their network; a claim address is taken to be
// on the network that binds it.
func podNetwork(bound map[string]map[netip.Addr]claimBound, a netip.Addr) string {
	for _, net := range sortedNets(bound) {
		if _, ok := bound[net][a]; ok {
			return net
		}
	}
	return "\x00"
}

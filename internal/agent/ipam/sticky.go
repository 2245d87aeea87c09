package ipam

import (
	"net/netip"
	"slices"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/sticky"
)

// Sticky StatefulSet addresses (docs/design.md, "Sticky StatefulSet addresses"): a pod with a
// StatefulSet identity that opted in (ipwarden.io/sticky, or a pool with spec.sticky) gets the
// address its pool's status.sticky reserves for the identity, exactly as a static address
// (static.go): taken when held and unused, else wanted from the controller, which moves it here
// once the node that held it gave it back (after the old pod's attachment is gone). Reserved
// addresses are never handed to another pod. The node reports the addresses its sticky pods use
// that the record lacks (spec.pools[].sticky); the controller records them.

// StickyUse is an address a sticky pod on the node uses, or one a pool reserves for an identity.
type StickyUse struct {
	Identity sticky.Identity `json:"identity"`
	Addr     netip.Addr      `json:"addr"`
}

// stickyFor returns the address pool reserves for the pod in meta, if it is sticky there.
func (s *State) stickyFor(meta PodMeta, pool string) (netip.Addr, bool) {
	if meta.Identity.StatefulSet == "" || meta.Identity.Ordinal < 0 {
		return netip.Addr{}, false
	}
	p := s.pools[pool]
	if p == nil || !(meta.Sticky || p.cfg.Sticky) {
		return netip.Addr{}, false
	}
	a, ok := p.reserved[meta.Identity]
	return a, ok
}

// stickyReserved is every address pool reserves for an identity.
func (s *State) stickyReserved(pool string) addr.Set {
	var as []netip.Addr
	if p := s.pools[pool]; p != nil {
		for _, a := range p.reserved {
			as = append(as, a)
		}
	}
	return addr.SetOfAddrs(as...)
}

// stickyUses lists the addresses of pool that the node's sticky pods use and the record lacks.
func (s *State) stickyUses(pool string) []StickyUse {
	var out []StickyUse
	p := s.pools[pool]
	if p == nil {
		return nil
	}
	for _, pod := range s.pods {
		id := pod.Identity
		if id.StatefulSet == "" || id.Ordinal < 0 || !(pod.Sticky || p.cfg.Sticky) || pod.Ref.UID == "" {
			continue
		}
		if _, has := p.reserved[id]; has {
			continue
		}
		for _, k := range s.PodAttachments(pod.Ref.UID) {
			if s.pending[k] != nil {
				continue
			}
			for _, a := range s.atts[k].Addresses {
				if a.Pool == pool && p.held.Contains(a.Addr) {
					out = append(out, StickyUse{Identity: id, Addr: a.Addr})
				}
			}
		}
	}
	slices.SortFunc(out, func(a, b StickyUse) int { return a.Addr.Compare(b.Addr) })
	return out
}

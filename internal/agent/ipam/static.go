package ipam

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// Static addresses (docs/design.md, "Static addresses"): a pod's ipwarden.io/ip-addresses
// annotation names at most one address per family, each inside one of the pools the pod draws
// from. The node asks the controller for one it does not hold (spec.pools[].wanted); the
// controller moves it into the node's holding when no other node holds it, or says why not
// (status.pools[].refused). An address in use by another attachment is never taken.

// SourceStatic is where static addresses come from, for errors.
const SourceStatic = "pod annotation ipwarden.io/ip-addresses"

// StaticUnavailableError says that a pod's static address is in use or refused by the
// controller right now (CNI code 11: the runtime retries). Nothing was handed out.
type StaticUnavailableError struct{ Msg string }

func (e *StaticUnavailableError) Error() string { return SourceStatic + ": " + e.Msg }

// ParseStaticAddresses reads an ipwarden.io/ip-addresses annotation: comma-separated addresses,
// at most one IPv4 and one IPv6.
func ParseStaticAddresses(s string) ([]netip.Addr, error) {
	parts := strings.Split(s, ",")
	if len(parts) > 2 {
		return nil, fmt.Errorf("names %d addresses; at most one IPv4 and one IPv6 address", len(parts))
	}
	var out []netip.Addr
	for _, p := range parts {
		p = strings.TrimSpace(p)
		a, err := netip.ParseAddr(p)
		if err != nil || a.Zone() != "" || a.Is4In6() {
			return nil, fmt.Errorf("%q is not an IP address: write one address per family, such as \"10.0.5.20\" or \"10.0.5.20,fd00:5::20\"", trunc(p))
		}
		if slices.ContainsFunc(out, func(b netip.Addr) bool { return b.Is4() == a.Is4() }) {
			return nil, fmt.Errorf("names two addresses of one family; at most one IPv4 and one IPv6 address")
		}
		out = append(out, a)
	}
	return out, nil
}

// staticPicks maps each of the pod's static addresses to the one of pools (already chosen, one
// per family) of its family, checking that the pool hands it out. No annotation: nil.
func (s *State) staticPicks(meta PodMeta, pools []string) (map[string]netip.Addr, error) {
	if strings.TrimSpace(meta.IPAddresses) == "" {
		return nil, nil
	}
	as, err := ParseStaticAddresses(meta.IPAddresses)
	if err != nil {
		return nil, &PoolChoiceError{Source: SourceStatic, Msg: err.Error()}
	}
	out := map[string]netip.Addr{}
	for _, a := range as {
		var pool string
		for _, n := range pools {
			if p := s.pools[n]; p != nil && p.cfg.Is4() == a.Is4() {
				pool = n
				break
			}
		}
		if pool == "" {
			return nil, &PoolChoiceError{Source: SourceStatic, Msg: fmt.Sprintf("address %s is outside every pool the pod may use: none of %s is of its family",
				a, strings.Join(pools, ", "))}
		}
		p := s.pools[pool]
		if !slices.ContainsFunc(p.cfg.CIDRs, func(c netip.Prefix) bool { return c.Contains(a) }) {
			return nil, &PoolChoiceError{Source: SourceStatic, Msg: fmt.Sprintf("address %s is outside every pool the pod may use (pool %s has %s)",
				a, pool, prefixes(p.cfg.CIDRs))}
		}
		if !p.isUsable(a) {
			return nil, &PoolChoiceError{Source: SourceStatic, Msg: fmt.Sprintf(
				"address %s is excluded from pool %s (spec.exclude, its gateway, or a network or broadcast address)", a, pool)}
		}
		out[pool] = a
	}
	return out, nil
}

func prefixes(ps []netip.Prefix) string {
	ss := make([]string, len(ps))
	for i, p := range ps {
		ss[i] = p.String()
	}
	return strings.Join(ss, ", ")
}

// wanted returns the addresses of pool that the node's pods ask for by name and do not use yet:
// those of pods bound to the node without an address of the pool, and of waiting ADDs. They are
// never handed out to another pod nor given back, and the node asks for those it lacks.
func (s *State) wanted(pool string) addr.Set {
	var as []netip.Addr
	for _, pod := range s.pods {
		if (pod.IPAddresses == "" && pod.Identity.StatefulSet == "") || !pod.NeedsAddress() || pod.Ref.UID == "" || s.podHolds(pod.Ref.UID, pool) {
			continue
		}
		meta := s.podMeta(pod)
		if a, ok := s.stickyFor(meta, pool); ok {
			as = append(as, a)
			continue
		}
		names, err := s.choosePools(meta, nil, pod.Ref.Namespace, "")
		if err != nil || !slices.Contains(names, pool) {
			continue
		}
		if picks, err := s.staticPicks(meta, names); err == nil {
			if a, ok := picks[pool]; ok {
				as = append(as, a)
			}
		}
	}
	for _, w := range s.waiters {
		for _, a := range w.static {
			if a.Pool == pool {
				as = append(as, a.Addr)
			}
		}
	}
	return addr.SetOfAddrs(as...)
}

// SetWantedElsewhere records the held addresses that pods on other nodes ask for by name
// (status.pools[].wantedElsewhere): they are never handed out here, and Release gives back
// those no attachment uses.
func (s *State) SetWantedElsewhere(m map[string]addr.Set) { s.elsewhere = m }

// reserved is what pool must not hand out to an ordinary ADD: static addresses wanted here or
// elsewhere, sticky reservations, addresses bound to IPAMClaims or asked for by a waiting claim
// ADD (claim.go).
func (s *State) reserved(pool string) addr.Set {
	return s.wanted(pool).Union(s.elsewhere[pool]).Union(s.stickyReserved(pool)).Union(s.prevAll).Union(s.claimBound(pool)).
		Union(s.claimHeldBack(pool)).Union(s.claimAsked(pool))
}

// SetRefused records the wanted addresses the controller refused, per pool, with its reasons
// (status.pools[].refused).
func (s *State) SetRefused(refused map[string]map[netip.Addr]string) { s.refused = refused }

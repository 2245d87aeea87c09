package controller

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/sticky"
)

// Sticky StatefulSet addresses (docs/design.md, "Sticky StatefulSet addresses"): the controller
// keeps the record, in each pool's status.sticky, of the address reserved for each pod identity.
// Agents report the addresses their sticky pods use (spec.pools[].sticky); the controller
// records one when the reporting node holds it and neither the identity nor the address is
// reserved otherwise. The record is dropped when sticky.Keep says so. The pool status write that
// carries it is fenced like every status write.

// stickyOf reads a status or spec entry.
func stickyOf(e ipwardenv1.StickyAddress) (sticky.Identity, netip.Addr, bool) {
	a, err := netip.ParseAddr(string(e.Address))
	if err != nil || e.Namespace == "" || e.StatefulSet == "" || e.Ordinal < 0 {
		return sticky.Identity{}, netip.Addr{}, false
	}
	return sticky.Identity{Namespace: e.Namespace, StatefulSet: e.StatefulSet, Ordinal: int(e.Ordinal)}, a, true
}

// restoreSticky loads a pool's record from its status.
func (p *poolState) restoreSticky(st []ipwardenv1.StickyAddress) {
	p.sticky = map[sticky.Identity]netip.Addr{}
	for _, e := range st {
		if id, a, ok := stickyOf(e); ok {
			p.sticky[id] = a
		}
	}
}

// stsKey names a StatefulSet.
type stsKey struct{ namespace, name string }

// recordSticky records the sticky addresses node name reports, where it holds them, unless the
// last view of the identity's StatefulSet says sticky.Keep would return it: a node reports its
// pod's address until the pod's attachment is gone, which outlives the StatefulSet's deletion or
// scale-down, and a record made then would never be returned (no StatefulSet event follows a
// deletion). A StatefulSet not seen yet does not block the record.
func (s *State) recordSticky(name string, spec ipwardenv1.NodeIPAllocationSpec) {
	n := s.node(name)
	for _, req := range spec.Pools {
		if len(req.Sticky) == 0 {
			continue
		}
		p := s.pool(req.Pool)
		if p.sticky == nil {
			p.sticky = map[sticky.Identity]netip.Addr{}
		}
		for _, e := range req.Sticky {
			id, a, ok := stickyOf(e)
			if !ok || !n.held[req.Pool].Contains(a) {
				continue
			}
			if _, has := p.sticky[id]; has {
				continue
			}
			if view, seen := s.statefulSets[stsKey{id.Namespace, id.StatefulSet}]; seen {
				if keep, _ := sticky.Keep(id, view); !keep {
					continue
				}
			}
			if len(p.sticky) >= ipwardenv1.MaxStickyReservations {
				// The status holds no more (its maxItems): the pod keeps an ordinary address,
				// and the pool's StickyFull condition says so.
				continue
			}
			taken := false
			for _, b := range p.sticky {
				taken = taken || b == a
			}
			if !taken {
				p.sticky[id] = a
				p.dirty = true
			}
		}
	}
}

// ReturnSticky drops the reservations of the StatefulSet namespace/name that sticky.Keep no
// longer keeps, and reports whether any pool changed. It remembers sts as the StatefulSet's
// last view for recordSticky (a deleted one until a StatefulSet of that name appears again).
func (s *State) ReturnSticky(namespace, name string, sts sticky.StatefulSet) bool {
	if s.statefulSets == nil {
		s.statefulSets = map[stsKey]sticky.StatefulSet{}
	}
	s.statefulSets[stsKey{namespace, name}] = sts
	changed := false
	for _, p := range s.pools {
		for id := range p.sticky {
			if id.Namespace != namespace || id.StatefulSet != name {
				continue
			}
			if keep, _ := sticky.Keep(id, sts); !keep {
				delete(p.sticky, id)
				p.dirty = true
				changed = true
			}
		}
	}
	return changed
}

// stickyStatus is the pool's record for its status, sorted.
func (p *poolState) stickyStatus() []ipwardenv1.StickyAddress {
	out := make([]ipwardenv1.StickyAddress, 0, len(p.sticky))
	for id, a := range p.sticky {
		out = append(out, ipwardenv1.StickyAddress{Address: ipwardenv1.IPAddress(a.String()), Namespace: id.Namespace,
			StatefulSet: id.StatefulSet, Ordinal: int32(id.Ordinal)})
	}
	slices.SortFunc(out, func(a, b ipwardenv1.StickyAddress) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.StatefulSet, b.StatefulSet), cmp.Compare(a.Ordinal, b.Ordinal))
	})
	if len(out) > ipwardenv1.MaxStickyReservations { // recordSticky never gets here
		out = out[:ipwardenv1.MaxStickyReservations]
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

// StickyCondition is a pool's StickyFull condition for n reservations: True from 90 % of
// MaxStickyReservations on, so an operator hears of it before new StatefulSet pods stop keeping
// their addresses.
func StickyCondition(n int, gen int64) metav1.Condition {
	limit := ipwardenv1.MaxStickyReservations
	c := metav1.Condition{Type: ipwardenv1.ConditionStickyFull, Status: metav1.ConditionFalse, Reason: "Room",
		Message: fmt.Sprintf("%d of %d sticky reservations", n, limit), ObservedGeneration: gen}
	switch {
	case n >= limit:
		c.Status, c.Reason = metav1.ConditionTrue, "Full"
		c.Message = fmt.Sprintf("%d of %d sticky reservations: new StatefulSet pods get ordinary addresses that do not follow them; turn sticky off for some StatefulSets or move them to another pool", n, limit)
	case n >= limit*9/10:
		c.Status, c.Reason = metav1.ConditionTrue, "NearlyFull"
		c.Message = fmt.Sprintf("%d of %d sticky reservations: at %d, new StatefulSet pods get ordinary addresses; turn sticky off for some StatefulSets or move them to another pool", n, limit, limit)
	}
	return c
}

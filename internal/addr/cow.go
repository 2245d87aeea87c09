package addr

import (
	"slices"
	"sync/atomic"
)

// cowSet is a Set that its holder (the Allocator) may update in place for
// as long as no one else can see its storage. Handing the Set out (view)
// gives up ownership; the next update then copies, as Set operations do.
// This turns the common "add or remove one small block" update of a large
// set into a binary search plus a memmove, without allocating.
//
// owned is atomic so that read-only Allocator methods, which call view,
// may run concurrently with each other.
type cowSet struct {
	s     Set
	owned atomic.Bool // s.rs is referenced only by this cowSet
}

// inPlaceMax is the most ranges an update may have to be applied in place;
// larger updates use a merge, which is linear anyway.
const inPlaceMax = 8

// view returns the set for use outside the holder, giving up ownership.
func (c *cowSet) view() Set {
	if c.owned.Load() {
		c.owned.Store(false)
	}
	return c.s
}

// clone returns a copy sharing storage; neither may update it in place.
func (c *cowSet) clone() *cowSet {
	c.owned.Store(false)
	return &cowSet{s: c.s}
}

// replace sets the value to r, computed by a Set operation from the current
// value and others. r may be one of its inputs, so it is owned only if it
// is fresh storage or the (owned) current value itself.
func (c *cowSet) replace(r Set, others ...Set) {
	switch {
	case len(r.rs) == 0:
		c.s = Set{}
		c.owned.Store(false)
		return
	case sameStorage(r, c.s):
		// Unchanged ownership.
	default:
		owned := true
		for _, o := range others {
			if sameStorage(r, o) {
				owned = false
			}
		}
		c.owned.Store(owned)
	}
	c.s = r
}

func sameStorage(a, b Set) bool {
	return len(a.rs) > 0 && len(b.rs) > 0 && &a.rs[0] == &b.rs[0]
}

// add unites p into the value.
func (c *cowSet) add(p Set) {
	if len(p.rs) == 0 {
		return
	}
	if !c.owned.Load() || len(p.rs) > inPlaceMax {
		c.replace(c.s.Union(p), p)
		return
	}
	for i, g := range p.rs {
		c.s = c.s.insertInPlace(g, i < p.n4)
	}
}

// remove subtracts p from the value.
func (c *cowSet) remove(p Set) {
	if len(p.rs) == 0 || len(c.s.rs) == 0 {
		return
	}
	if !c.owned.Load() || len(p.rs) > inPlaceMax {
		c.replace(c.s.Subtract(p), p)
		return
	}
	for i, g := range p.rs {
		c.s = c.s.removeInPlace(g, i < p.n4)
	}
	if len(c.s.rs) == 0 {
		c.s = Set{}
		c.owned.Store(false)
	}
}

// segment returns the bounds of family is4's part of s.rs.
func (s Set) segment(is4 bool) (lo, hi int) {
	if is4 {
		return 0, s.n4
	}
	return s.n4, len(s.rs)
}

// insertInPlace adds g (of family is4) to s, overwriting s's storage.
func (s Set) insertInPlace(g rng, is4 bool) Set {
	lo, hi := s.segment(is4)
	seg := s.rs[lo:hi]
	i := 0 // first range that touches g or follows it
	if !g.lo.isZero() {
		i = seekHi(seg, 0, g.lo.sub1())
	}
	j := i // first range after i that neither touches nor overlaps g
	for j < len(seg) && (g.hi == maxU128 || seg[j].lo.lessEq(g.hi.add1())) {
		j++
	}
	m := g
	if i < j {
		if seg[i].lo.less(m.lo) {
			m.lo = seg[i].lo
		}
		if m.hi.less(seg[j-1].hi) {
			m.hi = seg[j-1].hi
		}
	}
	s.rs = slices.Replace(s.rs, lo+i, lo+j, m)
	if is4 {
		s.n4 += 1 - (j - i)
	}
	return s
}

// removeInPlace removes g (of family is4) from s, overwriting s's storage.
func (s Set) removeInPlace(g rng, is4 bool) Set {
	lo, hi := s.segment(is4)
	seg := s.rs[lo:hi]
	i := seekHi(seg, 0, g.lo) // first range ending at or after g.lo
	j := i
	for j < len(seg) && seg[j].lo.lessEq(g.hi) {
		j++
	}
	if i == j {
		return s
	}
	var pieces [2]rng
	n := 0
	if seg[i].lo.less(g.lo) {
		pieces[n] = rng{seg[i].lo, g.lo.sub1()}
		n++
	}
	if g.hi.less(seg[j-1].hi) {
		pieces[n] = rng{g.hi.add1(), seg[j-1].hi}
		n++
	}
	s.rs = slices.Replace(s.rs, lo+i, lo+j, pieces[:n]...)
	if is4 {
		s.n4 += n - (j - i)
	}
	return s
}

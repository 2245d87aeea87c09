package addr

import (
	"net/netip"
	"slices"
	"strings"
)

// Set is a set of IPv4 and/or IPv6 addresses, stored as a sorted list of
// non-overlapping, non-adjacent ranges (see the package documentation).
// The zero value is the empty set.
//
// Sets are values: no method modifies its receiver or its arguments, and
// results may share storage with them, so Sets can be copied and shared
// freely, including between goroutines.
type Set struct {
	// rs holds the IPv4 ranges (rs[:n4]) followed by the IPv6 ranges
	// (rs[n4:]), each part sorted, non-overlapping and non-adjacent.
	rs []rng
	n4 int
}

func (s Set) v4() []rng { return s.rs[:s.n4] }
func (s Set) v6() []rng { return s.rs[s.n4:] }

func (s Set) fam(is4 bool) []rng {
	if is4 {
		return s.v4()
	}
	return s.v6()
}

// NewSet returns the set of addresses covered by rs. Ranges may overlap and
// come in any order. Invalid ranges (see Range.IsValid), including the zero
// Range, are ignored.
func NewSet(rs ...Range) Set {
	v4 := make([]rng, 0, len(rs))
	var v6 []rng
	for _, r := range rs {
		g, is4, ok := r.toRng()
		if !ok {
			continue
		}
		if is4 {
			v4 = append(v4, g)
		} else {
			v6 = append(v6, g)
		}
	}
	return fromUnsorted(v4, v6)
}

// fromUnsorted builds a Set from unsorted, possibly overlapping ranges. It
// reuses v4's storage.
func fromUnsorted(v4, v6 []rng) Set {
	v4 = normalize(v4)
	v6 = normalize(v6)
	if len(v6) == 0 {
		return Set{rs: trim(v4), n4: len(v4)}
	}
	if len(v4) == 0 {
		return Set{rs: trim(v6)}
	}
	rs := make([]rng, 0, len(v4)+len(v6))
	rs = append(append(rs, v4...), v6...)
	return Set{rs: rs, n4: len(v4)}
}

// SetOfPrefixes returns the set of addresses covered by ps. Host bits are
// ignored and invalid prefixes are skipped.
func SetOfPrefixes(ps ...netip.Prefix) Set {
	rs := make([]Range, 0, len(ps))
	for _, p := range ps {
		rs = append(rs, PrefixRange(p))
	}
	return NewSet(rs...)
}

// SetOfAddrs returns the set holding as. Zones are dropped and invalid
// addresses skipped.
func SetOfAddrs(as ...netip.Addr) Set {
	rs := make([]Range, 0, len(as))
	for _, a := range as {
		rs = append(rs, AddrRange(a))
	}
	return NewSet(rs...)
}

// Ranges returns the canonical ranges of s (IPv4 first, then IPv6, each in
// ascending order) in a new slice.
func (s Set) Ranges() []Range {
	if len(s.rs) == 0 {
		return nil
	}
	out := make([]Range, len(s.rs))
	for i, g := range s.rs {
		out[i] = g.toRange(i < s.n4)
	}
	return out
}

// NumRanges returns the number of canonical ranges in s.
func (s Set) NumRanges() int { return len(s.rs) }

// IsEmpty reports whether s holds no address.
func (s Set) IsEmpty() bool { return len(s.rs) == 0 }

// Is4 reports whether s is non-empty and holds only IPv4 addresses.
func (s Set) Is4() bool { return len(s.rs) > 0 && s.n4 == len(s.rs) }

// Is6 reports whether s is non-empty and holds only IPv6 addresses.
func (s Set) Is6() bool { return len(s.rs) > 0 && s.n4 == 0 }

// Size returns the number of addresses in s, saturating at MaxCount.
func (s Set) Size() Count {
	var total u128
	for _, g := range s.rs {
		var over bool
		total, over = total.add(g.size())
		if over {
			return MaxCount
		}
	}
	return countOf(total)
}

// Contains reports whether a is in s, in O(log n) for n ranges. A zone on
// a is ignored.
func (s Set) Contains(a netip.Addr) bool {
	if !a.IsValid() {
		return false
	}
	v, is4 := key(a)
	rs := s.fam(is4)
	i := seekHi(rs, 0, v)
	return i < len(rs) && rs[i].lo.lessEq(v)
}

// ContainsRange reports whether every address of r is in s. It is false for
// an invalid r.
func (s Set) ContainsRange(r Range) bool {
	g, is4, ok := r.toRng()
	if !ok {
		return false
	}
	rs := s.fam(is4)
	i := seekHi(rs, 0, g.lo)
	return i < len(rs) && rs[i].lo.lessEq(g.lo) && g.hi.lessEq(rs[i].hi)
}

// ContainsSet reports whether o is a subset of s.
func (s Set) ContainsSet(o Set) bool {
	return containsAll(s.v4(), o.v4()) && containsAll(s.v6(), o.v6())
}

// Overlaps reports whether s and o have an address in common.
func (s Set) Overlaps(o Set) bool {
	return overlaps(s.v4(), o.v4()) || overlaps(s.v6(), o.v6())
}

// Equal reports whether s and o hold the same addresses.
func (s Set) Equal(o Set) bool {
	return s.n4 == o.n4 && slices.Equal(s.rs, o.rs)
}

// Union returns the addresses in s or o.
func (s Set) Union(o Set) Set {
	if len(o.rs) == 0 {
		return s
	}
	if len(s.rs) == 0 {
		return o
	}
	dst := make([]rng, 0, len(s.rs)+len(o.rs))
	dst = union(dst, s.v4(), o.v4())
	n4 := len(dst)
	dst = union(dst, s.v6(), o.v6())
	return Set{rs: trim(dst), n4: n4}
}

// Intersect returns the addresses in both s and o.
func (s Set) Intersect(o Set) Set {
	if len(s.rs) == 0 || len(o.rs) == 0 {
		return Set{}
	}
	dst := make([]rng, 0, len(s.rs)+len(o.rs))
	dst = intersect(dst, s.v4(), o.v4())
	n4 := len(dst)
	dst = intersect(dst, s.v6(), o.v6())
	return Set{rs: trim(dst), n4: n4}
}

// Subtract returns the addresses in s but not in o.
func (s Set) Subtract(o Set) Set {
	if len(s.rs) == 0 || len(o.rs) == 0 {
		return s
	}
	dst := make([]rng, 0, len(s.rs)+len(o.rs))
	dst = subtract(dst, s.v4(), o.v4())
	n4 := len(dst)
	dst = subtract(dst, s.v6(), o.v6())
	return Set{rs: trim(dst), n4: n4}
}

// Addrs returns up to limit addresses of s, lowest first (IPv4 before
// IPv6). It is meant for small sets; limit <= 0 returns nil.
func (s Set) Addrs(limit int) []netip.Addr {
	if limit <= 0 || len(s.rs) == 0 {
		return nil
	}
	if n, ok := s.Size().Uint64(); ok && n < uint64(limit) {
		limit = int(n)
	}
	out := make([]netip.Addr, 0, min(limit, 1<<12))
	for i, g := range s.rs {
		is4 := i < s.n4
		for v := g.lo; ; v = v.add1() {
			if len(out) == limit {
				return out
			}
			out = append(out, addrOf(v, is4))
			if v == g.hi {
				break
			}
		}
	}
	return out
}

// First returns the set of the n lowest addresses of s (IPv4 before IPv6),
// or s itself if it holds n or fewer. n <= 0 returns the empty set.
func (s Set) First(n int) Set {
	if n <= 0 {
		return Set{}
	}
	left := u128{0, uint64(n)}
	for i, g := range s.rs {
		sz := g.size()
		if left.lessEq(sz) {
			if left == sz && i == len(s.rs)-1 {
				return s
			}
			out := make([]rng, i+1)
			copy(out, s.rs[:i+1])
			out[i].hi, _ = g.lo.add(left.sub1())
			return Set{rs: out, n4: min(s.n4, i+1)}
		}
		left = left.sub(sz)
	}
	return s
}

// Prefixes returns the minimal CIDR decomposition of s, range by range, in
// order. This is the set of routes that covers s exactly.
func (s Set) Prefixes() []netip.Prefix {
	var out []netip.Prefix
	for i, g := range s.rs {
		out = g.appendPrefixes(out, i < s.n4)
	}
	return out
}

// Strings returns the compact text form of s: one item per canonical range,
// formatted by Range.String. ParseSet(s.Strings()) returns s, unless s
// holds IPv4-mapped IPv6 addresses (::ffff:a.b.c.d), which only sets built
// from netip values can, and which ParseSet rejects.
func (s Set) Strings() []string {
	if len(s.rs) == 0 {
		return nil
	}
	out := make([]string, len(s.rs))
	var buf []byte
	for i, g := range s.rs {
		buf = g.appendText(buf[:0], i < s.n4)
		out[i] = string(buf)
	}
	return out
}

// String returns the items of Strings joined by commas ("" for the empty
// set). ParseSetString(s.String()) returns s.
func (s Set) String() string {
	var b strings.Builder
	var buf []byte
	for i, g := range s.rs {
		if i > 0 {
			b.WriteByte(',')
		}
		buf = g.appendText(buf[:0], i < s.n4)
		b.Write(buf)
	}
	return b.String()
}

// ---- single-family algorithms on canonical []rng ----

// touches reports whether a range starting at lo overlaps or is adjacent to
// a range ending at hi, given that it does not start before that range.
func touches(hi, lo u128) bool {
	return lo.isZero() || lo.sub1().lessEq(hi)
}

// trim drops excess capacity so that long-lived sets do not pin memory.
func trim(rs []rng) []rng {
	if cap(rs)-len(rs) <= 16 || cap(rs) <= 2*len(rs) {
		return rs
	}
	return slices.Clone(rs)
}

// normalize sorts rs by start and merges overlapping and adjacent ranges,
// in place.
func normalize(rs []rng) []rng {
	if len(rs) <= 1 {
		return rs
	}
	if !slices.IsSortedFunc(rs, cmpLo) {
		slices.SortFunc(rs, cmpLo)
	}
	out := rs[:1]
	for _, g := range rs[1:] {
		t := &out[len(out)-1]
		if touches(t.hi, g.lo) {
			if t.hi.less(g.hi) {
				t.hi = g.hi
			}
		} else {
			out = append(out, g)
		}
	}
	return out
}

func cmpLo(a, b rng) int { return a.lo.cmp(b.lo) }

// seekHi returns the first index k >= from with rs[k].hi >= v, or len(rs).
// It gallops, so a skip over d ranges costs O(log d).
func seekHi(rs []rng, from int, v u128) int {
	if from >= len(rs) || !rs[from].hi.less(v) {
		return from
	}
	lo, step := from, 1 // rs[lo].hi < v
	hi := lo + step
	for hi < len(rs) && rs[hi].hi.less(v) {
		lo = hi
		step <<= 1
		hi = lo + step
	}
	if hi > len(rs) {
		hi = len(rs)
	}
	// Answer in (lo, hi]; rs[hi].hi >= v if hi < len(rs).
	lo++
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if rs[m].hi.less(v) {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo
}

// appendMerge appends g to dst (whose part from start is the output being
// built), merging it into the last range if they touch. g must not start
// before the last range.
func appendMerge(dst []rng, start int, g rng) []rng {
	if n := len(dst); n > start {
		if t := &dst[n-1]; touches(t.hi, g.lo) {
			if t.hi.less(g.hi) {
				t.hi = g.hi
			}
			return dst
		}
	}
	return append(dst, g)
}

// appendRest appends the canonical ranges rest, all starting at or after
// the last output range, merging those that touch it.
func appendRest(dst []rng, start int, rest []rng) []rng {
	if len(rest) == 0 {
		return dst
	}
	if len(dst) > start {
		t := &dst[len(dst)-1]
		// Ranges ending within t are absorbed.
		k := seekHi(rest, 0, t.hi.add1())
		if t.hi == maxU128 {
			k = len(rest)
		}
		rest = rest[k:]
		if len(rest) > 0 && touches(t.hi, rest[0].lo) {
			t.hi = rest[0].hi
			rest = rest[1:]
		}
	}
	return append(dst, rest...)
}

// union appends the union of canonical a and b to dst.
func union(dst, a, b []rng) []rng {
	start := len(dst)
	i, j := 0, 0
	for i < len(a) && j < len(b) {
		if a[i].lo.less(b[j].lo) {
			a, b, i, j = b, a, j, i // make b[j] the lower one
		}
		// b[j] starts first. If it starts a new output range, copy the run
		// of b ranges that end before a[i] in bulk.
		if n := len(dst); !a[i].lo.isZero() && (n == start || !touches(dst[n-1].hi, b[j].lo)) {
			k := seekHi(b, j, a[i].lo.sub1())
			if k > j {
				dst = append(dst, b[j:k]...)
				j = k
				continue
			}
		}
		dst = appendMerge(dst, start, b[j])
		j++
	}
	if i < len(a) {
		return appendRest(dst, start, a[i:])
	}
	return appendRest(dst, start, b[j:])
}

// intersect appends the intersection of canonical a and b to dst.
func intersect(dst, a, b []rng) []rng {
	i, j := 0, 0
	for i < len(a) && j < len(b) {
		if a[i].hi.less(b[j].lo) {
			i = seekHi(a, i+1, b[j].lo)
			continue
		}
		if b[j].hi.less(a[i].lo) {
			j = seekHi(b, j+1, a[i].lo)
			continue
		}
		lo, hi := a[i].lo, a[i].hi
		if lo.less(b[j].lo) {
			lo = b[j].lo
		}
		if b[j].hi.less(hi) {
			hi = b[j].hi
		}
		dst = append(dst, rng{lo, hi})
		if a[i].hi.less(b[j].hi) {
			i++
		} else {
			j++
		}
	}
	return dst
}

// overlaps reports whether canonical a and b intersect.
func overlaps(a, b []rng) bool {
	i, j := 0, 0
	for i < len(a) && j < len(b) {
		switch {
		case a[i].hi.less(b[j].lo):
			i = seekHi(a, i+1, b[j].lo)
		case b[j].hi.less(a[i].lo):
			j = seekHi(b, j+1, a[i].lo)
		default:
			return true
		}
	}
	return false
}

// subtract appends a minus b (both canonical) to dst.
func subtract(dst, a, b []rng) []rng {
	i, j := 0, 0
	for i < len(a) {
		if j >= len(b) {
			return append(dst, a[i:]...)
		}
		if b[j].hi.less(a[i].lo) {
			j = seekHi(b, j+1, a[i].lo)
			continue
		}
		if a[i].hi.less(b[j].lo) {
			k := seekHi(a, i+1, b[j].lo)
			dst = append(dst, a[i:k]...)
			i = k
			continue
		}
		// a[i] and b[j] overlap.
		cur := a[i]
		i++
		for {
			if cur.lo.less(b[j].lo) {
				dst = append(dst, rng{cur.lo, b[j].lo.sub1()})
			}
			if cur.hi.lessEq(b[j].hi) {
				break // b[j] covers the rest of cur; it may reach a[i] too.
			}
			cur.lo = b[j].hi.add1()
			j++
			if j >= len(b) || cur.hi.less(b[j].lo) {
				dst = append(dst, cur)
				break
			}
		}
	}
	return dst
}

// containsAll reports whether canonical b is a subset of canonical a.
func containsAll(a, b []rng) bool {
	i := 0
	for _, g := range b {
		i = seekHi(a, i, g.lo)
		if i == len(a) || g.lo.less(a[i].lo) || a[i].hi.less(g.hi) {
			return false
		}
	}
	return true
}

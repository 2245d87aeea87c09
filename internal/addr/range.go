package addr

import (
	"errors"
	"fmt"
	"net/netip"
)

// Range is an inclusive range of addresses of one family, from First to
// Last. The zero value is invalid; see IsValid.
type Range struct{ First, Last netip.Addr }

// RangeOf returns the range [first, last]. It fails if either address is
// invalid or has a zone, if the families differ, or if first > last.
func RangeOf(first, last netip.Addr) (Range, error) {
	switch {
	case !first.IsValid() || !last.IsValid():
		return Range{}, errors.New("invalid address in range")
	case first.Zone() != "" || last.Zone() != "":
		return Range{}, fmt.Errorf("range %s-%s: zones are not allowed", first, last)
	case first.Is4() != last.Is4():
		return Range{}, fmt.Errorf("range %s-%s: mixes IPv4 and IPv6", first, last)
	case last.Less(first):
		return Range{}, fmt.Errorf("range %s-%s: first address after last", first, last)
	}
	return Range{first, last}, nil
}

// PrefixRange returns the range covered by p; host bits of p are ignored
// (p.Masked() is used). An invalid prefix yields the zero (invalid) Range.
func PrefixRange(p netip.Prefix) Range {
	if !p.IsValid() {
		return Range{}
	}
	p = p.Masked()
	lo, is4 := key(p.Addr())
	hi := lo.or(lowMask(famBits(is4) - p.Bits()))
	return Range{p.Addr(), addrOf(hi, is4)}
}

// AddrRange returns the range holding only a. A zone on a is dropped.
// An invalid a yields the zero (invalid) Range.
func AddrRange(a netip.Addr) Range {
	a = a.WithZone("")
	return Range{a, a}
}

// IsValid reports whether r is a well-formed range: both ends valid,
// without zones, of the same family, and First <= Last.
func (r Range) IsValid() bool {
	return r.First.IsValid() && r.Last.IsValid() &&
		r.First.Is4() == r.Last.Is4() &&
		r.First.Zone() == "" && r.Last.Zone() == "" &&
		!r.Last.Less(r.First)
}

// toRng converts a valid range to its numeric form.
func (r Range) toRng() (g rng, is4, ok bool) {
	if !r.IsValid() {
		return rng{}, false, false
	}
	lo, is4 := key(r.First)
	hi, _ := key(r.Last)
	return rng{lo, hi}, is4, true
}

// Contains reports whether a lies in r. A zone on a is ignored. It is false
// for an invalid r or a.
func (r Range) Contains(a netip.Addr) bool {
	if !a.IsValid() {
		return false
	}
	g, is4, ok := r.toRng()
	if !ok {
		return false
	}
	v, vis4 := key(a)
	return vis4 == is4 && g.lo.lessEq(v) && v.lessEq(g.hi)
}

// Is4 reports whether r is an IPv4 range.
func (r Range) Is4() bool { return r.First.Is4() }

// Size returns the number of addresses in r (0 for an invalid range). The
// whole IPv6 space saturates to MaxCount.
func (r Range) Size() Count {
	g, _, ok := r.toRng()
	if !ok {
		return Count{}
	}
	return countOf(g.size())
}

// String returns r as a prefix ("10.0.0.0/28") if it is exactly one aligned
// CIDR block of more than one address, as a single address ("10.0.0.5") if it
// holds one address, and as "first-last" otherwise.
func (r Range) String() string {
	g, is4, ok := r.toRng()
	if !ok {
		return "invalid Range"
	}
	return string(g.appendText(nil, is4))
}

// Prefixes returns the minimal list of CIDR prefixes that exactly cover r,
// in address order. It is nil for an invalid range.
func (r Range) Prefixes() []netip.Prefix {
	g, is4, ok := r.toRng()
	if !ok {
		return nil
	}
	return g.appendPrefixes(nil, is4)
}

// rng is the numeric form of a range of one (implied) family; lo <= hi.
type rng struct{ lo, hi u128 }

// size returns hi-lo+1, saturated to 2^128-1 for the full IPv6 space.
func (g rng) size() u128 {
	s := g.hi.sub(g.lo).add1()
	if s.isZero() {
		return maxU128
	}
	return s
}

func (g rng) toRange(is4 bool) Range {
	return Range{addrOf(g.lo, is4), addrOf(g.hi, is4)}
}

// firstBlock returns the log2 size of the largest aligned block that starts
// at lo and lies within [lo, hi].
func firstBlock(lo, hi u128, nbits int) int {
	k := min(lo.trailingZeros(), nbits)
	s := hi.sub(lo).add1() // size; zero means 2^128
	if !s.isZero() {
		k = min(k, s.floorLog2())
	}
	return k
}

// blocks calls f for each block of the minimal aligned decomposition of g,
// in address order, with the block's start and log2 size, until f returns
// false.
func (g rng) blocks(nbits int, f func(start u128, k int) bool) {
	lo := g.lo
	for {
		k := firstBlock(lo, g.hi, nbits)
		if !f(lo, k) {
			return
		}
		end := lo.or(lowMask(k))
		if end == g.hi {
			return
		}
		lo = end.add1()
	}
}

// numPrefixes returns the number of CIDR blocks needed to cover g.
func (g rng) numPrefixes(nbits int) int {
	n := 0
	g.blocks(nbits, func(u128, int) bool { n++; return true })
	return n
}

func (g rng) appendPrefixes(dst []netip.Prefix, is4 bool) []netip.Prefix {
	nbits := famBits(is4)
	g.blocks(nbits, func(start u128, k int) bool {
		dst = append(dst, netip.PrefixFrom(addrOf(start, is4), nbits-k))
		return true
	})
	return dst
}

// appendText appends the Range.String form of g.
func (g rng) appendText(b []byte, is4 bool) []byte {
	first := addrOf(g.lo, is4)
	if g.lo == g.hi {
		return first.AppendTo(b)
	}
	nbits := famBits(is4)
	if k := firstBlock(g.lo, g.hi, nbits); g.lo.or(lowMask(k)) == g.hi {
		return netip.PrefixFrom(first, nbits-k).AppendTo(b)
	}
	b = first.AppendTo(b)
	b = append(b, '-')
	return addrOf(g.hi, is4).AppendTo(b)
}

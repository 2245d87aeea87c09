package addr

import (
	"encoding/binary"
	"math"
	"math/bits"
	"net/netip"
)

// u128 is an unsigned 128-bit integer used for address arithmetic. An IPv4
// address is held in the low 32 bits, an IPv6 address uses all 128.
type u128 struct{ hi, lo uint64 }

// maxU128 is 2^128-1.
var maxU128 = u128{math.MaxUint64, math.MaxUint64}

// maxV4 is the largest IPv4 address as a u128.
var maxV4 = u128{0, math.MaxUint32}

func (a u128) isZero() bool       { return a.hi == 0 && a.lo == 0 }
func (a u128) less(b u128) bool   { return a.hi < b.hi || (a.hi == b.hi && a.lo < b.lo) }
func (a u128) lessEq(b u128) bool { return a.hi < b.hi || (a.hi == b.hi && a.lo <= b.lo) }

func (a u128) cmp(b u128) int {
	switch {
	case a.hi < b.hi:
		return -1
	case a.hi > b.hi:
		return 1
	case a.lo < b.lo:
		return -1
	case a.lo > b.lo:
		return 1
	}
	return 0
}

// add returns a+b and whether the sum overflowed 128 bits.
func (a u128) add(b u128) (u128, bool) {
	lo, c := bits.Add64(a.lo, b.lo, 0)
	hi, c := bits.Add64(a.hi, b.hi, c)
	return u128{hi, lo}, c != 0
}

// sub returns a-b modulo 2^128.
func (a u128) sub(b u128) u128 {
	lo, br := bits.Sub64(a.lo, b.lo, 0)
	hi, _ := bits.Sub64(a.hi, b.hi, br)
	return u128{hi, lo}
}

// add1 returns a+1 modulo 2^128.
func (a u128) add1() u128 {
	lo, c := bits.Add64(a.lo, 1, 0)
	return u128{a.hi + c, lo}
}

// sub1 returns a-1 modulo 2^128.
func (a u128) sub1() u128 {
	lo, br := bits.Sub64(a.lo, 1, 0)
	return u128{a.hi - br, lo}
}

// addU64 returns a+n modulo 2^128.
func (a u128) addU64(n uint64) u128 {
	lo, c := bits.Add64(a.lo, n, 0)
	return u128{a.hi + c, lo}
}

// trailingZeros returns the number of trailing zero bits; 128 for zero.
func (a u128) trailingZeros() int {
	if a.lo != 0 {
		return bits.TrailingZeros64(a.lo)
	}
	if a.hi != 0 {
		return 64 + bits.TrailingZeros64(a.hi)
	}
	return 128
}

// bitLen returns the minimum number of bits needed to represent a.
func (a u128) bitLen() int {
	if a.hi != 0 {
		return 64 + bits.Len64(a.hi)
	}
	return bits.Len64(a.lo)
}

// pow2 returns 2^k for 0 <= k < 128.
func pow2(k int) u128 {
	if k >= 64 {
		return u128{1 << uint(k-64), 0}
	}
	return u128{0, 1 << uint(k)}
}

// lowMask returns 2^k-1 for 0 <= k <= 128.
func lowMask(k int) u128 {
	switch {
	case k >= 128:
		return maxU128
	case k >= 64:
		return u128{1<<uint(k-64) - 1, math.MaxUint64}
	default:
		return u128{0, 1<<uint(k) - 1}
	}
}

func (a u128) or(b u128) u128 { return u128{a.hi | b.hi, a.lo | b.lo} }

// floorLog2 returns floor(log2(a)) for a > 0.
func (a u128) floorLog2() int { return a.bitLen() - 1 }

// key returns the numeric value of an address and whether it is IPv4.
// Zones are ignored. The address must be valid.
func key(a netip.Addr) (u128, bool) {
	if a.Is4() {
		b := a.As4()
		return u128{0, uint64(binary.BigEndian.Uint32(b[:]))}, true
	}
	b := a.As16()
	return u128{binary.BigEndian.Uint64(b[:8]), binary.BigEndian.Uint64(b[8:])}, false
}

// addrOf converts a numeric value back into an address of the given family.
func addrOf(v u128, is4 bool) netip.Addr {
	if is4 {
		var b [4]byte
		binary.BigEndian.PutUint32(b[:], uint32(v.lo))
		return netip.AddrFrom4(b)
	}
	var b [16]byte
	binary.BigEndian.PutUint64(b[:8], v.hi)
	binary.BigEndian.PutUint64(b[8:], v.lo)
	return netip.AddrFrom16(b)
}

// famBits returns the address length in bits for a family.
func famBits(is4 bool) int {
	if is4 {
		return 32
	}
	return 128
}

// famMax returns the largest address value of a family.
func famMax(is4 bool) u128 {
	if is4 {
		return maxV4
	}
	return maxU128
}

// Count is a number of addresses. It is an unsigned 128-bit integer (Hi is
// the high 64 bits, Lo the low 64 bits), large enough for any IPv6 range
// except the whole IPv6 space, whose 2^128 addresses saturate to MaxCount.
// Arithmetic saturates instead of wrapping. The zero value is 0.
type Count struct{ Hi, Lo uint64 }

// MaxCount is the largest representable Count, 2^128-1. Sizes that would
// exceed it (the whole IPv6 space, or that plus any IPv4 addresses) are
// reported as MaxCount.
var MaxCount = Count{math.MaxUint64, math.MaxUint64}

// CountOf returns n as a Count.
func CountOf(n uint64) Count { return Count{0, n} }

func (c Count) u() u128 { return u128{c.Hi, c.Lo} }

func countOf(v u128) Count { return Count{v.hi, v.lo} }

// Uint64 returns c as a uint64; ok is false if c does not fit.
func (c Count) Uint64() (n uint64, ok bool) {
	if c.Hi != 0 {
		return math.MaxUint64, false
	}
	return c.Lo, true
}

// Int64Sat returns c as an int64, saturating at math.MaxInt64. It is meant
// for API status fields.
func (c Count) Int64Sat() int64 {
	if c.Hi != 0 || c.Lo > math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(c.Lo)
}

// IsZero reports whether c is 0.
func (c Count) IsZero() bool { return c.Hi == 0 && c.Lo == 0 }

// Add returns c+d, saturating at MaxCount.
func (c Count) Add(d Count) Count {
	s, over := c.u().add(d.u())
	if over {
		return MaxCount
	}
	return countOf(s)
}

// Sub returns c-d, saturating at 0.
func (c Count) Sub(d Count) Count {
	if c.u().lessEq(d.u()) {
		return Count{}
	}
	return countOf(c.u().sub(d.u()))
}

// Cmp compares c and d and returns -1, 0 or +1.
func (c Count) Cmp(d Count) int { return c.u().cmp(d.u()) }

// String returns c in decimal.
func (c Count) String() string {
	if c.Hi == 0 {
		return uitoa(c.Lo)
	}
	// Split into base-10^19 chunks, least significant first.
	const base = 10000000000000000000 // 10^19
	var chunks []uint64
	hi, lo := c.Hi, c.Lo
	for hi != 0 || lo >= base {
		qhi := hi / base
		r := hi % base
		qlo, rem := bits.Div64(r, lo, base)
		chunks = append(chunks, rem)
		hi, lo = qhi, qlo
	}
	b := []byte(uitoa(lo))
	for i := len(chunks) - 1; i >= 0; i-- {
		s := uitoa(chunks[i])
		for range 19 - len(s) {
			b = append(b, '0')
		}
		b = append(b, s...)
	}
	return string(b)
}

func uitoa(n uint64) string {
	var buf [20]byte
	i := len(buf)
	for {
		i--
		buf[i] = byte('0' + n%10)
		n /= 10
		if n == 0 {
			break
		}
	}
	return string(buf[i:])
}

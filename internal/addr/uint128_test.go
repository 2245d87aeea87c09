package addr

import (
	"math"
	"math/big"
	"math/rand/v2"
	"testing"
)

func bigOf(c Count) *big.Int {
	b := new(big.Int).SetUint64(c.Hi)
	b.Lsh(b, 64)
	return b.Or(b, new(big.Int).SetUint64(c.Lo))
}

func TestCountBasics(t *testing.T) {
	if c := CountOf(42); c != cnt(0, 42) {
		t.Fatalf("CountOf(42) = %v", c)
	}
	for _, tc := range []struct {
		c    Count
		u    uint64
		ok   bool
		i64  int64
		text string
	}{
		{cnt(0, 0), 0, true, 0, "0"},
		{cnt(0, 1), 1, true, 1, "1"},
		{cnt(0, math.MaxInt64), math.MaxInt64, true, math.MaxInt64, "9223372036854775807"},
		{cnt(0, math.MaxInt64+1), math.MaxInt64 + 1, true, math.MaxInt64, "9223372036854775808"},
		{cnt(0, math.MaxUint64), math.MaxUint64, true, math.MaxInt64, "18446744073709551615"},
		{cnt(0, 1e19), 1e19, true, math.MaxInt64, "10000000000000000000"},
		{cnt(0, 1e19-1), 1e19 - 1, true, math.MaxInt64, "9999999999999999999"},
		{cnt(1, 0), math.MaxUint64, false, math.MaxInt64, "18446744073709551616"},
		{MaxCount, math.MaxUint64, false, math.MaxInt64, "340282366920938463463374607431768211455"},
	} {
		u, ok := tc.c.Uint64()
		if u != tc.u || ok != tc.ok {
			t.Errorf("%v.Uint64() = %d, %v; want %d, %v", tc.text, u, ok, tc.u, tc.ok)
		}
		if got := tc.c.Int64Sat(); got != tc.i64 {
			t.Errorf("%v.Int64Sat() = %d, want %d", tc.text, got, tc.i64)
		}
		if got := tc.c.String(); got != tc.text {
			t.Errorf("String() = %q, want %q", got, tc.text)
		}
		if tc.c.IsZero() != (tc.text == "0") {
			t.Errorf("%v.IsZero wrong", tc.text)
		}
	}
}

func TestCountArith(t *testing.T) {
	for _, tc := range []struct {
		a, b, sum, diff Count
		cmp             int
	}{
		{cnt(0, 1), cnt(0, 2), cnt(0, 3), cnt(0, 0), -1},
		{cnt(0, 5), cnt(0, 2), cnt(0, 7), cnt(0, 3), 1},
		{cnt(0, math.MaxUint64), cnt(0, 1), cnt(1, 0), cnt(0, math.MaxUint64-1), 1},
		{cnt(1, 0), cnt(0, 1), cnt(1, 1), cnt(0, math.MaxUint64), 1},
		{MaxCount, cnt(0, 1), MaxCount, cnt(math.MaxUint64, math.MaxUint64-1), 1},
		{MaxCount, MaxCount, MaxCount, cnt(0, 0), 0},
		{cnt(3, 0), cnt(3, 0), cnt(6, 0), cnt(0, 0), 0},
		{cnt(2, 7), cnt(3, 0), cnt(5, 7), cnt(0, 0), -1},
	} {
		if got := tc.a.Add(tc.b); got != tc.sum {
			t.Errorf("%v+%v = %v, want %v", tc.a, tc.b, got, tc.sum)
		}
		if got := tc.a.Sub(tc.b); got != tc.diff {
			t.Errorf("%v-%v = %v, want %v", tc.a, tc.b, got, tc.diff)
		}
		if got := tc.a.Cmp(tc.b); got != tc.cmp {
			t.Errorf("cmp(%v,%v) = %d, want %d", tc.a, tc.b, got, tc.cmp)
		}
	}
}

func TestCountAgainstBig(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	max := bigOf(MaxCount)
	gen := func() Count {
		switch r.IntN(4) {
		case 0:
			return cnt(0, r.Uint64N(1000))
		case 1:
			return cnt(0, r.Uint64())
		case 2:
			return cnt(r.Uint64N(3), r.Uint64())
		}
		return cnt(r.Uint64(), r.Uint64())
	}
	for range 5000 {
		a, b := gen(), gen()
		ba, bb := bigOf(a), bigOf(b)
		if a.String() != ba.String() {
			t.Fatalf("String(%v) = %s want %s", a, a.String(), ba)
		}
		sum := new(big.Int).Add(ba, bb)
		if sum.Cmp(max) > 0 {
			sum = max
		}
		if bigOf(a.Add(b)).Cmp(sum) != 0 {
			t.Fatalf("Add wrong for %v %v", a, b)
		}
		diff := new(big.Int).Sub(ba, bb)
		if diff.Sign() < 0 {
			diff.SetInt64(0)
		}
		if bigOf(a.Sub(b)).Cmp(diff) != 0 {
			t.Fatalf("Sub wrong for %v %v", a, b)
		}
		if a.Cmp(b) != ba.Cmp(bb) {
			t.Fatalf("Cmp wrong for %v %v", a, b)
		}
	}
}

func TestU128(t *testing.T) {
	if got := (u128{0, math.MaxUint64}).add1(); got != (u128{1, 0}) {
		t.Fatalf("add1 carry: %v", got)
	}
	if got := (u128{1, 0}).sub1(); got != (u128{0, math.MaxUint64}) {
		t.Fatalf("sub1 borrow: %v", got)
	}
	if got := maxU128.add1(); !got.isZero() {
		t.Fatalf("add1 wrap: %v", got)
	}
	if _, over := maxU128.add(u128{0, 1}); !over {
		t.Fatal("add overflow not reported")
	}
	for k := range 128 {
		p := pow2(k)
		if p.trailingZeros() != k || p.bitLen() != k+1 || p.floorLog2() != k {
			t.Fatalf("pow2(%d) = %v: tz %d len %d", k, p, p.trailingZeros(), p.bitLen())
		}
		if m := lowMask(k); m.add1() != p {
			t.Fatalf("lowMask(%d) = %v", k, m)
		}
	}
	if lowMask(128) != maxU128 || (u128{}).trailingZeros() != 128 {
		t.Fatal("edge values")
	}
	for _, s := range []string{"0.0.0.0", "255.255.255.255", "10.1.2.3", "::", "::1", "2001:db8::1", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", "::ffff:1.2.3.4"} {
		a := ip(s)
		v, is4 := key(a)
		if is4 != a.Is4() || addrOf(v, is4) != a {
			t.Errorf("key/addrOf round trip failed for %s", s)
		}
	}
}

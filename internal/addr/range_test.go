package addr

import (
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"
)

func TestRangeOf(t *testing.T) {
	for _, tc := range []struct {
		first, last netip.Addr
		err         string
	}{
		{ip("10.0.0.1"), ip("10.0.0.9"), ""},
		{ip("10.0.0.1"), ip("10.0.0.1"), ""},
		{ip("0.0.0.0"), ip("255.255.255.255"), ""},
		{ip("::"), ip("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"), ""},
		{ip("10.0.0.9"), ip("10.0.0.1"), "first address after last"},
		{ip("2001:db8::2"), ip("2001:db8::1"), "first address after last"},
		{ip("10.0.0.1"), ip("2001:db8::1"), "mixes IPv4 and IPv6"},
		{ip("::ffff:10.0.0.1"), ip("10.0.0.2"), "mixes IPv4 and IPv6"},
		{ip("fe80::1%eth0"), ip("fe80::2"), "zones are not allowed"},
		{netip.Addr{}, ip("10.0.0.1"), "invalid address"},
		{ip("10.0.0.1"), netip.Addr{}, "invalid address"},
	} {
		r, err := RangeOf(tc.first, tc.last)
		if tc.err == "" {
			if err != nil || r != (Range{tc.first, tc.last}) || !r.IsValid() {
				t.Errorf("RangeOf(%v, %v) = %v, %v", tc.first, tc.last, r, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.err) {
			t.Errorf("RangeOf(%v, %v) error = %v, want %q", tc.first, tc.last, err, tc.err)
		}
	}
}

func TestRangeIsValid(t *testing.T) {
	for _, tc := range []struct {
		r    Range
		want bool
	}{
		{Range{}, false},
		{rg("10.0.0.1", "10.0.0.1"), true},
		{rg("10.0.0.2", "10.0.0.1"), false},
		{Range{ip("10.0.0.1"), netip.Addr{}}, false},
		{Range{ip("10.0.0.1"), ip("::1")}, false},
		{Range{ip("fe80::1%eth0"), ip("fe80::2")}, false},
		{rg("::", "::"), true},
	} {
		if got := tc.r.IsValid(); got != tc.want {
			t.Errorf("%v.IsValid() = %v", tc.r, got)
		}
	}
}

func TestPrefixRange(t *testing.T) {
	for _, tc := range []struct {
		p           string
		first, last string
	}{
		{"10.0.0.0/8", "10.0.0.0", "10.255.255.255"},
		{"10.1.2.3/8", "10.0.0.0", "10.255.255.255"}, // masked
		{"0.0.0.0/0", "0.0.0.0", "255.255.255.255"},
		{"255.255.255.255/32", "255.255.255.255", "255.255.255.255"},
		{"10.0.0.16/28", "10.0.0.16", "10.0.0.31"},
		{"::/0", "::", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"},
		{"2001:db8::/64", "2001:db8::", "2001:db8::ffff:ffff:ffff:ffff"},
		{"2001:db8::1/128", "2001:db8::1", "2001:db8::1"},
		{"ffff:ffff:ffff:ffff:ffff:ffff:ffff:ff00/120", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ff00", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"},
	} {
		if got, want := PrefixRange(pfx(tc.p)), rg(tc.first, tc.last); got != want {
			t.Errorf("PrefixRange(%s) = %v, want %v", tc.p, got, want)
		}
	}
	if r := PrefixRange(netip.Prefix{}); r.IsValid() {
		t.Errorf("PrefixRange(invalid) = %v", r)
	}
}

func TestAddrRange(t *testing.T) {
	if r := AddrRange(ip("10.0.0.5")); r != rg("10.0.0.5", "10.0.0.5") {
		t.Errorf("AddrRange = %v", r)
	}
	if r := AddrRange(ip("fe80::1%eth0")); r != rg("fe80::1", "fe80::1") || !r.IsValid() {
		t.Errorf("AddrRange with zone = %v", r)
	}
	if r := AddrRange(netip.Addr{}); r.IsValid() || r != (Range{}) {
		t.Errorf("AddrRange(invalid) = %v", r)
	}
}

func TestRangeContains(t *testing.T) {
	r4 := rg("10.0.0.5", "10.0.0.9")
	r6 := rg("2001:db8::5", "2001:db8::9")
	full4 := rg("0.0.0.0", "255.255.255.255")
	full6 := PrefixRange(pfx("::/0"))
	for _, tc := range []struct {
		r    Range
		a    netip.Addr
		want bool
	}{
		{r4, ip("10.0.0.5"), true},
		{r4, ip("10.0.0.9"), true},
		{r4, ip("10.0.0.7"), true},
		{r4, ip("10.0.0.4"), false},
		{r4, ip("10.0.0.10"), false},
		{r4, ip("::ffff:10.0.0.7"), false},
		{r4, ip("2001:db8::7"), false},
		{r4, netip.Addr{}, false},
		{r6, ip("2001:db8::7"), true},
		{r6, ip("2001:db8::7%eth0"), true},
		{r6, ip("10.0.0.7"), false},
		{r6, ip("2001:db8::a"), false},
		{full4, ip("0.0.0.0"), true},
		{full4, ip("255.255.255.255"), true},
		{full4, ip("::"), false},
		{full6, ip("::"), true},
		{full6, ip("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"), true},
		{full6, ip("::ffff:1.2.3.4"), true},
		{full6, ip("1.2.3.4"), false},
		{Range{}, ip("1.2.3.4"), false},
		{rg("10.0.0.9", "10.0.0.1"), ip("10.0.0.5"), false},
	} {
		if got := tc.r.Contains(tc.a); got != tc.want {
			t.Errorf("%v.Contains(%v) = %v", tc.r, tc.a, got)
		}
	}
}

func TestRangeIs4(t *testing.T) {
	if !rg("10.0.0.1", "10.0.0.2").Is4() || rg("::1", "::2").Is4() || rg("::ffff:1.2.3.4", "::ffff:1.2.3.4").Is4() {
		t.Fatal("Is4 wrong")
	}
}

func TestRangeSize(t *testing.T) {
	for _, tc := range []struct {
		r    Range
		want Count
	}{
		{Range{}, cnt(0, 0)},
		{rg("10.0.0.5", "10.0.0.5"), cnt(0, 1)},
		{rg("10.0.0.5", "10.0.0.9"), cnt(0, 5)},
		{PrefixRange(pfx("10.0.0.0/8")), cnt(0, 1<<24)},
		{PrefixRange(pfx("0.0.0.0/0")), cnt(0, 1<<32)},
		{PrefixRange(pfx("2001:db8::/64")), cnt(1, 0)},
		{PrefixRange(pfx("2001:db8::/65")), cnt(0, 1<<63)},
		{PrefixRange(pfx("2001:db8::/32")), cnt(1<<32, 0)},
		{PrefixRange(pfx("::/1")), cnt(1<<63, 0)},
		{PrefixRange(pfx("::/0")), MaxCount},
		{rg("::1", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"), MaxCount},
		{rg("::", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe"), MaxCount},
		{rg("::", "::ffff:ffff:ffff:ffff"), cnt(1, 0)},
	} {
		if got := tc.r.Size(); got != tc.want {
			t.Errorf("%v.Size() = %v, want %v", tc.r, got, tc.want)
		}
	}
}

func TestRangeString(t *testing.T) {
	for _, tc := range []struct {
		r    Range
		want string
	}{
		{Range{}, "invalid Range"},
		{rg("10.0.0.5", "10.0.0.5"), "10.0.0.5"},
		{rg("10.0.0.0", "10.0.0.15"), "10.0.0.0/28"},
		{rg("10.0.0.5", "10.0.0.9"), "10.0.0.5-10.0.0.9"},
		{rg("10.0.0.4", "10.0.0.5"), "10.0.0.4/31"},
		{rg("10.0.0.5", "10.0.0.6"), "10.0.0.5-10.0.0.6"},
		{rg("10.0.0.0", "10.0.0.14"), "10.0.0.0-10.0.0.14"},
		{rg("0.0.0.0", "255.255.255.255"), "0.0.0.0/0"},
		{rg("0.0.0.0", "0.0.0.0"), "0.0.0.0"},
		{rg("255.255.255.255", "255.255.255.255"), "255.255.255.255"},
		{rg("128.0.0.0", "255.255.255.255"), "128.0.0.0/1"},
		{rg("0.0.0.1", "255.255.255.255"), "0.0.0.1-255.255.255.255"},
		{PrefixRange(pfx("::/0")), "::/0"},
		{PrefixRange(pfx("2001:db8::/64")), "2001:db8::/64"},
		{rg("2001:db8::5", "2001:db8::9"), "2001:db8::5-2001:db8::9"},
		{rg("::", "::"), "::"},
		{rg("::ffff:1.2.3.0", "::ffff:1.2.3.255"), "::ffff:1.2.3.0/120"},
	} {
		if got := tc.r.String(); got != tc.want {
			t.Errorf("String(%v..%v) = %q, want %q", tc.r.First, tc.r.Last, got, tc.want)
		}
	}
}

func TestRangePrefixes(t *testing.T) {
	for _, tc := range []struct {
		r    Range
		want string
	}{
		{Range{}, ""},
		{rg("10.0.0.5", "10.0.0.5"), "10.0.0.5/32"},
		{rg("10.0.0.0", "10.0.0.255"), "10.0.0.0/24"},
		{rg("10.0.0.1", "10.0.0.6"), "10.0.0.1/32 10.0.0.2/31 10.0.0.4/31 10.0.0.6/32"},
		{rg("10.0.0.0", "10.0.1.0"), "10.0.0.0/24 10.0.1.0/32"},
		{rg("0.0.0.0", "255.255.255.255"), "0.0.0.0/0"},
		{rg("0.0.0.1", "255.255.255.255"), "0.0.0.1/32 0.0.0.2/31 0.0.0.4/30 0.0.0.8/29 0.0.0.16/28 0.0.0.32/27 0.0.0.64/26 0.0.0.128/25 0.0.1.0/24 0.0.2.0/23 0.0.4.0/22 0.0.8.0/21 0.0.16.0/20 0.0.32.0/19 0.0.64.0/18 0.0.128.0/17 0.1.0.0/16 0.2.0.0/15 0.4.0.0/14 0.8.0.0/13 0.16.0.0/12 0.32.0.0/11 0.64.0.0/10 0.128.0.0/9 1.0.0.0/8 2.0.0.0/7 4.0.0.0/6 8.0.0.0/5 16.0.0.0/4 32.0.0.0/3 64.0.0.0/2 128.0.0.0/1"},
		{rg("255.255.255.254", "255.255.255.255"), "255.255.255.254/31"},
		{PrefixRange(pfx("::/0")), "::/0"},
		{rg("::", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe"), ""}, // checked below
		{rg("2001:db8::ffff:ffff:ffff:ffff", "2001:db8:0:1::"), "2001:db8::ffff:ffff:ffff:ffff/128 2001:db8:0:1::/128"},
		{PrefixRange(pfx("2001:db8::/64")), "2001:db8::/64"},
	} {
		got := tc.r.Prefixes()
		var ss []string
		for _, p := range got {
			ss = append(ss, p.String())
		}
		if tc.r.Last == ip("ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe") {
			if len(got) != 128 || got[0] != pfx("::/1") || got[127] != pfx("ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe/128") {
				t.Errorf("full-1 v6 decomposition wrong: %d %v", len(got), ss)
			}
			continue
		}
		if s := strings.Join(ss, " "); s != tc.want {
			t.Errorf("%v.Prefixes() = %q, want %q", tc.r, s, tc.want)
		}
	}
}

// minPrefixes counts the minimal CIDR cover of [lo, hi] within the aligned
// block [blo, blo+2^k) by recursion over the prefix tree.
func minPrefixes(lo, hi, blo uint64, k int) int {
	bhi := blo + 1<<k - 1
	if hi < blo || lo > bhi {
		return 0
	}
	if lo <= blo && bhi <= hi {
		return 1
	}
	half := uint64(1) << (k - 1)
	return minPrefixes(lo, hi, blo, k-1) + minPrefixes(lo, hi, blo+half, k-1)
}

func TestRangePrefixesRandom(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 7))
	for range 2000 {
		lo := r.Uint64N(1 << 12)
		hi := lo + r.Uint64N(1<<12-lo)
		for _, base := range []string{"10.0.0.0", "2001:db8::"} {
			b, is4 := key(ip(base))
			rr := rng{b.addU64(lo), b.addU64(hi)}.toRange(is4)
			ps := rr.Prefixes()
			if want := minPrefixes(lo, hi, 0, 12); len(ps) != want {
				t.Fatalf("%v: %d prefixes, want %d", rr, len(ps), want)
			}
			if !slices.IsSortedFunc(ps, func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) }) {
				t.Fatalf("%v: prefixes unsorted", rr)
			}
			if s := SetOfPrefixes(ps...); s.NumRanges() != 1 || s.Ranges()[0] != rr || s.Size() != rr.Size() {
				t.Fatalf("%v: prefixes %v do not cover it exactly", rr, ps)
			}
		}
	}
}

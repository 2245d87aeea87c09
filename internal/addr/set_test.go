package addr

import (
	"math"
	"net/netip"
	"slices"
	"strings"
	"testing"
)

const (
	max6 = "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"
)

func TestNewSet(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   []Range
		want string
	}{
		{"empty", nil, ""},
		{"zero range ignored", []Range{{}}, ""},
		{"invalid ignored", []Range{rg("10.0.0.9", "10.0.0.1"), {ip("10.0.0.1"), ip("::1")}, {ip("fe80::1%eth0"), ip("fe80::1%eth0")}, rg("10.0.0.1", "10.0.0.1")}, "10.0.0.1"},
		{"single", []Range{rg("10.0.0.1", "10.0.0.1")}, "10.0.0.1"},
		{"overlap", []Range{rg("10.0.0.1", "10.0.0.5"), rg("10.0.0.3", "10.0.0.9")}, "10.0.0.1-10.0.0.9"},
		{"adjacent merged", []Range{rg("10.0.0.0", "10.0.0.7"), rg("10.0.0.8", "10.0.0.15")}, "10.0.0.0/28"},
		{"unsorted", []Range{rg("10.0.0.20", "10.0.0.21"), rg("10.0.0.1", "10.0.0.1"), rg("10.0.0.10", "10.0.0.12")}, "10.0.0.1,10.0.0.10-10.0.0.12,10.0.0.20/31"},
		{"contained", []Range{rg("10.0.0.0", "10.0.0.255"), rg("10.0.0.5", "10.0.0.7")}, "10.0.0.0/24"},
		{"v4 before v6", []Range{rg("::1", "::1"), rg("10.0.0.1", "10.0.0.1")}, "10.0.0.1,::1"},
		{"v4 end not adjacent to v6 start", []Range{rg("255.255.255.255", "255.255.255.255"), rg("::", "::")}, "255.255.255.255,::"},
		{"4in6 is v6", []Range{rg("::ffff:10.0.0.1", "::ffff:10.0.0.1"), rg("10.0.0.1", "10.0.0.1")}, "10.0.0.1,::ffff:10.0.0.1"},
		{"edges v4", []Range{rg("0.0.0.0", "0.0.0.0"), rg("255.255.255.255", "255.255.255.255"), rg("0.0.0.1", "255.255.255.254")}, "0.0.0.0/0"},
		{"edges v6", []Range{rg("::", "::"), rg(max6, max6), rg("::1", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe")}, "::/0"},
		{"v6 adjacent across 64-bit boundary", []Range{rg("2001:db8::", "2001:db8::ffff:ffff:ffff:ffff"), rg("2001:db8:0:1::", "2001:db8:0:1::")}, "2001:db8::-2001:db8:0:1::"},
		{"duplicates", []Range{rg("10.0.0.1", "10.0.0.1"), rg("10.0.0.1", "10.0.0.1")}, "10.0.0.1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := NewSet(tc.in...)
			mustCanonical(t, got)
			if got.String() != tc.want {
				t.Fatalf("NewSet = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestSetOfPrefixes(t *testing.T) {
	s := SetOfPrefixes(pfx("10.0.0.0/8"))
	if s.NumRanges() != 1 || s.Size() != CountOf(1<<24) || s.String() != "10.0.0.0/8" {
		t.Fatalf("/8: %v ranges %d", s, s.NumRanges())
	}
	s = SetOfPrefixes(pfx("2001:db8::/64"))
	if s.NumRanges() != 1 || s.Size() != cnt(1, 0) || s.String() != "2001:db8::/64" {
		t.Fatalf("/64: %v", s)
	}
	s = SetOfPrefixes(pfx("10.0.0.0/25"), pfx("10.0.0.128/25"), pfx("10.0.1.5/24"), netip.Prefix{}, pfx("::/0"), pfx("0.0.0.0/32"))
	assertSet(t, s, "0.0.0.0,10.0.0.0/23,::/0")
	if s.Size() != MaxCount {
		t.Fatalf("size with ::/0 = %v", s.Size())
	}
}

func TestSetOfAddrs(t *testing.T) {
	s := SetOfAddrs(ip("10.0.0.3"), ip("10.0.0.1"), ip("10.0.0.2"), netip.Addr{}, ip("fe80::1%eth0"), ip("10.0.0.2"))
	assertSet(t, s, "10.0.0.1-10.0.0.3,fe80::1")
	if !SetOfAddrs().IsEmpty() {
		t.Fatal("empty")
	}
}

func TestSetAccessors(t *testing.T) {
	var zero Set
	if !zero.IsEmpty() || zero.NumRanges() != 0 || zero.Ranges() != nil || zero.Size() != (Count{}) || zero.String() != "" || zero.Strings() != nil || zero.Is4() || zero.Is6() {
		t.Fatal("zero Set not empty")
	}
	s := ms("10.0.0.0/24, 10.0.2.0/24, 2001:db8::/64")
	if s.IsEmpty() || s.NumRanges() != 3 || s.Is4() || s.Is6() {
		t.Fatal("accessors")
	}
	want := []Range{PrefixRange(pfx("10.0.0.0/24")), PrefixRange(pfx("10.0.2.0/24")), PrefixRange(pfx("2001:db8::/64"))}
	rs := s.Ranges()
	if !slices.Equal(rs, want) {
		t.Fatalf("Ranges = %v", rs)
	}
	rs[0] = Range{}
	if !slices.Equal(s.Ranges(), want) {
		t.Fatal("Ranges not a copy")
	}
	if got := s.Size(); got != cnt(1, 512) {
		t.Fatalf("Size = %v", got)
	}
	if !ms("10.0.0.0/8").Is4() || !ms("::/0").Is6() {
		t.Fatal("Is4/Is6")
	}
	if got := ms("0.0.0.0/0,::/1").Size(); got != cnt(1<<63, 1<<32) {
		t.Fatalf("Size = %v", got)
	}
	if got := ms("0.0.0.0/0,::/0").Size(); got != MaxCount {
		t.Fatalf("Size saturation = %v", got)
	}
}

func TestSetContains(t *testing.T) {
	s := ms("0.0.0.0, 10.0.0.0/24, 10.0.2.5-10.0.2.9, 255.255.255.255, ::, 2001:db8::/64, " + max6)
	for _, tc := range []struct {
		a    string
		want bool
	}{
		{"0.0.0.0", true},
		{"0.0.0.1", false},
		{"9.255.255.255", false},
		{"10.0.0.0", true},
		{"10.0.0.255", true},
		{"10.0.1.0", false},
		{"10.0.2.4", false},
		{"10.0.2.5", true},
		{"10.0.2.9", true},
		{"10.0.2.10", false},
		{"255.255.255.254", false},
		{"255.255.255.255", true},
		{"::", true},
		{"::1", false},
		{"::ffff:10.0.0.1", false},
		{"2001:db8::", true},
		{"2001:db8::ffff:ffff:ffff:ffff", true},
		{"2001:db8::ffff:ffff:ffff:ffff%eth0", true},
		{"2001:db8:0:1::", false},
		{"ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe", false},
		{max6, true},
	} {
		if got := s.Contains(ip(tc.a)); got != tc.want {
			t.Errorf("Contains(%s) = %v", tc.a, got)
		}
	}
	if s.Contains(netip.Addr{}) || (Set{}).Contains(ip("10.0.0.1")) {
		t.Error("Contains of invalid/empty")
	}
}

func TestSetContainsRange(t *testing.T) {
	s := ms("10.0.0.0/24, 10.0.2.5-10.0.2.9, 2001:db8::/64")
	for _, tc := range []struct {
		r    Range
		want bool
	}{
		{rg("10.0.0.0", "10.0.0.255"), true},
		{rg("10.0.0.5", "10.0.0.5"), true},
		{rg("10.0.0.5", "10.0.1.0"), false},
		{rg("10.0.0.255", "10.0.2.5"), false},
		{rg("10.0.2.5", "10.0.2.9"), true},
		{rg("10.0.2.4", "10.0.2.9"), false},
		{rg("10.0.2.5", "10.0.2.10"), false},
		{rg("2001:db8::", "2001:db8::ffff:ffff:ffff:ffff"), true},
		{rg("2001:db8::", "2001:db8:0:1::"), false},
		{rg("::ffff:10.0.0.1", "::ffff:10.0.0.1"), false},
		{Range{}, false},
	} {
		if got := s.ContainsRange(tc.r); got != tc.want {
			t.Errorf("ContainsRange(%v) = %v", tc.r, got)
		}
	}
}

func TestSetContainsSetOverlaps(t *testing.T) {
	a := ms("10.0.0.0/24, 10.0.2.5-10.0.2.9, 2001:db8::/64")
	for _, tc := range []struct {
		b                  string
		contains, overlaps bool
	}{
		{"", true, false},
		{"10.0.0.0/24", true, true},
		{"10.0.0.7, 10.0.2.6, 2001:db8::5", true, true},
		{"10.0.0.7, 10.0.2.6, 2001:db8:1::5", false, true},
		{"10.0.1.0/24", false, false},
		{"10.0.0.0/23", false, true},
		{"10.0.2.10-10.0.2.20, 2001:db8:1::/64", false, false},
		{"::/0", false, true},
		{"0.0.0.0/0", false, true},
		{"10.0.0.0/24, 10.0.2.5-10.0.2.9, 2001:db8::/64", true, true},
	} {
		b := ms(tc.b)
		if got := a.ContainsSet(b); got != tc.contains {
			t.Errorf("ContainsSet(%s) = %v", tc.b, got)
		}
		if got := a.Overlaps(b); got != tc.overlaps {
			t.Errorf("Overlaps(%s) = %v", tc.b, got)
		}
		if got := b.Overlaps(a); got != tc.overlaps {
			t.Errorf("reverse Overlaps(%s) = %v", tc.b, got)
		}
	}
	if m := SetOfPrefixes(pfx("::ffff:10.0.0.0/120")); a.ContainsSet(m) || a.Overlaps(m) || m.Overlaps(a) {
		t.Error("IPv4-mapped prefix treated as IPv4")
	}
	if !(Set{}).ContainsSet(Set{}) || (Set{}).ContainsSet(a) {
		t.Error("empty ContainsSet")
	}
}

func TestSetAlgebra(t *testing.T) {
	for _, tc := range []struct {
		a, b                    string
		union, inter, sub, rsub string
	}{
		{"", "", "", "", "", ""},
		{"10.0.0.0/24", "", "10.0.0.0/24", "", "10.0.0.0/24", ""},
		{"10.0.0.0/25", "10.0.0.128/25", "10.0.0.0/24", "", "10.0.0.0/25", "10.0.0.128/25"},
		{"10.0.0.0/24", "10.0.0.5", "10.0.0.0/24", "10.0.0.5", "10.0.0.0-10.0.0.4,10.0.0.6-10.0.0.255", ""},
		{"10.0.0.0-10.0.0.10", "10.0.0.5-10.0.0.20", "10.0.0.0-10.0.0.20", "10.0.0.5-10.0.0.10", "10.0.0.0-10.0.0.4", "10.0.0.11-10.0.0.20"},
		{"10.0.0.0/24", "10.0.0.1,10.0.0.3,10.0.0.5,10.0.1.0", "10.0.0.0-10.0.1.0", "10.0.0.1,10.0.0.3,10.0.0.5", "10.0.0.0,10.0.0.2,10.0.0.4,10.0.0.6-10.0.0.255", "10.0.1.0"},
		{"0.0.0.0/0", "0.0.0.0,255.255.255.255", "0.0.0.0/0", "0.0.0.0,255.255.255.255", "0.0.0.1-255.255.255.254", ""},
		{"::/0", "::, " + max6, "::/0", "::," + max6, "::1-ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe", ""},
		{"10.0.0.0/8, 2001:db8::/64", "10.1.0.0/16, 2001:db8::/65", "10.0.0.0/8,2001:db8::/64", "10.1.0.0/16,2001:db8::/65", "10.0.0.0/16,10.2.0.0-10.255.255.255,2001:db8::8000:0:0:0/65", ""},
		{"10.0.0.0/24", "2001:db8::/64", "10.0.0.0/24,2001:db8::/64", "", "10.0.0.0/24", "2001:db8::/64"},
		{"10.0.0.1,10.0.0.3,10.0.0.5", "10.0.0.2,10.0.0.4", "10.0.0.1-10.0.0.5", "", "10.0.0.1,10.0.0.3,10.0.0.5", "10.0.0.2,10.0.0.4"},
		{"10.0.0.0-10.0.0.3,10.0.0.8-10.0.0.11", "10.0.0.2-10.0.0.9", "10.0.0.0-10.0.0.11", "10.0.0.2-10.0.0.3,10.0.0.8-10.0.0.9", "10.0.0.0/31,10.0.0.10/31", "10.0.0.4-10.0.0.7"},
		{"::", "::1", "::/127", "", "::", "::1"},
		{"::/1", "8000::/1", "::/0", "", "::/1", "8000::/1"},
	} {
		a, b := ms(tc.a), ms(tc.b)
		assertSet(t, a.Union(b), tc.union)
		assertSet(t, b.Union(a), tc.union)
		assertSet(t, a.Intersect(b), tc.inter)
		assertSet(t, b.Intersect(a), tc.inter)
		assertSet(t, a.Subtract(b), tc.sub)
		assertSet(t, b.Subtract(a), tc.rsub)
	}
}

func TestSetImmutable(t *testing.T) {
	a := ms("10.0.0.0/24, 10.0.2.0/24")
	b := ms("10.0.1.0/24")
	before := a.String()
	_ = a.Union(b)
	_ = a.Subtract(b)
	_ = a.Intersect(b)
	_ = a.First(3)
	u := a.Union(Set{})
	_ = u.Subtract(ms("10.0.0.0/25"))
	if a.String() != before || b.String() != "10.0.1.0/24" {
		t.Fatal("operation modified an input")
	}
}

func TestSetEqual(t *testing.T) {
	if !ms("10.0.0.0/24").Equal(NewSet(rg("10.0.0.0", "10.0.0.127"), rg("10.0.0.128", "10.0.0.255"))) {
		t.Fatal("equal sets differ")
	}
	if ms("10.0.0.0/24").Equal(ms("10.0.0.0/25")) || ms("10.0.0.1").Equal(SetOfAddrs(ip("::ffff:10.0.0.1"))) || ms("10.0.0.1").Equal(Set{}) {
		t.Fatal("different sets equal")
	}
	if !(Set{}).Equal(ms("")) {
		t.Fatal("empty sets differ")
	}
}

func TestSetAddrs(t *testing.T) {
	s := ms("10.0.0.254-10.0.1.1, 255.255.255.255, ::, " + max6)
	for _, tc := range []struct {
		limit int
		want  string
	}{
		{-1, ""},
		{0, ""},
		{1, "10.0.0.254"},
		{3, "10.0.0.254 10.0.0.255 10.0.1.0"},
		{100, "10.0.0.254 10.0.0.255 10.0.1.0 10.0.1.1 255.255.255.255 :: " + max6},
	} {
		var ss []string
		for _, a := range s.Addrs(tc.limit) {
			ss = append(ss, a.String())
		}
		if got := strings.Join(ss, " "); got != tc.want {
			t.Errorf("Addrs(%d) = %q, want %q", tc.limit, got, tc.want)
		}
	}
	if got := ms("::/0").Addrs(2); len(got) != 2 || got[1] != ip("::1") {
		t.Errorf("Addrs on ::/0 = %v", got)
	}
}

func TestSetFirst(t *testing.T) {
	s := ms("10.0.0.0/30, 10.0.0.8/30, 2001:db8::/64")
	for _, tc := range []struct {
		n    int
		want string
	}{
		{-1, ""},
		{0, ""},
		{1, "10.0.0.0"},
		{4, "10.0.0.0/30"},
		{5, "10.0.0.0/30,10.0.0.8"},
		{8, "10.0.0.0/30,10.0.0.8/30"},
		{9, "10.0.0.0/30,10.0.0.8/30,2001:db8::"},
		{12, "10.0.0.0/30,10.0.0.8/30,2001:db8::/126"},
		{1 << 62, "10.0.0.0/30,10.0.0.8/30,2001:db8::-2001:db8::3fff:ffff:ffff:fff7"},
	} {
		assertSet(t, s.First(tc.n), tc.want)
	}
	if got := ms("::/0").First(1 << 20); got.String() != "::/108" {
		t.Errorf("First on ::/0 = %v", got)
	}
	if small := ms("10.0.0.0/30,2001:db8::/126"); !small.First(8).Equal(small) || !small.First(math.MaxInt).Equal(small) {
		t.Errorf("First(all) != set")
	}
	if got := ms("0.0.0.0/0").First(1 << 40); got.String() != "0.0.0.0/0" {
		t.Errorf("First beyond size = %v", got)
	}
}

func TestSetPrefixes(t *testing.T) {
	s := ms("10.0.0.1-10.0.0.6, 10.0.1.0/24, 2001:db8::/64, ::")
	var ss []string
	for _, p := range s.Prefixes() {
		ss = append(ss, p.String())
	}
	want := "10.0.0.1/32 10.0.0.2/31 10.0.0.4/31 10.0.0.6/32 10.0.1.0/24 ::/128 2001:db8::/64"
	if got := strings.Join(ss, " "); got != want {
		t.Fatalf("Prefixes = %q", got)
	}
	if (Set{}).Prefixes() != nil {
		t.Fatal("empty Prefixes")
	}
}

func TestSetStrings(t *testing.T) {
	s := ms(" 10.0.0.5 ,10.0.0.0/28, 10.0.1.0-10.0.1.6, 2001:db8::/64, 10.0.0.16, 0.0.0.0")
	want := []string{"0.0.0.0", "10.0.0.0-10.0.0.16", "10.0.1.0-10.0.1.6", "2001:db8::/64"}
	if got := s.Strings(); !slices.Equal(got, want) {
		t.Fatalf("Strings = %q", got)
	}
	if got := s.String(); got != strings.Join(want, ",") {
		t.Fatalf("String = %q", got)
	}
}

func TestSetAddrsHugeLimit(t *testing.T) {
	if got := ms("::/0").Addrs(5000); len(got) != 5000 || got[4999] != ip("::1387") {
		t.Fatalf("len = %d", len(got))
	}
	if got := ms("10.0.0.0/30").Addrs(math.MaxInt); len(got) != 4 {
		t.Fatalf("len = %d", len(got))
	}
}

package scaling

import (
	"math/rand/v2"
	"net/netip"
	"testing"

	"github.com/ipwarden/ipwarden/internal/addr"
)

func mustSet(t testing.TB, items ...string) addr.Set {
	t.Helper()
	s, err := addr.ParseSet(items)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestChooseRelease(t *testing.T) {
	for _, tc := range []struct {
		name       string
		held, free []string
		k          int
		want       []string
	}{
		{"nothing to give", []string{"10.0.0.0/28"}, nil, 4, nil},
		{"k zero", []string{"10.0.0.0/28"}, []string{"10.0.0.0/28"}, 0, nil},
		{"trim the high end of one run", []string{"10.0.0.0/28"}, []string{"10.0.0.8-10.0.0.15"}, 4, []string{"10.0.0.12/30"}},
		{"trim the low end when that is the free end", []string{"10.0.0.0/28"}, []string{"10.0.0.0-10.0.0.5"}, 3, []string{"10.0.0.0-10.0.0.2"}},
		{"whole free run goes first", []string{"10.0.0.0/28", "10.0.1.0/30"}, []string{"10.0.0.12/30", "10.0.1.0/30"}, 4, []string{"10.0.1.0/30"}},
		{"smallest whole free run first", []string{"10.0.0.0/29", "10.0.1.0/30", "10.0.2.0/31"}, []string{"10.0.0.0/29", "10.0.1.0/30", "10.0.2.0/31"}, 2, []string{"10.0.2.0/31"}},
		{"whole run too large: trim the smallest run's end", []string{"10.0.0.0/29", "10.0.1.0/30"}, []string{"10.0.0.0/29", "10.0.1.0/30"}, 2, []string{"10.0.1.2/31"}},
		{"interior only when no end is free", []string{"10.0.0.0/29"}, []string{"10.0.0.2", "10.0.0.5"}, 1, []string{"10.0.0.5"}},
		{"ends before interior", []string{"10.0.0.0/29"}, []string{"10.0.0.3", "10.0.0.7"}, 1, []string{"10.0.0.7"}},
		{"more than free gives all free", []string{"10.0.0.0/29"}, []string{"10.0.0.6-10.0.0.7"}, 5, []string{"10.0.0.6/31"}},
		{"free outside held is ignored", []string{"10.0.0.0/30"}, []string{"10.0.0.3", "10.9.9.9"}, 2, []string{"10.0.0.3"}},
		{"ipv6", []string{"fd00::/124"}, []string{"fd00::8/125"}, 8, []string{"fd00::8/125"}},
		{"trimming walks inward from the high end", []string{"fd00::/124"}, []string{"fd00::/124"}, 3, []string{"fd00::d-fd00::f"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := ChooseRelease(mustSet(t, tc.held...), mustSet(t, tc.free...), tc.k)
			if want := mustSet(t, tc.want...); !got.Equal(want) {
				t.Fatalf("ChooseRelease = %v, want %v", got, want)
			}
		})
	}
}

func TestChooseReleaseBounded(t *testing.T) {
	for _, tc := range []struct {
		name       string
		held, free []string
		k, least   int
		want       []string
	}{
		{"ends up to k, no interior past least", []string{"10.0.0.0/28"}, []string{"10.0.0.3", "10.0.0.14-10.0.0.15"}, 3, 0, []string{"10.0.0.14/31"}},
		{"interior up to least", []string{"10.0.0.0/28"}, []string{"10.0.0.3", "10.0.0.5", "10.0.0.15"}, 3, 2, []string{"10.0.0.5", "10.0.0.15"}},
		{"least beyond k is k", []string{"10.0.0.0/28"}, []string{"10.0.0.3", "10.0.0.5"}, 1, 9, []string{"10.0.0.5"}},
		{"whole runs need no least", []string{"10.0.0.0/28", "10.0.1.0/30"}, []string{"10.0.0.3", "10.0.1.0/30"}, 8, 0, []string{"10.0.1.0/30"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := ChooseReleaseBounded(mustSet(t, tc.held...), mustSet(t, tc.free...), tc.k, tc.least)
			if want := mustSet(t, tc.want...); !got.Equal(want) {
				t.Fatalf("ChooseReleaseBounded = %v, want %v", got, want)
			}
		})
	}
}

// TestChooseReleaseProperties: the choice is always k free held addresses (or all of them), and
// when the free addresses sit at run ends the node never ends up with more runs than before.
func TestChooseReleaseProperties(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	base := netip.MustParseAddr("10.0.0.0").As4()
	for iter := 0; iter < 2000; iter++ {
		var held, free []netip.Addr
		for i := 0; i < 64; i++ {
			if rng.IntN(3) == 0 {
				continue
			}
			b := base
			b[3] = byte(i)
			a := netip.AddrFrom4(b)
			held = append(held, a)
			if rng.IntN(2) == 0 {
				free = append(free, a)
			}
		}
		h, f := addr.SetOfAddrs(held...), addr.SetOfAddrs(free...)
		k := rng.IntN(40)
		got := ChooseRelease(h, f, k)
		fn, _ := f.Size().Uint64()
		gn, _ := got.Size().Uint64()
		if want := min(uint64(k), fn); gn != want {
			t.Fatalf("held %v free %v k %d: chose %d addresses, want %d", h, f, k, gn, want)
		}
		if !f.ContainsSet(got) {
			t.Fatalf("chose %v, not all free (%v)", got, f)
		}
		if b := ChooseReleaseBounded(h, f, k, 0); h.Subtract(b).NumRanges() > h.NumRanges() || !got.ContainsSet(b) && !interiorForced(h, f, k) {
			t.Fatalf("held %v free %v k %d: bounded with least 0 chose %v, runs went %d -> %d", h, f, k, b, h.NumRanges(), h.Subtract(b).NumRanges())
		}
		if after := h.Subtract(got); after.NumRanges() > h.NumRanges() && !interiorForced(h, f, k) {
			t.Fatalf("held %v free %v k %d: chose %v, runs went %d -> %d though ends were free",
				h, f, k, got, h.NumRanges(), after.NumRanges())
		}
	}
}

// interiorForced says whether giving k addresses from free must split a run: true when the free
// addresses reachable from run ends (contiguous free stretches touching an end) number fewer than k.
func interiorForced(held, free addr.Set, k int) bool {
	reachable := 0
	for _, r := range held.Ranges() {
		rs := addr.NewSet(r)
		n, _ := r.Size().Uint64()
		addrs := rs.Addrs(int(n))
		lo := 0
		for lo < len(addrs) && free.Contains(addrs[lo]) {
			lo++
		}
		hi := 0
		for hi < len(addrs)-lo && free.Contains(addrs[len(addrs)-1-hi]) {
			hi++
		}
		reachable += lo + hi
	}
	return reachable < k
}

func BenchmarkChooseRelease(b *testing.B) {
	held := mustSet(b, "10.0.0.0/24")
	free := mustSet(b, "10.0.0.100-10.0.0.255")
	for b.Loop() {
		_ = ChooseRelease(held, free, 64)
	}
}

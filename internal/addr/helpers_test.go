package addr

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"
)

func ip(s string) netip.Addr      { return netip.MustParseAddr(s) }
func pfx(s string) netip.Prefix   { return netip.MustParsePrefix(s) }
func ms(s string) Set             { return MustParseSetString(s) }
func rg(first, last string) Range { return Range{ip(first), ip(last)} }
func cnt(hi, lo uint64) Count     { return Count{Hi: hi, Lo: lo} }

// checkCanonical verifies the representation invariants of s.
func checkCanonical(s Set) error {
	if s.n4 < 0 || s.n4 > len(s.rs) {
		return fmt.Errorf("n4=%d out of range (len %d)", s.n4, len(s.rs))
	}
	for i, g := range s.rs {
		if g.hi.less(g.lo) {
			return fmt.Errorf("range %d reversed: %v", i, g)
		}
		if i < s.n4 && maxV4.less(g.hi) {
			return fmt.Errorf("v4 range %d beyond 32 bits: %v", i, g)
		}
		if i > 0 && i != s.n4 && touches(s.rs[i-1].hi, g.lo) {
			return fmt.Errorf("ranges %d and %d overlap or touch: %v %v", i-1, i, s.rs[i-1], g)
		}
		if i > 0 && i != s.n4 && !s.rs[i-1].lo.less(g.lo) {
			return fmt.Errorf("ranges %d and %d out of order", i-1, i)
		}
	}
	for i, r := range s.Ranges() {
		if !r.IsValid() || r.Is4() != (i < s.n4) {
			return fmt.Errorf("Ranges()[%d]=%v invalid or wrong family", i, r)
		}
	}
	return nil
}

func mustCanonical(t testing.TB, s Set) {
	t.Helper()
	if err := checkCanonical(s); err != nil {
		t.Fatalf("set %v not canonical: %v", s, err)
	}
}

// model is a naive per-address set used to check Set on small universes.
type model map[netip.Addr]bool

func (m model) set() Set {
	as := make([]netip.Addr, 0, len(m))
	for a := range m {
		as = append(as, a)
	}
	return SetOfAddrs(as...)
}

// matches reports whether s holds exactly the addresses of m, without
// building a Set from m.
func (m model) matches(s Set) bool {
	if s.Size() != CountOf(uint64(len(m))) {
		return false
	}
	for a := range m {
		if !s.Contains(a) {
			return false
		}
	}
	return true
}

func (m model) sorted() []netip.Addr {
	as := make([]netip.Addr, 0, len(m))
	for a := range m {
		as = append(as, a)
	}
	slices.SortFunc(as, netip.Addr.Compare)
	return as
}

func (m model) union(o model) model {
	r := model{}
	for a := range m {
		r[a] = true
	}
	for a := range o {
		r[a] = true
	}
	return r
}

func (m model) intersect(o model) model {
	r := model{}
	for a := range m {
		if o[a] {
			r[a] = true
		}
	}
	return r
}

func (m model) subtract(o model) model {
	r := model{}
	for a := range m {
		if !o[a] {
			r[a] = true
		}
	}
	return r
}

func (m model) equal(o model) bool {
	if len(m) != len(o) {
		return false
	}
	for a := range m {
		if !o[a] {
			return false
		}
	}
	return true
}

func assertSet(t testing.TB, got Set, want string) {
	t.Helper()
	mustCanonical(t, got)
	if w := ms(want); !got.Equal(w) {
		t.Fatalf("got %q, want %q", got, w)
	}
}

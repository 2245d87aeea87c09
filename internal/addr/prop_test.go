package addr

import (
	"errors"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"
	"time"
)

// byteReader feeds test scripts from fuzz or random bytes; past the end it
// yields zeros.
type byteReader struct {
	b []byte
	i int
}

func (r *byteReader) done() bool { return r.i >= len(r.b) }

func (r *byteReader) next() byte {
	if r.i >= len(r.b) {
		return 0
	}
	r.i++
	return r.b[r.i-1]
}

// universes are 256-address windows in which small random sets live,
// chosen to hit the family edges and the 64-bit word boundary.
var universes = []netip.Addr{
	ip("10.0.0.0"),
	ip("0.0.0.0"),
	ip("255.255.255.0"),
	ip("2001:db8::"),
	ip("::"),
	ip("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ff00"),
	ip("2001:db8::ffff:ffff:ffff:ff80"),
}

// decodeRange reads one range. With allowBig, some ranges are large CIDR
// blocks (up to /0) that the per-address model cannot follow; big reports
// that.
func decodeRange(r *byteReader, allowBig bool) (rr Range, big bool) {
	sel := r.next()
	base := universes[int(sel&0x0f)%len(universes)]
	b, is4 := key(base)
	if allowBig && sel&0x80 != 0 {
		nbits := famBits(is4)
		bits := int(r.next()) % (nbits + 1)
		p := netip.PrefixFrom(base, bits).Masked()
		return PrefixRange(p), nbits-bits > 12
	}
	lo := uint64(r.next())
	n := uint64(r.next() % 32)
	if sel&0x40 != 0 {
		n = uint64(r.next())
	}
	hi := min(lo+n, 255)
	return rng{b.addU64(lo), b.addU64(hi)}.toRange(is4), false
}

// decodeSet reads a set; rs are the raw ranges it was built from.
func decodeSet(r *byteReader, allowBig bool) (s Set, rs []Range, big bool) {
	n := int(r.next() % 8)
	for range n {
		rr, b := decodeRange(r, allowBig)
		rs = append(rs, rr)
		big = big || b
	}
	return NewSet(rs...), rs, big
}

// modelOfRanges enumerates the addresses of rs independently of Set.
func modelOfRanges(rs []Range) model {
	m := model{}
	for _, r := range rs {
		for a := r.First; ; a = a.Next() {
			m[a] = true
			if a == r.Last {
				break
			}
		}
	}
	return m
}

// checkSetOps checks algebraic identities between two sets and, when they
// are small, compares every operation with the per-address model.
func checkSetOps(t testing.TB, a, b Set, ra, rb []Range, small bool) {
	t.Helper()
	fail := func(format string, args ...any) {
		t.Helper()
		args = append([]any{a, b}, args...)
		t.Fatalf("A=%q B=%q: "+format, args...)
	}
	u, in, d, e := a.Union(b), a.Intersect(b), a.Subtract(b), b.Subtract(a)
	for name, s := range map[string]Set{"A": a, "B": b, "A∪B": u, "A∩B": in, "A−B": d, "B−A": e} {
		if err := checkCanonical(s); err != nil {
			fail("%s not canonical: %v", name, err)
		}
	}
	if !d.Union(in).Equal(a) {
		fail("(A−B)∪(A∩B) != A")
	}
	if d.Overlaps(b) || !d.Intersect(b).IsEmpty() {
		fail("A−B overlaps B")
	}
	if !u.Equal(b.Union(a)) || !in.Equal(b.Intersect(a)) {
		fail("not commutative")
	}
	if !u.Equal(d.Union(e).Union(in)) {
		fail("A∪B != (A−B)∪(B−A)∪(A∩B)")
	}
	if !a.ContainsSet(in) || !b.ContainsSet(in) || !u.ContainsSet(a) || !u.ContainsSet(b) {
		fail("subset relations")
	}
	if a.Overlaps(b) != !in.IsEmpty() || b.Overlaps(a) != !in.IsEmpty() {
		fail("Overlaps != nonempty intersection")
	}
	if !a.Subtract(d).Equal(in) {
		fail("A−(A−B) != A∩B")
	}
	if a.Equal(b) != (d.IsEmpty() && e.IsEmpty()) || a.ContainsSet(b) != e.IsEmpty() {
		fail("Equal/ContainsSet vs differences")
	}
	if !u.Subtract(a).Equal(e) || !a.Intersect(a).Equal(a) || !a.Union(a).Equal(a) || !a.Subtract(a).IsEmpty() {
		fail("idempotence")
	}
	sz := func(s Set) Count { return s.Size() }
	if sz(u) != MaxCount {
		if sz(d).Add(sz(in)) != sz(a) {
			fail("|A−B|+|A∩B| = %v+%v != |A| = %v", sz(d), sz(in), sz(a))
		}
		if sz(u).Add(sz(in)) != sz(a).Add(sz(b)) {
			fail("|A∪B|+|A∩B| != |A|+|B|")
		}
	}
	for _, s := range []Set{a, b, u, in, d} {
		if back, err := ParseSet(s.Strings()); err != nil || !back.Equal(s) {
			fail("ParseSet(%q.Strings()) = %q, %v", s, back, err)
		}
		if back, err := ParseSetString(s.String()); err != nil || !back.Equal(s) {
			fail("ParseSetString(%q) = %q, %v", s, back, err)
		}
		if !NewSet(s.Ranges()...).Equal(s) || !SetOfPrefixes(s.Prefixes()...).Equal(s) {
			fail("Ranges/Prefixes round trip of %q", s)
		}
		for _, r := range s.Ranges() {
			if !s.ContainsRange(r) || !s.Contains(r.First) || !s.Contains(r.Last) {
				fail("%q does not contain its range %v", s, r)
			}
			if p := r.First.Prev(); p.IsValid() && s.Contains(p) {
				fail("%q contains %v before its range %v", s, p, r)
			}
			if n := r.Last.Next(); n.IsValid() && s.Contains(n) {
				fail("%q contains %v after its range %v", s, n, r)
			}
		}
	}
	for _, k := range []int{0, 1, 2, 7, 100, 1000} {
		f := a.First(k)
		if err := checkCanonical(f); err != nil || !a.ContainsSet(f) {
			fail("First(%d) = %q not a canonical subset", k, f)
		}
		if want, _ := a.Size().Uint64(); (a.Size().Hi != 0 || want > uint64(k)) && f.Size() != CountOf(uint64(k)) {
			fail("First(%d) has size %v", k, f.Size())
		} else if f.Size().Cmp(CountOf(uint64(k))) > 0 {
			fail("First(%d) too big", k)
		}
		if rest := a.Subtract(f); !rest.IsEmpty() && !f.IsEmpty() {
			last := f.Ranges()[f.NumRanges()-1].Last
			if rest.Ranges()[0].First.Less(last) {
				fail("First(%d) = %q is not the lowest addresses", k, f)
			}
		}
	}
	if !small {
		return
	}
	ma, mb := modelOfRanges(ra), modelOfRanges(rb)
	if !ma.set().Equal(a) || !mb.set().Equal(b) {
		fail("NewSet disagrees with the model")
	}
	for name, c := range map[string]struct {
		got  Set
		want model
	}{
		"union": {u, ma.union(mb)}, "intersect": {in, ma.intersect(mb)},
		"subtract": {d, ma.subtract(mb)}, "rsubtract": {e, mb.subtract(ma)},
	} {
		if !modelOfRanges(c.got.Ranges()).equal(c.want) || !c.want.set().Equal(c.got) {
			fail("%s = %q disagrees with the model", name, c.got)
		}
		if c.got.Size() != CountOf(uint64(len(c.want))) {
			fail("%s size %v, model %d", name, c.got.Size(), len(c.want))
		}
		if !slices.Equal(c.got.Addrs(1<<20), c.want.sorted()) {
			fail("%s Addrs disagrees with the model", name)
		}
	}
	for x := range ma.union(mb) {
		for _, y := range []netip.Addr{x, x.Prev(), x.Next()} {
			if y.IsValid() && (a.Contains(y) != ma[y] || b.Contains(y) != mb[y]) {
				fail("Contains(%v) disagrees with the model", y)
			}
		}
	}
	for _, r := range rb {
		inA := true
		for y := range modelOfRanges([]Range{r}) {
			inA = inA && ma[y]
		}
		if a.ContainsRange(r) != inA {
			fail("ContainsRange(%v) = %v, model %v", r, !inA, inA)
		}
	}
}

func TestSetPropertiesRandom(t *testing.T) {
	rnd := rand.New(rand.NewPCG(42, 1))
	buf := make([]byte, 64)
	for i := range 3000 {
		for j := range buf {
			buf[j] = byte(rnd.Uint32())
		}
		r := &byteReader{b: buf}
		allowBig := i%4 == 0
		a, ra, bigA := decodeSet(r, allowBig)
		b, rb, bigB := decodeSet(r, allowBig)
		checkSetOps(t, a, b, ra, rb, !bigA && !bigB)
	}
}

// runAllocScript drives an Allocator with a byte script and checks it
// against a per-address model after every step.
func runAllocScript(t testing.TB, data []byte) {
	t.Helper()
	r := &byteReader{b: data}
	decodeSmallSet := func() (Set, []Range) {
		s, rs, _ := decodeSet(r, false)
		return s, rs
	}
	pool, poolRanges := decodeSmallSet()
	cooldown := time.Duration(r.next()%4) * 10 * time.Second
	a := NewAllocator(pool, cooldown)
	now := t0

	// The model: pool membership, allocation, and free time of cooling
	// addresses.
	mPool := modelOfRanges(poolRanges)
	mAlloc := model{}
	mCool := map[netip.Addr]time.Time{}
	var holdings []Set
	mExpire := func() model {
		exp := model{}
		for x, at := range mCool {
			if !now.Before(at.Add(cooldown)) {
				exp[x] = true
				delete(mCool, x)
			}
		}
		return exp
	}
	mFree := func() model {
		f := model{}
		for x := range mPool {
			if _, c := mCool[x]; !c && !mAlloc[x] {
				f[x] = true
			}
		}
		return f
	}
	fail := func(step int, format string, args ...any) {
		t.Helper()
		t.Fatalf("step %d (now=+%v): "+format, append([]any{step, now.Sub(t0)}, args...)...)
	}

	// Sets handed out must never change afterwards, even though the
	// allocator updates its own sets in place.
	type snapshot struct {
		s    Set
		text string
	}
	var snaps []snapshot
	keep := func(s Set) {
		if len(snaps) == 32 {
			snaps = snaps[1:]
		}
		snaps = append(snaps, snapshot{s, s.String()})
	}

	for step := 0; !r.done() && step < 200; step++ {
		switch op := r.next() % 11; op {
		case 0, 1: // allocate
			n := int(r.next() % 24)
			var near Set
			if len(holdings) > 0 {
				near = holdings[int(r.next())%len(holdings)]
			}
			exp := mExpire()
			_ = exp
			free := mFree()
			before := a.allocated.s.String()
			got, err := a.Allocate(n, near, now)
			if len(free) < n {
				var ex *ExhaustedError
				if !errors.As(err, &ex) || ex.Requested != n || ex.Available != CountOf(uint64(len(free))) {
					fail(step, "Allocate(%d) with %d free: %v", n, len(free), err)
				}
				if a.allocated.s.String() != before {
					fail(step, "failed Allocate changed state")
				}
				break
			}
			if err != nil {
				fail(step, "Allocate(%d) with %d free: %v", n, len(free), err)
			}
			if got.Size() != CountOf(uint64(n)) {
				fail(step, "Allocate(%d) returned %v addresses", n, got.Size())
			}
			for x := range modelOfRanges(got.Ranges()) {
				if !free[x] {
					fail(step, "Allocate handed out %v, which is not free (allocated %v, cooling %v)", x, mAlloc[x], !mCool[x].IsZero())
				}
				mAlloc[x] = true
			}
			if n > 0 {
				holdings = append(holdings, got)
				keep(got)
			}
		case 2: // free part of a holding
			if len(holdings) == 0 {
				break
			}
			i := int(r.next()) % len(holdings)
			h := holdings[i]
			part := h.First(int(r.next()%16) + 1)
			if err := a.Free(part, now); err != nil {
				fail(step, "Free(%v): %v", part, err)
			}
			for x := range modelOfRanges(part.Ranges()) {
				delete(mAlloc, x)
				mCool[x] = now
			}
			if rest := h.Subtract(part); rest.IsEmpty() {
				holdings = slices.Delete(holdings, i, i+1)
			} else {
				holdings[i] = rest
			}
		case 3: // free something not (all) allocated: must fail without change
			s, _ := decodeSmallSet()
			allAlloc := true
			for x := range modelOfRanges(s.Ranges()) {
				allAlloc = allAlloc && mAlloc[x]
			}
			if allAlloc {
				break
			}
			before, cool := a.allocated.s.String(), a.cooling.s.String()
			var na *NotAllocatedError
			if err := a.Free(s, now); !errors.As(err, &na) || na.Addrs.IsEmpty() || na.Addrs.Overlaps(a.allocated.s) {
				fail(step, "Free(%v) of unallocated: %v", s, err)
			}
			if a.allocated.s.String() != before || a.cooling.s.String() != cool {
				fail(step, "failed Free changed state")
			}
		case 4: // advance time
			now = now.Add(time.Duration(r.next()%40) * time.Second)
		case 5: // expire or count
			if r.next()%2 == 0 {
				want := mExpire()
				got := a.Expire(now)
				if !want.set().Equal(got) {
					fail(step, "Expire = %v, model %v", got, want.set())
				}
				keep(got)
			} else {
				mExpire()
				if got, want := a.Available(now), CountOf(uint64(len(mFree()))); got != want {
					fail(step, "Available = %v, model %v", got, want)
				}
			}
		case 6: // reserve
			s, _ := decodeSmallSet()
			dup := false
			for x := range modelOfRanges(s.Ranges()) {
				dup = dup || mAlloc[x]
			}
			err := a.Reserve(s)
			if dup {
				var aa *AlreadyAllocatedError
				if !errors.As(err, &aa) || !a.allocated.s.ContainsSet(aa.Addrs) || aa.Addrs.IsEmpty() {
					fail(step, "Reserve(%v) of allocated: %v", s, err)
				}
				break
			}
			if err != nil {
				fail(step, "Reserve(%v): %v", s, err)
			}
			for x := range modelOfRanges(s.Ranges()) {
				mAlloc[x] = true
				delete(mCool, x)
			}
			if !s.IsEmpty() {
				holdings = append(holdings, s)
			}
		case 7: // change the pool
			var rs []Range
			pool, rs = decodeSmallSet()
			a.SetPool(pool)
			keep(pool)
			mPool = modelOfRanges(rs)
		case 8: // take views
			keep(a.Allocated())
			keep(a.Cooling())
			keep(a.Conflicts())
			keep(a.Usable(now))
			mExpire()
		case 9: // a clone is independent
			c := a.Clone()
			before := []string{a.allocated.s.String(), a.cooling.s.String(), a.free.s.String()}
			for range 3 {
				if got, err := c.Allocate(int(r.next()%8)+1, Set{}, now); err == nil {
					_ = c.Free(got.First(2), now)
				}
			}
			c.SetPool(Set{})
			_ = c.Reserve(ms("10.0.0.0/24"))
			after := []string{a.allocated.s.String(), a.cooling.s.String(), a.free.s.String()}
			if !slices.Equal(before, after) {
				fail(step, "changing a clone changed the original: %q -> %q", before, after)
			}
		case 10: // unreserve part of a holding: straight back to free
			if len(holdings) == 0 {
				break
			}
			i := int(r.next()) % len(holdings)
			h := holdings[i]
			part := h.First(int(r.next()%16) + 1)
			if err := a.Unreserve(part); err != nil {
				fail(step, "Unreserve(%v): %v", part, err)
			}
			for x := range modelOfRanges(part.Ranges()) {
				delete(mAlloc, x)
			}
			if rest := h.Subtract(part); rest.IsEmpty() {
				holdings = slices.Delete(holdings, i, i+1)
			} else {
				holdings[i] = rest
			}
		}

		// Invariants after every step.
		if err := a.check(); err != nil {
			fail(step, "%v", err)
		}
		if !mAlloc.matches(a.allocated.s) {
			fail(step, "Allocated = %v, model %v", a.allocated.s, mAlloc.set())
		}
		mc := model{}
		for x := range mCool {
			mc[x] = true
		}
		if !mc.matches(a.cooling.s) {
			fail(step, "Cooling = %v, model %v", a.cooling.s, mc.set())
		}
		if want := mAlloc.subtract(mPool); !want.matches(a.Conflicts()) {
			fail(step, "Conflicts = %v, model %v", a.Conflicts(), want.set())
		}
		if !mPool.matches(a.Pool()) {
			fail(step, "Pool = %v", a.Pool())
		}
		// allocated ∪ cooling ∪ free covers the pool, and without
		// conflicts or outside cooling it is exactly the pool.
		whole := a.allocated.s.Union(a.cooling.s).Union(a.free.s)
		if !whole.ContainsSet(a.Pool()) {
			fail(step, "allocated ∪ cooling ∪ free does not cover the pool")
		}
		if a.Conflicts().IsEmpty() && a.Pool().ContainsSet(a.cooling.s) && !whole.Equal(a.Pool()) {
			fail(step, "allocated ∪ cooling ∪ free != pool")
		}
		for _, h := range holdings {
			if !a.allocated.s.ContainsSet(h) {
				fail(step, "holding %v no longer allocated", h)
			}
		}
		for _, sn := range snaps {
			if sn.s.String() != sn.text {
				fail(step, "a set handed out earlier changed from %q to %q", sn.text, sn.s)
			}
		}
		var fromBatches Set
		for _, b := range a.CoolingBatches() {
			fromBatches = fromBatches.Union(b.Addrs)
		}
		if !fromBatches.Equal(a.cooling.s) {
			fail(step, "CoolingBatches do not add up to Cooling")
		}
	}
}

func TestAllocatorPropertiesRandom(t *testing.T) {
	rnd := rand.New(rand.NewPCG(99, 3))
	for range 300 {
		buf := make([]byte, 20+rnd.IntN(400))
		for j := range buf {
			buf[j] = byte(rnd.Uint32())
		}
		runAllocScript(t, buf)
	}
}

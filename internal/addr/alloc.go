package addr

import (
	"cmp"
	"fmt"
	"math/bits"
	"slices"
	"time"
)

// Allocator hands out addresses from one pool, as the cluster controller
// does for nodes. It is a pure state machine: the current time is passed
// in by the caller and never read from a clock.
//
// Every address is in exactly one of these states:
//
//   - allocated: handed out by Allocate or marked by Reserve;
//   - cooling: given back by Free less than the cooldown ago;
//   - free: in the pool and neither allocated nor cooling.
//
// Allocated and cooling addresses may lie outside the pool (after SetPool
// shrank it, or after Reserve of outside addresses); allocated ones then
// show in Conflicts, and cooling ones simply vanish when they expire.
//
// The state is a handful of Sets plus a FIFO of freed batches, so its size
// depends on the number of ranges, never on the number of addresses in the
// pool.
//
// An Allocator is not safe for concurrent use, with one exception: the
// read-only methods Pool, Allocated, Cooling, Conflicts, CoolingBatches and
// Cooldown may run concurrently with each other (under a sync.RWMutex read
// lock, say), though not with any other method.
type Allocator struct {
	pool      Set
	allocated cowSet
	cooling   cowSet      // union of batches
	batches   []coolBatch // sorted by at, oldest first
	free      cowSet      // pool - allocated - cooling
	freeSize  Count       // free.s.Size()
	cooldown  time.Duration
	roomBits  int // SetRoom
}

// coolBatch is a set of addresses freed at one time.
type coolBatch struct {
	set Set
	at  time.Time
}

// NewAllocator returns an allocator for pool in which freed addresses cool
// down for cooldown before they can be handed out again. A cooldown <= 0
// makes freed addresses usable at once (at the next Allocate, Available or
// Expire).
func NewAllocator(pool Set, cooldown time.Duration) *Allocator {
	return &Allocator{pool: pool, free: cowSet{s: pool}, freeSize: pool.Size(), cooldown: max(cooldown, 0)}
}

// Clone returns an independent copy of a, for example to try out changes.
func (a *Allocator) Clone() *Allocator {
	return &Allocator{
		pool:      a.pool,
		allocated: *a.allocated.clone(),
		cooling:   *a.cooling.clone(),
		batches:   slices.Clone(a.batches),
		free:      *a.free.clone(),
		freeSize:  a.freeSize,
		cooldown:  a.cooldown,
		roomBits:  a.roomBits,
	}
}

// Cooldown returns the allocator's cooldown.
func (a *Allocator) Cooldown() time.Duration { return a.cooldown }

// Pool returns the pool.
func (a *Allocator) Pool() Set { return a.pool }

// SetPool replaces the pool, for example after a CIDR was dropped or an
// exclusion added. Allocated addresses outside the new pool are not taken
// away: they stay allocated and show in Conflicts until freed.
func (a *Allocator) SetPool(pool Set) {
	a.pool = pool
	a.free.replace(pool.Subtract(a.allocated.s).Subtract(a.cooling.s), pool)
	a.freeSize = a.free.s.Size()
}

// Conflicts returns the allocated addresses that lie outside the pool.
func (a *Allocator) Conflicts() Set {
	c := a.allocated.s.Subtract(a.pool)
	if sameStorage(c, a.allocated.s) {
		a.allocated.owned.Store(false)
	}
	return c
}

// Allocated returns the allocated addresses.
func (a *Allocator) Allocated() Set { return a.allocated.view() }

// Cooling returns the freed addresses that have not yet been returned to
// the free pool (by an explicit or implicit Expire).
func (a *Allocator) Cooling() Set { return a.cooling.view() }

// Available returns the number of addresses that Allocate could hand out at
// time now: the pool minus allocated minus still-cooling addresses. It
// expires cooled-down addresses first.
func (a *Allocator) Available(now time.Time) Count {
	a.Expire(now)
	return a.freeSize
}

// Usable returns the addresses that Allocate could hand out at time now. It
// expires cooled-down addresses first.
func (a *Allocator) Usable(now time.Time) Set {
	a.Expire(now)
	return a.free.view()
}

// Reserve marks s as allocated; it is used to rebuild state from the API.
// Addresses outside the pool are accepted and become conflicts. Addresses
// still cooling are taken out of the cooldown. If any address of s is
// already allocated, Reserve returns an *AlreadyAllocatedError naming them
// and changes nothing.
func (a *Allocator) Reserve(s Set) error {
	if s.IsEmpty() {
		return nil
	}
	if dup := s.Intersect(a.allocated.s); !dup.IsEmpty() {
		return &AlreadyAllocatedError{Addrs: dup}
	}
	a.allocated.add(s)
	if a.cooling.s.Overlaps(s) {
		a.cooling.remove(s)
		out := a.batches[:0]
		for _, b := range a.batches {
			if b.set.Overlaps(s) {
				b.set = b.set.Subtract(s)
			}
			if !b.set.IsEmpty() {
				out = append(out, b)
			}
		}
		clear(a.batches[len(out):])
		a.batches = out
	}
	if a.free.s.Overlaps(s) {
		a.free.remove(s)
		a.freeSize = a.free.s.Size()
	}
	return nil
}

// Free gives s back: its addresses start cooling at now and become
// available again at now+cooldown. Batches expire in order of their time,
// oldest first. If any address of s is not allocated, Free returns a
// *NotAllocatedError naming them and changes nothing.
func (a *Allocator) Free(s Set, now time.Time) error {
	if s.IsEmpty() {
		return nil
	}
	if !a.allocated.s.ContainsSet(s) {
		return &NotAllocatedError{Addrs: s.Subtract(a.allocated.s)}
	}
	a.allocated.remove(s)
	a.cooling.add(s)
	i := len(a.batches)
	for i > 0 && now.Before(a.batches[i-1].at) {
		i--
	}
	if i > 0 && a.batches[i-1].at.Equal(now) {
		a.batches[i-1].set = a.batches[i-1].set.Union(s)
	} else {
		a.batches = slices.Insert(a.batches, i, coolBatch{set: s, at: now})
	}
	return nil
}

// Return gives s back without a cooldown: its addresses are free at once (those
// outside the pool are simply forgotten). For addresses the holder says are
// past their cooldown already, or were never used. If any address of s is not
// allocated, Return returns a *NotAllocatedError naming them and changes
// nothing.
func (a *Allocator) Return(s Set) error {
	if s.IsEmpty() {
		return nil
	}
	if !a.allocated.s.ContainsSet(s) {
		return &NotAllocatedError{Addrs: s.Subtract(a.allocated.s)}
	}
	a.allocated.remove(s)
	back := s.Intersect(a.pool)
	a.free.add(back)
	if a.freeSize == MaxCount {
		a.freeSize = a.free.s.Size()
	} else {
		a.freeSize = a.freeSize.Add(back.Size())
	}
	return nil
}

// Expire returns the addresses whose cooldown has passed at now to the free
// pool and returns them (including any that are no longer in the pool and
// so are simply forgotten). Allocate, Available and Usable call it.
func (a *Allocator) Expire(now time.Time) Set {
	n := 0
	for n < len(a.batches) && !now.Before(a.batches[n].at.Add(a.cooldown)) {
		n++
	}
	if n == 0 {
		return Set{}
	}
	exp := a.batches[0].set
	if n > 1 {
		var v4, v6 []rng
		for _, b := range a.batches[:n] {
			v4 = append(v4, b.set.v4()...)
			v6 = append(v6, b.set.v6()...)
		}
		exp = fromUnsorted(v4, v6)
	}
	a.batches = slices.Delete(a.batches, 0, n)
	a.cooling.remove(exp)
	back := exp.Intersect(a.pool)
	a.free.add(back)
	if a.freeSize == MaxCount {
		a.freeSize = a.free.s.Size()
	} else {
		a.freeSize = a.freeSize.Add(back.Size())
	}
	return exp
}

// Allocate hands out n addresses at time now and returns them. If fewer
// than n addresses are available it returns an *ExhaustedError and changes
// nothing. It never returns an allocated or cooling address.
//
// near should be the requester's current holdings. The choice, in order:
//
//  0. the holes between near's ranges that are entirely free, smallest
//     first, as long as they fit in n: each joins two of the holder's runs
//     (the rest of n is then chosen by the steps below, near including
//     the holes);
//  1. n addresses right next to a range of near (extending it or filling
//     a gap), so the holder's routes aggregate, unless that would need
//     more routes than a fresh block;
//  2. else the smallest free aligned power-of-two block that holds n
//     (buddy style, lowest address first), using its first n addresses
//     (with SetRoom and nothing near, one with room to grow above them);
//  3. else the largest free aligned blocks, lowest first, until n are
//     gathered (the last need is again served by the smallest block that
//     fits).
//
// Allocations are within one family only if the pool is; use one
// Allocator per family for dual-stack.
func (a *Allocator) Allocate(n int, near Set, now time.Time) (Set, error) {
	if n < 0 {
		return Set{}, fmt.Errorf("cannot allocate %d addresses", n)
	}
	a.Expire(now)
	if n == 0 {
		return Set{}, nil
	}
	if a.freeSize.Cmp(CountOf(uint64(n))) < 0 {
		return Set{}, &ExhaustedError{Requested: n, Available: a.freeSize}
	}
	pick, got := a.gaps(uint64(n), near)
	a.take(pick, got)
	if got < uint64(n) {
		rest := a.pick(uint64(n)-got, near.Union(pick))
		a.take(rest, uint64(n)-got)
		pick = pick.Union(rest)
	}
	return pick, nil
}

// take moves pick, free and of size k, to allocated.
func (a *Allocator) take(pick Set, k uint64) {
	if k == 0 {
		return
	}
	a.allocated.add(pick)
	a.free.remove(pick)
	if a.freeSize == MaxCount {
		a.freeSize = a.free.s.Size()
	} else {
		a.freeSize = a.freeSize.Sub(CountOf(k))
	}
}

// gaps implements step 1 of Allocate: the holes between near's ranges that are entirely free
// and together hold at most n addresses, smallest first. Filling a hole whole joins two of the
// holder's runs into one, so each one taken is a route fewer. It returns them and their size.
func (a *Allocator) gaps(n uint64, near Set) (Set, uint64) {
	type gap struct {
		g    rng
		size uint64
		is4  bool
	}
	var cands []gap
	for _, is4 := range []bool{true, false} {
		nr, fr := near.fam(is4), a.free.s.fam(is4)
		k := 0
		for i := 0; i+1 < len(nr) && len(fr) > 0; i++ {
			g := rng{nr[i].hi.add1(), nr[i+1].lo.sub1()}
			sz := g.size()
			if sz.hi != 0 || sz.lo > n {
				continue
			}
			if k = seekHi(fr, k, g.lo); k == len(fr) {
				break
			}
			if fr[k].lo.lessEq(g.lo) && g.hi.lessEq(fr[k].hi) {
				cands = append(cands, gap{g, sz.lo, is4})
			}
		}
	}
	if len(cands) == 0 {
		return Set{}, 0
	}
	slices.SortStableFunc(cands, func(x, y gap) int { return cmp.Compare(x.size, y.size) })
	var v4, v6 []rng
	got := uint64(0)
	for _, c := range cands {
		if got+c.size > n {
			break
		}
		got += c.size
		if c.is4 {
			v4 = append(v4, c.g)
		} else {
			v6 = append(v6, c.g)
		}
	}
	return fromUnsorted(v4, v6), got
}

// SetRoom makes a holder with nothing yet get its first addresses at the start of the smallest
// free aligned block of at least 2^roomBits times the request (rounded up to a power of two),
// where the pool has one: the rest of the block stays free above the holder's run, and other
// holders' first addresses come from other blocks, so the holder's growth extends its run
// instead of starting another. 0 (the default) turns it off: the smallest block that fits.
func (a *Allocator) SetRoom(roomBits int) { a.roomBits = min(max(roomBits, 0), 16) }

// pick chooses n free addresses; a.free must hold at least n.
func (a *Allocator) pick(n uint64, near Set) Set {
	if near.IsEmpty() {
		if k := bits.Len64(n-1) + a.roomBits; a.roomBits > 0 && k < 64 {
			if b, ok := a.smallestBlock(k, false); ok {
				return b.first(n)
			}
		}
		return a.pickBlocks(n)
	}
	block := a.pickBlocks(n)
	// Route cost of the block choice, to compare with extending near.
	blockCost := 0
	for i, g := range block.rs {
		is4 := i < block.n4
		blockCost += routeDelta(near.fam(is4), famBits(is4), g)
	}
	best, bestIs4, bestCost := rng{}, false, -1
	for _, is4 := range []bool{true, false} {
		nr, fr := near.fam(is4), a.free.s.fam(is4)
		if len(nr) == 0 || len(fr) == 0 {
			continue
		}
		nbits, fmax := famBits(is4), famMax(is4)
		span := u128{0, n - 1}
		consider := func(g rng) {
			if c := routeDelta(nr, nbits, g); bestCost < 0 || c < bestCost {
				best, bestIs4, bestCost = g, is4, c
			}
		}
		for _, r := range nr {
			// Before r: [r.lo-n, r.lo-1] if free.
			if !r.lo.isZero() {
				v := r.lo.sub1()
				if k := seekHi(fr, 0, v); k < len(fr) && fr[k].lo.lessEq(v) && span.lessEq(v.sub(fr[k].lo)) {
					consider(rng{v.sub(span), v})
				}
			}
			// After r: [r.hi+1, r.hi+n] if free.
			if r.hi != fmax {
				v := r.hi.add1()
				if k := seekHi(fr, 0, v); k < len(fr) && fr[k].lo.lessEq(v) && span.lessEq(fr[k].hi.sub(v)) {
					consider(rng{v, v.addU64(n - 1)})
				}
			}
		}
	}
	if bestCost >= 0 && bestCost <= blockCost {
		if bestIs4 {
			return Set{rs: []rng{best}, n4: 1}
		}
		return Set{rs: []rng{best}}
	}
	return block
}

// routeDelta returns how many more CIDR routes near (one family, canonical)
// needs once g, which must not overlap it, is added.
func routeDelta(near []rng, nbits int, g rng) int {
	merged, before := g, 0
	i := 0
	if !g.lo.isZero() {
		i = seekHi(near, 0, g.lo.sub1())
	}
	for ; i < len(near) && (g.hi == maxU128 || near[i].lo.lessEq(g.hi.add1())); i++ {
		before += near[i].numPrefixes(nbits)
		if near[i].lo.less(merged.lo) {
			merged.lo = near[i].lo
		}
		if merged.hi.less(near[i].hi) {
			merged.hi = near[i].hi
		}
	}
	return merged.numPrefixes(nbits) - before
}

// blockRef is a free aligned block found while searching.
type blockRef struct {
	start u128
	is4   bool
}

// first returns the first n addresses of the block.
func (b blockRef) first(n uint64) Set {
	g := rng{b.start, b.start.addU64(n - 1)}
	if b.is4 {
		return Set{rs: []rng{g}, n4: 1}
	}
	return Set{rs: []rng{g}}
}

// smallestBlock finds the smallest free aligned block of at least 2^k addresses (of exactly
// 2^k when exact), lowest first.
func (a *Allocator) smallestBlock(k int, exact bool) (blockRef, bool) {
	var best blockRef
	bestK := -1
	for _, is4 := range []bool{true, false} {
		nbits := famBits(is4)
		if k > nbits {
			continue
		}
		minSpan := lowMask(k) // a range must hold 2^k addresses
		for _, g := range a.free.s.fam(is4) {
			if g.hi.sub(g.lo).less(minSpan) {
				continue
			}
			g.blocks(nbits, func(start u128, bk int) bool {
				if bk >= k && (bestK < 0 || bk < bestK) {
					best, bestK = blockRef{start, is4}, bk
				}
				return bestK != k
			})
			if bestK == k {
				break
			}
		}
		if bestK == k {
			break
		}
	}
	return best, bestK >= 0 && (!exact || bestK == k)
}

// pickBlocks implements steps 2 and 3 of Allocate.
func (a *Allocator) pickBlocks(n uint64) Set {
	k := bits.Len64(n - 1) // 2^k >= n
	if b, ok := a.smallestBlock(k, false); ok {
		return b.first(n)
	}

	// No single block fits: bucket all free blocks by size. All are
	// smaller than 2^k <= 2^64.
	var buckets [65][]blockRef
	for _, is4 := range []bool{true, false} {
		nbits := famBits(is4)
		for _, g := range a.free.s.fam(is4) {
			g.blocks(nbits, func(start u128, bk int) bool {
				buckets[bk] = append(buckets[bk], blockRef{start, is4})
				return true
			})
		}
	}
	var v4, v6 []rng
	take := func(b blockRef, cnt uint64) {
		g := rng{b.start, b.start.addU64(cnt - 1)}
		if b.is4 {
			v4 = append(v4, g)
		} else {
			v6 = append(v6, g)
		}
	}
	for left := n; left > 0; {
		c := bits.Len64(left - 1)
		j := c
		for j < len(buckets) && len(buckets[j]) == 0 {
			j++
		}
		if j < len(buckets) {
			take(buckets[j][0], left)
			break
		}
		for j = c - 1; len(buckets[j]) == 0; j-- {
		}
		take(buckets[j][0], 1<<uint(j))
		buckets[j] = buckets[j][1:]
		left -= 1 << uint(j)
	}
	return fromUnsorted(v4, v6)
}

// ExhaustedError is returned by Allocate when the pool has fewer usable
// addresses than requested.
type ExhaustedError struct {
	Requested int   // addresses asked for
	Available Count // addresses usable at the time
}

// Error implements error.
func (e *ExhaustedError) Error() string {
	return fmt.Sprintf("pool has %s usable addresses, need %d", e.Available, e.Requested)
}

// AlreadyAllocatedError is returned by Reserve for addresses that are
// already allocated.
type AlreadyAllocatedError struct {
	Addrs Set // the offending addresses
}

// Error implements error.
func (e *AlreadyAllocatedError) Error() string {
	return "addresses already allocated: " + summarize(e.Addrs)
}

// NotAllocatedError is returned by Free for addresses that are not
// allocated.
type NotAllocatedError struct {
	Addrs Set // the offending addresses
}

// Error implements error.
func (e *NotAllocatedError) Error() string {
	return "addresses not allocated: " + summarize(e.Addrs)
}

// summarize formats s for an error message, eliding long sets.
func summarize(s Set) string {
	const maxItems = 8
	if len(s.rs) <= maxItems {
		return s.String()
	}
	head := Set{rs: s.rs[:maxItems], n4: min(s.n4, maxItems)}
	return fmt.Sprintf("%s,... (%d ranges, %s addresses)", head, len(s.rs), s.Size())
}

package scaling

import (
	"net/netip"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// ChooseRelease picks k addresses to give back from free, the part of held the node does not
// use (free must be a subset of held; anything else in it is ignored). It keeps the node's
// holding as few contiguous runs as it can, so node routes stay aggregated:
//
//  1. whole runs that are entirely free and fit in what is left to give, smallest first
//     (each removes a fragment);
//  2. free addresses at either end of a run, taken from the smallest run first, high end before
//     low end (shrinking a run never splits it);
//  3. only then free addresses inside a run, highest first (each splits a run in two).
//
// Ties go to the higher address. It returns fewer than k addresses only when free holds fewer.
func ChooseRelease(held, free addr.Set, k int) addr.Set {
	return ChooseReleaseBounded(held, free, k, k)
}

// ChooseReleaseBounded is ChooseRelease giving at most k addresses, of which only the first
// least may split a run (step 3): past least it stops where every free address left lies inside
// a run. Steps 1 and 2 never add a run, so the node keeps its holding in as few runs as before.
func ChooseReleaseBounded(held, free addr.Set, k, least int) addr.Set {
	free = free.Intersect(held)
	least = min(least, k)
	if k <= 0 || free.IsEmpty() {
		return addr.Set{}
	}
	remaining := held
	var chosen []netip.Addr
	need := k
	take := func(a netip.Addr) {
		chosen = append(chosen, a)
		remaining = remaining.Subtract(addr.SetOfAddrs(a))
		free = free.Subtract(addr.SetOfAddrs(a))
		need--
	}
	for need > 0 && !free.IsEmpty() {
		runs := remaining.Ranges()
		// 1. Smallest entirely free run that fits.
		best, bestSize := -1, uint64(0)
		for i, r := range runs {
			n, ok := r.Size().Uint64()
			if !ok || n > uint64(need) || !free.ContainsRange(r) {
				continue
			}
			if best < 0 || n < bestSize || (n == bestSize && runs[best].First.Less(r.First)) {
				best, bestSize = i, n
			}
		}
		if best >= 0 {
			for _, a := range addr.NewSet(runs[best]).Addrs(int(bestSize)) {
				take(a)
			}
			continue
		}
		// 2. An end of the smallest run that has a free end.
		var edge netip.Addr
		var edgeRunSize addr.Count
		for _, r := range runs {
			for _, a := range []netip.Addr{r.Last, r.First} {
				if !free.Contains(a) {
					continue
				}
				sz := r.Size()
				if !edge.IsValid() || sz.Cmp(edgeRunSize) < 0 || (sz.Cmp(edgeRunSize) == 0 && edge.Less(a)) {
					edge, edgeRunSize = a, sz
				}
			}
		}
		if edge.IsValid() {
			take(edge)
			continue
		}
		// 3. The highest free address inside a run, while fewer than least are chosen.
		if len(chosen) >= least {
			break
		}
		fr := free.Ranges()
		take(fr[len(fr)-1].Last)
	}
	return addr.SetOfAddrs(chosen...)
}

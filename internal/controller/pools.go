package controller

import (
	"sort"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// PoolAddresses names a pool's address set with its creation order.
type PoolAddresses struct {
	Name      string
	Created   time.Time
	Addresses addr.Set
	// Network is the pool's spec.network: pools on different networks never overlap.
	Network string
}

// Overlaps finds pools that share addresses with an older pool of the same network. The older pool keeps serving; the
// younger one is invalid until the overlap is removed. Ties in age go by name. The result maps
// each invalid pool to the pool it overlaps.
func Overlaps(pools []PoolAddresses) map[string]string {
	sorted := append([]PoolAddresses(nil), pools...)
	sort.Slice(sorted, func(i, j int) bool {
		if !sorted[i].Created.Equal(sorted[j].Created) {
			return sorted[i].Created.Before(sorted[j].Created)
		}
		return sorted[i].Name < sorted[j].Name
	})
	out := map[string]string{}
	for i, p := range sorted {
		for _, q := range sorted[:i] {
			if _, bad := out[q.Name]; bad {
				continue
			}
			if p.Network == q.Network && p.Addresses.Overlaps(q.Addresses) {
				out[p.Name] = q.Name
				break
			}
		}
	}
	return out
}

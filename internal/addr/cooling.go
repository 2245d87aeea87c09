package addr

import "time"

// CoolingBatch is a set of addresses freed at one time.
type CoolingBatch struct {
	Addrs Set       // the addresses freed together
	Freed time.Time // when they were freed
}

// CoolingBatches returns the cooling addresses in batches, oldest first, so a caller can persist
// them and later restore them with Reserve followed by Free at each batch's time.
func (a *Allocator) CoolingBatches() []CoolingBatch {
	out := make([]CoolingBatch, 0, len(a.batches))
	for _, b := range a.batches {
		out = append(out, CoolingBatch{Addrs: b.set, Freed: b.at})
	}
	return out
}

// Unreserve returns allocated addresses straight to the free pool, with no cooldown. It is for
// addresses that were reserved but provably never handed out (a write that the API server
// rejected). If any address of s is not allocated it returns a *NotAllocatedError and changes
// nothing.
func (a *Allocator) Unreserve(s Set) error {
	if s.IsEmpty() {
		return nil
	}
	if !a.allocated.s.ContainsSet(s) {
		return &NotAllocatedError{Addrs: s.Subtract(a.allocated.s)}
	}
	a.allocated.remove(s)
	a.free.add(s.Intersect(a.pool))
	a.freeSize = a.free.s.Size()
	return nil
}

// SetCooldown changes the cooldown; batches already cooling expire by the new value.
func (a *Allocator) SetCooldown(d time.Duration) { a.cooldown = max(d, 0) }

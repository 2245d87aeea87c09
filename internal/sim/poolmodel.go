package sim

import (
	"slices"
	"time"
)

// poolModel keeps, as counters, the numbers a pool's status is made of, and mirrors when
// controller.State marks the pool dirty and expires cooled-down addresses, so the simulation can
// tell whether the controller's pool status write would change anything without computing the
// status (see flushPool). Tests check the mirror against the real State (exact).
type poolModel struct {
	capacity int64
	held     int64 // held by nodes as the controller's record says (committed fills)
	inflight int64 // reserved by fills whose status write has not landed
	holders  int64 // nodes holding at least one address
	// batches are addresses freed by take-backs, cooling down in the pool, by free time.
	batches []coolBatch
	cooling int64
	// records are the until times of the cooling records written to the pool status.
	records           []time.Duration
	recAdded, recPrun int
	// dirty mirrors the state's mark that the pool status needs a write.
	dirty bool
	// starved: a fill fell short since the pool status was last computed.
	starved bool
	// last is the status last written.
	last poolPrint
}

type coolBatch struct {
	at time.Duration
	n  int64
}

// poolPrint identifies a pool status: two statuses of the simulated pool are equal exactly when
// their prints are (capacity and generation never change; free follows from allocated).
type poolPrint struct {
	allocated, nodes  int64
	exhausted         bool
	recAdded, recPrun int
}

// free records n addresses freed at 'at' (Commit of a take-back).
func (m *poolModel) free(at time.Duration, n int64) {
	i := len(m.batches)
	for i > 0 && at < m.batches[i-1].at {
		i--
	}
	m.batches = slices.Insert(m.batches, i, coolBatch{at: at, n: n})
	m.cooling += n
}

// expireBatches returns cooled-down batches to the free pool, as Allocator.Expire does when
// PlanFill, MarkExpiredCooling or PoolStatus calls it.
func (m *poolModel) expireBatches(now, cooldown time.Duration) {
	k := 0
	for k < len(m.batches) && m.batches[k].at+cooldown <= now {
		m.cooling -= m.batches[k].n
		k++
	}
	m.batches = m.batches[k:]
}

// markExpired mirrors State.MarkExpiredCooling: a cooling record or batch that ended by now
// makes the pool dirty, and ended batches are expired.
func (m *poolModel) markExpired(now, cooldown time.Duration) {
	if len(m.records) > 0 && m.records[0] <= now {
		m.dirty = true
	}
	if len(m.batches) > 0 && m.batches[0].at+cooldown <= now {
		m.dirty = true
		m.expireBatches(now, cooldown)
	}
}

// computed mirrors what PoolStatus does to the state: expire batches, prune the cooling
// records that ended, clear the dirty mark.
func (m *poolModel) computed(now, cooldown time.Duration) {
	m.expireBatches(now, cooldown)
	for len(m.records) > 0 && m.records[0] <= now {
		m.records = m.records[1:]
		m.recPrun++
	}
	m.dirty = false
}

// coolingAt counts the addresses still cooling at now, changing nothing.
func (m *poolModel) coolingAt(now, cooldown time.Duration) int64 {
	c := m.cooling
	for _, b := range m.batches {
		if b.at+cooldown > now {
			break
		}
		c -= b.n
	}
	return c
}

// print is the status the pool would have now, given its exhausted flag. The status lists the
// cooling records recPrun..recAdded-1; every empty list is the same.
func (m *poolModel) print(exhausted bool) poolPrint {
	p := poolPrint{allocated: m.held + m.inflight + m.cooling, nodes: m.holders, exhausted: exhausted, recAdded: m.recAdded, recPrun: m.recPrun}
	if p.recAdded == p.recPrun {
		p.recAdded, p.recPrun = 0, 0
	}
	return p
}

package controller

import (
	"sort"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
)

// AuditResult compares the controller's record with NodeIPAllocation statuses freshly listed from
// the API server: the slow backstop behind the dirty-only node syncs.
type AuditResult struct {
	// Unpublished: addresses the record has a node holding that its status does not show (a
	// lost write, or an object deleted under the controller). Syncing those nodes rewrites or
	// releases them.
	Unpublished map[string]addr.Set
	// Adopted: addresses a status shows that the record did not have and no other node holds;
	// Audit reserves them for that node so they are never handed out twice.
	Adopted map[string]addr.Set
	// Twice: addresses two nodes' statuses show (or a status shows while the record gives them
	// to another node). Only an operator can tell which pod really uses them.
	Twice addr.Set
	// Leaked: allocated in a pool but held by no node and pending for none: returned to the pool.
	Leaked addr.Set
}

// ConfirmTwice is what two audits, the second on a later list, both found held twice: held by two
// nodes at rest. A list is not one moment of the controller's record: a status listed just before
// a take-back and a grant landed shows an address the record has already moved to another node,
// which one audit alone would report as held twice (an alarm an operator would act on).
func ConfirmTwice(first, second addr.Set) addr.Set { return first.Intersect(second) }

// Nodes lists the nodes an audit found out of step, to sync them.
func (r AuditResult) Nodes() []string {
	seen := map[string]bool{}
	for n := range r.Unpublished {
		seen[n] = true
	}
	for n := range r.Adopted {
		seen[n] = true
	}
	out := make([]string, 0, len(seen))
	for n := range seen {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Candidates is the number of addresses the audit found out of step.
func (r AuditResult) Candidates() int {
	n := count(r.Twice) + count(r.Leaked)
	for _, s := range r.Unpublished {
		n += count(s)
	}
	for _, s := range r.Adopted {
		n += count(s)
	}
	return n
}

// Audit compares the record with the listed statuses and repairs what it safely can: it adopts
// addresses a status shows that nobody else holds, and returns allocations that no node holds or
// awaits to their pool (with the cooldown).
func (s *State) Audit(allocs []ipwardenv1.NodeIPAllocation) AuditResult {
	r := AuditResult{Unpublished: map[string]addr.Set{}, Adopted: map[string]addr.Set{}}
	listed := map[string]map[string]addr.Set{} // node -> pool -> status addresses
	sort.Slice(allocs, func(i, j int) bool { return allocs[i].Name < allocs[j].Name })
	// Pools on different networks may overlap (one address on eth0 of one pod and net1 of
	// another): an address is held twice only if two statuses list it on one network.
	networkOf := func(pool string) string {
		if p, ok := s.pools[pool]; ok {
			return p.cfg.Network
		}
		return ""
	}
	all := map[string][]addr.Range{} // network -> listed ranges
	total := map[string]uint64{}
	for _, a := range allocs {
		for _, ps := range a.Status.Pools {
			set, err := addr.ParseSet(ps.Addresses)
			if err != nil {
				continue
			}
			net := networkOf(ps.Pool)
			all[net] = append(all[net], set.Ranges()...)
			n, _ := set.Size().Uint64()
			total[net] += n
			if listed[a.Name] == nil {
				listed[a.Name] = map[string]addr.Set{}
			}
			listed[a.Name][ps.Pool] = set
		}
	}
	// One merge of every listed range per network; only if the sizes disagree is anything held
	// twice, and then a pass in name order finds which addresses.
	for net, ranges := range all {
		if n, _ := addr.NewSet(ranges...).Size().Uint64(); n == total[net] {
			continue
		}
		var seen addr.Set
		for _, a := range allocs {
			for pool, set := range listed[a.Name] {
				if networkOf(pool) == net {
					r.Twice = r.Twice.Union(seen.Intersect(set))
					seen = seen.Union(set)
				}
			}
		}
	}
	// A claim address two nodes list under a shared grant naming both is not held twice.
	for name, p := range s.pools {
		for _, g := range p.shared {
			if !r.Twice.Contains(g.addr) {
				continue
			}
			listers := 0
			for node, pools := range listed {
				for pool, set := range pools {
					if networkOf(pool) == networkOf(name) && set.Contains(g.addr) {
						if !g.names(node) {
							listers = 3
						}
						listers++
					}
				}
			}
			if listers <= 2 {
				r.Twice = r.Twice.Subtract(addr.SetOfAddrs(g.addr))
			}
		}
	}
	// The record against the statuses.
	for name, n := range s.nodes {
		for pool, held := range n.held {
			if miss := held.Subtract(listed[name][pool]); !miss.IsEmpty() {
				r.Unpublished[name] = r.Unpublished[name].Union(miss)
			}
		}
	}
	for name, pools := range listed {
		n := s.node(name)
		for pool, set := range pools {
			extra := set.Subtract(n.held[pool]).Subtract(n.pending[pool]).Subtract(n.inflight[pool])
			if extra.IsEmpty() {
				continue
			}
			p := s.pool(pool)
			if busy := extra.Intersect(p.alloc.Allocated()); !busy.IsEmpty() {
				r.Twice = r.Twice.Union(busy)
				extra = extra.Subtract(busy)
			}
			if extra.IsEmpty() {
				continue
			}
			if err := p.alloc.Reserve(extra); err == nil {
				n.held[pool] = n.held[pool].Union(extra)
				p.holders[name] = count(n.held[pool])
				p.dirty = true
				r.Adopted[name] = r.Adopted[name].Union(extra)
			}
		}
	}
	// Allocations nobody holds or awaits.
	owned := map[string][]addr.Range{}
	for _, n := range s.nodes {
		for pool, h := range n.held {
			owned[pool] = append(owned[pool], h.Ranges()...)
		}
		for pool, h := range n.pending {
			owned[pool] = append(owned[pool], h.Ranges()...)
		}
		for pool, h := range n.inflight {
			owned[pool] = append(owned[pool], h.Ranges()...)
		}
	}
	for name, p := range s.pools {
		if leak := p.alloc.Allocated().Subtract(addr.NewSet(owned[name]...)); !leak.IsEmpty() {
			r.Leaked = r.Leaked.Union(leak)
			_ = p.alloc.Unreserve(leak)
			p.dirty = true
		}
	}
	return r
}

package ipam

import (
	"maps"
	"slices"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// The previous IPAM's reservations (docs/design.md, "Taking over from another IPAM"). A pod
// whose ADD went through the IPAM the node ran before ipwarden, just before the node switched,
// uses its address before its status.podIPs shows it, so adoption (PlanRebuild) cannot know it
// yet. What that IPAM reserved is a fact the agent reads (package previous: host-local's files,
// Whereabouts' IPPools) at every ADD whose CNI configuration names it as "previous", before the
// ADD picks, and hands in here per CNI network. Every address so reserved is out of use for
// ipwarden: never handed out, never given back, counted as demand; until a
// later reading no longer shows it (the previous IPAM released it: the pod's DEL went to it
// through "previous"). Nothing else frees it: the reading is the previous IPAM's own word. Reservations that
// belong to this node alone (host-local's) are also claimed, so the controller grants them to this
// node and to no other. The readings are memory only: after a restart the next ADD reads again
// before it picks.

// previousReading is what the previous IPAM of one CNI network reserved at the last reading.
type previousReading struct {
	reserved addr.Set
	// nodeLocal: the reservations are this node's alone (host-local's files).
	nodeLocal bool
}

// SetPrevious records what the previous IPAM of CNI network network reserves, as just read;
// nodeLocal says the reservations are this node's alone. It replaces the network's last reading.
func (s *State) SetPrevious(network string, reserved addr.Set, nodeLocal bool) {
	if s.previous == nil {
		s.previous = map[string]previousReading{}
	}
	s.previous[network] = previousReading{reserved: reserved, nodeLocal: nodeLocal}
	s.unionPrevious()
}

// AddPrevious adds more to what the previous IPAM of CNI network network reserves: addresses it
// reserved after the last reading, found when ipwarden's own reservation of them was refused
// (package previous: TakenError). The next reading replaces it all.
func (s *State) AddPrevious(network string, more addr.Set, nodeLocal bool) {
	s.SetPrevious(network, s.previous[network].reserved.Union(more), nodeLocal)
}

// ClearPrevious forgets the previous IPAM of CNI network network: its configuration no longer
// names one.
func (s *State) ClearPrevious(network string) {
	if _, ok := s.previous[network]; !ok {
		return
	}
	delete(s.previous, network)
	s.unionPrevious()
}

func (s *State) unionPrevious() {
	s.prevAll, s.prevLocal = addr.Set{}, addr.Set{}
	for _, n := range slices.Sorted(maps.Keys(s.previous)) {
		r := s.previous[n]
		s.prevAll = s.prevAll.Union(r.reserved)
		if r.nodeLocal {
			s.prevLocal = s.prevLocal.Union(r.reserved)
		}
	}
}

// PreviousReserved returns what the previous IPAMs reserve, every network's last reading together.
func (s *State) PreviousReserved() addr.Set { return s.prevAll }

// PreviousOut returns the addresses of a pool that the previous IPAM's reservations keep out of
// ipwarden's use: those the node holds that no attachment uses (an attachment's address is in
// use anyway: an adopted pod's address is also the previous IPAM's reservation) and that are
// not already out of use for another reason (other, e.g. the unattributed hold).
func PreviousOut(reserved, held, inUse, other addr.Set) addr.Set {
	return reserved.Intersect(held).Subtract(inUse).Subtract(other)
}

// PreviousClaims returns the node-local reservations (host-local's) that the node must claim in a
// pool: those in the pool's usable addresses that the node does not hold, so the controller
// grants them to this node and never to another. With the pool's spec unknown (!usableKnown)
// nothing is claimed: the reservation may lie outside the pool.
func PreviousClaims(local, held, usable addr.Set, usableKnown bool) addr.Set {
	if !usableKnown {
		return addr.Set{}
	}
	return local.Intersect(usable).Subtract(held)
}

// previousOut is PreviousOut for pool p: beyond addresses in use, those already kept out of use
// by the unattributed hold, a lost reservation ahead or a cooldown are not counted twice.
func (s *State) previousOut(p *poolState) addr.Set {
	if s.prevAll.IsEmpty() || !p.heldKnown {
		return addr.Set{}
	}
	return PreviousOut(s.prevAll, p.held, p.inUseSet(), p.unattributed.Union(p.lost).Union(p.stillCooling(s.clock)).Union(p.relSet))
}

// previousClaims is PreviousClaims for pool p.
func (s *State) previousClaims(p *poolState) addr.Set {
	if s.prevLocal.IsEmpty() || !p.heldKnown {
		return addr.Set{}
	}
	return PreviousClaims(s.prevLocal, p.held, p.usable, p.usableKnown)
}

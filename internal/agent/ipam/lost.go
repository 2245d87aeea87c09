package ipam

import (
	"github.com/ipwarden/ipwarden/internal/addr"
)

// Records of addresses reserved ahead, left by an older agent.
//
// Agents of journal format 2 before this one journaled a few addresses of each pool as
// "reserved ahead" and answered an ADD whose every address was one of them before the ADD's own
// journal write. After a crash between that answer and that write, such a record is the only
// trace of an address a running sandbox may use, and nothing tells which sandbox: neither its
// container ID nor its network namespace reached the disk, so no DEL, no CNI GC and no check of
// the node's network namespaces can ever prove that sandbox gone, and a pod's status.podIPs is a
// hint that can be stale, never the proof.
//
// This agent never answers before the journal write and never writes such records. It keeps
// every address that still has one out of use ("lost") for as long as the record exists: across
// restarts and clean stops, whatever the pods report. Lost addresses count as in use for demand
// (the controller grants others meanwhile) and as unattributed in Stats, LIST and the
// pool_unattributed_addresses gauge. There are at most the older agent's --reserve-ahead (2) per
// pool, on nodes whose agent crashed while on that version; docs/operations.md says how an
// operator reclaims them (a node whose sandboxes are all gone: drained and rebooted).

// LostAhead counts the addresses recorded as reserved ahead by an older agent that no
// attachment accounts for: they are out of use for as long as their records exist.
func (s *State) LostAhead() int {
	n := 0
	for _, p := range s.pools {
		n += count(p.lost.Subtract(p.inUseSet()))
	}
	return n
}

// AheadLost returns the addresses of pool recorded as reserved ahead by an older agent (tests,
// LIST).
func (s *State) AheadLost(pool string) addr.Set {
	if p, ok := s.pools[pool]; ok {
		return p.lost
	}
	return addr.Set{}
}

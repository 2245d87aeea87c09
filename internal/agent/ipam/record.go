package ipam

import (
	"fmt"
	"slices"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// The node's record rewinds (docs/design.md, "Claims and rewinds"). The NodeIPAllocation is
// not the only truth: the attachments are. Its status can show less than the node's pods use
// (etcd restored from an older snapshot, the object deleted and re-created) and, after a restore,
// more than the node holds: addresses the node gave back since the snapshot, which the
// controller may have handed to another node. So the agent
//
//   - claims, in its spec, the addresses its attachments use that its status lacks (Spec);
//   - remembers which object it last wrote and the generation of that write (RecordMark, in the
//     journal). A status on an object with another UID, or with a lower generation than the
//     agent's own last spec write, comes from a rewound or re-created record: the addresses it
//     shows that the node's last trusted holding lacked are suspect. PlanHoldings marks them
//     releasing: never handed out, given back;
//   - hands nothing out of the free set while its object is missing (SetRecordMissing).

// RecordMark identifies the NodeIPAllocation the node last wrote its spec to: its UID and the
// metadata.generation the write produced. A record with another UID or a lower generation has
// been rewound or re-created.
type RecordMark struct {
	UID        string `json:"uid"`
	Generation int64  `json:"generation"`
}

// IsRewound says whether an object with uid and generation is older than the node's mark:
// re-created (another UID) or rewound (a lower generation than the node's own last write).
// Without a mark (a new node, a lost journal) nothing is known to be rewound.
func IsRewound(mark RecordMark, uid string, generation int64) bool {
	if mark.UID == "" || uid == "" {
		return false
	}
	return uid != mark.UID || generation < mark.Generation
}

// Mark returns the node's record mark.
func (s *State) Mark() RecordMark { return s.mark }

// Rewound says whether the object (uid, generation) is older than the node's mark.
func (s *State) Rewound(uid string, generation int64) bool {
	return IsRewound(s.mark, uid, generation)
}

// SuspectAddresses is the distrust rule for one pool (PlanHoldings with distrust): what a rewound status shows beyond the last
// trusted holding, not in use and not already releasing. Without a trusted holding (never
// journaled one) every free address the status shows is suspect.
func SuspectAddresses(status, trusted addr.Set, trustedKnown bool, inUse, releasing addr.Set) addr.Set {
	s := status.Subtract(inUse).Subtract(releasing)
	if trustedKnown {
		s = s.Subtract(trusted)
	}
	return s
}

// SetRecordMissing records whether the node's NodeIPAllocation is missing (deleted by hand,
// not yet re-created). While it is, no address is handed out of the free set: what the node
// holds is no longer on record, and a controller that restarts meanwhile would see it free.
func (s *State) SetRecordMissing(missing bool) { s.recordMissing = missing }

// RecordMissing says whether the node's NodeIPAllocation is missing.
func (s *State) RecordMissing() bool { return s.recordMissing }

// claimed is what the node's attachments use from the pool that its status does not show:
// the node asks for it back in spec.pools[].claimed (nothing before the status is known).
func (p *poolState) claimed() addr.Set {
	if !p.heldKnown {
		return addr.Set{}
	}
	// An older agent's reservation ahead may be a running sandbox's (lost.go): claimed like an
	// attachment's address, so the controller hands it to no other node.
	return p.inUseSet().Union(p.lost).Subtract(p.held)
}

func deleteCooling(q []Cooling, s addr.Set) []Cooling {
	out := q[:0]
	for _, c := range q {
		if !s.Contains(c.Addr) {
			out = append(out, c)
		}
	}
	clear(q[len(out):])
	return out
}

func sortedNames[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func recordMissingReason(node string) string {
	return fmt.Sprintf("NodeIPAllocation %s is missing (deleted?): the node hands out no new address until it is back with its holding (the agent and the controller re-create it)", node)
}

// ShouldRecreate says whether the agent re-creates its node's missing NodeIPAllocation itself
// (docs/design.md, "A missing record"): only when the node had one before (its record mark is
// set), its pods use addresses, and its Node exists. The controller creates new nodes' objects
// and deletes those of nodes that are gone.
func ShouldRecreate(mark RecordMark, attachments int, nodeExists bool) bool {
	return mark.UID != "" && attachments > 0 && nodeExists
}

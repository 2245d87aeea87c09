package check

import (
	"net/netip"
	"slices"
	"strings"
)

// DRA reservations (docs/design.md, "Addresses the scheduler can see (DRA)"): the agent lists
// each as an attachment whose container ID is "dra:<claim UID>/<request>", and the claim's pod's
// own attachment lists the same address. That is one address of one pod, not an address on two
// attachments: the pod's first attachment of it is exempt from AttachedTwice; another pod's, or
// a second one of the same pod, is not.

func isReservation(at Attachment) bool { return strings.HasPrefix(at.ContainerID, "dra:") }

// reservationsFirst returns atts with the reservations first.
func reservationsFirst(atts []Attachment) []Attachment {
	out := slices.Clone(atts)
	slices.SortStableFunc(out, func(a, b Attachment) int {
		switch {
		case isReservation(a) == isReservation(b):
			return 0
		case isReservation(a):
			return -1
		}
		return 1
	})
	return out
}

// claimShares tracks the reserved addresses of one node, by the pod they are reserved for.
type claimShares struct {
	podOf  map[netip.Addr]string
	shared map[netip.Addr]bool
}

// exempt notes a reservation, or returns whether the pod's attachment at may list address a
// (its reservation's, not yet shared).
func (c *claimShares) exempt(at Attachment, a netip.Addr) bool {
	if c.podOf == nil {
		c.podOf, c.shared = map[netip.Addr]string{}, map[netip.Addr]bool{}
	}
	if isReservation(at) {
		if _, dup := c.podOf[a]; !dup {
			c.podOf[a] = at.PodUID
		}
		return false
	}
	if uid, ok := c.podOf[a]; ok && uid != "" && uid == at.PodUID && !c.shared[a] {
		c.shared[a] = true
		return true
	}
	return false
}

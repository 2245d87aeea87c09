package agent

import (
	"errors"
	"fmt"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/previous"
)

// The previous IPAM's store, as part of the machine's writes (docs/design.md, "What the previous
// IPAM reserved"). While an ADD's configuration names a "previous" IPAM whose store ipwarden
// writes (host-local, Whereabouts), the ADD's write is two steps, in this order: its addresses
// are made unavailable in that store (Write.Reserve, under that IPAM's own lock), then the
// journal write; the answer comes after both. When the previous IPAM reserved one of the
// addresses itself since the last reading (*previous.TakenError), nothing is journaled and the
// ADD picks again with those addresses out of use; any other failure fails the ADD with code 11,
// nothing handed out. A journal write refused after the reservation removes it again. A free
// of an attachment whose addresses were so reserved (ipam.Attachment.Previous) removes them
// from that store once its journal write landed (Write.Unreserve), before the machine hears of
// it.

// Reserve is ipwarden's reservation of one attachment's addresses in a previous IPAM's store.
type Reserve struct {
	Store        ipam.PreviousStore
	Reservations []previous.Reservation
}

// ReserveError is a reservation in the previous IPAM's store that failed for another reason than
// the previous IPAM's own reservation (its lock not taken in time, a write or an API error).
type ReserveError struct {
	Kind string
	Err  error
}

func (e *ReserveError) Error() string {
	return fmt.Sprintf("make the addresses unavailable in %s's store: %v", e.Kind, e.Err)
}

func (e *ReserveError) Unwrap() error { return e.Err }

// previousStore is where an ADD whose configuration names previous (the previous IPAM's ipam
// object, on CNI network network) reserves its addresses: host-local's directory, or Whereabouts'
// IPPools; nil for none (no previous, or one whose store ipwarden does not write). The driver
// refused a configuration Parse rejects before the request reached the machine.
func previousStore(raw []byte, network string) *ipam.PreviousStore {
	if len(raw) == 0 {
		return nil
	}
	src, err := previous.Parse(raw, network)
	if err != nil {
		return nil
	}
	switch src.Kind {
	case previous.HostLocal:
		return &ipam.PreviousStore{Kind: src.Kind.String(), Dir: src.Dir}
	case previous.Whereabouts:
		return &ipam.PreviousStore{Kind: src.Kind.String()}
	}
	return nil
}

// reserveOf is the reservation of att's addresses in its previous IPAM's store; adopted are the
// addresses it took over from its pod's rebuilt attachment (the pod's own: the previous IPAM's
// reservation of them is no conflict). Nil when att has no store.
func reserveOf(att ipam.Attachment, adopted addr.Set) *Reserve {
	if att.Previous == nil {
		return nil
	}
	rv := &Reserve{Store: *att.Previous}
	for _, a := range att.Addresses {
		rv.Reservations = append(rv.Reservations, previous.Reservation{Addr: a.Addr, ContainerID: att.Key.ContainerID, IfName: att.Key.IfName,
			Pod: att.Pod.Namespace + "/" + att.Pod.Name, Adopted: adopted.Contains(a.Addr)})
	}
	return rv
}

// withoutShared leaves out of rv the addresses two attachments hold (an IPAMClaim's during a
// live migration): the first holder's reservation in the previous IPAM's store covers the
// second, and a free of either leaves it for the other. (The file may outlive both, naming a
// gone container: it only keeps the previous IPAM off a claim's address.)
func (m *Machine) withoutShared(rv *Reserve) *Reserve {
	if rv == nil {
		return nil
	}
	kept := rv.Reservations[:0:0]
	for _, r := range rv.Reservations {
		shared := false
		for _, pool := range m.st.Served() {
			if len(m.st.Holders(pool, r.Addr)) > 1 {
				shared = true
			}
		}
		if !shared {
			kept = append(kept, r)
		}
	}
	if len(kept) == 0 {
		return nil
	}
	rv.Reservations = kept
	return rv
}

// rebuiltAddrs are the addresses of pod uid's attachments rebuilt from its status: an ADD of the
// pod adopts those of the pools it asks for.
func (m *Machine) rebuiltAddrs(uid string) addr.Set {
	var s addr.Set
	if uid == "" {
		return s
	}
	for _, k := range m.st.PodAttachments(uid) {
		if a, ok := m.st.Attachment(k); ok && a.Rebuilt {
			for _, ad := range a.Addresses {
				s = s.Union(addr.SetOfAddrs(ad.Addr))
			}
		}
	}
	return s
}

// reserveRefused handles ADD r's write refused by the previous IPAM's store: true when it did
// (the plan is aborted already). Taken addresses join the network's reading and the ADD picks
// again; another failure fails it with nothing handed out.
func (m *Machine) reserveRefused(r *mreq, err error) bool {
	var taken *previous.TakenError
	if errors.As(err, &taken) {
		m.log.Info("the previous IPAM reserved an address itself after ipwarden's reading; the ADD picks another",
			"network", r.add.Network, "type", taken.Kind.String(), "addresses", taken.Addrs.String(),
			"attachment", cniproto.Truncate(r.key.String(), logIDBytes))
		m.st.AddPrevious(r.add.Network, taken.Addrs, taken.Kind == previous.HostLocal)
		r.stage = stageWaiting
		m.tryAdd(r)
		return true
	}
	var re *ReserveError
	if errors.As(err, &re) {
		m.reply(r, errResp(cniproto.CodeTryAgainLater,
			fmt.Sprintf("ipwarden: the agent on node %s cannot make the address unavailable in the store of the previous IPAM %q of network %q: %s",
				m.cfg.Node, re.Kind, r.add.Network, cniproto.Truncate(re.Err.Error(), 300)),
			"nothing was handed out: without it a pod starting through the previous IPAM could get the same address; the runtime retries"))
		return true
	}
	return false
}

// isReserveError reports whether a write's outcome is the previous IPAM's store refusing the
// reservation (not the journal refusing the write).
func isReserveError(err error) bool {
	var taken *previous.TakenError
	var re *ReserveError
	return errors.As(err, &taken) || errors.As(err, &re)
}

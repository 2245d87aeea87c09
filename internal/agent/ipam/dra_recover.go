package ipam

import (
	"fmt"
	"net/netip"
	"slices"
	"time"
)

// Recovering DRA reservations after a lost journal (docs/design.md, "Addresses the scheduler can
// see (DRA)").
//
// The kubelet prepares a claim once: a claim it saw prepared is never prepared again, so a
// reservation lost with the journal would be lost for good. But the driver writes the claim's
// status.devices entry (its networkData names the address) only after the reservation's journal
// write landed, and the kubelet sees the claim prepared only after that write. So an entry of
// the driver for a device allocated to this node is the node's own evidence that it reserved
// that address for that claim, written before the journal was lost. The reservation then stays
// until the claim's pod is done (the kubelet's Unprepare) or the claim is no longer allocated to
// the node (the level reconcile): while the claim is allocated here and its pod may still run,
// the address was the reservation's up to the loss, and no ADD of this node handed it to
// another pod since it was reserved.
//
// After the journal is rebuilt, each such entry is one ReservationEvidence (read by the DRA
// driver, package dra), and DecideRecovery says whether the reservation is re-created from it,
// against what the rebuilt state shows (RecoveryFacts). What it does not re-create stays as a
// lost journal leaves it: the address is recorded for whoever the pods' reports name, or held
// by the hold until they report, and the claim's pod gets another address at its next ADD.

// ReservationEvidence is what a ResourceClaim shows of one reservation of this node: the
// driver's status.devices entry of a device allocated to the node.
type ReservationEvidence struct {
	// Claim is the claim, request and device; Interface is the entry's networkData.interfaceName.
	Claim ClaimDevice
	// Pod is the claim's one consumer (status.reservedFor).
	Pod PodRef
	// Pool is the IPPool the device is a slot of, among the pools serving the node ("": none).
	Pool string
	// Addr is the address the entry's networkData.ips names (its only one).
	Addr netip.Addr
}

// Key is the reservation's key.
func (e ReservationEvidence) Key() Key {
	return ReservationKey(e.Claim.UID, e.Claim.Request, e.Claim.Device)
}

// RecoveryOwner says which attachment, if any, uses the evidence's address in the rebuilt state.
type RecoveryOwner int

// RecoveryOwner values.
const (
	// OwnerNone: no attachment uses the address.
	OwnerNone RecoveryOwner = iota
	// OwnerPodRebuilt: the attachment rebuilt for the claim's own pod from its reports (its
	// sandbox runs with the address): the reservation takes the address over.
	OwnerPodRebuilt
	// OwnerPodAttachment: an attachment of the claim's own pod on the claim's interface, from an
	// ADD of this agent: it shares the address with the reservation, as after a Prepare.
	OwnerPodAttachment
	// OwnerOther: anything else (another pod's attachment, another reservation, the claim's pod
	// on another interface, an IPAMClaim's address two attachments share).
	OwnerOther
)

// RecoveryFacts is what the node's state shows of one piece of evidence.
type RecoveryFacts struct {
	// Reserved: the node holds a reservation under the evidence's key, with address ReservedAddr
	// (the journal was not lost, or an earlier start recovered it).
	Reserved     bool
	ReservedAddr netip.Addr
	// PodRuns: the claim's pod is among the node's pods and may run (Pod.MayRun).
	PodRuns bool
	// PodReportsOther: what the node can tell of the addresses the pod uses on the pool's network
	// (reportedOn) names addresses of the pool, and not this one.
	PodReportsOther bool
	// Served: the evidence's pool serves the node. Held: the node holds the address from it.
	Served, Held bool
	// Duplicate: another piece of evidence names the same address for another reservation, or the
	// same reservation with another address.
	Duplicate bool
	// OutOfUse: the address is releasing, cooling (freed on this node since the journal was
	// lost), or reserved ahead by an older agent.
	OutOfUse bool
	// Owner is who uses the address, OwnerKey its key.
	Owner    RecoveryOwner
	OwnerKey Key
}

// Recovery reasons (RecoveryOutcome.Reason); also the label of the agent's metric.
const (
	// RecoveryRecovered: the reservation is re-created from the evidence.
	RecoveryRecovered = "recovered"
	// RecoveryAlready: the node holds the reservation with that address.
	RecoveryAlready = "already_reserved"
	// RecoveryPodNotRunning: the claim's pod is gone or done: the kubelet unprepares it (or has),
	// and nothing is to be served from the reservation. Not a conflict.
	RecoveryPodNotRunning = "pod_not_running"
	// The conflicts: the claim's status names an address its pod will not get.
	RecoveryReservedOther  = "reserved_another_address"
	RecoveryPoolNotServing = "pool_not_serving"
	RecoveryNotHeld        = "address_not_held"
	RecoveryDuplicate      = "address_named_twice"
	RecoveryOutOfUse       = "address_out_of_use"
	RecoveryPodReportsElse = "pod_reports_another_address"
	RecoveryInUse          = "address_in_use"
)

// RecoveryReasons lists every reason, for the metric's labels.
var RecoveryReasons = []string{RecoveryRecovered, RecoveryAlready, RecoveryPodNotRunning, RecoveryReservedOther, RecoveryPoolNotServing,
	RecoveryNotHeld, RecoveryDuplicate, RecoveryOutOfUse, RecoveryPodReportsElse, RecoveryInUse}

// IsRecoveryConflict reports whether reason leaves a claim's status naming an address the node
// does not reserve for it (a conflict to report), as opposed to recovered or nothing to recover.
func IsRecoveryConflict(reason string) bool {
	return reason != RecoveryRecovered && reason != RecoveryAlready && reason != RecoveryPodNotRunning
}

// DecideRecovery decides whether a reservation is re-created from evidence of address a with
// facts f; it returns RecoveryRecovered or the reason it is not. The rules, in order:
//
//  1. the node already reserves it: nothing to do (with another address: kept, a conflict);
//  2. the claim's pod is gone or done: nothing to recover (the kubelet unprepares it);
//  3. the device's pool no longer serves the node, or the node does not hold the address: not
//     the node's to reserve;
//  4. two pieces of evidence name one address (or one reservation two addresses): neither;
//  5. the address is releasing, cooling or reserved ahead: the node moved it on since the loss;
//  6. the pod's own reports name another address of the pool and not this one: its sandbox runs
//     with another address, so the entry is older than the reservation it names (lost before);
//  7. the address is free, or the pod's own attachment uses it: recovered; any other user keeps
//     it (never two owners), a conflict.
func DecideRecovery(f RecoveryFacts, a netip.Addr) string {
	switch {
	case f.Reserved && f.ReservedAddr == a:
		return RecoveryAlready
	case f.Reserved:
		return RecoveryReservedOther
	case !f.PodRuns:
		return RecoveryPodNotRunning
	case !f.Served:
		return RecoveryPoolNotServing
	case !f.Held:
		return RecoveryNotHeld
	case f.Duplicate:
		return RecoveryDuplicate
	case f.OutOfUse:
		return RecoveryOutOfUse
	case f.PodReportsOther:
		return RecoveryPodReportsElse
	case f.Owner == OwnerNone, f.Owner == OwnerPodRebuilt, f.Owner == OwnerPodAttachment:
		return RecoveryRecovered
	default:
		return RecoveryInUse
	}
}

// RecoveryOutcome is the decision on one piece of evidence.
type RecoveryOutcome struct {
	Evidence ReservationEvidence
	Reason   string
	// Owner is the attachment that used the address: the conflict's, or the claim's pod's own
	// that the reservation took over or shares with (zero: none).
	Owner Key
}

// RecoverPlan is a recovery planned by PlanRecoverReservations: the reservations it records and
// the attachments it takes addresses from or shares them with are pending until it is applied
// or aborted.
type RecoverPlan struct {
	Change   Change
	Outcomes []RecoveryOutcome
	keys     []Key
	prior    map[Key]*Attachment
	// owners are the recovered addresses' users before the plan (absent: none).
	owners           map[Address]Key
	fromUnattributed []Address
}

// Changes implements Plan.
func (p RecoverPlan) Changes() Change { return p.Change }

// Recovered counts the reservations the plan re-creates.
func (p RecoverPlan) Recovered() int {
	n := 0
	for _, o := range p.Outcomes {
		if o.Reason == RecoveryRecovered {
			n++
		}
	}
	return n
}

// PlanRecoverReservations plans re-creating the reservations evs show (DecideRecovery on each,
// against the state as the rebuild left it: the pods last set, the runtime's last reading). A
// recovered reservation owns its address: an attachment rebuilt for the claim's pod gives the
// address up to it (it is dropped when nothing is left), an attachment of the pod's own ADD on
// the claim's interface shares it, as after a Prepare. It is meant for the start after a lost
// or damaged journal, before the hold starts and before any ADD or Prepare is served.
func (s *State) PlanRecoverReservations(evs []ReservationEvidence, now time.Time) RecoverPlan {
	s.observe(now)
	plan := RecoverPlan{prior: map[Key]*Attachment{}, owners: map[Address]Key{}}
	touch := func(k Key) {
		if _, seen := plan.prior[k]; seen {
			return
		}
		plan.keys = append(plan.keys, k)
		if a := s.atts[k]; a != nil {
			plan.prior[k] = a.clone()
		} else {
			plan.prior[k] = nil
		}
	}
	byAddr := map[netip.Addr]map[Key]bool{}
	byKey := map[Key]map[netip.Addr]bool{}
	for _, e := range evs {
		k := e.Key()
		if byAddr[e.Addr] == nil {
			byAddr[e.Addr] = map[Key]bool{}
		}
		byAddr[e.Addr][k] = true
		if byKey[k] == nil {
			byKey[k] = map[netip.Addr]bool{}
		}
		byKey[k][e.Addr] = true
	}
	done := map[Key]bool{}
	ch := &plan.Change
	for _, e := range evs {
		k := e.Key()
		if done[k] {
			continue // the same entry twice
		}
		done[k] = true
		f := s.recoveryFacts(e, len(byAddr[e.Addr]) > 1 || len(byKey[k]) > 1)
		o := RecoveryOutcome{Evidence: e, Reason: DecideRecovery(f, e.Addr), Owner: f.OwnerKey}
		plan.Outcomes = append(plan.Outcomes, o)
		if o.Reason != RecoveryRecovered {
			continue
		}
		ad := Address{Pool: e.Pool, Addr: e.Addr}
		p := s.pools[e.Pool]
		touch(k)
		if f.Owner != OwnerNone {
			touch(f.OwnerKey)
			plan.owners[ad] = f.OwnerKey
		}
		if f.Owner == OwnerPodRebuilt {
			// The rebuilt attachment gives the address up: the reservation owns it, and the pod's
			// next ADD on the claim's interface gets it from there.
			owner := s.atts[f.OwnerKey]
			owner.Addresses = slices.DeleteFunc(owner.Addresses, func(x Address) bool { return x == ad })
			if len(owner.Addresses) == 0 {
				s.dropAttachment(f.OwnerKey)
				ch.DeleteAttachments = append(ch.DeleteAttachments, f.OwnerKey)
			} else {
				ch.PutAttachments = append(ch.PutAttachments, *owner.clone())
			}
		}
		if p.unattributed.Contains(e.Addr) {
			plan.fromUnattributed = append(plan.fromUnattributed, ad)
		}
		p.take(e.Addr, k)
		c := e.Claim
		att := &Attachment{Key: k, Pod: e.Pod, Addresses: []Address{ad}, Created: now, DRA: &c}
		s.putAttachment(att)
		ch.PutAttachments = append(ch.PutAttachments, *att.clone())
	}
	for _, k := range plan.keys {
		s.pending[k] = &undo{}
	}
	return plan
}

// recoveryFacts is what the state shows of evidence e (dup: other evidence names its address, or
// its reservation another address).
func (s *State) recoveryFacts(e ReservationEvidence, dup bool) RecoveryFacts {
	f := RecoveryFacts{Duplicate: dup}
	k := e.Key()
	if r := s.atts[k]; r != nil {
		f.Reserved = true
		if len(r.Addresses) == 1 {
			f.ReservedAddr = r.Addresses[0].Addr
		}
	}
	for _, pod := range s.pods {
		if pod.Ref.UID != "" && pod.Ref.UID == e.Pod.UID && pod.MayRun() {
			f.PodRuns = true
			p := s.pools[e.Pool]
			if p == nil {
				break
			}
			var ofPool []netip.Addr
			for _, ip := range reportedOn(pod, p.cfg.Network, s.sandboxes) {
				if s.poolOfNetwork(ip, p.cfg.Network) == e.Pool {
					ofPool = append(ofPool, ip)
				}
			}
			f.PodReportsOther = len(ofPool) > 0 && !slices.Contains(ofPool, e.Addr)
			break
		}
	}
	p, known := s.pools[e.Pool]
	f.Served = e.Pool != "" && known && p.known && s.isServed(e.Pool)
	if !known {
		return f
	}
	f.Held = p.heldKnown && p.held.Contains(e.Addr)
	_, rel := p.releasing[e.Addr]
	_, cool := p.cooling[e.Addr]
	f.OutOfUse = rel || cool || p.lost.Contains(e.Addr)
	owner, used := p.inUse[e.Addr]
	if !used {
		return f
	}
	f.Owner, f.OwnerKey = OwnerOther, owner
	a := s.atts[owner]
	_, shared := p.second[e.Addr]
	if a == nil || shared || a.DRA != nil || a.Pod.UID == "" || a.Pod.UID != e.Pod.UID || s.pending[owner] != nil {
		return f
	}
	switch {
	case owner.IsRebuilt():
		f.Owner = OwnerPodRebuilt
	case owner.IfName == e.Claim.Interface:
		f.Owner = OwnerPodAttachment
	}
	return f
}

// applyRecover confirms a journaled recovery.
func (s *State) applyRecover(plan RecoverPlan) {
	for _, k := range plan.keys {
		delete(s.pending, k)
	}
}

// abortRecover undoes a recovery the journal refused: the reservations it recorded are gone, the
// attachments it changed are back, and each address is its earlier user's again (or free, or
// held by the hold, as before).
func (s *State) abortRecover(plan RecoverPlan) {
	pools := map[string]bool{}
	s.dropRecorded(plan.keys, pools)
	for _, k := range plan.keys {
		if a := plan.prior[k]; a != nil {
			s.putAttachment(a.clone())
		}
	}
	for ad, k := range plan.owners {
		s.pools[ad.Pool].inUse[ad.Addr] = k
	}
	for _, k := range plan.keys {
		if a := plan.prior[k]; a != nil {
			for _, ad := range a.Addresses {
				if p := s.pools[ad.Pool]; !isUsed(p, ad.Addr) {
					p.inUse[ad.Addr] = k
				}
			}
		}
	}
	for _, ad := range plan.fromUnattributed {
		p := s.pools[ad.Pool]
		p.unattributed = p.unattributed.Union(setOf(ad.Addr))
	}
	for name := range pools {
		s.pools[name].recompute()
	}
	for ad := range plan.owners {
		s.pools[ad.Pool].recompute()
	}
}

// String describes the outcome for a log line or an event.
func (o RecoveryOutcome) String() string {
	e := o.Evidence
	s := fmt.Sprintf("claim %s, pod %s, %s on %s: %s", e.Claim, e.Pod, e.Addr, e.Claim.Interface, o.Reason)
	if o.Owner != (Key{}) {
		s += " (used by " + o.Owner.String() + ")"
	}
	return s
}

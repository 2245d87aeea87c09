package agent

import (
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// The machine's DRA inputs (docs/design.md, "Addresses the scheduler can see (DRA)"): the kubelet
// plugin's Prepare and Unprepare of one allocated device, and the level reconcile of the
// reservations against the claims the API server shows. Each is a request on the reservation's
// key (ipam.ReservationKey), so it runs in turn with the others of that key, like the CNI
// requests of one attachment. The rules, each with a table test in machine_dra_test.go:
//   - Prepare is answered only after the journal write of its reservation landed; a refused write
//     reserves nothing; a repeated Prepare is answered with the same address and no write;
//   - Prepare is refused while the gate refuses ADD, and for a device of a pool that does not
//     serve the node;
//   - a Prepare short of addresses (the slot is within the node's headroom, but the controller
//     has not granted the address yet) waits, counted as demand and tried again after every
//     change, until --address-wait passes; then it is refused (the kubelet retries);
//   - an ADD of the reservation's pod on its interface gets exactly its address (ipam.Add), and
//     the DEL of that attachment frees nothing of it;
//   - Unprepare frees the reservation through the cooldown once its write landed, is refused
//     while an attachment uses the address, and succeeds for an unknown reservation;
//   - ReconcileClaims unprepares each reservation whose claim the API server no longer shows
//     allocated to the node, once no attachment uses it;
//   - after a lost or damaged journal, RecoverReservations re-creates the reservations the
//     claims' status entries name (ipam.DecideRecovery), journaled before the hold starts and
//     before anything is served; one it does not re-create for a conflict is logged, counted and
//     reported as an event, and its address stays whose it was.

const (
	reqPrepare   reqKind = 10 + iota // a DRA Prepare of one device (machine_dra.go)
	reqUnprepare                     // a DRA Unprepare of one device, or the level reconcile's
)

// Prepare reserves an address for one allocated device of a claim; its id's answer carries the
// reservation (Att) or the refusal (Err).
func (m *Machine) Prepare(req ipam.ReserveRequest, now time.Time) uint64 {
	m.now = now
	r := &mreq{id: m.id(), kind: reqPrepare, key: ipam.ReservationKey(req.Claim.UID, req.Claim.Request, req.Claim.Device), reserve: req}
	m.enqueue(r)
	return r.id
}

// Unprepare frees the reservation of one device of a claim; its id's answer carries the freed
// reservation (Att; nil when there was none) or the refusal (Err).
func (m *Machine) Unprepare(claimUID, request, device string, now time.Time) uint64 {
	m.now = now
	return m.unprepare(ipam.ReservationKey(claimUID, request, device))
}

func (m *Machine) unprepare(k ipam.Key) uint64 {
	r := &mreq{id: m.id(), kind: reqUnprepare, key: k}
	m.enqueue(r)
	return r.id
}

// ClaimAllocated says whether the API server shows the claim with uid allocated a device of the
// driver on this node (ReconcileClaims).
type ClaimAllocated func(c ipam.ClaimDevice) bool

// ReconcileClaims unprepares every reservation whose claim is not allocated to the node any more
// (gone, deallocated, or allocated elsewhere), unless an attachment still uses its address; it
// returns the ids of the unprepares it queued.
func (m *Machine) ReconcileClaims(allocated ClaimAllocated, now time.Time) []uint64 {
	m.now = now
	var ids []uint64
	for _, res := range m.st.Reservations() {
		if allocated(*res.DRA) || m.st.Pending(res.Key) || len(m.st.ReservationUsers(res.Key)) > 0 || len(m.keys[res.Key]) > 0 {
			continue
		}
		m.log.Info("releasing the address of a DRA reservation whose claim is no longer allocated to the node (a missed Unprepare)",
			"claim", res.DRA.String(), "addresses", fmtAddresses(res.Addresses))
		ids = append(ids, m.unprepare(res.Key))
	}
	return ids
}

// ReasonDRAReservationNotRecovered is the event on the node's NodeIPAllocation for a claim whose
// status names an address the node, after a lost journal, did not reserve for it again.
const ReasonDRAReservationNotRecovered = "DRAReservationNotRecovered"

// RecoverReservations re-creates, after a lost or damaged journal, the reservations the claims'
// status entries evs name (ipam.PlanRecoverReservations; journaled as a fact). The answer's N
// counts the reservations recovered, its Recovery holds every decision.
func (m *Machine) RecoverReservations(evs []ipam.ReservationEvidence, now time.Time) uint64 {
	return m.Fact("recover", func(m *Machine) ipam.Plan { return m.st.PlanRecoverReservations(evs, m.now) }, recoverApplied, now)
}

// recoverApplied logs, counts and reports each decision of a recovery once it is journaled.
func recoverApplied(m *Machine, p ipam.Plan, a *Answer) {
	plan, ok := p.(ipam.RecoverPlan)
	if !ok {
		return
	}
	for _, o := range plan.Outcomes {
		m.metrics.DRARecovered.WithLabelValues(o.Reason).Inc()
		e := o.Evidence
		kv := []any{"claim", e.Claim.String(), "pod", e.Pod.String(), "interface", e.Claim.Interface, "pool", e.Pool, "address", e.Addr.String(), "reason", o.Reason}
		if o.Owner != (ipam.Key{}) {
			kv = append(kv, "usedBy", o.Owner.String())
		}
		switch {
		case o.Reason == ipam.RecoveryRecovered:
			m.log.Info("recovered a DRA reservation from its claim's status after the journal was lost", kv...)
		case !ipam.IsRecoveryConflict(o.Reason):
			m.log.V(1).Info("a DRA claim's status entry needs no recovery", kv...)
		default:
			m.log.Error(nil, "a DRA claim's status names an address the node does not reserve for it again after the journal was lost: its pod's next ADD gets another address", kv...)
			m.rd.Events = append(m.rd.Events, NodeEvent{Type: corev1.EventTypeWarning, Reason: ReasonDRAReservationNotRecovered, Message: fmt.Sprintf(
				"after the journal was lost, ResourceClaim %s/%s (%s) names %s for pod %s's %s, which the node does not reserve for it again (%s%s): "+
					"the address stays whose it was, and the pod's next sandbox gets another address; check it with `ipwarden check`",
				e.Claim.Namespace, e.Claim.Name, e.Claim.UID, e.Addr, e.Pod, e.Claim.Interface, o.Reason, usedBy(o.Owner))})
		}
	}
	a.N, a.Recovery = plan.Recovered(), plan.Outcomes
	if a.N > 0 {
		m.rd.Kick = true
	}
}

func usedBy(k ipam.Key) string {
	if k == (ipam.Key{}) {
		return ""
	}
	return ", used by " + k.String()
}

// tryPrepare plans Prepare r.
func (m *Machine) tryPrepare(r *mreq) {
	if resp := m.gateRefusal(); resp != nil {
		m.answer(Answer{ID: r.id, Err: errors.New(resp.Error.Msg)})
		m.finish(r)
		return
	}
	if m.gate.mustRecheck(m.now) {
		if !m.gate.rechecking {
			m.gate.rechecking = true
			m.rd.Recheck = true
		}
		m.answer(Answer{ID: r.id, Err: fmt.Errorf("ipwarden: the agent on node %s is re-checking its Lease (past its permit); the kubelet retries", m.cfg.Node)})
		m.finish(r)
		return
	}
	att, ch, err := m.st.Reserve(r.reserve, m.now)
	var inFlight *ipam.InFlightError
	if errors.As(err, &inFlight) {
		m.wait(r, true)
		return
	}
	var short *ipam.ShortError
	if errors.As(err, &short) {
		// As an ADD does: wait up to --address-wait, counted as demand, tried again after every
		// change; the pool monitor asks for a round at once.
		if r.start.IsZero() {
			r.start, r.deadline = m.now, m.now.Add(m.cfg.AddressWait)
		}
		m.rd.KickNow = true
		if m.now.Before(r.deadline) {
			m.wait(r, false)
			if !r.waiter {
				m.st.AddWaiter(r.key, r.reserve.Pod.UID, []string{r.reserve.Pool})
				r.waiter = true
			}
			return
		}
		err = errors.New(m.shortMessage(short, m.now))
	}
	if err == nil {
		r.waiter = false // Reserve removed the waiter
	}
	m.dropWaiter(r)
	if err != nil {
		m.answer(Answer{ID: r.id, Err: err})
		m.finish(r)
		return
	}
	if ch.IsEmpty() {
		m.answer(Answer{ID: r.id, Att: &att}) // a repeated Prepare
		m.finish(r)
		return
	}
	r.stage, r.att, r.plan = stageWriting, att, ipam.AddPlan{Key: r.key, Change: ch}
	m.write(r.id, ch, false, false)
}

// prepareWritten answers Prepare r once its write landed or was refused.
func (m *Machine) prepareWritten(r *mreq, err error) {
	if err != nil {
		m.answer(Answer{ID: r.id, Err: fmt.Errorf("ipwarden: cannot record the reservation in the journal: %s", cniproto.Truncate(err.Error(), 300))})
		m.finish(r)
		return
	}
	att := r.att
	m.log.V(1).Info("DRA prepare", "claim", att.DRA.String(), "pod", att.Pod.String(), "addresses", fmtAddresses(att.Addresses))
	m.rd.Kick = true
	m.answer(Answer{ID: r.id, Att: &att})
	m.finish(r)
}

// tryUnprepare plans Unprepare r: refused while an attachment uses the address, else a free.
func (m *Machine) tryUnprepare(r *mreq) {
	if _, found := m.st.Attachment(r.key); found && !m.st.Pending(r.key) {
		if users := m.st.ReservationUsers(r.key); len(users) > 0 {
			m.answer(Answer{ID: r.id, Err: &ipam.ReservationBusyError{Key: r.key, Users: users}})
			m.finish(r)
			return
		}
	}
	m.tryDel(r)
}

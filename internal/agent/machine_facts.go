package agent

import (
	"net/netip"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// The facts the machine takes: what the API server says (pools, holdings, pods, namespaces,
// refused and wanted addresses, the record mark), rebuilds and the release round. Those that
// change the journal are facts in the machine's sense (Machine.Fact): planned one at a time,
// journaled, applied, answered. The others change only what the node knows of the cluster and
// apply at once.

// SetPools takes the pools' settings and the pools that select the node (journaled).
func (m *Machine) SetPools(pools []ipam.Pool, served []string, now time.Time) uint64 {
	return m.Fact("pools", func(m *Machine) ipam.Plan { return m.st.PlanPools(pools, served) },
		func(m *Machine, _ ipam.Plan, _ *Answer) { m.rd.Kick = true }, now)
}

// SetHoldings takes what the controller reports the node holds, read from record rec
// (journaled, with the record mark moving to rec).
func (m *Machine) SetHoldings(holdings map[string]addr.Set, rec RecordOf, now time.Time) uint64 {
	return m.Fact("holdings", func(m *Machine) ipam.Plan { return m.planHoldings(holdings, rec) },
		func(m *Machine, p ipam.Plan, _ *Answer) { m.holdingsApplied(rec, p) }, now)
}

// NoteSpecWritten takes the agent's own write of its spec to object uid, producing generation:
// the record mark moves (journaled) when it is newer.
func (m *Machine) NoteSpecWritten(uid string, generation int64, now time.Time) uint64 {
	return m.Fact("mark", func(m *Machine) ipam.Plan {
		mk, moves := ipam.NextMarkOnWrite(m.st.Mark(), uid, generation)
		if !moves {
			return nil
		}
		return m.st.PlanMark(mk)
	}, nil, now)
}

// Rebuild records attachments for running pods whose addresses no attachment accounts for
// (journaled; the answer's N counts them), logging its problems at verbosity v.
func (m *Machine) Rebuild(pods []ipam.Pod, v int, now time.Time) uint64 {
	return m.Fact("rebuild", func(m *Machine) ipam.Plan { return m.planRebuild(pods, v) }, rebuildApplied, now)
}

// ReleaseRound marks what is beyond each pool's target as releasing (journaled); the answer's
// Round is what the pool monitor publishes. The target counted addresses cooling at the state's
// clock, which is at least now: every one of them leaves its cooldown no earlier than
// Round.NextCooled. With stats the Round carries the pools' statistics and the handback mark
// (the pool monitor's metrics and Node condition; the simulator needs neither).
func (m *Machine) ReleaseRound(now time.Time, stats bool) uint64 {
	return m.Fact("release", func(m *Machine) ipam.Plan { return m.st.Release(m.now) }, func(m *Machine, p ipam.Plan, a *Answer) {
		roundApplied(m, p, a, stats)
	}, now)
}

// SetHandback journals the handback mark (nil: clears it).
func (m *Machine) SetHandback(mark *ipam.HandbackMark, now time.Time) uint64 {
	return m.Fact("handback", func(m *Machine) ipam.Plan { return m.st.PlanHandback(mark) }, nil, now)
}

// SetPods takes the pods bound to the node (demand, the hold's waiting list).
func (m *Machine) SetPods(pods []ipam.Pod, now time.Time) {
	m.now = now
	m.st.SetPods(pods)
}

// Pods returns the pods last set by SetPods.
func (m *Machine) Pods() []ipam.Pod { return m.st.Pods() }

// SetNamespaces takes the namespaces, for the pool choice of the node's pods.
func (m *Machine) SetNamespaces(ns map[string]ipam.Namespace) { m.st.SetNamespaces(ns) }

// SetRefused takes the wanted addresses the controller refused, per pool: a waiting ADD for one
// fails now.
func (m *Machine) SetRefused(refused map[string]map[netip.Addr]string, now time.Time) {
	m.now = now
	m.st.SetRefused(refused)
	m.changed()
}

// SetClaimRefused takes the IPAMClaims (by UID) the controller refuses the node, per pool, with
// its reasons (status.pools[].claimRefused): a waiting ADD of one fails now.
func (m *Machine) SetClaimRefused(refused map[string]map[string]string, now time.Time) {
	m.now = now
	m.st.SetClaimRefused(refused)
	m.changed()
}

// SetWantedElsewhere takes the held addresses other nodes' pods ask for by name; the pool
// monitor gives back those no attachment uses.
func (m *Machine) SetWantedElsewhere(w map[string]addr.Set) {
	m.st.SetWantedElsewhere(w)
	m.rd.Kick = true
}

// Round is what one pool monitor round needs from the state.
type Round struct {
	Marked      map[string]addr.Set // addresses newly marked releasing, per pool
	Spec        []ipam.PoolRequest
	NextCooled  time.Time
	NextRelease time.Time // when a pool's release delay ends (zero: none runs)
	Stats       []ipam.PoolStats
	Attachments int
	Handback    *ipam.HandbackMark // the handback mark, nil when none
	Claims      ipam.ClaimStats    // attachments bound to IPAMClaims, addresses two of them share
}

// roundApplied is what a pool monitor round reads once its release is applied.
func roundApplied(m *Machine, p ipam.Plan, a *Answer, stats bool) {
	var marked map[string]addr.Set
	if p, ok := p.(ipam.ReleasePlan); ok {
		marked = p.Marked
	}
	a.Round = &Round{
		Marked:      marked,
		Spec:        m.st.Spec(),
		NextCooled:  m.st.NextCooled(m.now),
		NextRelease: m.st.NextRelease(),
	}
	if stats {
		a.Round.Stats, a.Round.Attachments, a.Round.Handback = m.st.Stats(m.now), m.st.NumAttachments(), m.st.HandedBack()
		a.Round.Claims = m.st.ClaimCounts()
	}
}

// PoolUse is what the simulator samples of a pool: the addresses marked releasing, the node's
// demand, and whether the node is at rest (no release delay runs).
func (m *Machine) PoolUse(pool string) (releasing, demand int, resting bool) {
	return m.st.NumReleasing(pool), m.st.Demand(pool), m.st.NextRelease().IsZero()
}

// Holding is the pool's holding as the node knows it, and whether it knows the pool.
func (m *Machine) Holding(pool string) (addr.Set, bool) { return m.st.Holding(pool) }

// --- facts' plans and their effects ------------------------------------------------------------

// SetRecordMissing says whether the node's NodeIPAllocation is missing; while it is, no address
// is handed out of the free set.
func (m *Machine) SetRecordMissing(missing bool) {
	was := m.st.RecordMissing()
	m.st.SetRecordMissing(missing)
	if missing && !was {
		m.log.Info("the node's NodeIPAllocation is missing: no new address is handed out until it is back", "nodeIPAllocation", m.cfg.Node)
	}
	m.changed()
}

// SetSandboxes takes a reading of the container runtime's pod sandboxes (the node's own evidence
// for the rebuild and the hold; ipam.NodeSandboxes). During the hold it is evaluated again.
func (m *Machine) SetSandboxes(ev ipam.NodeSandboxes, now time.Time) {
	m.now = now
	m.st.SetSandboxes(ev)
	if on, _ := m.st.Hold(); on && m.evaluateHold() {
		m.changed()
	}
}

// EvaluateHold evaluates the unattributed hold now (after pods reported).
func (m *Machine) EvaluateHold(now time.Time) {
	m.now = now
	if m.evaluateHold() {
		m.changed()
	}
}

// planHoldings plans the holdings read from record rec, with the record mark moving to it.
func (m *Machine) planHoldings(holdings map[string]addr.Set, rec RecordOf) ipam.Plan {
	plan := m.st.PlanHoldings(holdings, rec.Rewound, m.now)
	batch := ipam.Batch{plan}
	if mk, moves := ipam.NextMarkOnRead(m.st.Mark(), rec.UID, rec.Generation, rec.Rewound); moves {
		batch = append(batch, m.st.PlanMark(mk))
	}
	return batch
}

// holdingsApplied reports a rewound record, notes the record present, and reports conflicts.
func (m *Machine) holdingsApplied(rec RecordOf, p ipam.Plan) {
	if rec.Rewound {
		var distrusted map[string]addr.Set
		if b, ok := p.(ipam.Batch); ok && len(b) > 0 {
			if hp, ok := b[0].(ipam.HoldingsPlan); ok {
				distrusted = hp.Distrusted
			}
		}
		m.metrics.RecordRewinds.Inc()
		m.log.Info("the node's NodeIPAllocation is older than this node's last write (etcd restored, or the object re-created): "+
			"addresses it shows that the node had given back are released again, and addresses its pods use are claimed",
			"uid", rec.UID, "generation", rec.Generation, "released", fmtSets(distrusted))
	}
	if m.st.RecordMissing() {
		m.st.SetRecordMissing(false)
		m.changed() // the free set is handed out again
	}
	m.reportConflicts()
	m.rd.Kick = true
}

// reportConflicts logs attachments whose addresses the node no longer holds, once each. A
// running pod keeps its address; the conflict shows in the metrics until it is freed.
func (m *Machine) reportConflicts() {
	now := map[ipam.Address]ipam.Key{}
	for _, st := range m.st.Stats(m.now) {
		for a, k := range m.st.Conflicts(st.Pool) {
			ad := ipam.Address{Pool: st.Pool, Addr: a}
			now[ad] = k
			if _, seen := m.conflicts[ad]; !seen {
				att, _ := m.st.Attachment(k)
				if k.IsRebuilt() {
					// Recorded from the pod's status (a pod of the previous IPAM, or a lost
					// journal): the node claims it; only a claim the controller cannot grant
					// is a conflict (it reports those).
					m.log.Info("claiming an address a running pod reports that the node does not hold",
						"pool", st.Pool, "address", a.String(), "pod", att.Pod.String(), "podUID", att.Pod.UID)
					continue
				}
				m.log.Error(nil, "conflict: an attachment uses an address the node no longer holds; it keeps serving the pod",
					"pool", st.Pool, "address", a.String(), "attachment", k.String(), "pod", att.Pod.String(), "podUID", att.Pod.UID)
				m.metrics.Conflicts.Inc()
			}
		}
	}
	m.conflicts = now
}

// planRebuild plans the attachments of running pods whose addresses no attachment accounts for
// (ipam.State.PlanRebuild), logging its problems at verbosity v.
func (m *Machine) planRebuild(pods []ipam.Pod, v int) ipam.Plan {
	plan := m.st.PlanRebuild(pods, m.now, m.cfg.Sandbox)
	for _, p := range plan.Problems {
		m.log.V(v).Info("rebuild: " + p)
	}
	return plan
}

// rebuildApplied logs the attachments a rebuild recorded and counts them.
func rebuildApplied(m *Machine, p ipam.Plan, a *Answer) {
	plan, ok := p.(ipam.RebuildPlan)
	if !ok {
		return
	}
	for _, at := range plan.Change.PutAttachments {
		if !at.Key.IsRebuilt() {
			continue // an attachment of another pod that lost an address the pod's report won
		}
		m.log.Info("recorded an attachment from what the node shows of the pod (the runtime's sandbox, status.podIPs, network-status; a pod the journal did not know: taken over from the previous IPAM, or a lost journal)",
			"pod", at.Pod.String(), "podUID", at.Pod.UID, "addresses", fmtAddresses(at.Addresses), "runtimeShowsPod", m.st.Sandboxes().Shows(at.Pod.UID))
	}
	a.N = len(plan.Change.PutAttachments)
}

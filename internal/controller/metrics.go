package controller

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the controller's Prometheus metrics. They are updated as state changes (after a
// write, on a pool flush), never by rescanning all nodes on a scrape or an event.
type Metrics struct {
	PoolCapacity  *prometheus.GaugeVec
	PoolAllocated *prometheus.GaugeVec
	PoolFree      *prometheus.GaugeVec
	PoolCooling   *prometheus.GaugeVec
	PoolExhausted *prometheus.GaugeVec
	PoolConflicts *prometheus.GaugeVec

	NodeHeld      *prometheus.GaugeVec
	NodeRequested *prometheus.GaugeVec
	NodeDeficit   *prometheus.GaugeVec

	NodesInDeficit  prometheus.Gauge
	NodesAtCapacity prometheus.Gauge
	Nodes           prometheus.Gauge

	Allocations    *prometheus.CounterVec
	Releases       *prometheus.CounterVec
	APIWrites      *prometheus.CounterVec
	SyncDuration   *prometheus.HistogramVec
	SyncErrors     *prometheus.CounterVec
	QueueDepth     prometheus.Gauge
	AddressesTwice prometheus.Gauge
	NodesReleased  prometheus.Counter
	GCCandidates   prometheus.Counter
	GCCollected    prometheus.Counter
	GCFailed       prometheus.Counter

	FencedWrites *prometheus.CounterVec
	// FencePolicyOK is 1 while the fence policy and its binding deny a stale leader's writes
	// (JudgeFence, at every lease operation), 0 while they do not (the controller refuses to
	// lead, or stepped down).
	FencePolicyOK prometheus.Gauge
	// FenceLost counts the times this process stopped leading because its fence stopped holding,
	// by reason (FenceProblem).
	FenceLost *prometheus.CounterVec
	// FenceUnenforced is 1 while this controller leads but writes nothing because the API
	// server's fence does not work for it (JudgeFenceProbe).
	FenceUnenforced prometheus.Gauge
	Epoch           prometheus.Gauge
	ClaimsGranted   *prometheus.CounterVec
	ClaimConflicts  prometheus.Gauge
	Unacked         prometheus.Gauge
	// PoolUnobserved: per pool waiting for the nodes (poolsettle.go), the nodes that have not
	// reported what their pods use in its new addresses.
	PoolUnobserved *prometheus.GaugeVec
	// PoolClaimed and ClaimSharedGrants: per pool, addresses bound to IPAMClaims and shared
	// grants in progress (docs/design.md, "VM addresses").
	PoolClaimed       *prometheus.GaugeVec
	ClaimSharedGrants *prometheus.GaugeVec
	// ClaimRefusals counts refused claim uses by the claim condition's reason.
	ClaimRefusals *prometheus.CounterVec
}

// NewMetrics creates the metrics and registers them with reg (nil: not registered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	const ns = "ipwarden_controller"
	pool := []string{"pool"}
	node := []string{"node", "pool"}
	m := &Metrics{
		PoolCapacity:  prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "pool_capacity_addresses", Help: "Addresses the pool can hand out (CIDRs minus exclusions)."}, pool),
		PoolAllocated: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "pool_allocated_addresses", Help: "Pool addresses held by nodes or cooling down."}, pool),
		PoolFree:      prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "pool_free_addresses", Help: "Pool addresses neither held nor cooling."}, pool),
		PoolCooling:   prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "pool_cooling_addresses", Help: "Released addresses waiting out the reuse cooldown."}, pool),
		PoolExhausted: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "pool_exhausted", Help: "1 while the pool is marked exhausted."}, pool),
		PoolConflicts: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "pool_conflict_addresses", Help: "Held addresses outside the pool after it shrank; they drain as nodes release them."}, pool),

		NodeHeld:      prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "node_held_addresses", Help: "Addresses a node holds from a pool."}, node),
		NodeRequested: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "node_requested_addresses", Help: "Addresses a node requests from a pool."}, node),
		NodeDeficit:   prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "node_deficit_addresses", Help: "Requested addresses a node does not hold yet."}, node),

		NodesInDeficit:  prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "nodes_in_deficit", Help: "Nodes holding fewer addresses than they request."}),
		NodesAtCapacity: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "nodes_at_capacity", Help: "Nodes holding maxPerNode addresses of some pool."}),
		Nodes:           prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "nodes", Help: "Nodes with a NodeIPAllocation record."}),

		Allocations:    prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "allocated_addresses_total", Help: "Addresses handed to nodes."}, pool),
		Releases:       prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "released_addresses_total", Help: "Addresses taken back from nodes (released or from deleted nodes)."}, pool),
		APIWrites:      prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "api_writes_total", Help: "Writes to the API server by resource, verb and result."}, []string{"resource", "verb", "result"}),
		SyncDuration:   prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "sync_duration_seconds", Help: "Duration of one node or pool sync, API calls included.", Buckets: prometheus.ExponentialBuckets(0.0001, 4, 10)}, []string{"kind"}),
		SyncErrors:     prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "sync_errors_total", Help: "Failed syncs (retried with backoff)."}, []string{"kind"}),
		QueueDepth:     prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "queue_depth", Help: "Nodes waiting for a sync."}),
		AddressesTwice: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "addresses_held_twice", Help: "Addresses found in two nodes' status when the state was rebuilt (must be 0)."}),
		NodesReleased:  prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "deleted_nodes_released_total", Help: "Deleted nodes whose addresses returned to their pools."}),
		GCCandidates:   prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "gc_candidates_total", Help: "Addresses the audit found out of step between the record and the API."}),
		GCCollected:    prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "gc_collected_total", Help: "Allocations held by no node that the audit returned to their pool."}),
		GCFailed:       prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "gc_failed_total", Help: "Audits that could not run (listing failed)."}),

		FencedWrites: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "fenced_writes_total", Help: "Writes refused because this controller no longer holds its Lease, by who refused (local: its own lease check; apiserver: the fence policy)."}, []string{"by"}),
		FencePolicyOK: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "fence_policy_ok",
			Help: "1 while the fence policy (ValidatingAdmissionPolicy ipwarden-controller-fence and its binding) denies a stale leader's writes to this controller's Lease, checked at every lease operation; 0 while it does not: the controller refuses to lead, or stepped down."}),
		FenceUnenforced: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "fence_unenforced",
			Help: "1 while this controller leads but writes nothing because the API server's fence does not work for it: a dry-run write with its own fence was denied, or one with another holder's was admitted (kube-apiserver's frozen view of the Lease after the fence was deleted, kubernetes/kubernetes#130887)."}),
		FenceLost: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "fence_lost_total",
			Help: "Times this controller stopped writing and stepped down as leader because its fence policy stopped denying a stale leader's writes, by reason (policy_missing, binding_missing, not_denying, fails_open, wrong_lease, check_changed, narrowed)."}, []string{"reason"}),
		Epoch:          prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "leader_epoch", Help: "The leader election epoch (Lease leaderTransitions) this controller writes with; 0 until it leads."}),
		ClaimsGranted:  prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "claims_granted_total", Help: "Claimed addresses (used by a node's pods, missing from its status) granted back to the node."}, pool),
		ClaimConflicts: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "claim_conflict_addresses", Help: "Addresses a node's pods use while another node holds them (must be 0; see ipwarden check)."}),
		PoolUnobserved: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "pool_unobserved_nodes",
			Help: "Nodes a new or grown pool's free addresses wait for, at most --pool-settle: nodes it selects that have not reported the addresses their running pods use in it (spec.observedPools), and silent nodes it does not select whose pods use its new addresses or have not been read yet."}, []string{"pool"}),
		Unacked: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "unacknowledged_nodes",
			Help: "Nodes whose agent has not yet acknowledged this leader (spec.acknowledgedLeader); no node is filled from the free pool until it is 0 or --claim-settle has passed."}),
		PoolClaimed: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "pool_claimed_addresses",
			Help: "Pool addresses bound to IPAMClaims (status.ipamClaims): they follow their VM to any node."}, pool),
		ClaimSharedGrants: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "claim_shared_grants",
			Help: "Claim addresses two nodes hold for a live migration (status.shared)."}, pool),
		ClaimRefusals: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "claim_refusals_total",
			Help: "IPAMClaim uses the controller refused, by reason (the claim's IPsAllocated condition reason)."}, []string{"reason"}),
	}
	if reg != nil {
		reg.MustRegister(m.PoolCapacity, m.PoolAllocated, m.PoolFree, m.PoolCooling, m.PoolExhausted, m.PoolConflicts,
			m.NodeHeld, m.NodeRequested, m.NodeDeficit, m.NodesInDeficit, m.NodesAtCapacity, m.Nodes,
			m.Allocations, m.Releases, m.APIWrites, m.SyncDuration, m.SyncErrors, m.QueueDepth, m.AddressesTwice, m.NodesReleased, m.GCCandidates, m.GCCollected, m.GCFailed,
			m.FencedWrites, m.FencePolicyOK, m.FenceLost, m.FenceUnenforced, m.Epoch, m.ClaimsGranted, m.ClaimConflicts, m.Unacked, m.PoolUnobserved,
			m.PoolClaimed, m.ClaimSharedGrants, m.ClaimRefusals)
	}
	return m
}

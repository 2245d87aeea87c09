package agent

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// Metrics are the agent's Prometheus metrics. Pool gauges are set by the pool monitor after each
// round (changes coalesce), never by a scan per request.
type Metrics struct {
	Held      *prometheus.GaugeVec
	InUse     *prometheus.GaugeVec
	Free      *prometheus.GaugeVec
	Cooling   *prometheus.GaugeVec
	Releasing *prometheus.GaugeVec
	Requested *prometheus.GaugeVec
	Conflict  *prometheus.GaugeVec
	// Unattributed: held addresses kept out of use by the hold after a rebuild.
	Unattributed *prometheus.GaugeVec
	// Adopted: addresses used by pods whose attachment was recorded from their status.podIPs
	// (taken over from the previous IPAM, or a lost journal).
	Adopted *prometheus.GaugeVec
	Outside *prometheus.GaugeVec
	// PreviousReserved: held addresses kept out of use because the previous IPAM reserves them;
	// PreviousReads counts the readings of its reservations at ADDs, by IPAM type and result.
	PreviousReserved *prometheus.GaugeVec
	PreviousReads    *prometheus.CounterVec
	// PreviousWrites counts ipwarden's writes into the previous IPAM's store (its reservations
	// before an ADD answers, their removal after a free), by IPAM type, operation and result.
	PreviousWrites *prometheus.CounterVec
	// RuntimeReads counts the readings of the container runtime's pod sandboxes, by result.
	RuntimeReads *prometheus.CounterVec

	Attachments prometheus.Gauge
	// ClaimAttachments: attachments bound to IPAMClaims; ClaimShared: claim addresses two of
	// the node's attachments share (a live migration on the node).
	ClaimAttachments prometheus.Gauge
	ClaimShared      prometheus.Gauge
	OpDuration       *prometheus.HistogramVec
	IPWait           prometheus.Histogram
	JournalWrite     prometheus.Histogram
	Errors           *prometheus.CounterVec
	SpecWrites       *prometheus.CounterVec
	Conflicts        prometheus.Counter
	// RecordRewinds counts reads of the node's NodeIPAllocation older than its own last write.
	RecordRewinds prometheus.Counter
	// RecordRecreated counts re-creations of the node's NodeIPAllocation by the agent.
	RecordRecreated prometheus.Counter
	// LeaderAcks counts acknowledgements of a new controller leader (spec.acknowledgedLeader).
	LeaderAcks prometheus.Counter

	// Leak collection, by path (PathEvent, PathFullCheck, PathCNIGC).
	GCCandidates   *prometheus.CounterVec
	GCCollected    *prometheus.CounterVec
	GCKept         *prometheus.CounterVec
	GCFailed       *prometheus.CounterVec
	GCDryRun       *prometheus.CounterVec
	GCDeleteToFree *prometheus.HistogramVec
	GCFullChecks   prometheus.Counter
	GCQueueDepth   prometheus.Gauge
	// GCSandboxHeld counts decisions to keep a gone pod's attachment because its sandbox may
	// still run, by what the agent could tell of its network namespace.
	GCSandboxHeld *prometheus.CounterVec
	// GCSandboxOutlived is the number of attachments whose pod is gone while their network
	// namespace still exists past --gc-sandbox-grace.
	GCSandboxOutlived prometheus.Gauge

	// The agent's IO edges: journal recovery, the hold, the socket.
	JournalRecovered *prometheus.CounterVec
	HoldActive       prometheus.Gauge
	// HandedBack is 1 while the node is handed back to host-local (`ipwarden agent handback`).
	HandedBack    prometheus.Gauge
	Conns         prometheus.Gauge
	Busy          prometheus.Counter
	BadRequests   prometheus.Counter
	AbandonedAdds prometheus.Counter
	// ReleasesInFlight counts DELs answered whose release is not yet journaled.
	ReleasesInFlight prometheus.Gauge
	// PodUnknown counts ADDs refused because neither the pod watch nor the API server could say
	// what the pod's annotations are.
	PodUnknown prometheus.Counter
	// JournalRefused counts changes of the node's state the journal refused, by change: the
	// state was left as it was (the commit protocol, ipam/plan.go).
	JournalRefused *prometheus.CounterVec
	// DRARecovered counts the claims' status entries a start after a lost journal read to
	// recover DRA reservations, by outcome (ipam.RecoveryReasons).
	DRARecovered *prometheus.CounterVec

	// AddressesExhausted is 1 while the node shows the scheduler signal (condition
	// ipwarden.io/AddressesExhausted).
	AddressesExhausted prometheus.Gauge

	// Queue holds the leak collector's work queue metrics (workqueue_*{name="ipwarden_agent_pod_gc"}).
	Queue *QueueMetrics

	pools map[string]bool // pool labels set by setPools
}

// NewMetrics creates the metrics and registers them with reg (nil: not registered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	const ns = "ipwarden_agent"
	pool := []string{"pool"}
	gauge := func(name, help string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: name, Help: help}, pool)
	}
	gcCounter := func(name, help string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: name, Help: help}, []string{"path"})
	}
	latency := []float64{.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30}
	m := &Metrics{
		Held:      gauge("pool_held_addresses", "Addresses the node holds from the pool (NodeIPAllocation status)."),
		InUse:     gauge("pool_in_use_addresses", "Addresses of the pool held by attachments on the node."),
		Free:      gauge("pool_free_addresses", "Addresses of the pool the node can hand out now."),
		Cooling:   gauge("pool_cooling_addresses", "Freed addresses of the pool still inside the reuse cooldown."),
		Releasing: gauge("pool_releasing_addresses", "Addresses of the pool the node is giving back."),
		Requested: gauge("pool_requested_addresses", "Addresses the node requests from the pool (scaling target)."),
		Conflict:  gauge("pool_conflict_addresses", "Addresses in use that the node no longer holds (kept for the running pod)."),
		Adopted: gauge("pool_adopted_addresses",
			"Addresses of the pool used by pods whose attachment was recorded from their status.podIPs rather than by an ADD: pods that ran before the node moved to ipwarden (taken over from the previous IPAM), or whose journal was lost. 0 on every node: the takeover is complete."),
		Unattributed: gauge("pool_unattributed_addresses",
			"Held addresses no attachment accounts for after the journal was rebuilt from the pods, kept out of use until every pod on the node has reported its addresses or the hold (--rebuild-hold) ends; and addresses an older agent recorded as reserved ahead before a crash, kept out of use for as long as their records exist."),
		PreviousReserved: gauge("pool_previous_reserved_addresses",
			"Held addresses of the pool kept out of use because the IPAM the node ran before ipwarden (the CNI configuration's \"previous\") reserves them, as last read at an ADD: a pod that started through it may use them before its status shows it. They become free once that IPAM releases them (the pod's DEL reaches it through \"previous\")."),
		PreviousReads: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "previous_reads_total",
			Help: "Readings of the previous IPAM's reservations at ADDs (host-local's files under its lock, Whereabouts' IPPools from the API server), by IPAM type and result: ok, error (the ADD failed with CNI error 11 and is retried), unreadable (another IPAM: nothing is kept out of use)."}, []string{"ipam", "result"}),
		PreviousWrites: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "previous_writes_total",
			Help: "ipwarden's writes into the previous IPAM's own store while the CNI configuration names it (\"previous\"): op reserve (an ADD's addresses made unavailable to it before the answer: host-local's file, Whereabouts' IPPool allocation) or release (removed after the free), by IPAM type and result: ok, taken (the previous IPAM reserved the address itself since the last reading: the ADD picks another), error (a reserve fails the ADD with CNI error 11; a failed release leaves the entry, which only keeps the previous IPAM off that address)."}, []string{"ipam", "op", "result"}),

		RuntimeReads: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "runtime_reads_total",
			Help: "Readings of the container runtime's pod sandboxes (CRI ListPodSandbox and PodSandboxStatus on --cri-socket) at start-up and during the hold after a lost journal, by result: ok, error (the hold falls back to the pods' own reports, network by network), off (no --cri-socket)."}, []string{"result"}),
		JournalRecovered: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "journal_recovered_total",
			Help: "Damaged journals moved aside at start (the attachments were rebuilt from the pods), by reason: truncated, corrupt, incompatible_version."}, []string{"reason"}),
		HoldActive: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "unattributed_hold_active",
			Help: "1 while held addresses of unknown owner are kept out of use after a rebuild of the journal, else 0."}),
		HandedBack: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "handed_back",
			Help: "1 while the node is handed back to host-local (`ipwarden agent handback`): every ADD is refused with CNI error 100, else 0."}),
		Conns: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "socket_connections",
			Help: "Plugin connections being served."}),
		Busy: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "socket_busy_total",
			Help: "Plugin connections answered \"busy\" (CNI error 11) because the agent served its maximum of connections."}),
		BadRequests: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "socket_bad_requests_total",
			Help: "Requests refused before handling: too large, undecodable, a field too long, or not sent in time."}),
		AbandonedAdds: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "abandoned_adds_total",
			Help: "ADDs rolled back because the plugin went away before the agent answered."}),
		ReleasesInFlight: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "releases_in_flight",
			Help: "DELs answered whose release the journal has not written yet; their addresses stay assigned until it has (about a millisecond each)."}),
		PodUnknown: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "add_pod_unreadable_total",
			Help: "ADDs refused (CNI error 11, the runtime retries) because the pod watch had not seen the pod and the API server did not answer: pools are never chosen without the pod's annotations."}),
		JournalRefused: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "journal_refused_total",
			Help: "Changes of the node's state the journal refused, by change (add, del, release, pools, holdings, mark, rebuild, handback, recover); the state was left as it was and the change is retried: by the runtime (add: answered with an error, nothing handed out), the leak collector (del: a DEL is answered before its write), the next pool monitor round (release), the next reading of the node's objects (pools, holdings, mark), the next pod event (rebuild), the next start (recover: the start-up stops short of serving ADD, as after a refused rebuild, and the next start recovers again) or the operator (handback: the command says so)."}, []string{"change"}),
		DRARecovered: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "dra_reservations_recovered_total",
			Help: "DRA claims' status entries of the node (driver ipam.ipwarden.io) read at a start after a lost or damaged journal to re-create the reservations they name, by reason: recovered; already_reserved; pod_not_running (nothing to recover); or a conflict, the claim's status naming an address its pod will not get: address_in_use (another attachment keeps it), pod_reports_another_address, address_named_twice, address_out_of_use, address_not_held, pool_not_serving, reserved_another_address (each logged, with a DRAReservationNotRecovered event)."}, []string{"reason"}),
		Outside: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "addresses_outside_pool",
			Help: "Addresses the node holds or uses that the pool's current spec no longer covers (a shrunk pool, a new exclusion): never handed out, released as they are freed."}, pool),

		Attachments: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "attachments", Help: "CNI attachments the node's journal records."}),
		ClaimAttachments: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "claim_attachments",
			Help: "CNI attachments on the node whose pod references an IPAMClaim: their addresses are the claims' (docs/design.md, \"VM addresses\")."}),
		ClaimShared: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "claim_shared_attachments",
			Help: "IPAMClaim addresses two of the node's attachments use at once: live migrations in progress on the node (a migration target beside its source)."}),
		OpDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "cni_request_duration_seconds",
			Help: "Time the agent took to answer a CNI request (journal write and any wait for addresses included).", Buckets: latency}, []string{"op"}),
		IPWait: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Name: "ip_wait_seconds",
			Help: "Time an ADD waited for the node to have a free address (0 when one was ready).", Buckets: append([]float64{0}, latency...)}),
		JournalWrite: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Name: "journal_write_seconds",
			Help: "Duration of one durable journal transaction (fsync included).", Buckets: latency}),
		Errors: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "cni_errors_total",
			Help: "CNI requests answered with an error, by operation and CNI error code."}, []string{"op", "code"}),
		SpecWrites: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "spec_writes_total",
			Help: "Writes of the node's NodeIPAllocation spec, by result."}, []string{"result"}),
		Conflicts: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "conflicts_total",
			Help: "Attachments found using an address the node no longer holds."}),
		RecordRewinds: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "record_rewinds_total",
			Help: "Times the node's NodeIPAllocation was found older than the node's own last write (etcd restored from a backup, or the object re-created)."}),
		RecordRecreated: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "record_recreated_total",
			Help: "Times the agent re-created its node's NodeIPAllocation after it was deleted while its pods used addresses."}),
		LeaderAcks: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "leader_acknowledgements_total",
			Help: "Times the agent acknowledged a new controller leader: its claims written from a fresh read of its NodeIPAllocation, with spec.acknowledgedLeader."}),

		GCCandidates: gcCounter("gc_candidates_total",
			"Attachments the leak collector considered freeing: re-checked against the API server (event, full-check) or missing from the runtime's valid list (cni-gc)."),
		GCCollected: gcCounter("gc_collected_total", "Attachments the leak collector freed (journal first, then the reuse cooldown, as a CNI DEL)."),
		GCKept: gcCounter("gc_kept_total",
			"Candidates kept because the API server still shows their pod (the informer cache lagged, or a stale delete event)."),
		GCFailed: gcCounter("gc_failed_total",
			"Candidates the leak collector could not decide or free: the API server did not answer, or the journal write failed. Retried; never freed on an error."),
		GCDryRun: gcCounter("gc_dry_run_total", "Attachments the leak collector would have freed, with --gc-dry-run (nothing was freed)."),
		GCDeleteToFree: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "gc_delete_to_free_seconds",
			Help:    "Time from a pod's deletion (its deletionTimestamp, or when the agent saw the deletion) to its addresses being free, when the agent saw the deletion.",
			Buckets: []float64{.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800}}, []string{"path"}),
		GCFullChecks: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "gc_full_checks_total",
			Help: "Full checks of the journal against the pods (--gc-full-check-interval)."}),
		GCQueueDepth: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "gc_queue_depth",
			Help: "Pod names waiting in the leak collector's work queue."}),
		GCSandboxHeld: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "gc_sandbox_held_total",
			Help: "Times the leak collector kept a gone pod's attachment because its sandbox may still run, by what it could tell of the network namespace (exists, unknown, unrecorded)."}, []string{"netns"}),
		GCSandboxOutlived: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "gc_sandbox_outlived_attachments",
			Help: "Attachments whose pod is gone while their network namespace still exists past --gc-sandbox-grace (held; a sandbox the runtime did not stop)."}),
	}
	for _, sb := range []string{"exists", "unknown", "unrecorded"} {
		m.GCSandboxHeld.WithLabelValues(sb)
	}
	for _, path := range []string{PathEvent, PathFullCheck, PathCNIGC} {
		for _, v := range []*prometheus.CounterVec{m.GCCandidates, m.GCCollected, m.GCKept, m.GCFailed, m.GCDryRun} {
			v.WithLabelValues(path)
		}
	}
	for _, c := range []string{"add", "del", "release", "pools", "holdings", "mark", "rebuild", "handback", "recover"} {
		m.JournalRefused.WithLabelValues(c)
	}
	for _, r := range ipam.RecoveryReasons {
		m.DRARecovered.WithLabelValues(r)
	}
	m.Queue = NewQueueMetrics(reg)
	m.AddressesExhausted = prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "addresses_exhausted",
		Help: "1 while the node shows the condition ipwarden.io/AddressesExhausted: pods wait and it can get no more addresses (at maxPerNode, or its pool exhausted)."})
	if reg != nil {
		reg.MustRegister(m.AddressesExhausted)
		reg.MustRegister(m.Held, m.InUse, m.Free, m.Cooling, m.Releasing, m.Requested, m.Conflict, m.Outside, m.Adopted,
			m.Attachments, m.ClaimAttachments, m.ClaimShared, m.OpDuration, m.IPWait, m.JournalWrite, m.Errors, m.SpecWrites, m.Conflicts, m.RecordRewinds, m.RecordRecreated, m.LeaderAcks,
			m.GCCandidates, m.GCCollected, m.GCKept, m.GCFailed, m.GCDryRun, m.GCDeleteToFree, m.GCFullChecks, m.GCQueueDepth,
			m.Unattributed, m.JournalRecovered, m.HoldActive, m.HandedBack, m.Conns, m.Busy, m.BadRequests, m.AbandonedAdds, m.ReleasesInFlight, m.PodUnknown, m.JournalRefused,
			m.GCSandboxHeld, m.GCSandboxOutlived, m.PreviousReserved, m.PreviousReads, m.PreviousWrites, m.RuntimeReads, m.DRARecovered)
	}
	return m
}

// setPools sets the per-pool gauges from stats; pools that disappeared are removed. Only the
// monitor calls it.
func (m *Metrics) setPools(stats []ipam.PoolStats, attachments int) {
	seen := map[string]bool{}
	for _, s := range stats {
		seen[s.Pool] = true
		m.Held.WithLabelValues(s.Pool).Set(float64(s.Held))
		m.InUse.WithLabelValues(s.Pool).Set(float64(s.InUse))
		m.Free.WithLabelValues(s.Pool).Set(float64(s.Free))
		m.Cooling.WithLabelValues(s.Pool).Set(float64(s.Cooling))
		m.Releasing.WithLabelValues(s.Pool).Set(float64(s.Releasing))
		m.Requested.WithLabelValues(s.Pool).Set(float64(s.Requested))
		m.Conflict.WithLabelValues(s.Pool).Set(float64(s.Conflicts))
		m.Unattributed.WithLabelValues(s.Pool).Set(float64(s.Unattributed))
		m.Adopted.WithLabelValues(s.Pool).Set(float64(s.Adopted))
		m.Outside.WithLabelValues(s.Pool).Set(float64(s.OutsidePool))
		m.PreviousReserved.WithLabelValues(s.Pool).Set(float64(s.PreviousReserved))
	}
	for p := range m.pools {
		if !seen[p] {
			for _, g := range []*prometheus.GaugeVec{m.Held, m.InUse, m.Free, m.Cooling, m.Releasing, m.Requested, m.Conflict, m.Unattributed, m.Adopted, m.Outside, m.PreviousReserved} {
				g.DeleteLabelValues(p)
			}
		}
	}
	m.pools = seen
	m.Attachments.Set(float64(attachments))
}

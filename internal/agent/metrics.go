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

	Attachments  prometheus.Gauge
	OpDuration   *prometheus.HistogramVec
	IPWait       prometheus.Histogram
	JournalWrite prometheus.Histogram
	Errors       *prometheus.CounterVec
	SpecWrites   *prometheus.CounterVec
	Conflicts    prometheus.Counter
	// RecordRewinds counts reads of the node's NodeIPAllocation older than its own last write.
	RecordRewinds prometheus.Counter
	// RecordRecreated counts re-creations of the node's NodeIPAllocation by the agent.
	RecordRecreated prometheus.Counter

	// Leak collection, by path (PathEvent, PathFullCheck, PathCNIGC).
	GCCandidates   *prometheus.CounterVec
	GCCollected    *prometheus.CounterVec
	GCKept         *prometheus.CounterVec
	GCFailed       *prometheus.CounterVec
	GCDryRun       *prometheus.CounterVec
	GCDeleteToFree *prometheus.HistogramVec
	GCFullChecks   prometheus.Counter
	GCQueueDepth   prometheus.Gauge

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

		Attachments: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "attachments", Help: "CNI attachments the node's journal records."}),
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
	}
	for _, path := range []string{PathEvent, PathFullCheck, PathCNIGC} {
		for _, v := range []*prometheus.CounterVec{m.GCCandidates, m.GCCollected, m.GCKept, m.GCFailed, m.GCDryRun} {
			v.WithLabelValues(path)
		}
	}
	if reg != nil {
		reg.MustRegister(m.Held, m.InUse, m.Free, m.Cooling, m.Releasing, m.Requested, m.Conflict,
			m.Attachments, m.OpDuration, m.IPWait, m.JournalWrite, m.Errors, m.SpecWrites, m.Conflicts, m.RecordRewinds, m.RecordRecreated,
			m.GCCandidates, m.GCCollected, m.GCKept, m.GCFailed, m.GCDryRun, m.GCDeleteToFree, m.GCFullChecks, m.GCQueueDepth)
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
	}
	for p := range m.pools {
		if !seen[p] {
			for _, g := range []*prometheus.GaugeVec{m.Held, m.InUse, m.Free, m.Cooling, m.Releasing, m.Requested, m.Conflict} {
				g.DeleteLabelValues(p)
			}
		}
	}
	m.pools = seen
	m.Attachments.Set(float64(attachments))
}

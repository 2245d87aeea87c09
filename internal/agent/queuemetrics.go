package agent

import (
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/util/workqueue"
)

// QueueMetrics is a workqueue.MetricsProvider whose metrics live in the agent's own registry
// (the one its metrics endpoint serves). Without it a named client-go work queue reports to the
// process-global provider, which controller-runtime points at its own registry: one the agent
// never serves. The names and the "name" label are those controller-runtime uses for the
// controller's queues (workqueue_depth{name="ipwarden_agent_pod_gc"} ...).
type QueueMetrics struct {
	depth                   *prometheus.GaugeVec
	adds                    *prometheus.CounterVec
	latency                 *prometheus.HistogramVec
	workDuration            *prometheus.HistogramVec
	unfinished              *prometheus.GaugeVec
	longestRunningProcessor *prometheus.GaugeVec
	retries                 *prometheus.CounterVec
}

// NewQueueMetrics creates the work queue metrics and registers them with reg (nil: not registered).
func NewQueueMetrics(reg prometheus.Registerer) *QueueMetrics {
	name := []string{"name"}
	buckets := prometheus.ExponentialBuckets(10e-9, 10, 12)
	m := &QueueMetrics{
		depth: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "workqueue_depth",
			Help: "Current depth of the work queue."}, name),
		adds: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "workqueue_adds_total",
			Help: "Total number of adds handled by the work queue."}, name),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "workqueue_queue_duration_seconds",
			Help: "How long in seconds an item stays in the work queue before being requested.", Buckets: buckets}, name),
		workDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "workqueue_work_duration_seconds",
			Help: "How long in seconds processing an item from the work queue takes.", Buckets: buckets}, name),
		unfinished: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "workqueue_unfinished_work_seconds",
			Help: "How many seconds of work has been done that is in progress and hasn't been observed by work_duration."}, name),
		longestRunningProcessor: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "workqueue_longest_running_processor_seconds",
			Help: "How many seconds has the longest running processor for the work queue been running."}, name),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "workqueue_retries_total",
			Help: "Total number of retries handled by the work queue."}, name),
	}
	if reg != nil {
		reg.MustRegister(m.depth, m.adds, m.latency, m.workDuration, m.unfinished, m.longestRunningProcessor, m.retries)
	}
	return m
}

var _ workqueue.MetricsProvider = (*QueueMetrics)(nil)

// NewDepthMetric implements workqueue.MetricsProvider.
func (m *QueueMetrics) NewDepthMetric(name string) workqueue.GaugeMetric {
	return m.depth.WithLabelValues(name)
}

// NewAddsMetric implements workqueue.MetricsProvider.
func (m *QueueMetrics) NewAddsMetric(name string) workqueue.CounterMetric {
	return m.adds.WithLabelValues(name)
}

// NewLatencyMetric implements workqueue.MetricsProvider.
func (m *QueueMetrics) NewLatencyMetric(name string) workqueue.HistogramMetric {
	return m.latency.WithLabelValues(name)
}

// NewWorkDurationMetric implements workqueue.MetricsProvider.
func (m *QueueMetrics) NewWorkDurationMetric(name string) workqueue.HistogramMetric {
	return m.workDuration.WithLabelValues(name)
}

// NewUnfinishedWorkSecondsMetric implements workqueue.MetricsProvider.
func (m *QueueMetrics) NewUnfinishedWorkSecondsMetric(name string) workqueue.SettableGaugeMetric {
	return m.unfinished.WithLabelValues(name)
}

// NewLongestRunningProcessorSecondsMetric implements workqueue.MetricsProvider.
func (m *QueueMetrics) NewLongestRunningProcessorSecondsMetric(name string) workqueue.SettableGaugeMetric {
	return m.longestRunningProcessor.WithLabelValues(name)
}

// NewRetriesMetric implements workqueue.MetricsProvider.
func (m *QueueMetrics) NewRetriesMetric(name string) workqueue.CounterMetric {
	return m.retries.WithLabelValues(name)
}

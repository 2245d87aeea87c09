package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/ipwarden/ipwarden/internal/agent/gc"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// The ways the leak collector frees an attachment: the metrics' path label.
const (
	// PathEvent is the deletion of a pod bound to the node, seen by the pod informer.
	PathEvent = "event"
	// PathFullCheck is the periodic check of the journal against the pods.
	PathFullCheck = "full-check"
	// PathCNIGC is the CNI GC verb (the runtime's valid-attachments list).
	PathCNIGC = "cni-gc"
)

// Kubernetes event reasons of the leak collector.
const (
	ReasonCollected       = "IPAddressGarbageCollected"
	ReasonCollectionFail  = "IPAddressGarbageCollectionFailed"
	ReasonCollectedDryRun = "IPAddressGarbageCollectionDryRun"
	// ReasonSandboxOutlivesPod: a pod is gone but the network namespace of its sandbox still
	// exists --gc-sandbox-grace later; its address stays held until the runtime removes it.
	ReasonSandboxOutlivesPod = "IPAddressSandboxOutlivesPod"
)

// DefaultNetnsDirs are where runtimes put pods' network namespaces (containerd and CRI-O:
// /var/run/netns/<name>); the DaemonSet mounts them read-only into the agent's container.
var DefaultNetnsDirs = []string{"/var/run/netns", "/run/netns"}

// PodSource is what the collector reads about pods; Kube implements it.
type PodSource interface {
	// CachedPods lists the pods bound to the node as the informer cache shows them.
	CachedPods(ctx context.Context) ([]ipam.PodRef, error)
	// GetPod reads the pod named n from the API server itself, never from a cache. Only a
	// definite "no such pod" may come back as not found; anything else is an error.
	GetPod(ctx context.Context, n gc.Name) gc.Lookup
}

// CollectorOptions configure NewCollector.
type CollectorOptions struct {
	// Grace: an attachment younger than this is never a full-check candidate (its pod may not be
	// in the cache yet); see package gc.
	Grace time.Duration
	// FullCheckInterval is the period of the full check of the journal against the pods.
	FullCheckInterval time.Duration
	// SandboxGrace: an attachment of a gone pod whose network namespace the agent cannot check
	// is freed this long after the pod was gone; a namespace that still exists then is reported
	// (default 10m; see package gc).
	SandboxGrace time.Duration
	// SandboxPoll: how often a gone pod's namespace that still exists is looked at again
	// (default 2s).
	SandboxPoll time.Duration
	// NetnsDirs are the directories the agent sees pods' network namespaces in (default
	// DefaultNetnsDirs).
	NetnsDirs []string
	// Workers process pod names in parallel (default 2).
	Workers int
	// MaxRetries bounds the retries of one pod name (default 10); then the collector gives up
	// with an IPAddressGarbageCollectionFailed event and the next full check tries again.
	MaxRetries int
	// RetryBase and RetryMax bound the exponential retry delay (default 500ms and 1m).
	RetryBase, RetryMax time.Duration
	// QueueMetrics receives the work queue's metrics (nil: client-go's global provider). The
	// agent passes one registered with the registry its metrics endpoint serves.
	QueueMetrics workqueue.MetricsProvider
	Log          logr.Logger
}

// GCQueueName is the leak collector's work queue, the name label of its workqueue_* metrics.
const GCQueueName = "ipwarden_agent_pod_gc"

// gcItem is one unit of the collector's work: look at the attachments of one pod name.
type gcItem struct {
	name gc.Name
	path string
}

// Collector is the agent's pod-deletion leak collector, the imperative shell around package gc:
// the pod informer's delete events (tombstones included) put the pod's name into a rate-limited
// work queue, the periodic full check puts in the names gc.Sweep finds, and a worker takes a
// name, picks its candidates (gc.Select), reads that pod from the API server once, and frees what
// gc.Judge allows through the DEL path (journal first, then the pool's reuse cooldown). A failed
// read or journal write is retried with exponential backoff a bounded number of times, never
// turned into a free.
type Collector struct {
	svc        collectorState
	metrics    *Metrics
	pods       PodSource
	grace      time.Duration
	interval   time.Duration
	workers    int
	maxRetries int
	timing     gc.Timing
	netnsDirs  []string
	log        logr.Logger
	queue      workqueue.TypedRateLimitingInterface[gcItem]

	// mu guards what the collector remembers (below): its workers and the pod informer's delete
	// handler share it. locked is the only place that takes it.
	mu        sync.Mutex
	deletions gc.Deletions
	// goneSince remembers when the API server first showed the pod of an attachment gone;
	// outlived, the attachments reported
	// as outliving their pod. Both are pruned to the journal's attachments by every full check.
	goneSince map[ipam.Key]time.Time
	outlived  map[ipam.Key]bool
}

// NewCollector returns a collector over svc; Run starts it. Register OnPodDelete with the pod
// informer before the informer starts.
func NewCollector(svc collectorState, pods PodSource, opts CollectorOptions) *Collector {
	if opts.Workers <= 0 {
		opts.Workers = 2
	}
	if opts.MaxRetries <= 0 {
		opts.MaxRetries = 10
	}
	if opts.RetryBase <= 0 {
		opts.RetryBase = 500 * time.Millisecond
	}
	if opts.RetryMax <= 0 {
		opts.RetryMax = time.Minute
	}
	if opts.FullCheckInterval <= 0 {
		opts.FullCheckInterval = 5 * time.Minute
	}
	if opts.SandboxGrace <= 0 {
		opts.SandboxGrace = 10 * time.Minute
	}
	if opts.SandboxPoll <= 0 {
		opts.SandboxPoll = 2 * time.Second
	}
	if opts.NetnsDirs == nil {
		opts.NetnsDirs = DefaultNetnsDirs
	}
	q := workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.NewTypedItemExponentialFailureRateLimiter[gcItem](opts.RetryBase, opts.RetryMax),
		workqueue.TypedRateLimitingQueueConfig[gcItem]{Name: GCQueueName, MetricsProvider: opts.QueueMetrics})
	return &Collector{svc: svc, metrics: svc.Metrics(), pods: pods, grace: opts.Grace, interval: opts.FullCheckInterval, workers: opts.Workers,
		maxRetries: opts.MaxRetries, log: opts.Log, queue: q, netnsDirs: opts.NetnsDirs,
		timing:    gc.Timing{Grace: opts.Grace, SandboxGrace: opts.SandboxGrace, Poll: opts.SandboxPoll, SlowPoll: time.Minute},
		goneSince: map[ipam.Key]time.Time{}, outlived: map[ipam.Key]bool{}}
}

// OnPodDelete is the pod informer's delete handler: it remembers the deletion (by UID, with its
// time) and queues the pod's name. It accepts a *corev1.Pod (or any object with metadata) and a
// cache.DeletedFinalStateUnknown tombstone holding one.
func (c *Collector) OnPodDelete(obj any) {
	d, ok := deletionOf(obj, c.svc.Clock())
	if !ok {
		c.log.Error(nil, "pod informer delivered a deletion the collector cannot read; the full check covers it", "object", fmt.Sprintf("%T", obj))
		return
	}
	var added bool
	c.locked(func() { added = c.deletions.Add(d) })
	if !added {
		return
	}
	n, _ := gc.NameOf(d.Pod)
	c.log.V(1).Info("pod deleted", "pod", n.String(), "podUID", d.Pod.UID)
	c.add(gcItem{name: n, path: PathEvent})
}

// deletionOf reads a deletion from an informer's delete notification. Its time is the pod's
// deletionTimestamp, or seen when the pod had none or it lies in the future (the pod went before
// its grace period ended).
func deletionOf(obj any, seen time.Time) (gc.Deletion, bool) {
	switch t := obj.(type) {
	case toolscache.DeletedFinalStateUnknown:
		obj = t.Obj
	case *toolscache.DeletedFinalStateUnknown:
		obj = t.Obj
	}
	m, ok := obj.(metav1.Object)
	if !ok || m == nil {
		return gc.Deletion{}, false
	}
	at := seen
	if ts := m.GetDeletionTimestamp(); ts != nil && ts.Time.Before(seen) {
		at = ts.Time
	}
	return gc.Deletion{Pod: ipam.PodRef{Namespace: m.GetNamespace(), Name: m.GetName(), UID: string(m.GetUID())}, At: at}, true
}

func (c *Collector) add(it gcItem) {
	c.queue.Add(it)
	c.metrics.GCQueueDepth.Set(float64(c.queue.Len()))
}

// Run does a full check at once and then every FullCheckInterval, and runs the workers, until
// ctx ends; it returns once the workers have finished the names in hand.
func (c *Collector) Run(ctx context.Context) {
	var wg sync.WaitGroup
	for range c.workers {
		wg.Go(func() {
			for c.processNext(ctx) {
			}
		})
	}
	defer wg.Wait()
	defer c.queue.ShutDown()
	c.log.Info("leak collector running", "gcGrace", c.grace.String(), "gcSandboxGrace", c.timing.SandboxGrace.String(),
		"netnsDirs", c.netnsDirs, "fullCheckInterval", c.interval.String(), "dryRun", c.svc.gcDryRun())
	tick := time.NewTicker(c.interval)
	defer tick.Stop()
	for {
		c.FullCheck(ctx)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// FullCheck compares the journal with the informer cache and queues the names of the pods whose
// attachments are older than the grace period and not in the cache (gc.Sweep); the workers
// re-check each against the API server.
func (c *Collector) FullCheck(ctx context.Context) {
	cached, err := c.pods.CachedPods(ctx)
	if err != nil {
		c.log.Error(err, "full check skipped: cannot list the node's pods from the informer cache")
		return
	}
	view := c.svc.gcView()
	c.prune(view)
	names := gc.Sweep(view, gc.NewCache(cached), c.svc.Clock(), c.grace)
	for _, n := range names {
		c.add(gcItem{name: n, path: PathFullCheck})
	}
	c.metrics.GCFullChecks.Inc()
	if len(names) > 0 {
		c.log.Info("full check: attachments whose pod the cache does not show; re-checking them against the API server", "pods", len(names))
	}
}

func (c *Collector) processNext(ctx context.Context) bool {
	it, shutdown := c.queue.Get()
	if shutdown {
		return false
	}
	defer c.queue.Done(it)
	c.metrics.GCQueueDepth.Set(float64(c.queue.Len()))
	res := c.sync(ctx, it)
	if res.err != nil {
		if ctx.Err() != nil {
			return true
		}
		if n := c.queue.NumRequeues(it); n < c.maxRetries {
			c.log.Info("could not finish collecting; retrying", "pod", it.name.String(), "path", it.path, "attempt", n+1, "error", res.err.Error())
			c.queue.AddRateLimited(it)
			return true
		}
		c.queue.Forget(it)
		c.forget(it.name, res.dels)
		msg := fmt.Sprintf("gave up after %d attempts: %v; the full check tries again within %s", c.maxRetries+1, res.err, c.interval)
		for _, cand := range res.failed {
			c.svc.reportGCFailed(it.path, cand, msg)
		}
		return true
	}
	c.queue.Forget(it)
	if !res.recheckAt.IsZero() {
		c.queue.AddAfter(it, max(0, res.recheckAt.Sub(c.svc.Clock())))
		return true
	}
	c.forget(it.name, res.dels)
	return true
}

func (c *Collector) forget(n gc.Name, dels []gc.Deletion) {
	if len(dels) == 0 {
		return
	}
	c.locked(func() { c.deletions.Forget(n, dels) })
}

// syncResult is what one pass over a pod name left to do.
type syncResult struct {
	dels      []gc.Deletion  // the deletions this pass handled
	err       error          // retry the name
	failed    []gc.Candidate // the candidates that could not be decided or freed
	recheckAt time.Time      // look again then
}

// sync does one pass over the attachments of pod name it.name: select, read the API server once,
// judge, free.
func (c *Collector) sync(ctx context.Context, it gcItem) syncResult {
	var res syncResult
	c.locked(func() { res.dels = c.deletions.Of(it.name) })
	cached, err := c.pods.CachedPods(ctx)
	if err != nil {
		res.err = fmt.Errorf("list the node's pods from the informer cache: %w", err)
		return res
	}
	sel := gc.Select(it.name, c.svc.gcView(), gc.NewCache(cached), res.dels, c.svc.Clock(), c.grace)
	res.recheckAt = sel.RecheckAt
	if len(sel.Candidates) == 0 {
		return res
	}
	m := c.metrics
	now := c.svc.Clock()
	sbs := make([]gc.Sandbox, len(sel.Candidates))
	needRead := false
	for i, cand := range sel.Candidates {
		sbs[i] = c.sandbox(cand.Netns)
		if gone, known := c.goneAt(cand); sbs[i] != gc.SandboxExists || !known || now.Sub(gone) >= c.timing.SandboxGrace {
			needRead = true
		}
	}
	// A namespace that still exists keeps its attachment whatever the API server says: while it
	// polls such a namespace, the collector reads the API server only when some candidate could
	// be freed or reported, or its pod's gone time is unknown.
	l := gc.Lookup{Name: it.name, Err: errNotRead}
	if needRead {
		m.GCCandidates.WithLabelValues(it.path).Add(float64(len(sel.Candidates)))
		rctx, cancel := context.WithTimeout(ctx, 15*time.Second)
		l = c.pods.GetPod(rctx, it.name)
		cancel()
	}
	for i, cand := range sel.Candidates {
		v := gc.Verdict{Free: true, Reason: gc.ReasonPodGone}
		if needRead {
			v = gc.Judge(cand.Pod, l)
		}
		switch {
		case v.Free:
			gone, known := c.goneAt(cand)
			if !known {
				gone = c.markGone(cand.Key, now)
			}
			rel := gc.Decide(sbs[i], gone, now, c.timing)
			if !rel.Free {
				c.hold(it.path, cand, sbs[i], rel)
				res.recheckAt = earliest(res.recheckAt, rel.RecheckAt)
				continue
			}
			if _, err := c.svc.collect(it.path, cand, why(it.path, v, l, cand)+"; its network namespace: "+sbs[i].String()+" ("+rel.Reason+")"); err != nil {
				res.err = fmt.Errorf("free attachment %s: %w", cand.Key, err)
				res.failed = append(res.failed, cand)
				continue
			}
			c.forgetKey(cand.Key)
		case v.Reason == gc.ReasonAPIError:
			m.GCFailed.WithLabelValues(it.path).Inc()
			res.err = l.Err
			if res.err == nil {
				res.err = fmt.Errorf("the API server returned pod %s without a UID", it.name)
			}
			res.failed = append(res.failed, cand)
			c.log.V(1).Info("kept: the API server gave no definite answer", "pod", it.name.String(), "attachment", cand.Key.String(), "error", res.err.Error())
		default:
			c.forgetKey(cand.Key)
			m.GCKept.WithLabelValues(it.path).Inc()
			c.log.V(1).Info("kept: the API server shows the attachment's pod", "pod", it.name.String(), "podUID", cand.Pod.UID,
				"attachment", cand.Key.String(), "reason", v.Reason, "path", it.path)
		}
	}
	return res
}

// errNotRead stands for the API read the collector skipped.
var errNotRead = errors.New("not read")

func earliest(a, b time.Time) time.Time {
	if a.IsZero() || (!b.IsZero() && b.Before(a)) {
		return b
	}
	return a
}

// sandbox looks at the network namespace path recorded for an attachment.
func (c *Collector) sandbox(netns string) gc.Sandbox { return lookSandbox(netns, c.netnsDirs) }

// lookSandbox reads whether the network namespace path netns exists in one of dirs (see
// gc.ClassifySandbox).
func lookSandbox(netns string, dirs []string) gc.Sandbox {
	dir, ok := gc.NetnsDir(netns, dirs)
	var dirErr, pathErr error
	if ok {
		if _, dirErr = os.Stat(dir); dirErr == nil {
			_, pathErr = os.Lstat(netns)
		}
	}
	return gc.ClassifySandbox(netns, ok, dirErr, pathErr)
}

// goneAt returns when the API server first showed the candidate's pod gone. Not its deletion
// time: only the API server's answer proves the pod gone, and a wait counted from it is never
// shorter than one counted from the true deletion.
func (c *Collector) goneAt(cand gc.Candidate) (time.Time, bool) {
	var t time.Time
	ok := false
	c.locked(func() { t, ok = c.goneSince[cand.Key] })
	return t, ok
}

func (c *Collector) markGone(k ipam.Key, now time.Time) time.Time {
	c.locked(func() {
		if t, ok := c.goneSince[k]; ok {
			now = t
			return
		}
		c.goneSince[k] = now
	})
	return now
}

// forgetKey drops what the collector remembers of attachment k.
func (c *Collector) forgetKey(k ipam.Key) {
	var n int
	c.locked(func() {
		delete(c.goneSince, k)
		delete(c.outlived, k)
		n = len(c.outlived)
	})
	c.metrics.GCSandboxOutlived.Set(float64(n))
}

// prune forgets the attachments that are no longer in the journal (freed by DEL).
func (c *Collector) prune(view []gc.Attachment) {
	live := make(map[ipam.Key]bool, len(view))
	for _, a := range view {
		live[a.Key] = true
	}
	var n int
	c.locked(func() {
		for k := range c.goneSince {
			if !live[k] {
				delete(c.goneSince, k)
			}
		}
		for k := range c.outlived {
			if !live[k] {
				delete(c.outlived, k)
			}
		}
		n = len(c.outlived)
	})
	c.metrics.GCSandboxOutlived.Set(float64(n))
}

// hold reports a gone pod's attachment kept because its sandbox may still exist.
func (c *Collector) hold(path string, cand gc.Candidate, sb gc.Sandbox, rel gc.Release) {
	c.metrics.GCSandboxHeld.WithLabelValues(sb.String()).Inc()
	c.log.V(1).Info("kept: the pod is gone but its sandbox may still run", "path", path, "pod", cand.Pod.String(), "podUID", cand.Pod.UID,
		"attachment", cand.Key.String(), "netns", cand.Netns, "sandbox", sb.String(), "reason", rel.Reason, "recheckAt", rel.RecheckAt)
	if !rel.Outlived {
		return
	}
	var first bool
	var n int
	c.locked(func() {
		first = !c.outlived[cand.Key]
		c.outlived[cand.Key] = true
		n = len(c.outlived)
	})
	c.metrics.GCSandboxOutlived.Set(float64(n))
	if first {
		c.svc.reportOutlived(cand, c.timing.SandboxGrace)
	}
}

// why says, for events and logs, why an attachment was (or would be) freed.
func why(path string, v gc.Verdict, l gc.Lookup, c gc.Candidate) string {
	s := "the pod no longer exists"
	if v.Reason == gc.ReasonNameReused {
		s = fmt.Sprintf("the pod no longer exists; its name now belongs to pod UID %s", l.UID)
	}
	if path == PathFullCheck && c.Deletion == nil {
		s += " (found by the full check)"
	}
	return s
}

// gcView returns what the collector needs of every attachment, in-flight ones marked.
func (s *Service) gcView() []gc.Attachment {
	var out []gc.Attachment
	s.read(func(m *Machine) { out = gcViewOf(m) })
	return out
}

// gcViewOf is the collector's view of m's attachments, in-flight ones marked: every one but the
// DRA reservations, which the claims' reconcile frees (machine_dra.go).
func gcViewOf(m *Machine) []gc.Attachment {
	atts := m.st.Attachments()
	out := make([]gc.Attachment, 0, len(atts))
	for _, a := range atts {
		if a.DRA != nil {
			continue
		}
		out = append(out, gcAttachment(a, m.st.Pending(a.Key)))
	}
	return out
}

func gcAttachment(a ipam.Attachment, pending bool) gc.Attachment {
	return gc.Attachment{Key: a.Key, Pod: a.Pod, Created: a.Created, Pending: pending, Netns: a.Netns}
}

// collect frees the candidate's attachment for the leak collector through the DEL path, only if
// it is still the attachment selected (same pod, same creation time, not in flight). With
// --gc-dry-run it reports what it would free and frees nothing. It reports and counts the
// outcome; an error is counted as a failure and left to the caller to retry.
func (s *Service) collect(path string, c gc.Candidate, why string) (bool, error) {
	if s.gcDryRunOn {
		var att ipam.Attachment
		ok := false
		s.read(func(m *Machine) {
			att, ok = m.st.Attachment(c.Key)
			ok = ok && !m.st.Pending(c.Key) && gcAttachment(att, false).Same(c.Attachment)
		})
		if ok {
			s.gcr.wouldFree(path, att, c.Deletion, why)
		}
		return false, nil
	}
	att, freed, err := s.delKeyIf(c.Key, func(a ipam.Attachment) bool { return gcAttachment(a, false).Same(c.Attachment) })
	if err != nil {
		s.metrics.GCFailed.WithLabelValues(path).Inc()
		if path == PathCNIGC {
			s.gcr.failed(path, c, fmt.Sprintf("cannot record the release in the journal: %v; the runtime retries GC", err))
		}
		return false, err
	}
	if freed {
		s.gcr.collected(path, att, c.Deletion, why, s.now())
	}
	return freed, nil
}

// SetEvents makes the leak collector record Kubernetes events with rec: on the pod when the agent
// saw its deletion, else on the node's NodeIPAllocation, whose reference node returns.
func (s *Service) SetEvents(rec record.EventRecorder, node func() *corev1.ObjectReference) {
	s.gcr.setEvents(rec, node)
}

// gcReporter reports what the leak collector does: logs, metrics and Kubernetes events.
type gcReporter struct {
	log     logr.Logger
	metrics *Metrics

	sink atomic.Pointer[eventSink] // nil: no events
}

// eventSink is where the reporter records events: on a deleted pod, or on the node's
// NodeIPAllocation (node returns its reference).
type eventSink struct {
	rec  record.EventRecorder
	node func() *corev1.ObjectReference
}

func newGCReporter(log logr.Logger, m *Metrics) *gcReporter { return &gcReporter{log: log, metrics: m} }

func (r *gcReporter) setEvents(rec record.EventRecorder, node func() *corev1.ObjectReference) {
	r.sink.Store(&eventSink{rec: rec, node: node})
}

// event records an event on the deleted pod when the agent saw its deletion, else on the node's
// NodeIPAllocation.
func (r *gcReporter) event(d *gc.Deletion, typ, reason, msg string) {
	sink := r.sink.Load()
	if sink == nil || sink.rec == nil {
		return
	}
	rec, node := sink.rec, sink.node
	var on *corev1.ObjectReference
	switch {
	case d != nil:
		on = &corev1.ObjectReference{APIVersion: "v1", Kind: "Pod", Namespace: d.Pod.Namespace, Name: d.Pod.Name, UID: types.UID(d.Pod.UID)}
	case node != nil:
		on = node()
	}
	if on == nil {
		return
	}
	rec.Event(on, typ, reason, msg)
}

func describe(att ipam.Attachment) string {
	pod := att.Pod.String()
	if pod == "" {
		pod = "an unnamed pod"
	}
	if att.Pod.UID != "" {
		pod += " (UID " + att.Pod.UID + ")"
	}
	what := "the addresses"
	if len(att.Addresses) > 0 {
		what = fmtAddresses(att.Addresses)
	}
	return fmt.Sprintf("%s of pod %s, attachment %s", what, pod, att.Key)
}

func (r *gcReporter) collected(path string, att ipam.Attachment, d *gc.Deletion, why string, now time.Time) {
	r.metrics.GCCollected.WithLabelValues(path).Inc()
	if d != nil {
		r.metrics.GCDeleteToFree.WithLabelValues(path).Observe(max(0, now.Sub(d.At)).Seconds())
	}
	r.log.Info("freed the addresses of a pod that is gone", "path", path, "pod", att.Pod.String(), "podUID", att.Pod.UID,
		"attachment", att.Key.String(), "addresses", fmtAddresses(att.Addresses), "why", why)
	r.event(d, corev1.EventTypeNormal, ReasonCollected, fmt.Sprintf("freed %s: %s", describe(att), why))
}

func (r *gcReporter) wouldFree(path string, att ipam.Attachment, d *gc.Deletion, why string) {
	r.metrics.GCDryRun.WithLabelValues(path).Inc()
	r.log.Info("dry run (--gc-dry-run): would free the addresses of a pod that is gone; freeing nothing", "path", path,
		"pod", att.Pod.String(), "podUID", att.Pod.UID, "attachment", att.Key.String(), "addresses", fmtAddresses(att.Addresses), "why", why)
	r.event(d, corev1.EventTypeNormal, ReasonCollectedDryRun, fmt.Sprintf("dry run (--gc-dry-run): would free %s: %s; nothing was freed", describe(att), why))
}

func (r *gcReporter) outlived(c gc.Candidate, grace time.Duration) {
	att := ipam.Attachment{Key: c.Key, Pod: c.Pod}
	r.log.Error(nil, "a pod is gone but its network namespace still exists; its addresses stay held until the runtime removes the sandbox or calls DEL",
		"pod", c.Pod.String(), "podUID", c.Pod.UID, "attachment", c.Key.String(), "netns", c.Netns, "gcSandboxGrace", grace.String())
	r.event(c.Deletion, corev1.EventTypeWarning, ReasonSandboxOutlivesPod, fmt.Sprintf(
		"%s: the pod is gone but its network namespace %s still exists after %s; the addresses stay held until the runtime removes the sandbox (check the kubelet and the container runtime on the node)",
		describe(att), c.Netns, grace))
}

func (r *gcReporter) failed(path string, c gc.Candidate, msg string) {
	att := ipam.Attachment{Key: c.Key, Pod: c.Pod}
	r.log.Error(nil, "could not free the addresses of a pod that may be gone", "path", path, "pod", c.Pod.String(), "podUID", c.Pod.UID,
		"attachment", c.Key.String(), "error", msg)
	r.event(c.Deletion, corev1.EventTypeWarning, ReasonCollectionFail, fmt.Sprintf("could not free the addresses of %s: %s", describe(att), msg))
}

// locked runs f with what the collector remembers.
func (c *Collector) locked(f func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	f()
}

package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"

	"github.com/ipwarden/ipwarden/internal/agent/gc"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// fakePods is the API server and the informer cache, separately: the cache may lag.
type fakePods struct {
	mu     sync.Mutex
	api    map[gc.Name]string // name -> UID
	cache  []ipam.PodRef
	err    error
	gets   int
	onGet  func(gc.Name) // runs during a read, to race the collector
	cacheE error
}

func (f *fakePods) CachedPods(context.Context) ([]ipam.PodRef, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]ipam.PodRef(nil), f.cache...), f.cacheE
}

func (f *fakePods) GetPod(_ context.Context, n gc.Name) gc.Lookup {
	f.mu.Lock()
	f.gets++
	hook := f.onGet
	l := gc.Lookup{Name: n, Err: f.err}
	if uid, ok := f.api[n]; ok && f.err == nil {
		l.Found, l.UID = true, uid
	}
	f.mu.Unlock()
	if hook != nil {
		hook(n)
	}
	return l
}

func (f *fakePods) set(fn func(f *fakePods)) {
	f.mu.Lock()
	fn(f)
	f.mu.Unlock()
}

// capture records events with the object they are about.
type capture struct {
	mu     sync.Mutex
	events []string // "Kind/namespace/name type reason: message"
}

func (c *capture) Event(obj runtime.Object, typ, reason, msg string) {
	ref := obj.(*corev1.ObjectReference)
	c.mu.Lock()
	c.events = append(c.events, fmt.Sprintf("%s/%s/%s %s %s: %s", ref.Kind, ref.Namespace, ref.Name, typ, reason, msg))
	c.mu.Unlock()
}

func (c *capture) Eventf(obj runtime.Object, typ, reason, format string, args ...any) {
	c.Event(obj, typ, reason, fmt.Sprintf(format, args...))
}

func (c *capture) AnnotatedEventf(obj runtime.Object, _ map[string]string, typ, reason, format string, args ...any) {
	c.Eventf(obj, typ, reason, format, args...)
}

func (c *capture) all() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.events...)
}

func (c *capture) find(prefix string) string {
	for _, e := range c.all() {
		if strings.HasPrefix(e, prefix) {
			return e
		}
	}
	return ""
}

type gcHarness struct {
	*svcHarness
	pods *fakePods
	rec  *capture
	col  *Collector
	reg  *prometheus.Registry
	// netns stands for /var/run/netns: ADDs record <netns>/<cid>, which does not exist (the
	// sandbox is gone) unless a test creates it.
	netns string
	mu    sync.Mutex
	now   time.Time
}

func newGCHarness(t *testing.T, dryRun bool, opts CollectorOptions) *gcHarness {
	t.Helper()
	h := &gcHarness{svcHarness: newSvc(t, time.Second, testV4), pods: &fakePods{api: map[gc.Name]string{}}, rec: &capture{},
		now: time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)}
	h.svc.now = func() time.Time { h.mu.Lock(); defer h.mu.Unlock(); return h.now }
	h.svc.gcDryRunOn = dryRun
	h.reg = prometheus.NewRegistry()
	h.svc.metrics = NewMetrics(h.reg)
	h.svc.gcr.metrics = h.svc.metrics
	h.svc.SetEvents(h.rec, func() *corev1.ObjectReference {
		return &corev1.ObjectReference{Kind: "NodeIPAllocation", Name: "node-a"}
	})
	h.hold(map[string]string{"v4": "10.1.1.0/28"})
	if opts.Grace == 0 {
		opts.Grace = time.Minute
	}
	opts.Log = logr.Discard()
	h.netns = t.TempDir()
	if opts.NetnsDirs == nil {
		opts.NetnsDirs = []string{h.netns}
	}
	h.col = NewCollector(h.svc, h.pods, opts)
	h.svc.SetPodLookup(h.pods.GetPod)
	return h
}

func (h *gcHarness) advance(d time.Duration) {
	h.mu.Lock()
	h.now = h.now.Add(d)
	h.mu.Unlock()
}

// addPod records an ADD for pod ns/name with uid ("" for none) and returns its address.
func (h *gcHarness) addPod(cid, name, uid string) string {
	h.t.Helper()
	resp := h.do(cniproto.Request{Op: cniproto.OpAdd, ContainerID: cid, IfName: "eth0", Network: "net",
		Netns: filepath.Join(h.netns, cid), Pod: cniproto.Pod{Namespace: "ns", Name: name, UID: uid}, NonKubernetes: name == ""})
	if resp.Error != nil {
		h.t.Fatalf("ADD %s: %v", cid, resp.Error)
	}
	return resp.IPs[0].Address
}

func (h *gcHarness) attachments() string {
	var ids []string
	for _, a := range h.do(cniproto.Request{Op: cniproto.OpList}).Attachments {
		ids = append(ids, a.ContainerID)
	}
	return strings.Join(ids, ",")
}

// metric returns the value of the series name{path=path} (a counter, a gauge, or a histogram's
// sample count with "_count" and sum with "_sum"), or -1 if there is no such series.
func (h *gcHarness) metric(name, path string) float64 {
	h.t.Helper()
	mfs, err := h.reg.Gather()
	if err != nil {
		h.t.Fatal(err)
	}
	base, suffix := name, ""
	for _, s := range []string{"_count", "_sum"} {
		if strings.HasSuffix(name, s) && strings.Contains(name, "seconds") {
			base, suffix = strings.TrimSuffix(name, s), s
		}
	}
	for _, mf := range mfs {
		if mf.GetName() != base {
			continue
		}
		for _, m := range mf.GetMetric() {
			match := path == ""
			for _, l := range m.GetLabel() {
				if l.GetName() == "path" && l.GetValue() == path {
					match = true
				}
			}
			if !match {
				continue
			}
			switch {
			case suffix == "_count":
				return float64(m.GetHistogram().GetSampleCount())
			case suffix == "_sum":
				return m.GetHistogram().GetSampleSum()
			case m.GetCounter() != nil:
				return m.GetCounter().GetValue()
			default:
				return m.GetGauge().GetValue()
			}
		}
	}
	return -1
}

// drain processes every queued name now (no rate-limited retries pending).
func (h *gcHarness) drain() {
	for h.col.queue.Len() > 0 {
		h.col.processNext(context.Background())
	}
}

func pod(name, uid string, deleting *time.Time) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, UID: types.UID(uid)}}
	if deleting != nil {
		p.DeletionTimestamp = &metav1.Time{Time: *deleting}
	}
	return p
}

func TestCollectorEventPathFreesByUIDThroughDEL(t *testing.T) {
	h := newGCHarness(t, false, CollectorOptions{})
	h.addPod("web", "web", "u-web")
	h.addPod("db", "db", "u-db")
	h.pods.set(func(f *fakePods) { f.api[gc.Name{Namespace: "ns", Name: "db"}] = "u-db" })
	h.advance(5 * time.Second)
	deletedAt := h.now.Add(-2 * time.Second)
	h.col.OnPodDelete(pod("web", "u-web", &deletedAt)) // young (5s < 1m grace): the deletion is proof enough
	h.drain()
	if got := h.attachments(); got != "db" {
		t.Fatalf("attachments %s, want db", got)
	}
	// DEL path: journaled, and the address cools down (1h) rather than becoming free.
	snap := h.j.snapshot()
	if len(snap.Attachments) != 1 || len(snap.Cooling) != 1 {
		t.Fatalf("journal: %d attachments, %d cooling", len(snap.Attachments), len(snap.Cooling))
	}
	ev := h.rec.find("Pod/ns/web Normal IPAddressGarbageCollected")
	if !strings.Contains(ev, "10.1.1.") || !strings.Contains(ev, "u-web") {
		t.Fatalf("events %q", h.rec.all())
	}
	if h.metric("ipwarden_agent_gc_collected_total", PathEvent) != 1 || h.metric("ipwarden_agent_gc_candidates_total", PathEvent) != 1 {
		t.Fatal("collected/candidates metrics")
	}
	if n, sum := h.metric("ipwarden_agent_gc_delete_to_free_seconds_count", PathEvent), h.metric("ipwarden_agent_gc_delete_to_free_seconds_sum", PathEvent); n != 1 || sum != 2 {
		t.Fatalf("delete-to-free: %v samples, sum %v; want 1 of 2s (since the deletionTimestamp)", n, sum)
	}
	if h.col.deletions.Len() != 0 {
		t.Fatal("the deletion is still remembered")
	}
}

func TestCollectorTombstoneAndStatefulSetNameReuse(t *testing.T) {
	h := newGCHarness(t, false, CollectorOptions{})
	h.addPod("old", "web-0", "u1")
	h.advance(time.Hour)
	h.addPod("new", "web-0", "u2")
	// The new pod exists; the old one's deletion arrives late, as a tombstone.
	h.pods.set(func(f *fakePods) { f.api[gc.Name{Namespace: "ns", Name: "web-0"}] = "u2" })
	h.col.OnPodDelete(toolscache.DeletedFinalStateUnknown{Key: "ns/web-0", Obj: pod("web-0", "u1", nil)})
	h.drain()
	if got := h.attachments(); got != "new" {
		t.Fatalf("attachments %s, want new", got)
	}
	if ev := h.rec.find("Pod/ns/web-0 Normal IPAddressGarbageCollected"); !strings.Contains(ev, "now belongs to pod UID u2") {
		t.Fatalf("events %q", h.rec.all())
	}
	// A replayed deletion of the live pod: the API server still shows it, so it stays.
	h.col.OnPodDelete(pod("web-0", "u2", nil))
	h.drain()
	if got := h.attachments(); got != "new" {
		t.Fatalf("after a stale deletion of the live pod: %s", got)
	}
	if h.metric("ipwarden_agent_gc_kept_total", PathEvent) != 1 {
		t.Fatal("kept metric")
	}
}

func TestCollectorWithoutUIDMatchesByNameAfterGrace(t *testing.T) {
	// A short grace: the recheck is queued with AddAfter, which runs on the real clock.
	h := newGCHarness(t, false, CollectorOptions{Grace: 200 * time.Millisecond})
	h.addPod("noid", "web-0", "")
	h.advance(50 * time.Millisecond)
	h.col.OnPodDelete(pod("web-0", "u1", nil)) // an earlier pod of that name
	h.drain()
	if got := h.attachments(); got != "noid" {
		t.Fatalf("a young attachment without UID was freed on another pod's deletion: %s", got)
	}
	if h.pods.gets != 0 {
		t.Fatal("read the API server for a non-candidate")
	}
	// The recheck is scheduled for the end of the grace period; a pod of that name exists then.
	h.pods.set(func(f *fakePods) { f.api[gc.Name{Namespace: "ns", Name: "web-0"}] = "u2" })
	h.advance(200 * time.Millisecond)
	h.col.processNext(context.Background()) // blocks until the AddAfter (150ms) fires
	if got := h.attachments(); got != "noid" {
		t.Fatalf("freed while a pod of that name exists: %s", got)
	}
	// The name is gone: the next full check frees it.
	h.pods.set(func(f *fakePods) { delete(f.api, gc.Name{Namespace: "ns", Name: "web-0"}) })
	h.col.FullCheck(context.Background())
	h.drain()
	if got := h.attachments(); got != "" {
		t.Fatalf("attachments %s", got)
	}
	if ev := h.rec.find("NodeIPAllocation//node-a Normal IPAddressGarbageCollected"); !strings.Contains(ev, "full check") {
		t.Fatalf("events %q", h.rec.all())
	}
}

func TestCollectorFullCheckHonoursGraceCacheAndAPI(t *testing.T) {
	h := newGCHarness(t, false, CollectorOptions{})
	h.addPod("gone", "gone", "u-gone")
	h.addPod("cached", "cached", "u-cached")
	h.addPod("uncached", "uncached", "u-uncached") // the cache lags; the API server has it
	h.addPod("noname", "", "u-noname")
	h.pods.set(func(f *fakePods) {
		f.cache = []ipam.PodRef{{Namespace: "ns", Name: "cached", UID: "u-cached"}}
		f.api[gc.Name{Namespace: "ns", Name: "cached"}] = "u-cached"
		f.api[gc.Name{Namespace: "ns", Name: "uncached"}] = "u-uncached"
	})
	h.col.FullCheck(context.Background())
	h.drain()
	if h.pods.gets != 0 || h.attachments() != "cached,gone,noname,uncached" {
		t.Fatalf("within the grace period: %d reads, attachments %s", h.pods.gets, h.attachments())
	}
	h.advance(time.Minute)
	h.col.FullCheck(context.Background())
	h.drain()
	if got := h.attachments(); got != "cached,noname,uncached" {
		t.Fatalf("after the grace period: %s", got)
	}
	if h.pods.gets != 2 {
		t.Fatalf("%d API reads, want 2 (gone, uncached)", h.pods.gets)
	}
	if h.metric("ipwarden_agent_gc_kept_total", PathFullCheck) != 1 || h.metric("ipwarden_agent_gc_collected_total", PathFullCheck) != 1 ||
		h.metric("ipwarden_agent_gc_full_checks_total", "") != 2 {
		t.Fatal("metrics")
	}
	if h.metric("ipwarden_agent_gc_delete_to_free_seconds_count", PathFullCheck) > 0 {
		t.Fatal("observed a deletion time the agent never saw")
	}
}

func TestCollectorNeverFreesOnAPIErrorAndGivesUp(t *testing.T) {
	h := newGCHarness(t, false, CollectorOptions{MaxRetries: 3, RetryBase: time.Millisecond, RetryMax: 2 * time.Millisecond,
		FullCheckInterval: time.Hour})
	h.addPod("web", "web", "u-web")
	h.pods.set(func(f *fakePods) { f.err = errors.New("connection refused") })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { h.col.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	h.col.OnPodDelete(pod("web", "u-web", nil))
	wait(t, "the failure event", func() error {
		if h.rec.find("Pod/ns/web Warning IPAddressGarbageCollectionFailed") == "" {
			return fmt.Errorf("events %q", h.rec.all())
		}
		return nil
	})
	if got := h.attachments(); got != "web" {
		t.Fatalf("freed on an API error: %s", got)
	}
	if ev := h.rec.find("Pod/ns/web Warning"); !strings.Contains(ev, "connection refused") || !strings.Contains(ev, "gave up after 4 attempts") {
		t.Fatalf("event %q", ev)
	}
	if n := h.metric("ipwarden_agent_gc_failed_total", PathEvent); n != 4 {
		t.Fatalf("failed %v, want 4 attempts", n)
	}
	if h.col.deletions.Len() != 0 {
		t.Fatal("the deletion is still remembered after giving up")
	}
	// The API server is back: the next deletion notice (or full check) frees it.
	h.pods.set(func(f *fakePods) { f.err = nil })
	h.col.OnPodDelete(pod("web", "u-web", nil))
	wait(t, "the free once the API server answered", func() error {
		if got := h.attachments(); got != "" {
			return fmt.Errorf("attachments %q", got)
		}
		return nil
	})
}

func TestCollectorDoesNotUndoARacingADD(t *testing.T) {
	h := newGCHarness(t, false, CollectorOptions{})
	h.addPod("c1", "web", "u-web")
	// While the collector reads the API server, the runtime DELs and re-ADDs the same key for
	// the same pod: a different attachment now, which the collector never selected.
	h.pods.onGet = func(gc.Name) {
		h.do(cniproto.Request{Op: cniproto.OpDel, ContainerID: "c1", IfName: "eth0"})
		h.advance(time.Second)
		h.addPod("c1", "web", "u-web")
	}
	h.col.OnPodDelete(pod("web", "u-web", nil))
	h.drain()
	if got := h.attachments(); got != "c1" {
		t.Fatalf("attachments %q: the re-added attachment was freed", got)
	}
	if h.metric("ipwarden_agent_gc_collected_total", PathEvent) != 0 {
		t.Fatal("counted a free that did not happen")
	}
}

func TestCollectorDryRun(t *testing.T) {
	h := newGCHarness(t, true, CollectorOptions{})
	h.addPod("web", "web", "u-web")
	h.addPod("cni", "cni", "u-cni")
	h.advance(2 * time.Minute)
	h.col.OnPodDelete(pod("web", "u-web", nil))
	h.drain()
	resp := h.do(cniproto.Request{Op: cniproto.OpGC, Network: "net", HasValidAttachments: true})
	if resp.Error != nil || resp.Freed != 0 {
		t.Fatalf("GC in dry run: %+v", resp)
	}
	if got := h.attachments(); got != "cni,web" {
		t.Fatalf("dry run freed something: %s", got)
	}
	if len(h.j.snapshot().Cooling) != 0 {
		t.Fatal("dry run journaled a release")
	}
	if h.metric("ipwarden_agent_gc_dry_run_total", PathEvent) != 1 || h.metric("ipwarden_agent_gc_dry_run_total", PathCNIGC) != 2 ||
		h.metric("ipwarden_agent_gc_collected_total", PathEvent) != 0 {
		t.Fatal("dry-run metrics")
	}
	if ev := h.rec.find("Pod/ns/web Normal IPAddressGarbageCollectionDryRun"); !strings.Contains(ev, "would free") {
		t.Fatalf("events %q", h.rec.all())
	}
	if h.rec.find("NodeIPAllocation//node-a Normal IPAddressGarbageCollectionDryRun") == "" || h.rec.find("Pod/ns/web Normal IPAddressGarbageCollected") != "" {
		t.Fatalf("events %q", h.rec.all())
	}
}

func TestCNIGCReportsOnTheNode(t *testing.T) {
	h := newGCHarness(t, false, CollectorOptions{})
	h.addPod("keep", "keep", "u1")
	h.addPod("gone", "gone", "u2")
	h.advance(2 * time.Minute)
	resp := h.do(cniproto.Request{Op: cniproto.OpGC, Network: "net", HasValidAttachments: true, ValidAttachments: []cniproto.AttachmentID{{ContainerID: "keep", IfName: "eth0"}}})
	if resp.Error != nil || resp.Freed != 1 || h.attachments() != "keep" {
		t.Fatalf("GC %+v, attachments %s", resp, h.attachments())
	}
	if ev := h.rec.find("NodeIPAllocation//node-a Normal IPAddressGarbageCollected"); !strings.Contains(ev, "CNI GC") {
		t.Fatalf("events %q", h.rec.all())
	}
	if h.metric("ipwarden_agent_gc_collected_total", PathCNIGC) != 1 {
		t.Fatal("metric")
	}
	// A journal failure: kept, counted, a warning, and the runtime is told to retry.
	h.addPod("gone2", "gone2", "u3")
	h.advance(2 * time.Minute)
	h.j.setFail(errors.New("disk full"))
	resp = h.do(cniproto.Request{Op: cniproto.OpGC, Network: "net", HasValidAttachments: true, ValidAttachments: []cniproto.AttachmentID{{ContainerID: "keep", IfName: "eth0"}}})
	h.j.setFail(nil)
	if resp.Error == nil || h.attachments() != "gone2,keep" {
		t.Fatalf("GC with a failing journal: %+v, %s", resp, h.attachments())
	}
	if ev := h.rec.find("NodeIPAllocation//node-a Warning IPAddressGarbageCollectionFailed"); !strings.Contains(ev, "disk full") {
		t.Fatalf("events %q", h.rec.all())
	}
}

func TestDeletionOf(t *testing.T) {
	seen := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	early, late := seen.Add(-time.Minute), seen.Add(time.Minute)
	for _, tc := range []struct {
		obj  any
		ok   bool
		uid  string
		want time.Time
	}{
		{pod("a", "u1", nil), true, "u1", seen},
		{pod("a", "u1", &early), true, "u1", early},
		{pod("a", "u1", &late), true, "u1", seen}, // removed before its grace period ended
		{toolscache.DeletedFinalStateUnknown{Obj: pod("a", "u2", &early)}, true, "u2", early},
		{&toolscache.DeletedFinalStateUnknown{Obj: pod("a", "u3", nil)}, true, "u3", seen},
		{toolscache.DeletedFinalStateUnknown{Obj: "junk"}, false, "", time.Time{}},
		{"junk", false, "", time.Time{}},
	} {
		d, ok := deletionOf(tc.obj, seen)
		if ok != tc.ok || d.Pod.UID != tc.uid || !d.At.Equal(tc.want) {
			t.Errorf("deletionOf(%T) = %+v, %v", tc.obj, d, ok)
		}
	}
}

// A pod deleted while its network namespace exists keeps its address, however long; it is freed
// once the namespace is gone. With no namespace recorded (an older journal) the collector waits
// the grace period after the API server first showed the pod gone.
func TestCollectorKeepsAddressWhileNetnsExists(t *testing.T) {
	h := newGCHarness(t, false, CollectorOptions{SandboxGrace: 10 * time.Minute})
	h.addPod("web", "web", "u-web")
	ns := filepath.Join(h.netns, "web")
	if err := os.WriteFile(ns, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	h.advance(5 * time.Second)
	h.col.OnPodDelete(pod("web", "u-web", nil))
	for range 5 {
		h.col.processNext(context.Background())
		h.advance(3 * time.Minute)
		if got := h.attachments(); got != "web" {
			t.Fatalf("attachments %q while the namespace exists", got)
		}
		requeue(h, "web")
	}
	if v := h.metric("ipwarden_agent_gc_sandbox_outlived_attachments", ""); v != 1 {
		t.Fatalf("outlived gauge %v, want 1", v)
	}
	if ev := h.rec.find("Pod/ns/web Warning IPAddressSandboxOutlivesPod"); !strings.Contains(ev, ns) {
		t.Fatalf("events %q", h.rec.all())
	}
	if err := os.Remove(ns); err != nil {
		t.Fatal(err)
	}
	h.col.processNext(context.Background())
	if got := h.attachments(); got != "" {
		t.Fatalf("attachments %q after the namespace went", got)
	}
	if v := h.metric("ipwarden_agent_gc_sandbox_outlived_attachments", ""); v != 0 {
		t.Fatalf("outlived gauge %v after the free", v)
	}
}

func TestCollectorUnrecordedNetnsWaitsGrace(t *testing.T) {
	h := newGCHarness(t, false, CollectorOptions{Grace: time.Minute})
	resp := h.do(cniproto.Request{Op: cniproto.OpAdd, ContainerID: "old", IfName: "eth0", Network: "net",
		Pod: cniproto.Pod{Namespace: "ns", Name: "old", UID: "u-old"}})
	if resp.Error != nil {
		t.Fatal(resp.Error)
	}
	h.col.OnPodDelete(pod("old", "u-old", nil))
	h.col.processNext(context.Background())
	if got := h.attachments(); got != "old" {
		t.Fatalf("freed at once without a recorded namespace: %q", got)
	}
	h.advance(time.Minute)
	requeue(h, "old")
	h.col.processNext(context.Background())
	if got := h.attachments(); got != "" {
		t.Fatalf("attachments %q after the grace", got)
	}
}

// requeue puts pod name ns/name back into the collector's queue, as its delayed recheck does
// (the workqueue's AddAfter runs on the real clock, not the test's).
func requeue(h *gcHarness, name string) {
	h.col.add(gcItem{name: gc.Name{Namespace: "ns", Name: name}, path: PathEvent})
}

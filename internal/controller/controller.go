package controller

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/go-logr/logr"
	ipamclaimsv1 "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1"
	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/nodelease"
	"github.com/ipwarden/ipwarden/internal/sticky"
)

// Options tune the controller. Zero values take the defaults in brackets.
type Options struct {
	// Workers is the number of node syncs run in parallel [4].
	Workers int
	// MinSyncInterval is the least time between two syncs of one node; events in between
	// coalesce into one sync [100ms].
	MinSyncInterval time.Duration
	// ResyncPeriod is the period of the full pass that repairs anything an event missed [1m].
	ResyncPeriod time.Duration
	// BackoffBase and BackoffMax bound the retry delay of a failing node [250ms, 2m].
	BackoffBase, BackoffMax time.Duration
	// PoolStatusInterval coalesces pool status writes [1s].
	PoolStatusInterval time.Duration
	// AuditPeriod is the period of the slow audit that compares the record with freshly listed
	// NodeIPAllocation statuses [10m].
	AuditPeriod time.Duration
	// Exhaustion sets the exhausted flag's hysteresis [DefaultExhaustionMarks].
	Exhaustion ExhaustionMarks
	// Now is the clock [time.Now].
	Now func() time.Time
	// Fence is the write permit from leader election [NoFence: unfenced, no leader election].
	Fence *Fence
	// Lease is the leader election Lease, for events about the fence; with it, a controller that
	// starts leading probes the API server's fence before it writes (fenceprobe.go) [nil: no
	// probe].
	Lease *corev1.ObjectReference
	// ClaimSettle bounds how long after it starts leading the controller serves only claims
	// and take-backs, waiting for every node's agent to acknowledge it, before it fills nodes
	// from the free pool anyway [60s]. Without leader election nothing acknowledges, and it
	// waits exactly this long.
	ClaimSettle time.Duration
	// PerNodeMetrics exports the node x pool gauges (node_held_addresses,
	// node_requested_addresses, node_deficit_addresses) [false: each agent exports the same
	// figures for its node, and at thousands of nodes these are tens of thousands of series].
	PerNodeMetrics bool
	// AgentLeaseNamespace is where the agents keep their Leases ipwarden-agent-<node>: a
	// deleted node's addresses return to their pools only once its agent has stopped renewing
	// (agentalive.go) ["": not checked, a deleted node's addresses return at once].
	AgentLeaseNamespace string
	// AgentLeaseDuration is the agents' Lease duration when a Lease does not say [60s, the
	// agents' default --lease-duration].
	AgentLeaseDuration time.Duration
	// PoolSettle bounds how long a pool that appears or gains addresses while the controller
	// leads keeps its free addresses from every node, waiting for the nodes whose pods may use
	// them to report what their running pods use in it (spec.observedPools; a silent node's pods
	// are read after podReadAfter instead; poolsettle.go) [60s; <0: not at all].
	PoolSettle time.Duration
}

func (o *Options) setDefaults() {
	if o.Workers <= 0 {
		o.Workers = 4
	}
	if o.MinSyncInterval <= 0 {
		o.MinSyncInterval = 100 * time.Millisecond
	}
	if o.AgentLeaseDuration <= 0 {
		o.AgentLeaseDuration = 60 * time.Second
	}
	if o.ResyncPeriod <= 0 {
		o.ResyncPeriod = time.Minute
	}
	if o.BackoffBase <= 0 {
		o.BackoffBase = 250 * time.Millisecond
	}
	if o.BackoffMax <= 0 {
		o.BackoffMax = 2 * time.Minute
	}
	if o.PoolStatusInterval <= 0 {
		o.PoolStatusInterval = time.Second
	}
	if o.AuditPeriod <= 0 {
		o.AuditPeriod = 10 * time.Minute
	}
	if o.Exhaustion == (ExhaustionMarks{}) {
		o.Exhaustion = DefaultExhaustionMarks
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Fence == nil {
		o.Fence = NoFence()
	}
	// A negative settle stays negative: none (setDefaults runs more than once).
	if o.ClaimSettle == 0 {
		o.ClaimSettle = 60 * time.Second
	}
	if o.PoolSettle == 0 {
		o.PoolSettle = 60 * time.Second
	}
}

// Controller is the driver of the Machine on the API server: it feeds the informers' events, the
// clock and the outcomes of the reads and writes it performs into the machine, one goroutine
// owning it, and carries out what the machine's Ready lists. It decides nothing itself except
// the fence check before each write (the permit leader election gives).
type Controller struct {
	opts    Options
	cache   cache.Cache
	reader  client.Reader // uncached: fresh reads before decisions that must not trust the cache
	writer  client.Client
	events  record.EventRecorder
	metrics *Metrics
	log     logr.Logger
	fence   *Fence
	stop    context.CancelCauseFunc // ends Start with ErrFenced

	m      *Machine // owned by Start's goroutine
	inbox  inbox
	claims ClaimAPI // nil: no IPAMClaims (every claim use is refused)
}

// claimSyncWait bounds how long the controller waits for the IPAMClaim informer before it leads.
const claimSyncWait = 30 * time.Second

// WithClaims has the controller read and write IPAMClaims through api (docs/design.md, "VM
// addresses").
func (c *Controller) WithClaims(api ClaimAPI) *Controller {
	c.claims = api
	return c
}

// FieldManager is the field manager of every write the controller makes (managedFields shows
// which fields it owns).
const FieldManager = "ipwarden-controller"

// New returns a controller reading through c (an informer cache), reader (the API server,
// uncached) and writing through writer, as FieldManager.
func New(c cache.Cache, reader client.Reader, writer client.Client, events record.EventRecorder, m *Metrics, log logr.Logger, opts Options) *Controller {
	mach := NewMachine(opts, m, log) // applies the defaults (once: a settle of 0 means none)
	opts = mach.opts
	mach.sched.Jitter = rand.Float64
	return &Controller{
		opts: opts, cache: c, reader: reader, writer: client.WithFieldOwner(writer, FieldManager), events: events, metrics: m, log: log,
		fence: opts.Fence, m: mach, inbox: newInbox(),
	}
}

// NeedLeaderElection makes the manager run the controller only on the elected replica.
func (c *Controller) NeedLeaderElection() bool { return true }

func nodeMeta() *metav1.PartialObjectMetadata {
	m := &metav1.PartialObjectMetadata{}
	m.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Node"))
	return m
}

// input is one informer event for the machine.
type input func(m *Machine, now time.Time)

// inbox carries informer events to the machine's goroutine without blocking the informers.
type inbox struct {
	mu     sync.Mutex
	items  []input
	signal chan struct{}
}

func newInbox() inbox { return inbox{signal: make(chan struct{}, 1)} }

func (b *inbox) push(in input) {
	b.mu.Lock()
	b.items = append(b.items, in)
	b.mu.Unlock()
	select {
	case b.signal <- struct{}{}:
	default:
	}
}

func (b *inbox) take() []input {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := b.items
	b.items = nil
	return out
}

// Start runs the controller until ctx ends. It is called on gaining leadership: the machine
// starts from a fresh LIST (not the cache, which may lag the previous leader's last writes),
// then serves events, timers and the outcomes of its writes.
func (c *Controller) Start(ctx context.Context) error {
	ctx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	c.stop = stop
	if err := c.fence.Allow(); err != nil {
		return err
	}
	c.metrics.Epoch.Set(float64(c.fence.Epoch()))
	c.log.Info("leading", "holder", c.fence.Holder(), "epoch", c.fence.Epoch())
	if err := c.awaitFence(ctx); err != nil {
		return err
	}
	if ctx.Err() != nil {
		return nil
	}
	if err := c.watch(ctx); err != nil {
		return err
	}
	var pools ipwardenv1.IPPoolList
	if err := c.reader.List(ctx, &pools); err != nil {
		return fmt.Errorf("list IPPools: %w", err)
	}
	var allocs ipwardenv1.NodeIPAllocationList
	if err := c.reader.List(ctx, &allocs); err != nil {
		return fmt.Errorf("list NodeIPAllocations: %w", err)
	}
	if err := c.m.Lead(pools.Items, allocs.Items, c.fence.Stamp(), c.opts.Now()); err != nil {
		if errors.Is(err, ErrFenced) {
			c.fenced("local", err)
		}
		return err
	}
	c.log.Info("controller serving", "workers", c.opts.Workers, "resync", c.opts.ResyncPeriod, "claimSettle", max(c.opts.ClaimSettle, 0))
	c.run(ctx)
	if cause := context.Cause(ctx); errors.Is(cause, ErrFenced) || errors.Is(cause, ErrFenceLost) {
		return cause
	}
	return nil
}

// watch waits for the informers and sends their events to the inbox: they wait there until the
// machine leads.
func (c *Controller) watch(ctx context.Context) error {
	nodeInf, err := c.cache.GetInformer(ctx, nodeMeta())
	if err != nil {
		return fmt.Errorf("node informer: %w", err)
	}
	poolInf, err := c.cache.GetInformer(ctx, &ipwardenv1.IPPool{})
	if err != nil {
		return fmt.Errorf("IPPool informer: %w", err)
	}
	allocInf, err := c.cache.GetInformer(ctx, &ipwardenv1.NodeIPAllocation{})
	if err != nil {
		return fmt.Errorf("NodeIPAllocation informer: %w", err)
	}
	stsInf, err := c.cache.GetInformer(ctx, &appsv1.StatefulSet{})
	if err != nil {
		return fmt.Errorf("StatefulSet informer: %w", err)
	}
	if !c.cache.WaitForCacheSync(ctx) {
		return errors.New("caches did not sync")
	}
	if c.claims != nil {
		// The claims present reach the inbox before the machine leads, so its first fills know
		// them; without the CRD, ready comes at once and the watch starts when it appears.
		ready := make(chan struct{})
		go c.claims.Watch(ctx, func(obj *ipamclaimsv1.IPAMClaim) {
			c.inbox.push(func(m *Machine, now time.Time) { m.ClaimChanged(obj, now) })
		}, func(ns, name string) {
			c.inbox.push(func(m *Machine, now time.Time) { m.ClaimDeleted(ns, name, now) })
		}, ready)
		select {
		case <-ready:
		case <-time.After(claimSyncWait):
			// Forbidden (RBAC) or an API server slow to list them: lead anyway; claims reach
			// the machine as the informer delivers them (until then their uses are refused).
			c.log.Error(nil, "IPAMClaims did not sync; leading without them for now", "waited", claimSyncWait.String())
		case <-ctx.Done():
			return nil
		}
	}
	for _, reg := range []struct {
		inf     cache.Informer
		changed func(obj any) input
		deleted func(name string) input
	}{
		{nodeInf, func(obj any) input {
			n, ok := obj.(*metav1.PartialObjectMetadata)
			if !ok {
				return nil
			}
			return func(m *Machine, now time.Time) { m.NodeChanged(n, now) }
		}, func(name string) input { return func(m *Machine, now time.Time) { m.NodeDeleted(name, now) } }},
		{allocInf, func(obj any) input {
			a, ok := obj.(*ipwardenv1.NodeIPAllocation)
			if !ok {
				return nil
			}
			return func(m *Machine, now time.Time) { m.AllocChanged(a, now) }
		}, func(name string) input { return func(m *Machine, now time.Time) { m.AllocDeleted(name, now) } }},
		{poolInf, func(obj any) input {
			p, ok := obj.(*ipwardenv1.IPPool)
			if !ok {
				return nil
			}
			return func(m *Machine, now time.Time) { m.PoolChanged(p, now) }
		}, func(name string) input { return func(m *Machine, now time.Time) { m.PoolDeleted(name, now) } }},
	} {
		reg := reg
		changed := func(obj any) {
			if in := reg.changed(obj); in != nil {
				c.inbox.push(in)
			}
		}
		if _, err := reg.inf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
			AddFunc:    changed,
			UpdateFunc: func(_, obj any) { changed(obj) },
			DeleteFunc: func(obj any) {
				if m := metaOf(obj); m != nil {
					c.inbox.push(reg.deleted(m.GetName()))
				}
			},
		}); err != nil {
			return err
		}
	}
	sts := func(obj any, deleted bool) {
		if t, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
			obj, deleted = t.Obj, true
		}
		s, ok := obj.(*appsv1.StatefulSet)
		if !ok {
			return
		}
		view := sticky.Of(s)
		if deleted {
			view.Exists = false
		}
		c.inbox.push(func(m *Machine, _ time.Time) { m.StatefulSetChanged(s.Namespace, s.Name, view) })
	}
	_, err = stsInf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { sts(obj, false) },
		UpdateFunc: func(_, obj any) { sts(obj, false) },
		DeleteFunc: func(obj any) { sts(obj, true) },
	})
	return err
}

// run is the driver loop: inputs in, Ready out, until ctx ends; then it waits for the
// operations in flight.
func (c *Controller) run(ctx context.Context) {
	results := make(chan OpResult, 16)
	var inflight sync.WaitGroup
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		now := c.opts.Now()
		for _, in := range c.inbox.take() {
			in(c.m, now)
		}
		c.m.Tick(now)
		rd := c.m.Ready(now)
		for _, op := range rd.Ops {
			inflight.Add(1)
			go func() {
				defer inflight.Done()
				results <- c.perform(ctx, op)
			}()
		}
		for _, e := range rd.Events {
			c.events.Event(e.Object, e.Type, e.Reason, e.Message)
		}
		if rd.Fenced != nil {
			c.fenced("local", rd.Fenced)
		}
		c.m.Advance()
		timer.Reset(max(rd.Wake.Sub(c.opts.Now()), time.Millisecond))
		select {
		case <-ctx.Done():
			done := make(chan struct{})
			go func() { inflight.Wait(); close(done) }()
			for {
				select {
				case <-results:
				case <-done:
					return
				}
			}
		case <-c.inbox.signal:
		case <-c.fence.Lost():
			// The fence gate took the permit and said so (log, event, metrics): step down.
			c.stop(c.fence.Allow())
		case r := <-results:
			c.m.Done(r, c.opts.Now())
		case <-timer.C:
		}
	}
}

// guard is called before every write: it refuses (and stops the controller) once the lease
// this process holds has run out by its own clock.
func (c *Controller) guard() error {
	if err := c.fence.Allow(); err != nil {
		c.fenced("local", err)
		return err
	}
	return nil
}

// written inspects a write's error: a rejection by the fence policy stops the controller.
func (c *Controller) written(err error) error {
	if err != nil && IsFenceRejection(err) {
		c.fenced("apiserver", err)
		return fmt.Errorf("%w: %v", ErrFenced, err)
	}
	return err
}

// fenced stops the controller at once: another controller leads, or (ErrFenceLost) the fence
// policy no longer fences its writes, which the fence gate reported.
func (c *Controller) fenced(by string, err error) {
	if errors.Is(err, ErrFenceLost) {
		if c.stop != nil {
			c.stop(err)
		}
		return
	}
	c.metrics.FencedWrites.WithLabelValues(by).Inc()
	c.log.Error(err, "write refused: this controller no longer holds its lease; stopping so it restarts as a follower",
		"refusedBy", by, "holder", c.fence.Holder(), "epoch", c.fence.Epoch())
	if c.stop != nil {
		c.stop(ErrFenced)
	}
}

// perform carries out one operation and says what became of it.
func (c *Controller) perform(ctx context.Context, op Op) OpResult {
	r := OpResult{ID: op.ID}
	if op.Kind.Write() {
		if err := c.guard(); err != nil {
			r.Err = err
			return r
		}
	}
	switch op.Kind {
	case OpCreateAllocation:
		r.Err = c.writer.Create(ctx, op.Alloc)
		c.countWrite("nodeipallocations", "create", r.Err)
	case OpDeleteAllocation:
		pre := client.Preconditions{UID: &op.Alloc.UID}
		if op.ExactVersion {
			pre.ResourceVersion = &op.Alloc.ResourceVersion
		}
		r.Err = c.writer.Delete(ctx, op.Alloc, pre)
		c.countWrite("nodeipallocations", "delete", r.Err)
	case OpPatchOwner:
		obj := op.Alloc.DeepCopy()
		r.Err = c.writer.Patch(ctx, obj, client.MergeFrom(op.Base))
		c.countWrite("nodeipallocations", "patch", r.Err)
		r.Alloc = obj
	case OpNodeStatus:
		r.Err = c.writer.Status().Update(ctx, op.Alloc) // the stored object comes back in op.Alloc
		c.countWrite("nodeipallocations/status", "update", r.Err)
		r.Alloc = op.Alloc
	case OpPoolStatus:
		r.Err = c.writer.Status().Update(ctx, op.Pool)
		c.countWrite("ippools/status", "update", r.Err)
		r.Pool = op.Pool
	case OpReadNode:
		r.Err = c.reader.Get(ctx, client.ObjectKey{Name: op.Node}, nodeMeta())
	case OpReadAllocation:
		r.Alloc = &ipwardenv1.NodeIPAllocation{}
		r.Err = c.reader.Get(ctx, client.ObjectKey{Name: op.Node}, r.Alloc)
	case OpReadPool:
		r.Pool = &ipwardenv1.IPPool{}
		r.Err = c.reader.Get(ctx, client.ObjectKey{Name: op.PoolName}, r.Pool)
	case OpReadAgentLease:
		var lease coordinationv1.Lease
		r.Err = c.reader.Get(ctx, client.ObjectKey{Namespace: c.opts.AgentLeaseNamespace, Name: nodelease.Name(op.Node)}, &lease)
		if r.Err == nil {
			r.Lease = &nodelease.Record{Version: lease.ResourceVersion}
			if lease.Spec.HolderIdentity != nil {
				r.Lease.Holder = *lease.Spec.HolderIdentity
			}
			if s := lease.Spec.LeaseDurationSeconds; s != nil && *s > 0 {
				r.LeaseDuration = time.Duration(*s) * time.Second
			}
		}
	case OpListAllocations:
		var list ipwardenv1.NodeIPAllocationList
		r.Err = c.reader.List(ctx, &list)
		r.Allocs = list.Items
	case OpListNodePods:
		var list corev1.PodList
		r.Err = c.reader.List(ctx, &list, client.MatchingFields{"spec.nodeName": op.Node})
		if r.Err == nil {
			r.PodAddrs = PodAddrs(list.Items)
		}
	case OpClaimStatus, OpListClaims:
		c.performClaim(ctx, op, &r)
	default:
		r.Err = fmt.Errorf("unknown operation %v", op.Kind)
	}
	if op.Kind.Write() {
		r.Err = c.written(r.Err)
	}
	return r
}

func nodeOwner(a *ipwardenv1.NodeIPAllocation) types.UID {
	for _, o := range a.OwnerReferences {
		if o.Kind == "Node" && o.APIVersion == "v1" {
			return o.UID
		}
	}
	return ""
}

func replaceNodeOwner(refs []metav1.OwnerReference, node *metav1.PartialObjectMetadata) []metav1.OwnerReference {
	out := []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: node.Name, UID: node.UID}}
	for _, o := range refs {
		if !(o.Kind == "Node" && o.APIVersion == "v1") {
			out = append(out, o)
		}
	}
	return out
}

// OutcomeOf maps a write's error to the step machine's outcome: a conflict, a definite
// refusal (invalid, not found, forbidden, fenced), or an unknown outcome (timeouts, lost
// connections, server errors after the request may have been applied).
func OutcomeOf(err error) Outcome {
	switch {
	case err == nil:
		return Landed
	case apierrors.IsConflict(err):
		return Conflict
	case errors.Is(err, ErrFenced), errors.Is(err, ErrFenceLost), apierrors.IsInvalid(err), apierrors.IsNotFound(err), apierrors.IsForbidden(err),
		apierrors.IsBadRequest(err), apierrors.IsAlreadyExists(err):
		return Rejected
	default:
		return Unknown
	}
}

func (c *Controller) countWrite(resource, verb string, err error) {
	result := "ok"
	switch {
	case err == nil:
	case apierrors.IsConflict(err):
		result = "conflict"
	default:
		result = "error"
	}
	c.metrics.APIWrites.WithLabelValues(resource, verb, result).Inc()
}

func metaOf(obj any) metav1.Object {
	if t, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	m, _ := obj.(metav1.Object)
	return m
}

// firstN returns at most n of names.
func firstN(names []string, n int) []string { return names[:min(n, len(names))] }

package controller

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/agent/nodelease"
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
	// leads keeps its free addresses from every node, waiting for each node's agent to report
	// what its running pods use in it (spec.observedPools; poolsettle.go) [60s; <0: not at all].
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
	if o.ClaimSettle < 0 {
		o.ClaimSettle = 0
	} else if o.ClaimSettle == 0 {
		o.ClaimSettle = 60 * time.Second
	}
	if o.PoolSettle < 0 {
		o.PoolSettle = 0
	} else if o.PoolSettle == 0 {
		o.PoolSettle = 60 * time.Second
	}
}

// Controller is the IO shell around State: it watches Nodes (metadata only), IPPools and
// NodeIPAllocations, schedules node syncs by need, and writes statuses and objects.
type Controller struct {
	opts    Options
	cache   cache.Cache
	reader  client.Reader // uncached: fresh reads before decisions that must not trust the cache
	writer  client.Client
	events  record.EventRecorder
	metrics *Metrics
	log     logr.Logger
	sched   *Scheduler

	mu          sync.Mutex // guards state and nodeFlags
	state       *State
	nodeFlags   map[string][2]bool // deficit, at capacity: for the fleet gauges
	poolLocks   sync.Map           // pool name -> *sync.Mutex, serializes a pool's status writes
	poolWritten sync.Map           // pool name -> time.Time of its last status write
	poolWake    chan struct{}
	workersWG   sync.WaitGroup
	fence       *Fence
	stop        context.CancelCauseFunc // ends Start with ErrFenced
	// awaitAcks is set from the start of leading until every node acknowledged this leader
	// or ClaimSettle passed; ledAt is when it started leading.
	awaitAcks atomic.Bool
	ledAt     time.Time
	// poolsSettling is set while a pool waits for the nodes to observe it (poolsettle.go).
	poolsSettling atomic.Bool
	// agentSeen: for each deleted node whose agent Lease still looked held, when the
	// controller first saw the Lease's current version (guarded by mu).
	agentSeen map[string]*nodelease.Observer
}

// FieldManager is the field manager of every write the controller makes (managedFields shows
// which fields it owns).
const FieldManager = "ipwarden-controller"

// New returns a controller reading through c (an informer cache), reader (the API server,
// uncached) and writing through writer, as FieldManager.
func New(c cache.Cache, reader client.Reader, writer client.Client, events record.EventRecorder, m *Metrics, log logr.Logger, opts Options) *Controller {
	opts.setDefaults()
	s := NewScheduler(opts.MinSyncInterval, opts.BackoffBase, opts.BackoffMax)
	s.Jitter = rand.Float64
	s.Now = opts.Now
	return &Controller{
		opts: opts, cache: c, reader: reader, writer: client.WithFieldOwner(writer, FieldManager), events: events, metrics: m, log: log,
		sched: s, state: NewState(opts.Exhaustion), nodeFlags: map[string][2]bool{}, agentSeen: map[string]*nodelease.Observer{},
		poolWake: make(chan struct{}, 1), fence: opts.Fence,
	}
}

// NeedLeaderElection makes the manager run the controller only on the elected replica.
func (c *Controller) NeedLeaderElection() bool { return true }

func nodeMeta() *metav1.PartialObjectMetadata {
	m := &metav1.PartialObjectMetadata{}
	m.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Node"))
	return m
}

// Start runs the controller until ctx ends. It is called on gaining leadership: it rebuilds the
// allocation state from a fresh LIST (not the cache, which may lag the previous leader's last
// writes), then serves events, a periodic full pass and the pool status writer.
func (c *Controller) Start(ctx context.Context) error {
	ctx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	c.stop = stop
	if err := c.fence.Allow(); err != nil {
		return err
	}
	c.metrics.Epoch.Set(float64(c.fence.Epoch()))
	c.log.Info("leading", "holder", c.fence.Holder(), "epoch", c.fence.Epoch())
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
	if err := c.rebuild(ctx); err != nil {
		return err
	}

	if _, err := nodeInf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) { c.nodeEvent(obj) },
		UpdateFunc: func(old, obj any) {
			o, n := metaOf(old), metaOf(obj)
			if o == nil || n == nil || o.GetUID() != n.GetUID() || !equality.Semantic.DeepEqual(o.GetLabels(), n.GetLabels()) {
				c.nodeEvent(obj)
			}
		},
		DeleteFunc: func(obj any) { c.nodeEvent(obj) },
	}); err != nil {
		return err
	}
	if _, err := allocInf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) { c.allocEvent(obj) },
		UpdateFunc: func(old, obj any) {
			o, n := metaOf(old), metaOf(obj)
			if o == nil || n == nil || o.GetGeneration() != n.GetGeneration() || o.GetUID() != n.GetUID() ||
				!equality.Semantic.DeepEqual(o.GetOwnerReferences(), n.GetOwnerReferences()) {
				c.allocEvent(obj)
			}
		},
		DeleteFunc: func(obj any) { c.allocEvent(obj) },
	}); err != nil {
		return err
	}
	if _, err := poolInf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) { c.poolEvent(obj, false) },
		UpdateFunc: func(old, obj any) {
			o, n := metaOf(old), metaOf(obj)
			if o == nil || n == nil || o.GetGeneration() != n.GetGeneration() {
				c.poolEvent(obj, false)
			}
		},
		DeleteFunc: func(obj any) { c.poolEvent(obj, true) },
	}); err != nil {
		return err
	}

	if _, err := stsInf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { c.statefulSetEvent(obj, false) },
		UpdateFunc: func(_, obj any) { c.statefulSetEvent(obj, false) },
		DeleteFunc: func(obj any) { c.statefulSetEvent(obj, true) },
	}); err != nil {
		return err
	}

	for range c.opts.Workers {
		c.workersWG.Add(1)
		go c.worker(ctx)
	}
	c.workersWG.Add(3)
	go c.poolLoop(ctx)
	go c.every(ctx, c.opts.ResyncPeriod, func() { c.resync(ctx) })
	go c.every(ctx, c.opts.AuditPeriod, func() { c.runAudit(ctx) })
	c.enqueueAll(ctx)
	if c.awaitAcks.Load() {
		c.checkAcks(ctx) // agents may have acknowledged before this process finished starting
	}
	c.workersWG.Add(1)
	go func() {
		// Claims first: once every node acknowledged (checkAcks), or at the latest after the
		// settle bound, every node is synced again and fills resume.
		defer c.workersWG.Done()
		select {
		case <-ctx.Done():
		case <-time.After(c.opts.ClaimSettle):
			if c.awaitAcks.CompareAndSwap(true, false) {
				missing, _ := c.unacknowledged(ctx)
				c.log.Error(nil, "nodes did not acknowledge this leader within --claim-settle; filling from the free pool anyway. "+
					"Their agents may be down or too old: addresses their pods use that their status lost can go to another node (docs/design.md, \"Claims and rewinds\")",
					"claimSettle", c.opts.ClaimSettle.String(), "nodes", len(missing), "first", firstN(missing, 10))
				for _, name := range missing {
					alloc := &ipwardenv1.NodeIPAllocation{}
					if err := c.cache.Get(ctx, client.ObjectKey{Name: name}, alloc); err == nil {
						c.events.Eventf(alloc, corev1.EventTypeWarning, "LeaderNotAcknowledged",
							"the node's agent did not acknowledge controller %s within %s; the controller fills other nodes anyway", c.fence.Holder(), c.opts.ClaimSettle)
					}
				}
			}
			c.enqueueAll(ctx)
		}
	}()
	c.log.Info("controller serving", "workers", c.opts.Workers, "resync", c.opts.ResyncPeriod, "claimSettle", c.opts.ClaimSettle)
	<-ctx.Done()
	c.sched.ShutDown()
	c.workersWG.Wait()
	if cause := context.Cause(ctx); errors.Is(cause, ErrFenced) {
		return cause
	}
	return nil
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

// fenced stops the controller at once: another controller leads.
func (c *Controller) fenced(by string, err error) {
	c.metrics.FencedWrites.WithLabelValues(by).Inc()
	c.log.Error(err, "write refused: this controller no longer holds its lease; stopping so it restarts as a follower",
		"refusedBy", by, "holder", c.fence.Holder(), "epoch", c.fence.Epoch())
	if c.stop != nil {
		c.stop(ErrFenced)
	}
}

// rebuild loads the state from the API server.
func (c *Controller) rebuild(ctx context.Context) error {
	var pools ipwardenv1.IPPoolList
	if err := c.reader.List(ctx, &pools); err != nil {
		return fmt.Errorf("list IPPools: %w", err)
	}
	var allocs ipwardenv1.NodeIPAllocationList
	if err := c.reader.List(ctx, &allocs); err != nil {
		return fmt.Errorf("list NodeIPAllocations: %w", err)
	}
	ours := c.fence.Stamp()
	for i := range allocs.Items {
		if seen := allocs.Items[i].Status.Fence; c.fence.Outranked(seen) {
			err := fmt.Errorf("%w: NodeIPAllocation %s was written by %s at epoch %d, after this controller's epoch %d",
				ErrFenced, allocs.Items[i].Name, seen.Holder, seen.Epoch, ours.Epoch)
			c.fenced("local", err)
			return err
		}
	}
	c.mu.Lock()
	twice := c.state.Rebuild(pools.Items, allocs.Items, c.opts.Now())
	c.state.SettleUntil(c.opts.Now().Add(c.opts.ClaimSettle))
	c.ledAt = c.opts.Now()
	c.awaitAcks.Store(c.fence.Stamp() != nil) // with leader election: wait for the agents' acknowledgements
	c.mu.Unlock()
	n, _ := twice.Size().Uint64()
	c.metrics.AddressesTwice.Set(float64(n))
	if n > 0 {
		c.log.Error(nil, "addresses are held by two nodes; they stay with the first node by name until an operator resolves it",
			"addresses", twice.String())
	}
	c.log.Info("state rebuilt from the API server", "pools", len(pools.Items), "nodeIPAllocations", len(allocs.Items))
	return nil
}

func metaOf(obj any) metav1.Object {
	if t, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	m, _ := obj.(metav1.Object)
	return m
}

func (c *Controller) nodeEvent(obj any) {
	if m := metaOf(obj); m != nil {
		c.enqueue(m.GetName())
	}
	if c.awaitAcks.Load() {
		c.checkAcks(context.Background())
	}
	if c.poolsSettling.Load() {
		c.checkPoolSettles(context.Background())
	}
}

func (c *Controller) allocEvent(obj any) {
	if m := metaOf(obj); m != nil {
		c.enqueue(m.GetName())
	}
	if c.awaitAcks.Load() {
		c.checkAcks(context.Background())
	}
	if c.poolsSettling.Load() {
		c.checkPoolSettles(context.Background())
	}
}

// checkAcks ends the settle once every node's agent has acknowledged this leader: their claims
// are in, so the free pool holds no address a node's pods use.
func (c *Controller) checkAcks(ctx context.Context) {
	missing, err := c.unacknowledged(ctx)
	if err != nil {
		c.log.Error(err, "cannot check the nodes' acknowledgements; the next event retries")
		return
	}
	c.metrics.Unacked.Set(float64(len(missing)))
	if len(missing) > 0 || !c.awaitAcks.CompareAndSwap(true, false) {
		return
	}
	c.mu.Lock()
	c.state.EndSettle()
	c.mu.Unlock()
	c.log.Info("every node acknowledged this leader with its claims; filling from the free pool",
		"waited", c.opts.Now().Sub(c.ledAt).Round(time.Millisecond).String())
	c.enqueueAll(ctx)
}

// unacknowledged lists the nodes whose agent has not acknowledged this leader (Unacknowledged
// over the cache).
func (c *Controller) unacknowledged(ctx context.Context) ([]string, error) {
	allocs, selected, err := c.nodeReports(ctx)
	if err != nil {
		return nil, err
	}
	return Unacknowledged(allocs, selected, c.fence.Holder()), nil
}

// nodeReports lists the NodeIPAllocations from the cache, and every Node with whether a serving
// pool selects it.
func (c *Controller) nodeReports(ctx context.Context) ([]ipwardenv1.NodeIPAllocation, map[string]bool, error) {
	var allocs ipwardenv1.NodeIPAllocationList
	if err := c.cache.List(ctx, &allocs); err != nil {
		return nil, nil, fmt.Errorf("list NodeIPAllocations: %w", err)
	}
	nodes := &metav1.PartialObjectMetadataList{}
	nodes.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("NodeList"))
	if err := c.cache.List(ctx, nodes); err != nil {
		return nil, nil, fmt.Errorf("list nodes: %w", err)
	}
	selected := make(map[string]bool, len(nodes.Items))
	c.mu.Lock()
	for _, n := range nodes.Items {
		selected[n.Name] = c.state.Selected(n.Labels)
	}
	c.mu.Unlock()
	return allocs.Items, selected, nil
}

// checkPoolSettles ends the wait of each pool every node has observed (PoolUnobserved), and of
// each whose --pool-settle bound has passed (with a Warning event naming the nodes that did not
// report); then every node is synced again, so fills from those pools resume.
func (c *Controller) checkPoolSettles(ctx context.Context) {
	c.mu.Lock()
	settles := c.state.PoolsSettling()
	c.mu.Unlock()
	if len(settles) == 0 {
		c.poolsSettling.Store(false)
		return
	}
	allocs, selected, err := c.nodeReports(ctx)
	if err != nil {
		c.log.Error(err, "cannot check which nodes observed the new pools; the next event retries")
		return
	}
	now := c.opts.Now()
	ended := false
	for _, st := range settles {
		missing := PoolUnobserved(allocs, selected, st.Pool, st.UID, st.Generation)
		c.metrics.PoolUnobserved.WithLabelValues(st.Pool).Set(float64(len(missing)))
		switch {
		case len(missing) == 0:
			c.log.Info("every node reported the addresses its pods use in the pool; filling from its free addresses",
				"pool", st.Pool, "generation", st.Generation)
		case !now.Before(st.Until):
			c.log.Error(nil, "nodes did not report the addresses their pods use in the new or grown pool within --pool-settle; filling from its free addresses anyway. "+
				"Their agents may be down or too old: an address one of their pods got from another IPAM can go to another node (docs/operations.md, \"Moving from another IPAM\")",
				"pool", st.Pool, "poolSettle", c.opts.PoolSettle.String(), "nodes", len(missing), "first", firstN(missing, 10))
			pool := &ipwardenv1.IPPool{}
			if err := c.cache.Get(ctx, client.ObjectKey{Name: st.Pool}, pool); err == nil {
				c.events.Eventf(pool, corev1.EventTypeWarning, "PoolSettleTimedOut",
					"%d nodes did not report what their pods use in this pool's new addresses within %s (first: %v); filling from them anyway",
					len(missing), c.opts.PoolSettle, firstN(missing, 10))
			}
		default:
			continue
		}
		c.mu.Lock()
		c.state.EndPoolSettle(st.Pool)
		c.mu.Unlock()
		ended = true
	}
	if ended {
		c.enqueueAll(ctx)
	}
}

func (c *Controller) poolEvent(obj any, deleted bool) {
	m := metaOf(obj)
	if m == nil {
		return
	}
	c.mu.Lock()
	var affected, settle bool
	var until time.Time
	if deleted {
		affected = c.state.DeletePool(m.GetName())
		c.state.EndPoolSettle(m.GetName())
	} else if p, ok := obj.(*ipwardenv1.IPPool); ok {
		settle = c.opts.PoolSettle > 0 && c.state.PoolGrows(p)
		affected = c.state.SetPool(p)
		if settle {
			until = c.opts.Now().Add(c.opts.PoolSettle)
			c.state.StartPoolSettle(p.Name, string(p.UID), p.Generation, until)
		}
	}
	c.mu.Unlock()
	if settle {
		c.poolsSettling.Store(true)
		c.log.Info("pool is new or gained addresses: its free addresses wait until every node has reported what its running pods use in it",
			"pool", m.GetName(), "generation", m.GetGeneration(), "poolSettle", c.opts.PoolSettle.String())
		if p, ok := obj.(*ipwardenv1.IPPool); ok {
			c.events.Eventf(p, corev1.EventTypeNormal, "PoolSettling",
				"waiting up to %s for every node to report the addresses its running pods use in this pool before handing out its free addresses", c.opts.PoolSettle)
		}
		c.checkPoolSettles(context.Background())
		time.AfterFunc(until.Sub(c.opts.Now())+100*time.Millisecond, func() { c.checkPoolSettles(context.Background()) })
	}
	c.wakePools()
	if affected {
		c.enqueueAll(context.Background())
	}
}

// enqueue marks a node dirty with its current need.
// statefulSetEvent returns the sticky addresses of a StatefulSet's identities that its PVC
// retention policy no longer keeps (scaled below the ordinal, or deleted).
func (c *Controller) statefulSetEvent(obj any, deleted bool) {
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
	c.mu.Lock()
	changed := c.state.ReturnSticky(s.Namespace, s.Name, view)
	c.mu.Unlock()
	if changed {
		c.log.Info("returned sticky addresses to their pools", "statefulSet", s.Namespace+"/"+s.Name, "deleted", deleted)
		c.wakePools()
	}
}

func (c *Controller) enqueue(name string) {
	var need Need
	alloc := &ipwardenv1.NodeIPAllocation{}
	if err := c.cache.Get(context.Background(), client.ObjectKey{Name: name}, alloc); err == nil {
		c.mu.Lock()
		need = c.state.NeedOfNode(name, alloc.Spec)
		c.mu.Unlock()
	}
	c.sched.Add(name, need, c.opts.Now())
	c.metrics.QueueDepth.Set(float64(c.sched.Len()))
}

// enqueueAll marks every known node dirty: the full pass.
func (c *Controller) enqueueAll(ctx context.Context) {
	names := map[string]bool{}
	nodes := &metav1.PartialObjectMetadataList{}
	nodes.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("NodeList"))
	if err := c.cache.List(ctx, nodes); err == nil {
		for _, n := range nodes.Items {
			names[n.Name] = true
		}
	}
	var allocs ipwardenv1.NodeIPAllocationList
	if err := c.cache.List(ctx, &allocs); err == nil {
		for _, a := range allocs.Items {
			names[a.Name] = true
		}
	}
	c.mu.Lock()
	for _, n := range c.state.Known() {
		names[n] = true
	}
	c.mu.Unlock()
	for n := range names {
		c.enqueue(n)
	}
}

// every runs f each period until ctx ends.
func (c *Controller) every(ctx context.Context, period time.Duration, f func()) {
	defer c.workersWG.Done()
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			f()
		}
	}
}

// resync is the full pass: every node queued, every pool status recomputed (written if changed).
func (c *Controller) resync(ctx context.Context) {
	c.enqueueAll(ctx)
	c.mu.Lock()
	for _, p := range c.state.PoolNames() {
		c.state.MarkPoolDirty(p)
	}
	c.mu.Unlock()
	c.wakePools()
}

func (c *Controller) runAudit(ctx context.Context) {
	if err := c.audit(ctx); err != nil && ctx.Err() == nil {
		c.metrics.GCFailed.Inc()
		c.log.Error(err, "audit failed; the next one retries")
	}
}

// audit is the slow backstop: it lists every NodeIPAllocation from the API server and compares
// the statuses with the record (State.Audit), then syncs the nodes found out of step.
// auditConfirmDelay is how long after an audit that found addresses held twice the second
// audit lists again (ConfirmTwice): longer than a fill's writes take to land.
const auditConfirmDelay = 5 * time.Second

func (c *Controller) audit(ctx context.Context) error {
	r, err := c.auditOnce(ctx)
	if err != nil {
		return err
	}
	if !r.Twice.IsEmpty() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(auditConfirmDelay):
		}
		again, err := c.auditOnce(ctx)
		if err != nil {
			return err
		}
		r.Twice = ConfirmTwice(r.Twice, again.Twice)
		r.Leaked = r.Leaked.Union(again.Leaked)
		for n, set := range again.Adopted {
			r.Adopted[n] = r.Adopted[n].Union(set)
		}
		for n, set := range again.Unpublished {
			r.Unpublished[n] = r.Unpublished[n].Union(set)
		}
	}
	c.metrics.GCCandidates.Add(float64(r.Candidates()))
	c.metrics.GCCollected.Add(float64(count(r.Leaked)))
	twice := count(r.Twice)
	c.metrics.AddressesTwice.Set(float64(twice))
	if twice > 0 {
		c.log.Error(nil, "addresses are held by two nodes; an operator must decide which pod keeps them (ipwarden check shows both)", "addresses", r.Twice.String())
	}
	if !r.Leaked.IsEmpty() {
		c.log.Info("audit returned allocations no node held to their pools", "addresses", r.Leaked.String())
	}
	for node, set := range r.Adopted {
		c.log.Info("audit adopted addresses a node's status showed that the record lacked", "node", node, "addresses", set.String())
	}
	for _, n := range r.Nodes() {
		c.enqueue(n)
	}
	c.wakePools()
	return nil
}

// auditOnce lists every NodeIPAllocation from the API server and audits the record against it.
func (c *Controller) auditOnce(ctx context.Context) (AuditResult, error) {
	var allocs ipwardenv1.NodeIPAllocationList
	if err := c.reader.List(ctx, &allocs); err != nil {
		return AuditResult{}, fmt.Errorf("list NodeIPAllocations: %w", err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.state.Audit(allocs.Items), nil
}

func (c *Controller) worker(ctx context.Context) {
	defer c.workersWG.Done()
	for {
		name, ok := c.sched.Get(ctx)
		if !ok {
			return
		}
		start := time.Now()
		err := c.safeSyncNode(ctx, name)
		c.metrics.SyncDuration.WithLabelValues("node").Observe(time.Since(start).Seconds())
		if err != nil {
			c.metrics.SyncErrors.WithLabelValues("node").Inc()
			c.log.Error(err, "node sync failed; retrying with backoff", "node", name, "failures", c.sched.Failures(name)+1)
		}
		c.sched.Done(name, err != nil, c.opts.Now())
		c.metrics.QueueDepth.Set(float64(c.sched.Len()))
	}
}

// safeSyncNode turns a panic in a sync into a retried error.
func (c *Controller) safeSyncNode(ctx context.Context, name string) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic in node sync: %v\n%s", r, debug.Stack())
		}
	}()
	return c.syncNode(ctx, name)
}

// syncNode moves one node one step toward its goal: the right NodeIPAllocation object, holding
// what its agent requests minus what it releases.
func (c *Controller) syncNode(ctx context.Context, name string) error {
	node := nodeMeta()
	nodeErr := c.cache.Get(ctx, client.ObjectKey{Name: name}, node)
	if nodeErr != nil && !apierrors.IsNotFound(nodeErr) {
		return nodeErr
	}
	alloc := &ipwardenv1.NodeIPAllocation{}
	allocErr := c.cache.Get(ctx, client.ObjectKey{Name: name}, alloc)
	if allocErr != nil && !apierrors.IsNotFound(allocErr) {
		return allocErr
	}
	facts := NodeFacts{NodeExists: nodeErr == nil, AllocationExists: allocErr == nil}
	if facts.NodeExists {
		facts.NodeUID = node.UID
	}
	if facts.AllocationExists {
		facts.OwnerUID = nodeOwner(alloc)
		for _, p := range alloc.Spec.Pools {
			if p.Requested > 0 || len(p.Releasing) > 0 {
				facts.Asks = true
			}
		}
	}
	c.mu.Lock()
	if facts.NodeExists {
		c.state.SetNodeLabels(name, node.Labels)
		facts.Selected = c.state.Selected(node.Labels)
	}
	facts.Holds = c.state.Holds(name)
	c.mu.Unlock()

	lc := DecideLifecycle(facts)
	switch {
	case lc.ConfirmGone:
		return c.confirmGone(ctx, name, facts.AllocationExists, alloc)
	case lc.Create:
		return c.createAllocation(ctx, name, node)
	case lc.DeleteOrphan:
		if err := c.guard(); err != nil {
			return err
		}
		err := c.writer.Delete(ctx, alloc, client.Preconditions{UID: &alloc.UID, ResourceVersion: &alloc.ResourceVersion})
		c.countWrite("nodeipallocations", "delete", err)
		if err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete orphan NodeIPAllocation: %w", err)
		}
		c.mu.Lock()
		c.state.ForgetNode(name)
		c.mu.Unlock()
		c.log.Info("deleted NodeIPAllocation of a node no pool selects", "node", name)
		return nil
	}
	if lc.FixOwner {
		if err := c.guard(); err != nil {
			return err
		}
		patch := client.MergeFrom(alloc.DeepCopy())
		alloc.OwnerReferences = replaceNodeOwner(alloc.OwnerReferences, node)
		err := c.writer.Patch(ctx, alloc, patch)
		c.countWrite("nodeipallocations", "patch", err)
		if err != nil {
			return fmt.Errorf("set owner reference: %w", err)
		}
	}
	if lc.Fill {
		return c.fill(ctx, alloc)
	}
	return nil
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

func (c *Controller) createAllocation(ctx context.Context, name string, node *metav1.PartialObjectMetadata) error {
	obj := &ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{
		Name:            name,
		OwnerReferences: replaceNodeOwner(nil, node),
		Labels:          map[string]string{"app.kubernetes.io/managed-by": "ipwarden"},
	}}
	if err := c.guard(); err != nil {
		return err
	}
	err := c.writer.Create(ctx, obj)
	c.countWrite("nodeipallocations", "create", err)
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create NodeIPAllocation: %w", err)
	}
	c.log.V(1).Info("created NodeIPAllocation", "node", name)
	// The object's watch event queues the next sync, which fills it (and restores the status
	// if the controller's record says the node holds addresses).
	return nil
}

// confirmGone asks the API server whether a node the cache lacks is really gone; if so, its
// addresses return to their pools (cooling first) and its NodeIPAllocation is deleted.
func (c *Controller) confirmGone(ctx context.Context, name string, allocExists bool, alloc *ipwardenv1.NodeIPAllocation) error {
	err := c.reader.Get(ctx, client.ObjectKey{Name: name}, nodeMeta())
	if err == nil {
		return nil // the cache lags; the node's event will queue it again
	}
	if !apierrors.IsNotFound(err) {
		return fmt.Errorf("confirm node deletion: %w", err)
	}
	if alive, err := c.agentAlive(ctx, name, allocExists, alloc); err != nil || alive {
		return err
	}
	now := c.opts.Now()
	c.mu.Lock()
	delete(c.agentSeen, name)
	released := c.state.HeldBy(name)
	q := c.state.StartNodeGone(name, allocExists, now)
	c.mu.Unlock()
	if err := c.run(ctx, q, alloc); err != nil {
		return fmt.Errorf("return the addresses of deleted node %s: %w", name, err)
	}
	total := 0
	for pool, set := range released {
		n := count(set)
		total += n
		c.metrics.Releases.WithLabelValues(pool).Add(float64(n))
		c.metrics.NodeHeld.DeleteLabelValues(name, pool)
		c.metrics.NodeRequested.DeleteLabelValues(name, pool)
		c.metrics.NodeDeficit.DeleteLabelValues(name, pool)
	}
	for pool := range released {
		c.refillPool(pool)
	}
	c.setNodeFlags(name, false, false, true)
	c.metrics.NodesReleased.Inc()
	c.sched.Forget(name)
	c.wakePools()
	c.log.Info("node deleted: its addresses return to their pools after the reuse cooldown", "node", name, "addresses", total)
	return nil
}

// agentAlive reads the agent Lease of a node whose Node is gone and says whether the agent still
// renews it (DecideAgentAlive): then the node's addresses stay, and the node is looked at again
// when the Lease would expire.
func (c *Controller) agentAlive(ctx context.Context, name string, allocExists bool, alloc *ipwardenv1.NodeIPAllocation) (bool, error) {
	if c.opts.AgentLeaseNamespace == "" {
		return false, nil
	}
	var lease coordinationv1.Lease
	var rec *nodelease.Record
	d := c.opts.AgentLeaseDuration
	err := c.reader.Get(ctx, client.ObjectKey{Namespace: c.opts.AgentLeaseNamespace, Name: nodelease.Name(name)}, &lease)
	switch {
	case apierrors.IsNotFound(err):
	case err != nil:
		return false, fmt.Errorf("read the agent Lease of deleted node %s: %w", name, err)
	default:
		rec = &nodelease.Record{Version: lease.ResourceVersion}
		if lease.Spec.HolderIdentity != nil {
			rec.Holder = *lease.Spec.HolderIdentity
		}
		if s := lease.Spec.LeaseDurationSeconds; s != nil && *s > 0 {
			d = time.Duration(*s) * time.Second
		}
	}
	now := c.opts.Now()
	c.mu.Lock()
	obs, known := c.agentSeen[name]
	if !known {
		obs = &nodelease.Observer{}
		c.agentSeen[name] = obs
	}
	alive, recheck := DecideAgentAlive(rec, obs.Observe(rec, now), now, d)
	c.mu.Unlock()
	if !alive {
		return false, nil
	}
	if !known {
		c.log.Info("node deleted, but its agent still renews its Lease: its addresses stay held until the agent stops (the Node may be re-created)",
			"node", name, "lease", c.opts.AgentLeaseNamespace+"/"+nodelease.Name(name), "holder", rec.Holder)
		if allocExists {
			c.events.Eventf(alloc, corev1.EventTypeWarning, "NodeDeletedAgentAlive",
				"Node %s is gone but its ipwarden agent still renews its Lease (holder %s): its addresses stay held until the agent stops or the Node comes back",
				name, rec.Holder)
		}
	}
	time.AfterFunc(recheck.Sub(now)+time.Second, func() { c.enqueue(name) })
	return true, nil
}

// fill writes one node's status: released addresses leave, new ones arrive. The order of the
// writes and what each outcome means come from the step machine (State.StartFill, steps.go); this
// loop only performs them. On a conflict it starts over from a fresh read.
func (c *Controller) fill(ctx context.Context, alloc *ipwardenv1.NodeIPAllocation) error {
	name := alloc.Name
	// Addresses left pending by a write whose outcome was unknown are settled against a fresh
	// read first: planning from the record alone would write a status without them even if the
	// earlier write landed and the node already hands them out.
	c.mu.Lock()
	pending := c.state.HasPending(name)
	c.mu.Unlock()
	if pending {
		alloc = &ipwardenv1.NodeIPAllocation{}
		if err := c.reader.Get(ctx, client.ObjectKey{Name: name}, alloc); err != nil {
			return fmt.Errorf("re-read NodeIPAllocation to settle an unknown write: %w", err)
		}
		c.mu.Lock()
		c.state.ResolvePending(name, alloc.Status)
		c.mu.Unlock()
	}
	for attempt := 0; ; attempt++ {
		c.mu.Lock()
		q := c.state.StartFill(name, alloc, c.opts.Now())
		c.mu.Unlock()
		err := c.run(ctx, q, alloc)
		switch q.Result() {
		case NoChange:
			c.updateNodeMetrics(name, alloc.Spec, q.Fill())
			return nil
		case Committed:
			c.afterFill(alloc, q.Fill())
			return nil
		case Retry:
			if attempt >= 3 {
				return fmt.Errorf("write NodeIPAllocation status: %w", err)
			}
			alloc = &ipwardenv1.NodeIPAllocation{}
			if err := c.reader.Get(ctx, client.ObjectKey{Name: name}, alloc); err != nil {
				return fmt.Errorf("re-read NodeIPAllocation after a conflict: %w", err)
			}
			if c.fence.Outranked(alloc.Status.Fence) {
				err := fmt.Errorf("%w: NodeIPAllocation %s was written by %s at epoch %d", ErrFenced, name, alloc.Status.Fence.Holder, alloc.Status.Fence.Epoch)
				c.fenced("local", err)
				return err
			}
			continue
		default:
			c.events.Eventf(alloc, corev1.EventTypeWarning, "FillFailed", "could not write the node's addresses: %v", err)
			return err
		}
	}
}

// run performs a sequence's steps in order and reports each outcome back to it; it returns the
// error of the step that ended it, if any.
func (c *Controller) run(ctx context.Context, q *Sequence, alloc *ipwardenv1.NodeIPAllocation) error {
	for {
		c.mu.Lock()
		step, ok := q.Next()
		c.mu.Unlock()
		if !ok {
			return nil
		}
		err := c.perform(ctx, step, alloc)
		c.mu.Lock()
		q.Advance(OutcomeOf(err))
		c.mu.Unlock()
		if err != nil {
			return fmt.Errorf("%s of %s: %w", step.Kind, step.Node, err)
		}
	}
}

// perform does one step's write.
func (c *Controller) perform(ctx context.Context, step Step, alloc *ipwardenv1.NodeIPAllocation) error {
	if err := c.guard(); err != nil {
		return err
	}
	switch step.Kind {
	case StepPoolStatus:
		return c.flushPool(ctx, step.Pool)
	case StepNodeStatus:
		obj := alloc.DeepCopy()
		obj.Status = step.Status
		obj.Status.Fence = c.fence.Stamp()
		err := c.written(c.writer.Status().Update(ctx, obj))
		c.countWrite("nodeipallocations/status", "update", err)
		return err
	case StepDeleteAllocation:
		err := c.writer.Delete(ctx, alloc, client.Preconditions{UID: &alloc.UID})
		c.countWrite("nodeipallocations", "delete", err)
		if apierrors.IsNotFound(err) {
			return nil
		}
		return err
	}
	return fmt.Errorf("unknown step %v", step.Kind)
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
	case errors.Is(err, ErrFenced), apierrors.IsInvalid(err), apierrors.IsNotFound(err), apierrors.IsForbidden(err),
		apierrors.IsBadRequest(err), apierrors.IsAlreadyExists(err):
		return Rejected
	default:
		return Unknown
	}
}

// reportConflicts makes a claim the controller cannot grant visible: a Warning event on the
// node's NodeIPAllocation (the status carries the AddressConflict condition), the conflict gauge,
// and a sync of the other node so its status shows the condition too.
func (c *Controller) reportConflicts(alloc *ipwardenv1.NodeIPAllocation, f *Fill) {
	c.mu.Lock()
	total := 0
	for _, cf := range c.state.Conflicts() {
		total += count(cf.Addrs)
	}
	c.mu.Unlock()
	c.metrics.ClaimConflicts.Set(float64(total))
	others := map[string]bool{}
	for _, cf := range f.Conflicts {
		if cf.Claimant == alloc.Name {
			c.events.Eventf(alloc, corev1.EventTypeWarning, "AddressConflict", "%s: an operator must decide which pod keeps it (ipwarden check names both pods)", cf.String())
			others[cf.Holder] = true
		} else {
			others[cf.Claimant] = true
		}
	}
	if len(f.Conflicts) > 0 {
		c.log.Error(nil, "addresses used by pods on two nodes", "node", alloc.Name, "conflicts", conflictMessage(f.Conflicts))
	}
	for n := range others {
		c.sched.Add(n, Need{Claims: 1}, c.opts.Now())
	}
}

// afterFill records metrics and events of a committed fill.
func (c *Controller) afterFill(alloc *ipwardenv1.NodeIPAllocation, f *Fill) {
	woke := false
	for pool, pf := range f.Pools {
		if n := count(pf.Added); n > 0 {
			c.metrics.Allocations.WithLabelValues(pool).Add(float64(n))
			woke = true
		}
		if n := count(pf.Removed); n > 0 {
			c.metrics.Releases.WithLabelValues(pool).Add(float64(n))
			woke = true
		}
	}
	for pool, pf := range f.Pools {
		if !pf.Removed.IsEmpty() {
			c.refillPool(pool)
			c.mu.Lock()
			claimants := c.state.Claimants(pool)
			wanters := c.state.Wanters(pool)
			c.mu.Unlock()
			for _, n := range claimants {
				c.enqueue(n)
			}
			for _, n := range wanters {
				if n != alloc.Name {
					c.enqueue(n) // a static address it wants may be free now
				}
			}
		}
	}
	for pool, pf := range f.Pools {
		if n := count(pf.Granted); n > 0 {
			c.metrics.ClaimsGranted.WithLabelValues(pool).Add(float64(n))
			c.log.Info("granted claimed addresses back: the node's pods use them but its status had lost them",
				"node", alloc.Name, "pool", pool, "addresses", pf.Granted.String())
		}
	}
	for _, pool := range sortedKeys(f.Pools) {
		for _, r := range f.Pools[pool].Refused {
			if r.Holder != "" {
				c.enqueue(r.Holder) // its status asks it to give the address back if unused
			}
		}
	}
	c.reportConflicts(alloc, f)
	for _, pool := range f.Starved {
		c.events.Eventf(alloc, corev1.EventTypeWarning, "PoolExhausted", "cannot fill this node's request: %s: %s", f.Pools[pool].Reason, f.Pools[pool].Detail)
	}
	c.mu.Lock()
	missed := c.state.RefillMissed(f, alloc.Spec, c.opts.Now())
	c.mu.Unlock()
	if len(missed) > 0 {
		c.enqueue(alloc.Name) // addresses came back while its fill was in flight
	}
	if woke || len(f.Starved) > 0 {
		c.wakePools()
	}
	c.updateNodeMetrics(alloc.Name, alloc.Spec, f)
}

func (c *Controller) updateNodeMetrics(name string, spec ipwardenv1.NodeIPAllocationSpec, f *Fill) {
	requested := map[string]int{}
	for _, p := range spec.Pools {
		requested[p.Pool] = int(p.Requested)
	}
	deficit, atCap := false, false
	c.mu.Lock()
	for pool, pf := range f.Pools {
		held := count(pf.Held)
		d := max(requested[pool]-held, 0)
		if c.opts.PerNodeMetrics {
			c.metrics.NodeHeld.WithLabelValues(name, pool).Set(float64(held))
			c.metrics.NodeRequested.WithLabelValues(name, pool).Set(float64(requested[pool]))
			c.metrics.NodeDeficit.WithLabelValues(name, pool).Set(float64(d))
		}
		if d > 0 {
			deficit = true
		}
		if m := c.state.PoolMaxPerNode(pool); m > 0 && held >= m {
			atCap = true
		}
	}
	c.mu.Unlock()
	c.setNodeFlags(name, deficit, atCap, false)
}

// setNodeFlags keeps the fleet gauges as running counts, changed only when a node's flags change.
func (c *Controller) setNodeFlags(name string, deficit, atCap, gone bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	prev, had := c.nodeFlags[name]
	d := func(b bool) float64 {
		if b {
			return 1
		}
		return 0
	}
	c.metrics.NodesInDeficit.Add(d(deficit && !gone) - d(prev[0]))
	c.metrics.NodesAtCapacity.Add(d(atCap && !gone) - d(prev[1]))
	if gone {
		delete(c.nodeFlags, name)
		if had {
			c.metrics.Nodes.Dec()
		}
		return
	}
	if !had {
		c.metrics.Nodes.Inc()
	}
	c.nodeFlags[name] = [2]bool{deficit, atCap}
}

// refillPool queues the nodes a pool left short (addresses came back to it).
func (c *Controller) refillPool(pool string) {
	c.mu.Lock()
	nodes := c.state.Refill(pool)
	c.mu.Unlock()
	for _, n := range nodes {
		c.enqueue(n)
	}
}

func (c *Controller) wakePools() {
	select {
	case c.poolWake <- struct{}{}:
	default:
	}
}

// poolLoop writes dirty pool statuses, each pool at most once per PoolStatusInterval (writes the
// fill path makes to record cooling addresses count too): a burst of changes is one write.
func (c *Controller) poolLoop(ctx context.Context) {
	defer c.workersWG.Done()
	t := time.NewTicker(max(c.opts.PoolStatusInterval/4, time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-c.poolWake:
		}
		now := c.opts.Now()
		c.mu.Lock()
		refill := c.state.MarkExpiredCooling(now)
		dirty := c.state.DirtyPools()
		c.mu.Unlock()
		for _, n := range refill {
			c.enqueue(n)
		}
		for _, p := range dirty {
			if last, ok := c.poolWritten.Load(p); ok && now.Sub(last.(time.Time)) < c.opts.PoolStatusInterval {
				continue // still dirty: a later round writes it
			}
			start := time.Now()
			if err := c.flushPool(ctx, p); err != nil && ctx.Err() == nil {
				c.metrics.SyncErrors.WithLabelValues("pool").Inc()
				c.log.Error(err, "pool status write failed; retrying", "pool", p)
			}
			c.metrics.SyncDuration.WithLabelValues("pool").Observe(time.Since(start).Seconds())
		}
	}
}

func (c *Controller) poolLock(name string) *sync.Mutex {
	l, _ := c.poolLocks.LoadOrStore(name, &sync.Mutex{})
	return l.(*sync.Mutex)
}

// flushPool writes a pool's status if it changed. Writes of one pool are serialized so a write
// carrying a new cooling record is never overtaken by an older one.
func (c *Controller) flushPool(ctx context.Context, name string) error {
	l := c.poolLock(name)
	l.Lock()
	defer l.Unlock()
	obj := &ipwardenv1.IPPool{}
	if err := c.cache.Get(ctx, client.ObjectKey{Name: name}, obj); err != nil {
		if apierrors.IsNotFound(err) {
			return nil // deleted pool: nothing to write
		}
		return err
	}
	for attempt := 0; ; attempt++ {
		now := c.opts.Now()
		c.mu.Lock()
		st, ok := c.state.PoolStatus(name, obj.Status, obj.Generation, now)
		c.mu.Unlock()
		if !ok {
			return nil
		}
		c.setPoolMetrics(name, st)
		if equality.Semantic.DeepEqual(st, obj.Status) {
			return nil
		}
		wasExhausted := obj.Status.Exhausted
		upd := obj.DeepCopy()
		upd.Status = st
		upd.Status.Fence = c.fence.Stamp()
		if err := c.guard(); err != nil {
			c.mu.Lock()
			c.state.MarkPoolDirty(name)
			c.mu.Unlock()
			return err
		}
		err := c.written(c.writer.Status().Update(ctx, upd))
		c.countWrite("ippools/status", "update", err)
		if err == nil {
			c.poolWritten.Store(name, c.opts.Now())
			if st.Exhausted != wasExhausted {
				if st.Exhausted {
					c.events.Eventf(obj, corev1.EventTypeWarning, "PoolExhausted", "only %d of %d addresses free: nodes now grow one address at a time", st.Free, st.Capacity)
				} else {
					c.events.Eventf(obj, corev1.EventTypeNormal, "PoolRecovered", "%d of %d addresses free again", st.Free, st.Capacity)
				}
			}
			return nil
		}
		c.mu.Lock()
		c.state.MarkPoolDirty(name)
		c.mu.Unlock()
		if !apierrors.IsConflict(err) || attempt >= 3 {
			return fmt.Errorf("write IPPool %s status: %w", name, err)
		}
		obj = &ipwardenv1.IPPool{}
		if err := c.reader.Get(ctx, client.ObjectKey{Name: name}, obj); err != nil {
			return err
		}
	}
}

func (c *Controller) setPoolMetrics(name string, st ipwardenv1.IPPoolStatus) {
	c.metrics.PoolCapacity.WithLabelValues(name).Set(float64(st.Capacity))
	c.metrics.PoolAllocated.WithLabelValues(name).Set(float64(st.Allocated))
	c.metrics.PoolFree.WithLabelValues(name).Set(float64(st.Free))
	ex := 0.0
	if st.Exhausted {
		ex = 1
	}
	c.metrics.PoolExhausted.WithLabelValues(name).Set(ex)
	c.mu.Lock()
	cooling, conflicts := c.state.PoolCounts(name)
	c.mu.Unlock()
	c.metrics.PoolCooling.WithLabelValues(name).Set(float64(cooling))
	c.metrics.PoolConflicts.WithLabelValues(name).Set(float64(conflicts))
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

// firstN returns at most n of names.
func firstN(names []string, n int) []string { return names[:min(n, len(names))] }

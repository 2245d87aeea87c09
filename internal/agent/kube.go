package agent

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/gc"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/ipamclaim"
	"github.com/ipwarden/ipwarden/internal/ippool"
	"github.com/ipwarden/ipwarden/internal/podinfo"
	"github.com/ipwarden/ipwarden/internal/sticky"
)

// fieldOwner names the agent in managed fields.
const fieldOwner = client.FieldOwner("ipwarden-agent")

// Kube is the agent's view of the API server: its Node, the IPPools, its NodeIPAllocation and
// the pods bound to it, each watched through an informer (pods by field selector
// spec.nodeName, the Node and NodeIPAllocation by metadata.name). It pushes what it sees into the
// Service, level-based, and writes the node's request into the NodeIPAllocation spec.
type Kube struct {
	node  string
	only  []string // --pools: serve only these
	cache cache.Cache
	api   client.Client // uncached: writes and fresh reads
	// meta reads a pod's and a namespace's metadata at an ADD whose pod the cache lacks: no
	// client-side rate limit, so such an ADD never queues behind the agent's other requests.
	meta client.Reader
	// prevw writes ipwarden's allocations into Whereabouts' IPPools at ADDs while the CNI
	// configuration names Whereabouts as "previous" (kube_previous.go): the same unlimited
	// client as meta.
	prevw client.Writer
	// wbEditMu serializes the agent's edits of Whereabouts' IPPools (EditWhereaboutsPools).
	wbEditMu sync.Mutex
	log      logr.Logger
	svc      *Service
	trigger  chan struct{}
	// podDeleted, when set, also receives the pod informer's delete notifications.
	podDeleted func(obj any)
	// ctrlLease is the controller's leader election Lease; onLeader is called when it changes.
	ctrlLease types.NamespacedName
	onLeader  func()

	// recordMu serializes handing the service a NodeIPAllocation (Push) with the
	// acknowledgement (ack), so an older cached status never lands between the fresh read an
	// acknowledgement's claims are computed from and the write that carries them.
	recordMu sync.Mutex

	mu          sync.Mutex
	lastWritten writtenSpec

	// handled records the informers whose handlers are registered; started, that the cache
	// runs. Start may be called again after an error (the API server was away).
	handled map[string]bool
	started bool
}

// publishStep is what PublishSpec does with the cached record (decidePublish).
type publishStep int

const (
	// publishAcknowledge: a new controller leader has not been acknowledged: acknowledge it
	// first, from a fresh read (acknowledge), whatever the request.
	publishAcknowledge publishStep = iota
	// publishCacheLags: the cache shows the object our last write was based on, and we would
	// write the same again: wait for the cache.
	publishCacheLags
	// publishNothing: the record already carries the request and the observed pools.
	publishNothing
	// publishWrite: patch the spec.
	publishWrite
)

// decidePublish decides what PublishSpec does with the record cur (from the cache, or re-read
// after a conflict), given the controller's leader ("" when none is known), the pools the node
// observed, the request and the agent's last write. The order is the rule: a leader not yet
// acknowledged first; then a cache that has not shown our last write; then whether the record
// differs enough to be worth a write (ipam.SpecWorthWriting: a new observed pool always is).
func decidePublish(cur *ipwardenv1.NodeIPAllocation, leader string, observed []ipwardenv1.ObservedPool, reqs []ipam.PoolRequest, last writtenSpec) publishStep {
	if leader != "" && cur.Spec.AcknowledgedLeader != leader {
		return publishAcknowledge
	}
	if last.baseRV != "" && cur.ResourceVersion == last.baseRV && poolsEqual(last.pools, specPools(reqs)) && observedEqual(last.observed, observed) {
		return publishCacheLags
	}
	if observedEqual(cur.Spec.ObservedPools, observed) && !ipam.SpecWorthWriting(requestsOf(cur.Spec.Pools), reqs) {
		return publishNothing
	}
	return publishWrite
}

// writtenSpec is the last spec the agent wrote, with the resource versions before and after,
// so a lagging cache does not make it write the same spec again.
type writtenSpec struct {
	pools         []ipwardenv1.NodePoolRequest
	observed      []ipwardenv1.ObservedPool
	baseRV, newRV string
}

// NewKube creates the informers' cache and an API client for node. ctrlLease names the
// controller's leader election Lease (empty: the agent acknowledges no controller).
func NewKube(cfg *rest.Config, scheme *runtime.Scheme, node string, only []string, ctrlLease types.NamespacedName, svc *Service, log logr.Logger) (*Kube, error) {
	byName := fields.OneTermEqualSelector("metadata.name", node)
	byObject := map[client.Object]cache.ByObject{
		&corev1.Pod{}:                  {Field: fields.OneTermEqualSelector("spec.nodeName", node)},
		&corev1.Node{}:                 {Field: byName},
		&ipwardenv1.NodeIPAllocation{}: {Field: byName},
		&ipwardenv1.IPPool{}:           {},
		&corev1.Namespace{}:            {},
	}
	if ctrlLease.Name != "" {
		byObject[&coordinationv1.Lease{}] = cache.ByObject{
			Namespaces: map[string]cache.Config{ctrlLease.Namespace: {}},
			Field:      fields.OneTermEqualSelector("metadata.name", ctrlLease.Name),
		}
	}
	c, err := cache.New(cfg, cache.Options{Scheme: scheme, ByObject: byObject})
	if err != nil {
		return nil, fmt.Errorf("create informer cache: %w", err)
	}
	api, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		return nil, fmt.Errorf("create API client: %w", err)
	}
	meta, err := client.New(metadataConfig(cfg), client.Options{Scheme: scheme})
	if err != nil {
		return nil, fmt.Errorf("create API client: %w", err)
	}
	return &Kube{node: node, only: only, ctrlLease: ctrlLease, cache: c, api: api, meta: meta, prevw: meta, log: log, svc: svc, trigger: make(chan struct{}, 1)}, nil
}

// metadataConfig is cfg for the reads an ADD makes when the pod watch lacks its pod: without a
// client-side rate limit (a negative QPS makes client-go build none), so such an ADD never
// queues behind the agent's other requests, and bounded by podMetaTimeout.
func metadataConfig(cfg *rest.Config) *rest.Config {
	c := rest.CopyConfig(cfg)
	c.QPS, c.Burst, c.RateLimiter = -1, 0, nil
	c.Timeout = podMetaTimeout
	return c
}

// OnLeaderChange makes f run after every event on the controller's Lease (the monitor's kick:
// its round acknowledges a new leader). Call it before Start.
func (k *Kube) OnLeaderChange(f func()) { k.onLeader = f }

// Leader is the holder of the controller's Lease as the cache shows it ("" when there is none,
// or the agent watches no Lease).
func (k *Kube) Leader(ctx context.Context) string {
	if k.ctrlLease.Name == "" {
		return ""
	}
	var l coordinationv1.Lease
	if err := k.cache.Get(ctx, k.ctrlLease, &l); err != nil || l.Spec.HolderIdentity == nil {
		return ""
	}
	return *l.Spec.HolderIdentity
}

// OnPodDelete makes f receive the pod informer's delete notifications (a *corev1.Pod or a
// cache.DeletedFinalStateUnknown tombstone). Call it before Start.
func (k *Kube) OnPodDelete(f func(obj any)) { k.podDeleted = f }

// API returns the uncached API client.
func (k *Kube) API() client.Client { return k.api }

// Start runs the informers and waits until they have listed everything once. While the API
// server is away it fails (the informers cannot be set up without its discovery); call it again.
func (k *Kube) Start(ctx context.Context) error {
	if k.handled == nil {
		k.handled = map[string]bool{}
	}
	objs := []client.Object{&corev1.Pod{}, &corev1.Node{}, &ipwardenv1.NodeIPAllocation{}, &ipwardenv1.IPPool{}, &corev1.Namespace{}}
	if k.ctrlLease.Name != "" {
		objs = append(objs, &coordinationv1.Lease{})
	}
	for _, obj := range objs {
		name := fmt.Sprintf("%T", obj)
		if k.handled[name] {
			continue
		}
		inf, err := k.cache.GetInformer(ctx, obj)
		if err != nil {
			return fmt.Errorf("informer for %T: %w", obj, err)
		}
		onEvent := k.Trigger
		if _, isLease := obj.(*coordinationv1.Lease); isLease {
			onEvent = func() {
				if k.onLeader != nil {
					k.onLeader()
				}
			}
		}
		onDelete := func(any) { onEvent() }
		if _, isPod := obj.(*corev1.Pod); isPod && k.podDeleted != nil {
			onDelete = func(o any) {
				k.podDeleted(o)
				k.Trigger()
			}
		}
		if _, err := inf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
			AddFunc:    func(any) { onEvent() },
			UpdateFunc: func(any, any) { onEvent() },
			DeleteFunc: onDelete,
		}); err != nil {
			return fmt.Errorf("watch %T: %w", obj, err)
		}
		k.handled[name] = true
	}
	if !k.started {
		k.started = true
		go func() {
			if err := k.cache.Start(ctx); err != nil {
				k.log.Error(err, "informers stopped")
			}
		}()
	}
	k.log.Info("waiting for the informers to list the node's objects from the API server")
	if !k.cache.WaitForCacheSync(ctx) {
		return fmt.Errorf("informers did not sync: %w", context.Cause(ctx))
	}
	return nil
}

// Trigger asks Run to push the cache into the service.
func (k *Kube) Trigger() {
	select {
	case k.trigger <- struct{}{}:
	default:
	}
}

// WaitForAllocation waits until the controller has created the node's NodeIPAllocation.
func (k *Kube) WaitForAllocation(ctx context.Context) error {
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	start := time.Now()
	lastLog := time.Time{}
	for {
		var nipa ipwardenv1.NodeIPAllocation
		err := k.cache.Get(ctx, client.ObjectKey{Name: k.node}, &nipa)
		if err == nil {
			return nil
		}
		if !apierrors.IsNotFound(err) {
			return fmt.Errorf("read NodeIPAllocation %s: %w", k.node, err)
		}
		// Deleted while the agent was down, and its pods still use addresses: re-create it.
		var node corev1.Node
		if err := k.cache.Get(ctx, client.ObjectKey{Name: k.node}, &node); err == nil {
			if err := k.recreate(ctx, &node); err != nil {
				k.log.Error(err, "cannot re-create this node's NodeIPAllocation", "nodeIPAllocation", k.node)
			}
		}
		if time.Since(lastLog) > 10*time.Second {
			k.log.Info("waiting for the controller to create this node's NodeIPAllocation (the agent re-creates it only when it had one and its pods use addresses). "+
				"Is ipwarden controller running, and does an IPPool's nodeSelector select this node?",
				"nodeIPAllocation", k.node, "waited", time.Since(start).Round(time.Second).String())
			lastLog = time.Now()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for NodeIPAllocation %s: %w", k.node, context.Cause(ctx))
		case <-tick.C:
		}
	}
}

// Push hands the service everything the cache knows: pools and which select the node, the
// node's holdings, and its pods. It returns the pods for the start-up rebuild.
func (k *Kube) Push(ctx context.Context) ([]ipam.Pod, error) {
	var node corev1.Node
	var nodeLabels map[string]string
	if err := k.cache.Get(ctx, client.ObjectKey{Name: k.node}, &node); err == nil {
		nodeLabels = node.Labels
	} else if !apierrors.IsNotFound(err) {
		return nil, fmt.Errorf("read Node %s: %w", k.node, err)
	}
	var poolList ipwardenv1.IPPoolList
	if err := k.cache.List(ctx, &poolList); err != nil {
		return nil, fmt.Errorf("list IPPools: %w", err)
	}
	var pools []ipam.Pool
	var served []string
	for i := range poolList.Items {
		p := &poolList.Items[i]
		spec, err := ippool.Parse(p.Spec)
		if err != nil {
			k.log.Error(err, "ignoring an IPPool the agent cannot read", "pool", p.Name)
			continue
		}
		pc := ipam.PoolOf(p.Name, spec, p.Status.Exhausted)
		pc.UID, pc.Generation = string(p.UID), p.Generation
		for _, e := range p.Status.Sticky {
			a, err := netip.ParseAddr(string(e.Address))
			if err != nil {
				continue
			}
			pc.Reserved = append(pc.Reserved, ipam.StickyUse{Identity: sticky.Identity{Namespace: e.Namespace, StatefulSet: e.StatefulSet, Ordinal: int(e.Ordinal)}, Addr: a})
		}
		slices.SortFunc(pc.Reserved, func(a, b ipam.StickyUse) int { return a.Addr.Compare(b.Addr) })
		pc.Claims = claimBindings(p.Status.IPAMClaims)
		pools = append(pools, pc)
		if spec.Selects(nodeLabels) && (len(k.only) == 0 || slices.Contains(k.only, p.Name)) {
			served = append(served, p.Name)
		}
	}
	if err := k.svc.SetPools(pools, served); err != nil {
		return nil, err
	}

	k.recordMu.Lock()
	err := k.pushRecord(ctx, &node)
	k.recordMu.Unlock()
	if err != nil {
		return nil, err
	}

	var nsList corev1.NamespaceList
	if err := k.cache.List(ctx, &nsList); err != nil {
		return nil, fmt.Errorf("list namespaces: %w", err)
	}
	namespaces := make(map[string]ipam.Namespace, len(nsList.Items))
	for i := range nsList.Items {
		namespaces[nsList.Items[i].Name] = NamespaceFromAPI(&nsList.Items[i].ObjectMeta)
	}
	k.svc.SetNamespaces(namespaces)

	var podList corev1.PodList
	if err := k.cache.List(ctx, &podList); err != nil {
		return nil, fmt.Errorf("list pods on node %s: %w", k.node, err)
	}
	pods := make([]ipam.Pod, 0, len(podList.Items))
	for i := range podList.Items {
		pods = append(pods, PodFromAPI(&podList.Items[i]))
	}
	k.svc.SetPods(pods)
	return pods, nil
}

// pushRecord hands the service the node's NodeIPAllocation from the cache, confirmed by a
// fresh read when the cache shows none or an object older than the node's own last write.
// Callers hold recordMu.
func (k *Kube) pushRecord(ctx context.Context, node *corev1.Node) error {
	var nipa ipwardenv1.NodeIPAllocation
	err := k.cache.Get(ctx, client.ObjectKey{Name: k.node}, &nipa)
	fresh := false
	switch {
	case err == nil && k.svc.Rewound(string(nipa.UID), nipa.Generation),
		apierrors.IsNotFound(err):
		// The cache shows an object older than the node's own last write, or none: confirm
		// with the API server (the cache may just lag) before acting on it.
		nipa = ipwardenv1.NodeIPAllocation{}
		err = k.api.Get(ctx, client.ObjectKey{Name: k.node}, &nipa)
		fresh = true
	}
	switch {
	case err == nil:
		return k.setRecord(&nipa, fresh)
	case apierrors.IsNotFound(err):
		k.svc.SetRecordMissing(true)
		if err := k.recreate(ctx, node); err != nil {
			k.log.Error(err, "cannot re-create this node's NodeIPAllocation; retrying on the next event", "nodeIPAllocation", k.node)
		}
		return nil
	default:
		return fmt.Errorf("read NodeIPAllocation %s: %w", k.node, err)
	}
}

// setRecord hands the service the node's holdings from nipa; fresh says nipa comes from the API
// server itself (only then may it count as a rewind).
func (k *Kube) setRecord(nipa *ipwardenv1.NodeIPAllocation, fresh bool) error {
	return k.setRecordAs(nipa, fresh && k.svc.Rewound(string(nipa.UID), nipa.Generation))
}

// setRecordAs hands the service the node's holdings from nipa, distrusted as a rewound
// record's when rewound.
func (k *Kube) setRecordAs(nipa *ipwardenv1.NodeIPAllocation, rewound bool) error {
	rec := RecordOf{UID: string(nipa.UID), Generation: nipa.Generation, Rewound: rewound}
	holdings := map[string]addr.Set{}
	refused := map[string]map[netip.Addr]string{}
	claimRefused := map[string]map[string]string{}
	elsewhere := map[string]addr.Set{}
	for _, ps := range nipa.Status.Pools {
		for _, r := range ps.ClaimRefused {
			if claimRefused[ps.Pool] == nil {
				claimRefused[ps.Pool] = map[string]string{}
			}
			claimRefused[ps.Pool][r.UID] = r.Reason
		}
		if len(ps.WantedElsewhere) > 0 {
			blocks := make([]string, len(ps.WantedElsewhere))
			for i, b := range ps.WantedElsewhere {
				blocks[i] = string(b)
			}
			if set, err := addr.ParseSet(blocks); err == nil {
				elsewhere[ps.Pool] = set
			}
		}
		for _, r := range ps.Refused {
			if a, err := netip.ParseAddr(string(r.Address)); err == nil {
				if refused[ps.Pool] == nil {
					refused[ps.Pool] = map[netip.Addr]string{}
				}
				refused[ps.Pool][a] = r.Reason
			}
		}
		s, err := addr.ParseSet(ps.Addresses)
		if err != nil {
			// Never guess: an unreadable holding is treated as unknown-but-kept (no change).
			k.log.Error(err, "NodeIPAllocation status holds an unreadable address list; keeping the previous view", "pool", ps.Pool)
			return fmt.Errorf("NodeIPAllocation %s status for pool %s: %w", k.node, ps.Pool, err)
		}
		holdings[ps.Pool] = s
	}
	k.svc.SetRefused(refused)
	k.svc.SetClaimRefused(claimRefused)
	k.svc.SetWantedElsewhere(elsewhere)
	return k.svc.SetHoldings(holdings, rec)
}

// Run pushes the cache into the service after every watch event, coalesced.
func (k *Kube) Run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-k.trigger:
		}
		if _, err := k.Push(ctx); err != nil && ctx.Err() == nil {
			k.log.Error(err, "cannot hand the node's objects to the service; the next event retries")
		}
	}
}

// CachedPods lists the pods bound to the node as the informer cache shows them (for the leak
// collector, which only uses them to decide what to re-check against the API server).
func (k *Kube) CachedPods(ctx context.Context) ([]ipam.PodRef, error) {
	var list corev1.PodList
	if err := k.cache.List(ctx, &list, client.UnsafeDisableDeepCopy); err != nil {
		return nil, fmt.Errorf("list pods on node %s: %w", k.node, err)
	}
	out := make([]ipam.PodRef, len(list.Items))
	for i := range list.Items {
		p := &list.Items[i]
		out[i] = ipam.PodRef{Namespace: p.Namespace, Name: p.Name, UID: string(p.UID)}
	}
	return out, nil
}

// GetPod reads the pod named n from the API server (a quorum read of its metadata, never the
// cache). Not found is reported only when the API server says that this very pod does not exist
// (a NotFound status naming it); any other answer, including a NotFound without those details
// (a wrong path, a proxy), is an error, so the collector keeps the attachment.
func (k *Kube) GetPod(ctx context.Context, n gc.Name) gc.Lookup {
	l := gc.Lookup{Name: n}
	if n.Namespace == "" || n.Name == "" {
		l.Err = fmt.Errorf("cannot read pod %q: namespace and name are required", n.String())
		return l
	}
	m := &metav1.PartialObjectMetadata{}
	m.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Pod"))
	err := k.api.Get(ctx, client.ObjectKey{Namespace: n.Namespace, Name: n.Name}, m)
	switch {
	case err == nil:
		l.Found, l.UID = true, string(m.UID)
	case podNotFound(err, n.Name):
	default:
		l.Err = fmt.Errorf("read pod %s from the API server: %w", n, err)
	}
	return l
}

// podNotFound reports whether err is the API server's NotFound for the pod name.
func podNotFound(err error, name string) bool {
	var st apierrors.APIStatus
	if !apierrors.IsNotFound(err) || !errors.As(err, &st) {
		return false
	}
	d := st.Status().Details
	return d != nil && d.Kind == "pods" && d.Group == "" && d.Name == name
}

// NodeRef returns a reference to the node's NodeIPAllocation, for events about the node's
// addresses that concern no pod the agent knows.
func (k *Kube) NodeRef() *corev1.ObjectReference {
	ref := &corev1.ObjectReference{APIVersion: ipwardenv1.SchemeGroupVersion.String(), Kind: "NodeIPAllocation", Name: k.node}
	var nipa ipwardenv1.NodeIPAllocation
	if err := k.cache.Get(context.Background(), client.ObjectKey{Name: k.node}, &nipa); err == nil {
		ref.UID = nipa.UID
	}
	return ref
}

// PublishSpec writes reqs into the NodeIPAllocation's spec.pools unless it already says so. It
// reports whether it wrote.
//
// The write lands only on the record the node last wrote or read (its record mark): a JSON patch
// that tests the object's UID and generation against the mark before it replaces spec.pools and
// spec.observedPools (markedSpecPatch). There is no resourceVersion precondition: the agent is
// the spec's only writer (its node Lease) and a precondition would conflict with every status
// write of the controller since the agent's cache read (the status subresource shares the
// object's resourceVersion): that was the routine 409 after a burst. Status writes leave the
// generation alone, so the test fails only on a record the node has not seen: rewound (etcd
// restored), re-created, or written by someone else. Then nothing is written; a fresh read is
// handed to the service first (distrusted when older than the mark, which moves the mark to
// it) and the write repeats against it. Judging the record after an unconditional write could
// not tell a rewound record the node wrote once since the backup (its write produces the
// mark's generation) from a write that changed nothing on the current one (it keeps the mark's
// generation): the second was taken for the first, and a live IPAMClaim's address was
// released. The controller keeps its own precondition on the status, so a status planned from
// an older spec is refused and replanned.
func (k *Kube) PublishSpec(ctx context.Context, reqs []ipam.PoolRequest) (bool, error) {
	desired := specPools(reqs)
	var nipa ipwardenv1.NodeIPAllocation
	if err := k.cache.Get(ctx, client.ObjectKey{Name: k.node}, &nipa); err != nil {
		return false, fmt.Errorf("read NodeIPAllocation %s: %w", k.node, err)
	}
	leader := k.Leader(ctx)
	// The pools whose running pods' addresses the node has recorded, read before the request: a
	// pool it lists for the first time is written with claims computed after it (ObservedPools).
	observed := observedPools(k.svc.ObservedPools())
	if !observedEqual(nipa.Spec.ObservedPools, observed) {
		reqs = k.svc.Spec()
		desired = specPools(reqs)
	}
	k.mu.Lock()
	lw := k.lastWritten
	k.mu.Unlock()
	switch decidePublish(&nipa, leader, observed, reqs, lw) {
	case publishAcknowledge:
		return k.acknowledge(ctx, leader)
	case publishCacheLags, publishNothing:
		return false, nil
	}
	// The record's handover is held across the write: an informer push must not move the mark
	// between the patch's test and a fresh read's handover.
	k.recordMu.Lock()
	defer k.recordMu.Unlock()
	for attempt := 0; ; attempt++ {
		if attempt > 0 && decidePublish(&nipa, "", observed, reqs, writtenSpec{}) == publishNothing {
			return false, nil
		}
		mark := k.svc.Mark()
		base := nipa.DeepCopy()
		var patch client.Patch = client.MergeFrom(base)
		if mark.UID != "" {
			raw, err := markedSpecPatch(mark, desired, observed)
			if err != nil {
				return false, err
			}
			patch = client.RawPatch(types.JSONPatchType, raw)
		}
		nipa.Spec.Pools = desired
		nipa.Spec.ObservedPools = observed
		err := k.api.Patch(ctx, &nipa, patch, fieldOwner)
		if err == nil {
			k.noteWritten(&nipa, desired, observed, base.ResourceVersion)
			return true, nil
		}
		if attempt >= 5 || !(apierrors.IsConflict(err) || mark.UID != "" && apierrors.IsInvalid(err)) {
			return false, fmt.Errorf("write NodeIPAllocation %s spec: %w", k.node, err)
		}
		nipa = ipwardenv1.NodeIPAllocation{}
		if err := k.api.Get(ctx, client.ObjectKey{Name: k.node}, &nipa); err != nil {
			return false, fmt.Errorf("re-read NodeIPAllocation %s after a refused spec write: %w", k.node, err)
		}
		switch refusedSpecWrite(mark, apierrors.IsConflict(err), string(nipa.UID), nipa.Generation) {
		case refusedRetry:
			continue
		case refusedWriteOnto:
			return k.writeSpecOnto(ctx, &nipa, desired, observed)
		}
		if err := k.setRecord(&nipa, true); err != nil {
			return false, err
		}
		// What the handover distrusted is released in this very write.
		reqs = k.svc.Spec()
		desired = specPools(reqs)
	}
}

// refusedStep is what PublishSpec does after the API server refused its spec write and the
// record was read again.
type refusedStep uint8

const (
	// refusedRetry: write again onto the fresh read.
	refusedRetry refusedStep = iota
	// refusedWriteOnto: write onto exactly the fresh read, preconditioned on its resourceVersion.
	refusedWriteOnto
	// refusedHandOver: hand the fresh read to the service first (distrusted when older than the
	// mark, which moves the mark to it), then write again.
	refusedHandOver
)

// refusedSpecWrite decides the step after a refused spec write, from the node's mark and the
// fresh read (freshUID, freshGen): a conflict (the unmarked merge write) is retried; a refused
// test on the very record the mark names means the patch itself could not apply (an object
// created without a spec has nothing to add to), so the spec goes onto exactly that read; any
// other record is one the node has not seen (rewound, re-created, written by someone else).
func refusedSpecWrite(mark ipam.RecordMark, conflict bool, freshUID string, freshGen int64) refusedStep {
	switch {
	case conflict:
		return refusedRetry
	case freshUID == mark.UID && freshGen == mark.Generation:
		return refusedWriteOnto
	}
	return refusedHandOver
}

// markedSpecPatch is the node's spec write onto the record its mark names: a JSON patch that
// tests metadata.uid and metadata.generation, then replaces spec.pools and spec.observedPools.
func markedSpecPatch(mark ipam.RecordMark, pools []ipwardenv1.NodePoolRequest, observed []ipwardenv1.ObservedPool) ([]byte, error) {
	if pools == nil {
		pools = []ipwardenv1.NodePoolRequest{}
	}
	if observed == nil {
		observed = []ipwardenv1.ObservedPool{}
	}
	type op struct {
		Op    string `json:"op"`
		Path  string `json:"path"`
		Value any    `json:"value"`
	}
	raw, err := json.Marshal([]op{
		{"test", "/metadata/uid", mark.UID},
		{"test", "/metadata/generation", mark.Generation},
		{"add", "/spec/pools", pools},
		{"add", "/spec/observedPools", observed},
	})
	if err != nil {
		return nil, fmt.Errorf("encode the spec write: %w", err)
	}
	return raw, nil
}

// writeSpecOnto writes the spec onto exactly the object nipa (a fresh read at the node's mark),
// preconditioned on its resourceVersion.
func (k *Kube) writeSpecOnto(ctx context.Context, nipa *ipwardenv1.NodeIPAllocation, desired []ipwardenv1.NodePoolRequest, observed []ipwardenv1.ObservedPool) (bool, error) {
	base := nipa.DeepCopy()
	nipa.Spec.Pools = desired
	nipa.Spec.ObservedPools = observed
	if err := k.api.Patch(ctx, nipa, client.MergeFromWithOptions(base, client.MergeFromWithOptimisticLock{}), fieldOwner); err != nil {
		return false, fmt.Errorf("write NodeIPAllocation %s spec: %w", k.node, err)
	}
	k.noteWritten(nipa, desired, observed, base.ResourceVersion)
	return true, nil
}

// noteWritten records the agent's own spec write: the record mark, and what it wrote over which
// resource version, so a lagging cache does not make it write the same spec again.
func (k *Kube) noteWritten(nipa *ipwardenv1.NodeIPAllocation, desired []ipwardenv1.NodePoolRequest, observed []ipwardenv1.ObservedPool, baseRV string) {
	k.svc.NoteSpecWritten(string(nipa.UID), nipa.Generation)
	k.mu.Lock()
	k.lastWritten = writtenSpec{pools: desired, observed: observed, baseRV: baseRV, newRV: nipa.ResourceVersion}
	k.mu.Unlock()
}

// acknowledge tells a controller that started leading that this node's claims are complete
// (docs/design.md, "Claims and rewinds"): it reads the NodeIPAllocation from the API server,
// hands its status to the service (a rewound record is distrusted and its lost addresses
// claimed, as on any read), and writes the resulting request with spec.acknowledgedLeader,
// conditioned on the resource version it read. The claims therefore account for the status as
// it stood; the controller's own later writes only add addresses or remove released ones.
func (k *Kube) acknowledge(ctx context.Context, leader string) (bool, error) {
	k.recordMu.Lock()
	defer k.recordMu.Unlock()
	for attempt := 0; ; attempt++ {
		var nipa ipwardenv1.NodeIPAllocation
		err := k.api.Get(ctx, client.ObjectKey{Name: k.node}, &nipa)
		switch {
		case apierrors.IsNotFound(err):
			return false, nil // re-created first (pushRecord); the next round acknowledges
		case err != nil:
			return false, fmt.Errorf("read NodeIPAllocation %s to acknowledge the controller %s: %w", k.node, leader, err)
		case nipa.Spec.AcknowledgedLeader == leader:
			return false, nil
		}
		if err := k.setRecord(&nipa, true); err != nil {
			return false, err
		}
		observed := observedPools(k.svc.ObservedPools())
		reqs := k.svc.Spec()
		base := nipa.DeepCopy()
		nipa.Spec.Pools = specPools(reqs)
		nipa.Spec.ObservedPools = observed
		nipa.Spec.AcknowledgedLeader = leader
		err = k.api.Patch(ctx, &nipa, client.MergeFromWithOptions(base, client.MergeFromWithOptimisticLock{}), fieldOwner)
		if err == nil {
			k.svc.NoteSpecWritten(string(nipa.UID), nipa.Generation)
			k.mu.Lock()
			k.lastWritten = writtenSpec{pools: nipa.Spec.Pools, observed: observed, baseRV: base.ResourceVersion, newRV: nipa.ResourceVersion}
			k.mu.Unlock()
			k.svc.Metrics().LeaderAcks.Inc()
			claimed := 0
			for _, r := range reqs {
				n, _ := r.Claimed.Size().Uint64()
				claimed += int(n)
			}
			k.log.Info("acknowledged the controller's new leader: claims written from a fresh read of the node's record",
				"leader", leader, "claimed", claimed)
			return true, nil
		}
		if !apierrors.IsConflict(err) || attempt >= 5 {
			return false, fmt.Errorf("acknowledge the controller %s in NodeIPAllocation %s: %w", leader, k.node, err)
		}
	}
}

// recreate creates the node's NodeIPAllocation after it was deleted by hand while the node's
// pods use addresses (docs/design.md, "Claims and rewinds"): with the controller down, nothing
// else would, and a controller that restarts must see the node's claims before it fills others.
// It creates the object only when the node had one before (its record mark), its Node exists,
// and its pods use addresses; the controller creates new nodes' objects and deletes those of
// nodes that are gone. The admission policy lets an agent create only its own node's object.
func (k *Kube) recreate(ctx context.Context, node *corev1.Node) error {
	mark, uses := k.svc.recordUse()
	if !ipam.ShouldRecreate(mark, uses, node.UID != "") {
		return nil
	}
	obj := &ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{
		Name:            k.node,
		Labels:          map[string]string{"app.kubernetes.io/managed-by": "ipwarden"},
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: node.Name, UID: node.UID}},
	}}
	err := k.api.Create(ctx, obj, fieldOwner)
	switch {
	case apierrors.IsAlreadyExists(err):
		return nil
	case err != nil:
		return fmt.Errorf("create NodeIPAllocation %s: %w", k.node, err)
	}
	k.svc.Metrics().RecordRecreated.Inc()
	k.log.Info("re-created this node's NodeIPAllocation, deleted while its pods use addresses; they are claimed back from the controller",
		"nodeIPAllocation", k.node, "attachments", uses)
	k.Trigger()
	return nil
}

func specPools(reqs []ipam.PoolRequest) []ipwardenv1.NodePoolRequest {
	out := make([]ipwardenv1.NodePoolRequest, 0, len(reqs))
	for _, r := range reqs {
		pr := ipwardenv1.NodePoolRequest{Pool: r.Pool, Requested: int32(min(r.Requested, 65536))}
		for _, s := range r.Releasing.Strings() {
			pr.Releasing = append(pr.Releasing, ipwardenv1.AddressBlock(s))
		}
		cooled := r.ReleasingCooled
		if cooled.NumRanges() > ipam.MaxReleasingBlocks {
			cooled = addr.NewSet(cooled.Ranges()[:ipam.MaxReleasingBlocks]...)
		}
		for _, s := range cooled.Strings() {
			pr.ReleasingCooled = append(pr.ReleasingCooled, ipwardenv1.AddressBlock(s))
		}
		for _, s := range r.Claimed.Strings() {
			pr.Claimed = append(pr.Claimed, ipwardenv1.AddressBlock(s))
		}
		for _, s := range r.Wanted.Strings() {
			pr.Wanted = append(pr.Wanted, ipwardenv1.AddressBlock(s))
		}
		for i, u := range r.Sticky {
			if i == 256 { // the API's MaxItems
				break
			}
			pr.Sticky = append(pr.Sticky, ipwardenv1.StickyAddress{Address: ipwardenv1.IPAddress(u.Addr.String()),
				Namespace: u.Identity.Namespace, StatefulSet: u.Identity.StatefulSet, Ordinal: int32(u.Identity.Ordinal)})
		}
		for i, u := range r.Claims {
			if i == ipam.MaxClaimUses {
				break
			}
			cu := ipwardenv1.ClaimUse{Namespace: u.Claim.Namespace, Name: u.Claim.Name, UID: u.Claim.UID, Pod: u.Pod,
				Attached: u.Attached, MigrationTarget: u.Claim.MigrationTarget}
			if u.Addr.IsValid() {
				cu.Address = ipwardenv1.IPAddress(u.Addr.String())
			}
			pr.IPAMClaims = append(pr.IPAMClaims, cu)
		}
		out = append(out, pr)
	}
	return out
}

// observedPools is the spec's form of the pools the node has recorded its pods' addresses with.
func observedPools(obs []ipam.ObservedPool) []ipwardenv1.ObservedPool {
	out := make([]ipwardenv1.ObservedPool, 0, min(len(obs), maxObservedPools))
	for _, o := range obs[:min(len(obs), maxObservedPools)] {
		out = append(out, ipwardenv1.ObservedPool{Pool: o.Pool, UID: o.UID, Generation: o.Generation})
	}
	return out
}

// maxObservedPools is spec.observedPools' MaxItems.
const maxObservedPools = 256

func observedEqual(a, b []ipwardenv1.ObservedPool) bool {
	return slices.Equal(a, b) || (len(a) == 0 && len(b) == 0)
}

func poolsEqual(a, b []ipwardenv1.NodePoolRequest) bool {
	return slices.EqualFunc(a, b, func(x, y ipwardenv1.NodePoolRequest) bool {
		return x.Pool == y.Pool && x.Requested == y.Requested && slices.Equal(x.Releasing, y.Releasing) &&
			slices.Equal(x.ReleasingCooled, y.ReleasingCooled) && slices.Equal(x.Claimed, y.Claimed) &&
			slices.Equal(x.Wanted, y.Wanted) && slices.Equal(x.Sticky, y.Sticky) && slices.Equal(x.IPAMClaims, y.IPAMClaims)
	})
}

// requestsOf reads a published spec back into requests (blocks that do not parse are left out:
// the agent wrote them, so none should).
func requestsOf(pools []ipwardenv1.NodePoolRequest) []ipam.PoolRequest {
	out := make([]ipam.PoolRequest, 0, len(pools))
	parse := func(bs []ipwardenv1.AddressBlock) addr.Set {
		var s addr.Set
		for _, b := range bs {
			if one, err := addr.ParseSet([]string{string(b)}); err == nil {
				s = s.Union(one)
			}
		}
		return s
	}
	for _, p := range pools {
		r := ipam.PoolRequest{Pool: p.Pool, Requested: int(p.Requested), Releasing: parse(p.Releasing),
			ReleasingCooled: parse(p.ReleasingCooled), Claimed: parse(p.Claimed), Wanted: parse(p.Wanted)}
		for _, u := range p.Sticky {
			a, err := netip.ParseAddr(string(u.Address))
			if err != nil {
				continue
			}
			r.Sticky = append(r.Sticky, ipam.StickyUse{Addr: a,
				Identity: sticky.Identity{Namespace: u.Namespace, StatefulSet: u.StatefulSet, Ordinal: int(u.Ordinal)}})
		}
		for _, u := range p.IPAMClaims {
			cu := ipam.ClaimUse{Claim: ipam.ClaimRef{Namespace: u.Namespace, Name: u.Name, UID: u.UID, MigrationTarget: u.MigrationTarget},
				Pod: u.Pod, Attached: u.Attached}
			if u.Address != "" {
				a, err := netip.ParseAddr(string(u.Address))
				if err != nil {
					continue
				}
				cu.Addr = a
			}
			r.Claims = append(r.Claims, cu)
		}
		out = append(out, r)
	}
	return out
}

// claimBindings reads a pool's status.ipamClaims, sorted by address (entries that do not parse
// are left out: the controller wrote them, so none should).
func claimBindings(bs []ipwardenv1.ClaimBinding) []ipam.ClaimBinding {
	var out []ipam.ClaimBinding
	for _, b := range bs {
		a, err := netip.ParseAddr(string(b.Address))
		if err != nil || b.UID == "" {
			continue
		}
		out = append(out, ipam.ClaimBinding{Namespace: b.Namespace, Name: b.Name, UID: b.UID, Addr: a})
	}
	slices.SortFunc(out, func(a, b ipam.ClaimBinding) int { return cmp.Or(a.Addr.Compare(b.Addr), strings.Compare(a.UID, b.UID)) })
	return out
}

// PoolFromAPI converts an IPPool into what the state machine needs (through package ippool, the
// one conversion the controller uses too).
func PoolFromAPI(p *ipwardenv1.IPPool) (ipam.Pool, error) {
	spec, err := ippool.Parse(p.Spec)
	if err != nil {
		return ipam.Pool{}, err
	}
	return ipam.PoolOf(p.Name, spec, p.Status.Exhausted), nil
}

// PodFromAPI converts a pod bound to the node (through package podinfo, the one Pod conversion).
func PodFromAPI(p *corev1.Pod) ipam.Pod {
	v := podinfo.Of(p)
	return ipam.Pod{
		Ref:         ipam.PodRef{Namespace: v.Namespace, Name: v.Name, UID: v.UID},
		IPs:         v.IPs,
		HostNetwork: v.HostNetwork,
		Finished:    v.Finished,
		Deleting:    v.Deleting,
		Pools:       v.Pools,
		IPAddresses: v.IPAddresses,
		Identity:    identityOf(v),
		Sticky:      v.Sticky,
		Networks:    v.Networks,
	}
}

// identityOf is the pod's StatefulSet identity (StatefulSet "" when none).
func identityOf(v podinfo.Pod) sticky.Identity {
	if v.StatefulSet == "" || v.Ordinal < 0 {
		return sticky.Identity{Ordinal: -1}
	}
	return sticky.Identity{Namespace: v.Namespace, StatefulSet: v.StatefulSet, Ordinal: v.Ordinal}
}

// NamespaceFromAPI converts a namespace's metadata for pool choice.
func NamespaceFromAPI(m *metav1.ObjectMeta) ipam.Namespace {
	return ipam.Namespace{Labels: m.Labels, Pools: m.Annotations[podinfo.AnnotationPools]}
}

// resourceClaimNames are the ResourceClaims a pod uses: named ones in its spec, generated ones
// (from a template) in its status.
func resourceClaimNames(p *corev1.Pod) []string {
	var out []string
	for _, c := range p.Spec.ResourceClaims {
		if c.ResourceClaimName != nil && *c.ResourceClaimName != "" {
			out = append(out, *c.ResourceClaimName)
		}
	}
	for _, c := range p.Status.ResourceClaimStatuses {
		if c.ResourceClaimName != nil && *c.ResourceClaimName != "" && !slices.Contains(out, *c.ResourceClaimName) {
			out = append(out, *c.ResourceClaimName)
		}
	}
	return out
}

// PodMeta reads what pool choice needs of the pod namespace/name with uid (uid may be empty) and
// its namespace: from the informer caches, which is the usual case at ADD and makes no API call
// (the kubelet starts a sandbox after the pod is bound, and the agent's pod watch sees the binding
// as soon as the kubelet's does). On a miss (the watch has not delivered the pod yet, an older
// pod of the same name, or a pod the API server does not know) it reads the pod from the API
// server once, on a client without client-side rate limit (the agent's own requests never delay
// an ADD). A pod the API server does not know has no annotations. An error means the pod or its
// namespace could not be read at all (the API server is away): the caller must not choose pools
// as if there were no annotations.
func (k *Kube) PodMeta(ctx context.Context, namespace, name, uid string) (ipam.PodMeta, error) {
	var meta ipam.PodMeta
	var pod corev1.Pod
	key := client.ObjectKey{Namespace: namespace, Name: name}
	found := false
	if err := k.cache.Get(ctx, key, &pod); err == nil && (uid == "" || string(pod.UID) == uid) {
		found = true
	} else {
		// The pod itself, not its metadata only: its spec names the ResourceClaims it uses
		// (a shared named claim is refused at ADD, ipam.reservedForAnother).
		pod = corev1.Pod{}
		switch err := k.meta.Get(ctx, key, &pod); {
		case err == nil:
			found = true
		case podNotFound(err, name):
		default:
			return meta, fmt.Errorf("read pod %s/%s: %w", namespace, name, err)
		}
	}
	if found {
		v := podinfo.Of(&pod)
		meta.Pools, meta.IPAddresses = v.Pools, v.IPAddresses
		meta.Identity, meta.Sticky = identityOf(v), v.Sticky
		meta.NetworkAnnotations, meta.MigrationTarget = claimAnnotations(pod.Annotations), ipamclaim.MigrationTarget(pod.Labels)
		meta.ResourceClaims = resourceClaimNames(&pod)
	}
	var ns corev1.Namespace
	if err := k.cache.Get(ctx, client.ObjectKey{Name: namespace}, &ns); err == nil {
		meta.Namespace, meta.NamespaceKnown = NamespaceFromAPI(&ns.ObjectMeta), true
		return meta, nil
	}
	m := &metav1.PartialObjectMetadata{}
	m.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Namespace"))
	switch err := k.meta.Get(ctx, client.ObjectKey{Name: namespace}, m); {
	case err == nil:
		meta.Namespace, meta.NamespaceKnown = NamespaceFromAPI(&m.ObjectMeta), true
	case apierrors.IsNotFound(err):
	default:
		return meta, fmt.Errorf("read namespace %s: %w", namespace, err)
	}
	return meta, nil
}

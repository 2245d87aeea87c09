package controller

import (
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/go-logr/logr"
	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	ipamclaimsv1 "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/nodelease"
	"github.com/ipwarden/ipwarden/internal/sticky"
)

// The controller as a single-owner machine, in the style of etcd's raft: one goroutine owns it;
// informer events, the clock and the outcomes of its reads and writes are its inputs (the methods
// below, each given the time); what it wants done comes out of Ready as data (the operations to
// perform, the Kubernetes events to record, when to wake it next), which a driver carries out
// and feeds back with Done, then acknowledges with Advance. Two drivers exist: Controller
// (controller.go, the API server) and `ipwarden simulate` (internal/sim, a virtual clock). Every
// ordering rule is here, as the phases of a node's task, the steps of its Sequence (steps.go) and
// the pool writes fills wait for; none is the statement order of an IO loop. The machine records
// Prometheus metrics and logs as it decides (a sink: they order nothing).
//
// The rules, each with a table test in machine_test.go:
//   - claims before fills: a new leader fills from the free pool only once every node's agent has
//     acknowledged it, or --claim-settle passed (State.Settling; checkReports);
//   - a pool that appears or grows hands out none of its free addresses until every node observed
//     it, or had its pods read (PodReadDue) and they use none of them, or --pool-settle
//     passed (PoolWaits; checkReports);
//   - a node's lifecycle write (create, orphan delete, owner fix) comes before its fill, and a fill
//     never runs beside another task of the same node (one task per node);
//   - addresses left pending by a write with no answer are settled from a fresh read before the
//     node is planned again; a conflict re-reads, and a status written by a newer leader stops
//     this one (Outranked);
//   - a fill that takes addresses from a node waits for a pool status write that carries their
//     cooling record and was computed after it was recorded; a pool status conflict re-reads the
//     pool and retries, at most three times;
//   - what follows a commit (refills of nodes the pool left short, claimants and wanters of the
//     returned addresses, holders asked to give back) is queued in the same step as the commit;
//   - an IPAMClaim's record or shared grant lands in the pool's status before the node status that
//     grants its address, and the claim's status after both (machine_claims.go); a record is
//     dropped only after a fresh LIST of the claims lacks it and no node uses it.

// OpKind says what an operation does.
type OpKind int

const (
	// OpCreateAllocation creates Op.Alloc.
	OpCreateAllocation OpKind = iota
	// OpDeleteAllocation deletes Op.Alloc, on the precondition of its UID (and its
	// resourceVersion when Op.ExactVersion).
	OpDeleteAllocation
	// OpPatchOwner merge-patches Op.Base into Op.Alloc (the Node owner reference); the result
	// carries the patched object.
	OpPatchOwner
	// OpNodeStatus writes Op.Alloc's status.
	OpNodeStatus
	// OpPoolStatus writes Op.Pool's status.
	OpPoolStatus
	// OpReadNode asks the API server (not a cache) whether Node Op.Node exists.
	OpReadNode
	// OpReadAllocation reads NodeIPAllocation Op.Node from the API server.
	OpReadAllocation
	// OpReadPool reads IPPool Op.PoolName from the API server.
	OpReadPool
	// OpReadAgentLease reads the agent Lease of node Op.Node.
	OpReadAgentLease
	// OpListAllocations lists every NodeIPAllocation from the API server (the audit).
	OpListAllocations
	// OpListNodePods lists the Pods bound to node Op.Node from the API server; the result is the
	// addresses its running pods report (OpResult.PodAddrs), for a pool settle (PoolWaits).
	OpListNodePods
	// OpClaimStatus writes Op.Claim's status (an IPAMClaim: not fenced, a foreign CRD; the
	// pool's binding is authoritative).
	OpClaimStatus
	// OpListClaims lists every IPAMClaim from the API server; the result is their UIDs
	// (OpResult.ClaimUIDs), to release the bindings of claims that are gone.
	OpListClaims
)

var opKindNames = [...]string{"create NodeIPAllocation", "delete NodeIPAllocation", "patch NodeIPAllocation owner",
	"write NodeIPAllocation status", "write IPPool status", "read Node", "read NodeIPAllocation", "read IPPool",
	"read agent Lease", "list NodeIPAllocations", "list the node's Pods", "write IPAMClaim status", "list IPAMClaims"}

func (k OpKind) String() string {
	if int(k) < len(opKindNames) {
		return opKindNames[k]
	}
	return fmt.Sprintf("op(%d)", int(k))
}

// Write says whether the operation writes (the driver checks the fence before each write).
func (k OpKind) Write() bool { return k <= OpPoolStatus || k == OpClaimStatus }

// Op is one read or write for the driver to perform. Objects in it belong to the op: the driver
// may send them as they are.
type Op struct {
	ID           uint64
	Kind         OpKind
	Node         string
	PoolName     string
	Alloc        *ipwardenv1.NodeIPAllocation
	Base         *ipwardenv1.NodeIPAllocation // OpPatchOwner: the object before the patch
	Pool         *ipwardenv1.IPPool
	ExactVersion bool                    // OpDeleteAllocation: also require the resourceVersion (an orphan)
	Claim        *ipamclaimsv1.IPAMClaim // OpClaimStatus
}

// OpResult is an operation's outcome, fed back with Done.
type OpResult struct {
	ID  uint64
	Err error
	// Alloc: OpReadAllocation's object; OpPatchOwner's patched object; OpNodeStatus's stored
	// object (optional).
	Alloc *ipwardenv1.NodeIPAllocation
	// Pool: OpReadPool's object; OpPoolStatus's stored object (optional).
	Pool *ipwardenv1.IPPool
	// Lease and LeaseDuration: OpReadAgentLease's record (nil with a NotFound Err).
	Lease         *nodelease.Record
	LeaseDuration time.Duration
	// Allocs: OpListAllocations's objects.
	Allocs []ipwardenv1.NodeIPAllocation
	// PodAddrs: OpListNodePods's answer, every address in status.podIPs of the node's pods that
	// may run (not finished, not on the host network).
	PodAddrs addr.Set
	// Claim: OpClaimStatus's stored object (optional). ClaimUIDs: OpListClaims's answer, the
	// UID of every IPAMClaim.
	Claim     *ipamclaimsv1.IPAMClaim
	ClaimUIDs map[string]bool
}

// Event is a Kubernetes event to record about Object.
type Event struct {
	Object  runtime.Object
	Type    string
	Reason  string
	Message string
}

// Ready is what the machine wants done now.
type Ready struct {
	Ops    []Op
	Events []Event
	// Wake is when the machine wants Tick next (zero: no timer; inputs wake it).
	Wake time.Time
	// Fenced is set when the machine found a newer leader's write: the driver stops leading.
	Fenced error
}

type taskPhase int

const (
	phaseConfirmGone    taskPhase = iota // OpReadNode in flight
	phaseAgentLease                      // OpReadAgentLease in flight
	phaseCreate                          // OpCreateAllocation in flight
	phaseDeleteOrphan                    // OpDeleteAllocation of an orphan in flight
	phaseFixOwner                        // OpPatchOwner in flight; the fill follows
	phaseResolvePending                  // OpReadAllocation in flight: settle an unknown write first
	phaseReread                          // OpReadAllocation in flight after a conflict
	phaseStep                            // the sequence's write in flight (node status, delete)
	phasePoolStep                        // waiting for a pool status write carrying the cooling record
)

// task is one node's sync in progress: at most one per node, at most Options.Workers at once.
type task struct {
	node        string
	phase       taskPhase
	started     time.Time
	alloc       *ipwardenv1.NodeIPAllocation // the object the task writes against
	allocExists bool
	seq         *Sequence
	gone        bool                // seq returns a deleted node's addresses
	released    map[string]addr.Set // gone: what the node held
	attempt     int
	stepErr     error
}

// poolRun is a pool's status writes: one in flight at a time, fills waiting for the next.
type poolRun struct {
	op           uint64   // the write or re-read in flight; 0 when none
	reading      bool     // op is the re-read after a conflict
	carries      []string // tasks whose cooling record the write in flight carries
	next         []string // tasks waiting for a write that starts after their record
	attempts     int
	wasExhausted bool
	obj          *ipwardenv1.IPPool // what the write in flight was computed against
	written      ipwardenv1.IPPoolStatus
	started      time.Time
}

type opOwner struct {
	node      string // a task's op
	pool      string // a pool write's op
	audit     bool
	pods      string   // a pool settle's read of this node's pods
	claim     ClaimKey // a claim's status write
	claimList bool
}

// podRead is one read of a node's pods for the pool settles: issued then, answered (done) with
// the addresses its running pods report, or failed (retry after podReadAfter).
type podRead struct {
	issued time.Time
	done   bool
	addrs  addr.Set
	retry  time.Time
}

// settleProgress is how many nodes had observed a settling pool (the one that started then) at
// the last check, and when that count last grew (PodReadDue).
type settleProgress struct {
	started  time.Time
	observed int
	at       time.Time
}

// auditRun is an audit in progress: a first list, and when it found addresses held twice, a
// second one auditConfirmDelay later (ConfirmTwice).
type auditRun struct {
	first     *AuditResult
	confirmAt time.Time // the second list is due
}

// Machine is the controller's state and every decision about it. Not safe for concurrent use:
// one goroutine owns it.
type Machine struct {
	opts    Options
	state   *State
	sched   *Scheduler
	metrics *Metrics
	log     logr.Logger

	stamp *ipwardenv1.Fence // this leader's fence (nil: unfenced)

	// What the informers delivered last (shared with the informer caches: never modified).
	nodes  map[string]*metav1.PartialObjectMetadata
	allocs map[string]*ipwardenv1.NodeIPAllocation
	pools  map[string]*ipwardenv1.IPPool

	tasks    map[string]*task
	poolRuns map[string]*poolRun
	ops      map[uint64]opOwner
	nextID   uint64

	awaitAcks       bool
	claimSettleAt   time.Time // the claim settle bound; zero once its pass ran
	reportsDirty    bool      // a node or allocation changed while reports are awaited
	nextReportCheck time.Time
	podReads        map[string]*podRead        // pool settles' reads of silent nodes' pods, by node
	podReadAt       time.Time                  // a silent node's pods are due to be read then
	settleProgress  map[string]*settleProgress // per settling pool: when a node last reported it
	agentSeen       map[string]*nodelease.Observer
	rechecks        map[string]time.Time // deleted nodes whose agent Lease to look at again
	nodeFlags       map[string][2]bool   // deficit, at capacity: for the fleet gauges
	poolWritten     map[string]time.Time
	poolWake        bool
	nextPoolPass    time.Time
	nextResync      time.Time
	nextAudit       time.Time
	audit           *auditRun
	schedNext       time.Time              // when the scheduler has a node ready next
	claims          map[ClaimKey]*claimRun // IPAMClaims (machine_claims.go)
	claimList       uint64                 // OpListClaims in flight
	claimListAgain  bool
	claimCheck      bool // a binding's claim may be gone and unused: look (checkClaims)

	out Ready

	recording bool
	script    []Input
	issued    []Op
}

// reportCheckInterval bounds how often the acknowledgement and pool-settle checks (a pass over
// every node) run while events stream in.
const reportCheckInterval = 100 * time.Millisecond

// NewMachine returns a machine with opts (defaults applied), recording into m (NewMetrics(nil)
// for a private registry) and log.
func NewMachine(opts Options, m *Metrics, log logr.Logger) *Machine {
	opts.setDefaults()
	s := NewScheduler(opts.MinSyncInterval, opts.BackoffBase, opts.BackoffMax)
	return &Machine{
		opts: opts, state: NewState(opts.Exhaustion), sched: s, metrics: m, log: log,
		nodes: map[string]*metav1.PartialObjectMetadata{}, allocs: map[string]*ipwardenv1.NodeIPAllocation{},
		pools: map[string]*ipwardenv1.IPPool{}, tasks: map[string]*task{}, poolRuns: map[string]*poolRun{},
		ops: map[uint64]opOwner{}, agentSeen: map[string]*nodelease.Observer{}, rechecks: map[string]time.Time{}, podReads: map[string]*podRead{},
		settleProgress: map[string]*settleProgress{},
		nodeFlags:      map[string][2]bool{}, poolWritten: map[string]time.Time{}, claims: map[ClaimKey]*claimRun{},
	}
}

// Options are the machine's options, defaults applied (to make another machine like it).
func (m *Machine) Options() Options { return m.opts }

// State is the machine's allocation record (for tests and the simulator's accounting; the
// machine's owner must not change it).
func (m *Machine) State() *State { return m.state }

// Scheduler is the machine's work queue (for the simulator's accounting).
func (m *Machine) Scheduler() *Scheduler { return m.sched }

// Lead starts leading from freshly listed pools and allocations (not a cache, which may lag the
// previous leader's last writes), as the holder of stamp (nil: unfenced). It refuses with
// ErrFenced when a status was written by a newer leader.
func (m *Machine) Lead(pools []ipwardenv1.IPPool, allocs []ipwardenv1.NodeIPAllocation, stamp *ipwardenv1.Fence, now time.Time) error {
	m.record(Input{Kind: InLead, At: now, Pools: pools, Allocs: allocs, Stamp: stamp})
	for i := range allocs {
		if seen := allocs[i].Status.Fence; m.outranked(stamp, seen) {
			return fmt.Errorf("%w: NodeIPAllocation %s was written by %s at epoch %d, after this controller's epoch %d",
				ErrFenced, allocs[i].Name, seen.Holder, seen.Epoch, stamp.Epoch)
		}
	}
	m.stamp = stamp
	twice := m.state.Rebuild(pools, allocs, now)
	settle := max(m.opts.ClaimSettle, 0) // negative: none
	m.state.SettleUntil(now.Add(settle))
	m.claimSettleAt = now.Add(settle)
	m.awaitAcks = stamp != nil // with leader election: wait for the agents' acknowledgements
	m.reportsDirty = m.awaitAcks
	m.nextPoolPass = now
	m.nextResync = now.Add(m.opts.ResyncPeriod)
	m.nextAudit = now.Add(m.opts.AuditPeriod)
	n, _ := twice.Size().Uint64()
	m.metrics.AddressesTwice.Set(float64(n))
	if n > 0 {
		m.log.Error(nil, "addresses are held by two nodes; they stay with the first node by name until an operator resolves it",
			"addresses", twice.String())
	}
	m.log.Info("state rebuilt from the API server", "pools", len(pools), "nodeIPAllocations", len(allocs))
	m.enqueueAll(now)
	return nil
}

// --- inputs: informer events ------------------------------------------------------------------

// NodeChanged: the Node informer delivered obj (added or updated).
func (m *Machine) NodeChanged(obj *metav1.PartialObjectMetadata, now time.Time) {
	m.record(Input{Kind: InNodeChanged, At: now, Node: obj})
	old := m.nodes[obj.Name]
	m.nodes[obj.Name] = obj
	if old == nil || old.UID != obj.UID || !equality.Semantic.DeepEqual(old.Labels, obj.Labels) {
		m.nodeMoved(obj.Name, now)
	}
}

// NodeDeleted: the Node informer deleted name.
func (m *Machine) NodeDeleted(name string, now time.Time) {
	m.record(Input{Kind: InNodeDeleted, At: now, Name: name})
	delete(m.nodes, name)
	m.nodeMoved(name, now)
}

// AllocChanged: the NodeIPAllocation informer delivered obj (added or updated). The object is
// kept (writes go against its resourceVersion); the node is queued when its spec or owner moved.
func (m *Machine) AllocChanged(obj *ipwardenv1.NodeIPAllocation, now time.Time) {
	m.record(Input{Kind: InAllocChanged, At: now, Alloc: obj})
	old := m.allocs[obj.Name]
	m.allocs[obj.Name] = obj
	if old == nil || old.Generation != obj.Generation || old.UID != obj.UID ||
		!equality.Semantic.DeepEqual(old.OwnerReferences, obj.OwnerReferences) {
		m.nodeMoved(obj.Name, now)
		m.claimCheck = m.claimCheck || m.state.HasBindings()
	}
}

// AllocDeleted: the NodeIPAllocation informer deleted name.
func (m *Machine) AllocDeleted(name string, now time.Time) {
	m.record(Input{Kind: InAllocDeleted, At: now, Name: name})
	delete(m.allocs, name)
	m.nodeMoved(name, now)
	m.claimCheck = m.claimCheck || m.state.HasBindings()
}

func (m *Machine) nodeMoved(name string, now time.Time) {
	m.enqueue(name, now)
	m.reportsDirty = true
}

// PoolChanged: the IPPool informer delivered obj (added or updated). A new generation changes
// the record; a new or grown pool starts its settle (PoolGrowth).
func (m *Machine) PoolChanged(obj *ipwardenv1.IPPool, now time.Time) {
	m.record(Input{Kind: InPoolChanged, At: now, Pool: obj})
	old := m.pools[obj.Name]
	m.pools[obj.Name] = obj
	if old != nil && old.Generation == obj.Generation && old.UID == obj.UID {
		return // its status: kept for the next write, nothing to decide
	}
	var added addr.Set
	if m.opts.PoolSettle > 0 {
		added = m.state.PoolGrowth(obj)
	}
	affected := m.state.SetPool(obj)
	if !added.IsEmpty() {
		m.state.StartPoolSettle(obj.Name, string(obj.UID), obj.Generation, added, now, now.Add(m.opts.PoolSettle))
		m.reportsDirty = true
		m.nextReportCheck = time.Time{}
		m.log.Info("pool is new or gained addresses: its free addresses wait until every node has reported what its running pods use in it, or had its pods read",
			"pool", obj.Name, "generation", obj.Generation, "added", added.String(), "poolSettle", m.opts.PoolSettle.String())
		m.event(obj, corev1.EventTypeNormal, "PoolSettling",
			"waiting up to %s for every node to report the addresses its running pods use in this pool (a node still silent %s after the last report has its pods read instead) before handing out its free addresses", m.opts.PoolSettle, podReadAfter)
	}
	m.poolWake = true
	if affected {
		m.enqueueAll(now)
	}
}

// PoolDeleted: the IPPool informer deleted name.
func (m *Machine) PoolDeleted(name string, now time.Time) {
	m.record(Input{Kind: InPoolDeleted, At: now, Name: name})
	delete(m.pools, name)
	affected := m.state.DeletePool(name)
	m.state.EndPoolSettle(name)
	m.poolWake = true
	if affected {
		m.enqueueAll(now)
	}
}

// StatefulSetChanged: a StatefulSet changed or went (view.Exists false); sticky addresses its
// PVC retention no longer keeps return to their pools.
func (m *Machine) StatefulSetChanged(namespace, name string, view sticky.StatefulSet) {
	m.record(Input{Kind: InStatefulSet, Namespace: namespace, Name: name, StatefulSet: view})
	if m.state.ReturnSticky(namespace, name, view) {
		m.log.Info("returned sticky addresses to their pools", "statefulSet", namespace+"/"+name, "deleted", !view.Exists)
		m.poolWake = true
	}
}

// --- inputs: the clock ------------------------------------------------------------------------

// Tick runs what is due by now: the claim and pool settle bounds, agent Lease rechecks, the pool
// pass, the full resync and the audit.
func (m *Machine) Tick(now time.Time) {
	m.record(Input{Kind: InTick, At: now})
	if !m.claimSettleAt.IsZero() && !now.Before(m.claimSettleAt) {
		m.claimSettleAt = time.Time{}
		if m.awaitAcks {
			m.awaitAcks = false
			missing := m.unacknowledged()
			m.log.Error(nil, "nodes did not acknowledge this leader within --claim-settle; filling from the free pool anyway. "+
				"Their agents may be down or too old: addresses their pods use that their status lost can go to another node (docs/design.md, \"Claims and rewinds\")",
				"claimSettle", max(m.opts.ClaimSettle, 0).String(), "nodes", len(missing), "first", firstN(missing, 10))
			for _, name := range missing {
				if a := m.allocs[name]; a != nil {
					m.event(a, corev1.EventTypeWarning, "LeaderNotAcknowledged",
						"the node's agent did not acknowledge controller %s within %s; the controller fills other nodes anyway", m.holder(), max(m.opts.ClaimSettle, 0))
				}
			}
		}
		m.enqueueAll(now)
	}
	for _, st := range m.state.PoolsSettling() {
		if !now.Before(st.Until) {
			m.reportsDirty = true
			m.nextReportCheck = time.Time{}
		}
	}
	if !m.podReadAt.IsZero() && !now.Before(m.podReadAt) {
		m.podReadAt = time.Time{}
		m.reportsDirty = true
		m.nextReportCheck = time.Time{}
	}
	for _, name := range sortedKeys(m.rechecks) {
		if !now.Before(m.rechecks[name]) {
			delete(m.rechecks, name)
			m.enqueue(name, now)
		}
	}
	if !now.Before(m.nextResync) {
		m.nextResync = now.Add(m.opts.ResyncPeriod)
		m.enqueueAll(now)
		for _, p := range m.state.PoolNames() {
			m.state.MarkPoolDirty(p)
		}
		m.poolWake = true
	}
	if m.audit == nil && !now.Before(m.nextAudit) {
		m.nextAudit = now.Add(m.opts.AuditPeriod)
		m.audit = &auditRun{}
		m.issue(opOwner{audit: true}, Op{Kind: OpListAllocations})
		if m.state.HasBindings() {
			m.requestClaimList() // the periodic full read: a claim deletion the watch missed
		}
	} else if m.audit != nil && !m.audit.confirmAt.IsZero() && !now.Before(m.audit.confirmAt) {
		m.audit.confirmAt = time.Time{}
		m.issue(opOwner{audit: true}, Op{Kind: OpListAllocations})
	}
	if m.poolWake || !now.Before(m.nextPoolPass) {
		m.poolPass(now)
	}
}

// --- outputs ----------------------------------------------------------------------------------

// Ready runs the coalesced checks, starts node tasks up to Options.Workers, and returns what the
// driver must do. It returns the same until Advance.
func (m *Machine) Ready(now time.Time) Ready {
	m.record(Input{Kind: InReady, At: now})
	if m.poolWake {
		m.poolPass(now)
	}
	if m.reportsDirty && !now.Before(m.nextReportCheck) {
		m.checkReports(now)
	}
	if m.claimCheck {
		m.checkClaims()
	}
	m.schedNext = time.Time{}
	for len(m.tasks) < m.opts.Workers {
		name, ok, next := m.sched.Next(now)
		if !ok {
			m.schedNext = next
			break
		}
		m.startTask(name, now)
	}
	m.out.Wake = m.wake(now)
	return m.out
}

// Advance acknowledges the last Ready: its operations are issued, its events recorded.
func (m *Machine) Advance() {
	if m.recording {
		m.issued = append(m.issued, m.out.Ops...)
	}
	m.out = Ready{}
}

// Idle says whether nothing is in flight (no task, pool write or audit), for drivers and tests.
func (m *Machine) Idle() bool { return len(m.ops) == 0 && len(m.tasks) == 0 }

// wake is the earliest time something is due.
func (m *Machine) wake(now time.Time) time.Time {
	w := m.nextPoolPass
	at := func(t time.Time) {
		if !t.IsZero() && (w.IsZero() || t.Before(w)) {
			w = t
		}
	}
	at(m.schedNext) // zero while every worker is busy: a task's end wakes the machine
	at(m.claimSettleAt)
	for _, st := range m.state.PoolsSettling() {
		at(st.Until)
	}
	at(m.podReadAt)
	for _, t := range m.rechecks {
		at(t)
	}
	at(m.nextResync)
	if m.audit == nil {
		at(m.nextAudit)
	} else {
		at(m.audit.confirmAt)
	}
	if m.reportsDirty {
		at(m.nextReportCheck)
	}
	if w.Before(now) {
		w = now
	}
	return w
}

func (m *Machine) issue(owner opOwner, op Op) uint64 {
	m.nextID++
	op.ID = m.nextID
	m.ops[op.ID] = owner
	m.out.Ops = append(m.out.Ops, op)
	return op.ID
}

func (m *Machine) event(obj runtime.Object, kind, reason, format string, args ...any) {
	m.out.Events = append(m.out.Events, Event{Object: obj, Type: kind, Reason: reason, Message: fmt.Sprintf(format, args...)})
}

func (m *Machine) holder() string {
	if m.stamp == nil {
		return ""
	}
	return m.stamp.Holder
}

// outranked is Outranked, never with the fence's local checks off (tests of the API server's
// fence alone).
func (m *Machine) outranked(ours, seen *ipwardenv1.Fence) bool {
	return !(m.opts.Fence != nil && m.opts.Fence.localChecksOff()) && Outranked(ours, seen)
}

func (m *Machine) fenced(err error) {
	if m.out.Fenced == nil {
		m.out.Fenced = err
	}
}

// --- queueing ---------------------------------------------------------------------------------

// enqueue marks a node dirty with its current need.
func (m *Machine) enqueue(name string, now time.Time) {
	var need Need
	if a := m.allocs[name]; a != nil {
		need = m.state.NeedOfNode(name, a.Spec)
	}
	m.sched.Add(name, need, now)
	m.metrics.QueueDepth.Set(float64(m.sched.Len()))
}

// enqueueAll marks every known node dirty: the full pass.
func (m *Machine) enqueueAll(now time.Time) {
	names := map[string]bool{}
	for n := range m.nodes {
		names[n] = true
	}
	for n := range m.allocs {
		names[n] = true
	}
	for _, n := range m.state.Known() {
		names[n] = true
	}
	sorted := make([]string, 0, len(names))
	for n := range names {
		sorted = append(sorted, n)
	}
	sort.Strings(sorted)
	for _, n := range sorted {
		m.enqueue(n, now)
	}
}

func (m *Machine) enqueueEach(names []string, now time.Time) {
	sort.Strings(names)
	for _, n := range names {
		m.enqueue(n, now)
	}
}

// --- reports: acknowledgements and pool settles ----------------------------------------------

// checkReports ends the claim settle once every node's agent acknowledged this leader, and each
// pool settle once no node whose pods may use its new addresses is left (PoolWaits) or its bound
// passed. It reads the pods of the nodes still silent podReadAfter after the last report (PodReadDue).
func (m *Machine) checkReports(now time.Time) {
	m.reportsDirty = false
	m.nextReportCheck = now.Add(reportCheckInterval)
	settles := m.state.PoolsSettling()
	if !m.awaitAcks && len(settles) == 0 {
		return
	}
	allocs, selected := m.nodeReports()
	if m.awaitAcks {
		missing := Unacknowledged(allocs, selected, m.holder())
		m.metrics.Unacked.Set(float64(len(missing)))
		if len(missing) == 0 {
			m.awaitAcks = false
			m.state.EndSettle()
			m.log.Info("every node acknowledged this leader with its claims; filling from the free pool")
			m.enqueueAll(now)
		}
	}
	ended := false
	for _, st := range settles {
		missing, read, observed := PoolWaits(allocs, m.settleNodes(st, selected), st.Pool, st.UID, st.Generation, st.Added)
		pr := m.settleProgress[st.Pool]
		if pr == nil || !pr.started.Equal(st.Started) {
			pr = &settleProgress{started: st.Started}
			m.settleProgress[st.Pool] = pr
		}
		if observed > pr.observed {
			pr.observed, pr.at = observed, now
		}
		m.metrics.PoolUnobserved.WithLabelValues(st.Pool).Set(float64(len(missing)))
		switch {
		case len(missing) == 0:
			m.log.Info("every node has reported the pool, or had its pods read with none using its new addresses; filling from its free addresses",
				"pool", st.Pool, "generation", st.Generation)
		case !now.Before(st.Until):
			m.log.Error(nil, "nodes did not report the addresses their pods use in the new or grown pool within --pool-settle; filling from its free addresses anyway. "+
				"Their agents may be down or too old: an address one of their pods got from another IPAM can go to another node (docs/operations.md, \"Moving from another IPAM\")",
				"pool", st.Pool, "poolSettle", m.opts.PoolSettle.String(), "nodes", len(missing), "first", firstN(missing, 10))
			if p := m.pools[st.Pool]; p != nil {
				m.event(p, corev1.EventTypeWarning, "PoolSettleTimedOut",
					"%d nodes did not report what their pods use in this pool's new addresses within %s (first: %v); filling from them anyway",
					len(missing), m.opts.PoolSettle, firstN(missing, 10))
			}
		default:
			m.readPods(read, PodReadDue(st.Started, pr.at), now)
			continue // Tick looks again at the bound
		}
		m.state.EndPoolSettle(st.Pool)
		ended = true
	}
	for pool := range m.settleProgress {
		if !m.state.PoolSettlingNow(pool) {
			delete(m.settleProgress, pool)
		}
	}
	if len(m.state.PoolsSettling()) == 0 {
		m.podReadAt = time.Time{}
		for name, rd := range m.podReads {
			if rd.done || !rd.retry.IsZero() {
				delete(m.podReads, name) // answered: no settle needs it (one in flight is dropped at its answer)
			}
		}
	}
	if ended {
		m.enqueueAll(now)
	}
}

// settleNodes is what PoolWaits needs of every existing node for settle st: whether a serving pool
// selects it (selected), and its pods read since the settle started.
func (m *Machine) settleNodes(st PoolSettle, selected map[string]bool) map[string]SettleNode {
	out := make(map[string]SettleNode, len(selected))
	for name, sel := range selected {
		n := SettleNode{Selected: sel}
		if rd := m.podReads[name]; rd != nil && rd.done && !rd.issued.Before(st.Started) {
			n.Pods = &rd.addrs
		}
		out[name] = n
	}
	return out
}

// maxPodReads bounds the reads of nodes' pods in flight: they share the controller's API rate
// limit with its writes (the rest are read as answers come back).
const maxPodReads = 16

// readPods issues a read of the pods of each node in names that has none in flight, from due on
// (a node that failed is read again podReadAfter later), at most maxPodReads in flight; before
// due it only asks to be woken.
func (m *Machine) readPods(names []string, due, now time.Time) {
	inflight := 0
	for _, rd := range m.podReads {
		if !rd.done && rd.retry.IsZero() {
			inflight++
		}
	}
	for _, name := range names {
		rd := m.podReads[name]
		at := due
		if rd != nil && !rd.retry.IsZero() && rd.retry.After(at) {
			at = rd.retry
		}
		if rd != nil && !rd.done && rd.retry.IsZero() {
			continue // in flight
		}
		if now.Before(at) {
			if m.podReadAt.IsZero() || at.Before(m.podReadAt) {
				m.podReadAt = at
			}
			continue
		}
		if inflight >= maxPodReads {
			continue
		}
		inflight++
		m.podReads[name] = &podRead{issued: now}
		m.issue(opOwner{pods: name}, Op{Kind: OpListNodePods, Node: name})
	}
}

// podsDone records the answer to a read of node's pods and has the settles look again.
func (m *Machine) podsDone(node string, r OpResult, now time.Time) {
	rd := m.podReads[node]
	if rd == nil || len(m.state.PoolsSettling()) == 0 {
		delete(m.podReads, node)
		return
	}
	if r.Err != nil {
		rd.retry = now.Add(podReadAfter)
		m.log.Error(r.Err, "could not list the pods of a node a settling pool waits for; reading them again later", "node", node, "retryIn", podReadAfter.String())
	} else {
		rd.done, rd.addrs = true, r.PodAddrs
	}
	m.reportsDirty = true
	m.nextReportCheck = time.Time{}
}

func (m *Machine) unacknowledged() []string {
	allocs, selected := m.nodeReports()
	return Unacknowledged(allocs, selected, m.holder())
}

// nodeReports lists the NodeIPAllocations the informer delivered, and every Node with whether a
// serving pool selects it.
func (m *Machine) nodeReports() ([]ipwardenv1.NodeIPAllocation, map[string]bool) {
	names := make([]string, 0, len(m.allocs))
	for n := range m.allocs {
		names = append(names, n)
	}
	sort.Strings(names)
	allocs := make([]ipwardenv1.NodeIPAllocation, 0, len(names))
	for _, n := range names {
		allocs = append(allocs, *m.allocs[n])
	}
	selected := make(map[string]bool, len(m.nodes))
	for n, obj := range m.nodes {
		selected[n] = m.state.Selected(obj.Labels)
	}
	return allocs, selected
}

// --- node tasks -------------------------------------------------------------------------------

// startTask moves one node one step toward its goal: the right NodeIPAllocation object, holding
// what its agent requests minus what it releases (DecideLifecycle, then the fill).
func (m *Machine) startTask(name string, now time.Time) {
	t := &task{node: name, started: now}
	m.tasks[name] = t
	node, nodeOK := m.nodes[name]
	alloc, allocOK := m.allocs[name]
	facts := NodeFacts{NodeExists: nodeOK, AllocationExists: allocOK}
	if nodeOK {
		facts.NodeUID = node.UID
		m.state.SetNodeLabels(name, node.Labels)
		facts.Selected = m.state.Selected(node.Labels)
	}
	if allocOK {
		facts.OwnerUID = nodeOwner(alloc)
		for _, p := range alloc.Spec.Pools {
			if p.Requested > 0 || len(p.Releasing) > 0 {
				facts.Asks = true
			}
		}
	} else {
		alloc = &ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: name}}
	}
	facts.Holds = m.state.Holds(name)
	t.alloc, t.allocExists = alloc, allocOK
	lc := DecideLifecycle(facts)
	switch {
	case lc.ConfirmGone:
		m.taskOp(t, phaseConfirmGone, Op{Kind: OpReadNode, Node: name})
	case lc.Create:
		m.taskOp(t, phaseCreate, Op{Kind: OpCreateAllocation, Node: name, Alloc: newAllocation(name, node)})
	case lc.DeleteOrphan:
		m.taskOp(t, phaseDeleteOrphan, Op{Kind: OpDeleteAllocation, Node: name, Alloc: alloc, ExactVersion: true})
	case lc.FixOwner:
		patched := alloc.DeepCopy()
		patched.OwnerReferences = replaceNodeOwner(patched.OwnerReferences, node)
		m.taskOp(t, phaseFixOwner, Op{Kind: OpPatchOwner, Node: name, Alloc: patched, Base: alloc})
	case lc.Fill:
		m.startFill(t, alloc, now)
	default:
		m.finish(t, nil, now)
	}
}

func newAllocation(name string, node *metav1.PartialObjectMetadata) *ipwardenv1.NodeIPAllocation {
	return &ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{
		Name:            name,
		OwnerReferences: replaceNodeOwner(nil, node),
		Labels:          map[string]string{"app.kubernetes.io/managed-by": "ipwarden"},
	}}
}

func (m *Machine) taskOp(t *task, phase taskPhase, op Op) {
	t.phase = phase
	m.issue(opOwner{node: t.node}, op)
}

// finish ends a node's task; a failed one is retried after the scheduler's backoff.
func (m *Machine) finish(t *task, err error, now time.Time) {
	delete(m.tasks, t.node)
	m.metrics.SyncDuration.WithLabelValues("node").Observe(now.Sub(t.started).Seconds())
	if err != nil {
		m.metrics.SyncErrors.WithLabelValues("node").Inc()
		m.log.Error(err, "node sync failed; retrying with backoff", "node", t.node, "failures", m.sched.Failures(t.node)+1)
	}
	m.sched.Done(t.node, err != nil, now)
	m.metrics.QueueDepth.Set(float64(m.sched.Len()))
}

// startFill settles a write with an unknown outcome from a fresh read first: planning from the
// record alone would write a status without its addresses even if it landed and the node already
// hands them out.
func (m *Machine) startFill(t *task, alloc *ipwardenv1.NodeIPAllocation, now time.Time) {
	t.alloc = alloc
	if m.state.HasPending(t.node) {
		m.taskOp(t, phaseResolvePending, Op{Kind: OpReadAllocation, Node: t.node})
		return
	}
	m.planFill(t, now)
}

func (m *Machine) planFill(t *task, now time.Time) {
	t.seq = m.state.StartFill(t.node, t.alloc, now)
	m.runSteps(t, now)
}

// runSteps issues the sequence's next step, or ends the task by the sequence's result.
func (m *Machine) runSteps(t *task, now time.Time) {
	if step, ok := t.seq.Next(); ok {
		switch step.Kind {
		case StepPoolStatus:
			t.phase = phasePoolStep
			m.requestPoolWrite(step.Pool, t.node, now)
		case StepNodeStatus:
			obj := t.alloc.DeepCopy()
			obj.Status = step.Status
			obj.Status.Fence = m.stamp
			m.taskOp(t, phaseStep, Op{Kind: OpNodeStatus, Node: t.node, Alloc: obj})
		case StepDeleteAllocation:
			m.taskOp(t, phaseStep, Op{Kind: OpDeleteAllocation, Node: t.node, Alloc: t.alloc})
		}
		return
	}
	if t.gone {
		if t.seq.Result() != Committed {
			m.finish(t, fmt.Errorf("return the addresses of deleted node %s: %w", t.node, t.stepErr), now)
			return
		}
		m.afterGone(t, now)
		return
	}
	f := t.seq.Fill()
	switch t.seq.Result() {
	case NoChange:
		m.updateNodeMetrics(t.node, t.alloc.Spec, f)
		m.claimsAnswered(t.alloc, f, now)
		m.finish(t, nil, now)
	case Committed:
		m.afterFill(t.alloc, f, now)
		m.claimsAnswered(t.alloc, f, now)
		m.finish(t, nil, now)
	case Retry:
		if t.attempt >= 3 {
			m.finish(t, fmt.Errorf("write NodeIPAllocation status: %w", t.stepErr), now)
			return
		}
		t.attempt++
		m.taskOp(t, phaseReread, Op{Kind: OpReadAllocation, Node: t.node})
	default:
		m.event(t.alloc, corev1.EventTypeWarning, "FillFailed", "could not write the node's addresses: %v", t.stepErr)
		m.finish(t, t.stepErr, now)
	}
}

// Done feeds back the outcome of an operation Ready returned.
func (m *Machine) Done(r OpResult, now time.Time) {
	m.record(Input{Kind: InDone, At: now, Result: r})
	owner, ok := m.ops[r.ID]
	if !ok {
		return
	}
	delete(m.ops, r.ID)
	switch {
	case owner.audit:
		m.auditDone(r, now)
	case owner.pods != "":
		m.podsDone(owner.pods, r, now)
	case owner.claimList:
		m.claimListDone(r, now)
	case owner.claim != ClaimKey{}:
		m.claimStatusDone(owner.claim, r, now)
	case owner.pool != "":
		m.poolDone(owner.pool, r, now)
	default:
		if t := m.tasks[owner.node]; t != nil {
			m.taskDone(t, r, now)
		}
	}
}

func (m *Machine) taskDone(t *task, r OpResult, now time.Time) {
	err := r.Err
	switch t.phase {
	case phaseConfirmGone:
		switch {
		case err == nil:
			m.finish(t, nil, now) // the cache lags; the node's event queues it again
		case !apierrors.IsNotFound(err):
			m.finish(t, fmt.Errorf("confirm node deletion: %w", err), now)
		case m.opts.AgentLeaseNamespace != "":
			m.taskOp(t, phaseAgentLease, Op{Kind: OpReadAgentLease, Node: t.node})
		default:
			m.startGone(t, now)
		}
	case phaseAgentLease:
		if err != nil && !apierrors.IsNotFound(err) {
			m.finish(t, fmt.Errorf("read the agent Lease of deleted node %s: %w", t.node, err), now)
			return
		}
		if m.agentAlive(t, r, now) {
			m.finish(t, nil, now)
			return
		}
		m.startGone(t, now)
	case phaseCreate:
		if err != nil && !apierrors.IsAlreadyExists(err) {
			m.finish(t, fmt.Errorf("create NodeIPAllocation: %w", err), now)
			return
		}
		// The object's watch event queues the next sync, which fills it (and restores the
		// status if the record says the node holds addresses).
		m.log.V(1).Info("created NodeIPAllocation", "node", t.node)
		m.finish(t, nil, now)
	case phaseDeleteOrphan:
		if err != nil && !apierrors.IsNotFound(err) {
			m.finish(t, fmt.Errorf("delete orphan NodeIPAllocation: %w", err), now)
			return
		}
		m.state.ForgetNode(t.node)
		m.log.Info("deleted NodeIPAllocation of a node no pool selects", "node", t.node)
		m.finish(t, nil, now)
	case phaseFixOwner:
		if err != nil {
			m.finish(t, fmt.Errorf("set owner reference: %w", err), now)
			return
		}
		alloc := r.Alloc
		if alloc == nil {
			alloc = t.alloc
		}
		m.startFill(t, alloc, now)
	case phaseResolvePending:
		if err != nil {
			m.finish(t, fmt.Errorf("re-read NodeIPAllocation to settle an unknown write: %w", err), now)
			return
		}
		m.state.ResolvePending(t.node, r.Alloc.Status)
		t.alloc = r.Alloc
		m.planFill(t, now)
	case phaseReread:
		if err != nil {
			m.finish(t, fmt.Errorf("re-read NodeIPAllocation after a conflict: %w", err), now)
			return
		}
		if m.outranked(m.stamp, r.Alloc.Status.Fence) {
			seen := r.Alloc.Status.Fence
			err := fmt.Errorf("%w: NodeIPAllocation %s was written by %s at epoch %d", ErrFenced, t.node, seen.Holder, seen.Epoch)
			m.fenced(err)
			m.finish(t, err, now)
			return
		}
		t.alloc = r.Alloc
		m.planFill(t, now)
	case phaseStep:
		step, _ := t.seq.Next()
		if err == nil && r.Alloc != nil && m.allocs[t.node] != nil {
			m.allocs[t.node] = r.Alloc // the API server's answer: newer than the informer's copy
		}
		o := OutcomeOf(err)
		if step.Kind == StepDeleteAllocation && apierrors.IsNotFound(err) {
			o = Landed // already gone
		}
		if o != Landed {
			t.stepErr = fmt.Errorf("%s of %s: %w", step.Kind, step.Node, err)
		}
		t.seq.Advance(o)
		m.runSteps(t, now)
	}
}

// agentAlive decides from the agent Lease of a node whose Node is gone whether the agent still
// renews it (DecideAgentAlive): then the node's addresses stay, and it is looked at again when
// the Lease would expire.
func (m *Machine) agentAlive(t *task, r OpResult, now time.Time) bool {
	d := m.opts.AgentLeaseDuration
	if r.Err == nil && r.LeaseDuration > 0 {
		d = r.LeaseDuration
	}
	var rec *nodelease.Record
	if r.Err == nil {
		rec = r.Lease
	}
	obs, known := m.agentSeen[t.node]
	if !known {
		obs = &nodelease.Observer{}
		m.agentSeen[t.node] = obs
	}
	alive, recheck := DecideAgentAlive(rec, obs.Observe(rec, now), now, d)
	if !alive {
		return false
	}
	if !known {
		m.log.Info("node deleted, but its agent still renews its Lease: its addresses stay held until the agent stops (the Node may be re-created)",
			"node", t.node, "lease", m.opts.AgentLeaseNamespace+"/"+nodelease.Name(t.node), "holder", rec.Holder)
		if t.allocExists {
			m.event(t.alloc, corev1.EventTypeWarning, "NodeDeletedAgentAlive",
				"Node %s is gone but its ipwarden agent still renews its Lease (holder %s): its addresses stay held until the agent stops or the Node comes back",
				t.node, rec.Holder)
		}
	}
	m.rechecks[t.node] = recheck.Add(time.Second)
	return true
}

// startGone returns a deleted node's addresses: cooling records first, then the deletion of its
// NodeIPAllocation, then the record (StartNodeGone).
func (m *Machine) startGone(t *task, now time.Time) {
	delete(m.agentSeen, t.node)
	t.gone = true
	t.released = m.state.HeldBy(t.node)
	t.seq = m.state.StartNodeGone(t.node, t.allocExists, now)
	m.runSteps(t, now)
}

func (m *Machine) afterGone(t *task, now time.Time) {
	total := 0
	for pool, set := range t.released {
		n := count(set)
		total += n
		m.metrics.Releases.WithLabelValues(pool).Add(float64(n))
		m.metrics.NodeHeld.DeleteLabelValues(t.node, pool)
		m.metrics.NodeRequested.DeleteLabelValues(t.node, pool)
		m.metrics.NodeDeficit.DeleteLabelValues(t.node, pool)
	}
	for _, pool := range sortedKeys(t.released) {
		m.enqueueEach(m.state.Refill(pool), now)
	}
	m.setNodeFlags(t.node, false, false, true)
	m.metrics.NodesReleased.Inc()
	m.log.Info("node deleted: its addresses return to their pools after the reuse cooldown", "node", t.node, "addresses", total)
	m.poolWake = true
	m.claimCheck = m.claimCheck || m.state.HasBindings() // its claim uses went with it
	delete(m.tasks, t.node)
	m.sched.Forget(t.node)
	m.metrics.SyncDuration.WithLabelValues("node").Observe(now.Sub(t.started).Seconds())
	m.metrics.QueueDepth.Set(float64(m.sched.Len()))
}

// afterFill queues what a committed fill makes possible and records its metrics and events.
func (m *Machine) afterFill(alloc *ipwardenv1.NodeIPAllocation, f *Fill, now time.Time) {
	woke := false
	pools := sortedKeys(f.Pools)
	for _, pool := range pools {
		pf := f.Pools[pool]
		if n := count(pf.Added); n > 0 {
			m.metrics.Allocations.WithLabelValues(pool).Add(float64(n))
			woke = true
		}
		if n := count(pf.Removed); n > 0 {
			m.metrics.Releases.WithLabelValues(pool).Add(float64(n))
			woke = true
		}
		if n := count(pf.Granted); n > 0 {
			m.metrics.ClaimsGranted.WithLabelValues(pool).Add(float64(n))
			m.log.Info("granted claimed addresses back: the node's pods use them but its status had lost them",
				"node", alloc.Name, "pool", pool, "addresses", pf.Granted.String())
		}
	}
	for _, pool := range pools {
		if f.Pools[pool].Removed.IsEmpty() {
			continue
		}
		// Addresses came back: the nodes the pool left short (a fill in flight included: it
		// was recorded short when planned), the claimants, and other nodes that want one.
		m.enqueueEach(m.state.Refill(pool), now)
		m.enqueueEach(m.state.Claimants(pool), now)
		wanters := m.state.Wanters(pool)
		sort.Strings(wanters)
		for _, n := range wanters {
			if n != alloc.Name {
				m.enqueue(n, now)
			}
		}
	}
	for _, pool := range pools {
		pf := f.Pools[pool]
		for _, r := range pf.Refused {
			if r.Holder != "" {
				m.enqueue(r.Holder, now) // its status asks it to give the address back if unused
			}
		}
		// Claims: holders asked to give a claim's address back, and the other node of a shared
		// grant that began or ended (its wantedElsewhere changes); a returned address may be
		// a waiting claim's.
		m.enqueueEach(slices.Clone(pf.AskedBack), now)
		if set := pf.Shared.Union(pf.Dropped); !set.IsEmpty() {
			m.enqueueEach(sortedKeys(m.state.holdersOf(pool, set, alloc.Name)), now)
		}
		if !pf.Removed.IsEmpty() {
			m.enqueueEach(m.state.ClaimWaiters(pool), now)
		}
	}
	m.reportConflicts(alloc, f, now)
	for _, pool := range f.Starved {
		m.event(alloc, corev1.EventTypeWarning, "PoolExhausted", "cannot fill this node's request: %s: %s", f.Pools[pool].Reason, f.Pools[pool].Detail)
	}
	if woke || len(f.Starved) > 0 {
		m.poolWake = true
	}
	m.updateNodeMetrics(alloc.Name, alloc.Spec, f)
}

// reportConflicts makes a claim the controller cannot grant visible: a Warning event on the
// node's NodeIPAllocation (the status carries the AddressConflict condition), the conflict gauge,
// and a sync of the other node so its status shows the condition too.
func (m *Machine) reportConflicts(alloc *ipwardenv1.NodeIPAllocation, f *Fill, now time.Time) {
	total := 0
	for _, cf := range m.state.Conflicts() {
		total += count(cf.Addrs)
	}
	m.metrics.ClaimConflicts.Set(float64(total))
	others := map[string]bool{}
	for _, cf := range f.Conflicts {
		if cf.Claimant == alloc.Name {
			m.event(alloc, corev1.EventTypeWarning, "AddressConflict", "%s: an operator must decide which pod keeps it (ipwarden check names both pods)", cf.String())
			others[cf.Holder] = true
		} else {
			others[cf.Claimant] = true
		}
	}
	if len(f.Conflicts) > 0 {
		m.log.Error(nil, "addresses used by pods on two nodes", "node", alloc.Name, "conflicts", conflictMessage(f.Conflicts))
	}
	for _, n := range sortedKeys(others) {
		m.sched.Add(n, Need{Claims: 1}, now)
	}
}

func (m *Machine) updateNodeMetrics(name string, spec ipwardenv1.NodeIPAllocationSpec, f *Fill) {
	requested := map[string]int{}
	for _, p := range spec.Pools {
		requested[p.Pool] = int(p.Requested)
	}
	deficit, atCap := false, false
	for pool, pf := range f.Pools {
		held := count(pf.Held)
		d := max(requested[pool]-held, 0)
		if m.opts.PerNodeMetrics {
			m.metrics.NodeHeld.WithLabelValues(name, pool).Set(float64(held))
			m.metrics.NodeRequested.WithLabelValues(name, pool).Set(float64(requested[pool]))
			m.metrics.NodeDeficit.WithLabelValues(name, pool).Set(float64(d))
		}
		if d > 0 {
			deficit = true
		}
		if mx := m.state.PoolMaxPerNode(pool); mx > 0 && held >= mx {
			atCap = true
		}
	}
	m.setNodeFlags(name, deficit, atCap, false)
}

// setNodeFlags keeps the fleet gauges as running counts, changed only when a node's flags change.
func (m *Machine) setNodeFlags(name string, deficit, atCap, gone bool) {
	prev, had := m.nodeFlags[name]
	d := func(b bool) float64 {
		if b {
			return 1
		}
		return 0
	}
	m.metrics.NodesInDeficit.Add(d(deficit && !gone) - d(prev[0]))
	m.metrics.NodesAtCapacity.Add(d(atCap && !gone) - d(prev[1]))
	if gone {
		delete(m.nodeFlags, name)
		if had {
			m.metrics.Nodes.Dec()
		}
		return
	}
	if !had {
		m.metrics.Nodes.Inc()
	}
	m.nodeFlags[name] = [2]bool{deficit, atCap}
}

// --- pool status writes -----------------------------------------------------------------------

func (m *Machine) poolRun(name string) *poolRun {
	r := m.poolRuns[name]
	if r == nil {
		r = &poolRun{}
		m.poolRuns[name] = r
	}
	return r
}

// requestPoolWrite asks for a pool status write that carries what the record holds now (a
// task's cooling record): the next one to start, never one already in flight.
func (m *Machine) requestPoolWrite(pool, node string, now time.Time) {
	r := m.poolRun(pool)
	r.next = append(r.next, node)
	if r.op == 0 {
		m.startPoolWrite(pool, nil, now)
	}
}

// poolPass refills nodes whose pool has cooled-down addresses again, then writes dirty pool
// statuses, each pool at most once per PoolStatusInterval (fills' writes count too): a burst of
// changes is one write.
func (m *Machine) poolPass(now time.Time) {
	m.poolWake = false
	m.nextPoolPass = now.Add(max(m.opts.PoolStatusInterval/4, time.Millisecond))
	m.enqueueEach(m.state.MarkExpiredCooling(now), now)
	for _, p := range m.state.DirtyPools() {
		if r := m.poolRuns[p]; r != nil && r.op != 0 {
			continue // still dirty: a later pass writes it
		}
		if last, ok := m.poolWritten[p]; ok && now.Sub(last) < m.opts.PoolStatusInterval {
			continue
		}
		m.startPoolWrite(p, nil, now)
	}
}

// startPoolWrite computes a pool's status and writes it if it changed. fresh is the object read
// after a conflict (nil: the informer's).
func (m *Machine) startPoolWrite(pool string, fresh *ipwardenv1.IPPool, now time.Time) {
	r := m.poolRun(pool)
	if fresh == nil {
		r.carries, r.next = append(r.carries, r.next...), nil
		r.attempts = 0
		r.started = now
	}
	obj := fresh
	if obj == nil {
		obj = m.pools[pool]
	}
	if obj == nil {
		m.poolWriteEnded(pool, Landed, nil, now) // a deleted pool: nothing to write
		return
	}
	st, ok := m.state.PoolStatus(pool, obj.Status, obj.Generation, now)
	if !ok {
		m.poolWriteEnded(pool, Landed, nil, now)
		return
	}
	m.setPoolMetrics(pool, st)
	if equality.Semantic.DeepEqual(st, obj.Status) {
		m.state.MarkClaimsDurable(pool, st) // the stored status carries them already
		m.poolWriteEnded(pool, Landed, nil, now)
		return
	}
	upd := obj.DeepCopy()
	upd.Status = st
	upd.Status.Fence = m.stamp
	r.wasExhausted = obj.Status.Exhausted
	r.obj = obj
	r.written = st
	r.reading = false
	r.op = m.issue(opOwner{pool: pool}, Op{Kind: OpPoolStatus, PoolName: pool, Pool: upd})
}

func (m *Machine) poolDone(pool string, res OpResult, now time.Time) {
	r := m.poolRun(pool)
	r.op = 0
	if r.reading {
		r.reading = false
		if res.Err != nil {
			if apierrors.IsNotFound(res.Err) {
				m.poolWriteEnded(pool, Landed, nil, now)
				return
			}
			m.state.MarkPoolDirty(pool)
			m.poolWriteEnded(pool, OutcomeOf(res.Err), fmt.Errorf("re-read IPPool %s after a conflict: %w", pool, res.Err), now)
			return
		}
		m.startPoolWrite(pool, res.Pool, now)
		return
	}
	if res.Err == nil {
		m.poolWritten[pool] = now
		m.state.MarkClaimsDurable(pool, r.written)
		if res.Pool != nil && m.pools[pool] != nil {
			m.pools[pool] = res.Pool // the API server's answer: newer than the informer's copy
		}
		if st := r.written; st.Exhausted != r.wasExhausted {
			if st.Exhausted {
				m.event(r.obj, corev1.EventTypeWarning, "PoolExhausted", "only %d of %d addresses free: nodes now grow one address at a time", st.Free, st.Capacity)
			} else {
				m.event(r.obj, corev1.EventTypeNormal, "PoolRecovered", "%d of %d addresses free again", st.Free, st.Capacity)
			}
		}
		m.poolWriteEnded(pool, Landed, nil, now)
		return
	}
	m.state.MarkPoolDirty(pool)
	if apierrors.IsConflict(res.Err) && r.attempts < 3 {
		r.attempts++
		r.reading = true
		r.op = m.issue(opOwner{pool: pool}, Op{Kind: OpReadPool, PoolName: pool})
		return
	}
	m.poolWriteEnded(pool, OutcomeOf(res.Err), fmt.Errorf("write IPPool %s status: %w", pool, res.Err), now)
}

// poolWriteEnded advances the tasks whose cooling record the write carried, and starts the next
// write if tasks wait for one.
func (m *Machine) poolWriteEnded(pool string, o Outcome, err error, now time.Time) {
	r := m.poolRun(pool)
	r.op = 0
	if err != nil {
		m.metrics.SyncErrors.WithLabelValues("pool").Inc()
		m.log.Error(err, "pool status write failed; retrying", "pool", pool)
	}
	if !r.started.IsZero() {
		m.metrics.SyncDuration.WithLabelValues("pool").Observe(now.Sub(r.started).Seconds())
	}
	carries := r.carries
	r.carries = nil
	for _, node := range carries {
		t := m.tasks[node]
		if t == nil || t.phase != phasePoolStep {
			continue
		}
		if o != Landed {
			t.stepErr = fmt.Errorf("pool status of %s: %w", pool, err)
		}
		t.seq.Advance(o)
		m.runSteps(t, now)
	}
	if len(r.next) > 0 && r.op == 0 {
		m.startPoolWrite(pool, nil, now)
	}
}

func (m *Machine) setPoolMetrics(name string, st ipwardenv1.IPPoolStatus) {
	m.metrics.PoolCapacity.WithLabelValues(name).Set(float64(st.Capacity))
	m.metrics.PoolAllocated.WithLabelValues(name).Set(float64(st.Allocated))
	m.metrics.PoolFree.WithLabelValues(name).Set(float64(st.Free))
	ex := 0.0
	if st.Exhausted {
		ex = 1
	}
	m.metrics.PoolExhausted.WithLabelValues(name).Set(ex)
	cooling, conflicts := m.state.PoolCounts(name)
	m.metrics.PoolCooling.WithLabelValues(name).Set(float64(cooling))
	m.metrics.PoolConflicts.WithLabelValues(name).Set(float64(conflicts))
	bound, shared := m.state.ClaimCounts(name)
	m.metrics.PoolClaimed.WithLabelValues(name).Set(float64(bound))
	m.metrics.ClaimSharedGrants.WithLabelValues(name).Set(float64(shared))
}

// --- the audit --------------------------------------------------------------------------------

// auditConfirmDelay is how long after an audit that found addresses held twice the second list
// is made (ConfirmTwice): longer than a fill's writes take to land.
const auditConfirmDelay = 5 * time.Second

// auditDone compares freshly listed statuses with the record (State.Audit), then queues the
// nodes found out of step. Addresses held twice are reported only when a second list 5 s later
// finds them too.
func (m *Machine) auditDone(res OpResult, now time.Time) {
	if res.Err != nil {
		m.audit = nil
		m.metrics.GCFailed.Inc()
		m.log.Error(res.Err, "audit failed; the next one retries")
		return
	}
	r := m.state.Audit(res.Allocs)
	if first := m.audit.first; first == nil {
		if !r.Twice.IsEmpty() {
			m.audit.first = &r
			m.audit.confirmAt = now.Add(auditConfirmDelay)
			return
		}
	} else {
		again := r
		r = *first
		r.Twice = ConfirmTwice(r.Twice, again.Twice)
		r.Leaked = r.Leaked.Union(again.Leaked)
		for n, set := range again.Adopted {
			r.Adopted[n] = r.Adopted[n].Union(set)
		}
		for n, set := range again.Unpublished {
			r.Unpublished[n] = r.Unpublished[n].Union(set)
		}
	}
	m.audit = nil
	m.metrics.GCCandidates.Add(float64(r.Candidates()))
	m.metrics.GCCollected.Add(float64(count(r.Leaked)))
	twice := count(r.Twice)
	m.metrics.AddressesTwice.Set(float64(twice))
	if twice > 0 {
		m.log.Error(nil, "addresses are held by two nodes; an operator must decide which pod keeps them (ipwarden check shows both)", "addresses", r.Twice.String())
	}
	if !r.Leaked.IsEmpty() {
		m.log.Info("audit returned allocations no node held to their pools", "addresses", r.Leaked.String())
	}
	for _, node := range sortedKeys(r.Adopted) {
		m.log.Info("audit adopted addresses a node's status showed that the record lacked", "node", node, "addresses", r.Adopted[node].String())
	}
	m.enqueueEach(r.Nodes(), now)
	m.poolWake = true
}

// --- recording and replay ---------------------------------------------------------------------

// InputKind says which of the machine's inputs an Input is.
type InputKind int

// The machine's inputs, one per method.
const (
	InLead InputKind = iota
	InNodeChanged
	InNodeDeleted
	InAllocChanged
	InAllocDeleted
	InPoolChanged
	InPoolDeleted
	InStatefulSet
	InTick
	InReady
	InDone
	InClaimChanged
	InClaimDeleted
)

// Input is one call of an input method, as Record keeps it: the objects are the ones the driver
// passed (informer objects are never changed, so keeping them is keeping their value).
type Input struct {
	Kind        InputKind
	At          time.Time
	Node        *metav1.PartialObjectMetadata
	Alloc       *ipwardenv1.NodeIPAllocation
	Pool        *ipwardenv1.IPPool
	Name        string
	Namespace   string
	StatefulSet sticky.StatefulSet
	Result      OpResult
	Pools       []ipwardenv1.IPPool
	Allocs      []ipwardenv1.NodeIPAllocation
	Stamp       *ipwardenv1.Fence
	Claim       *ipamclaimsv1.IPAMClaim
}

// Record starts keeping every input from now on (Script) and every operation acknowledged with
// Advance (Issued): a driver's run as a script another machine can replay.
func (m *Machine) Record() { m.recording, m.script, m.issued = true, nil, nil }

// Script is what Record kept: the inputs, in order.
func (m *Machine) Script() []Input { return m.script }

// Issued is every operation the driver acknowledged since Record, in order.
func (m *Machine) Issued() []Op { return m.issued }

func (m *Machine) record(in Input) {
	if m.recording {
		m.script = append(m.script, in)
	}
}

// Replay feeds script to m (a new machine with the same options) as a driver would, and returns
// the operations it asked for.
func Replay(m *Machine, script []Input) ([]Op, error) {
	m.Record()
	for _, in := range script {
		switch in.Kind {
		case InLead:
			if err := m.Lead(in.Pools, in.Allocs, in.Stamp, in.At); err != nil {
				return nil, err
			}
		case InNodeChanged:
			m.NodeChanged(in.Node, in.At)
		case InNodeDeleted:
			m.NodeDeleted(in.Name, in.At)
		case InAllocChanged:
			m.AllocChanged(in.Alloc, in.At)
		case InAllocDeleted:
			m.AllocDeleted(in.Name, in.At)
		case InPoolChanged:
			m.PoolChanged(in.Pool, in.At)
		case InPoolDeleted:
			m.PoolDeleted(in.Name, in.At)
		case InStatefulSet:
			m.StatefulSetChanged(in.Namespace, in.Name, in.StatefulSet)
		case InTick:
			m.Tick(in.At)
		case InReady:
			m.Ready(in.At)
			m.Advance()
		case InDone:
			m.Done(in.Result, in.At)
		case InClaimChanged:
			m.ClaimChanged(in.Claim, in.At)
		case InClaimDeleted:
			m.ClaimDeleted(in.Namespace, in.Name, in.At)
		}
	}
	return m.Issued(), nil
}

// SameOps says whether two drivers' operations are the same writes and reads, in the same order
// and with the same content (condition transition times aside: the API's helpers stamp them
// from the wall clock). It returns the first difference.
func SameOps(a, b []Op) error {
	if len(a) != len(b) {
		return fmt.Errorf("%d operations against %d", len(a), len(b))
	}
	for i := range a {
		x, y := normalOp(a[i]), normalOp(b[i])
		if !equality.Semantic.DeepEqual(x, y) {
			return fmt.Errorf("operation %d: %v %s%s against %v %s%s: %s", i, x.Kind, x.Node, x.Pool, y.Kind, y.Node, y.Pool, cmp.Diff(x, y))
		}
	}
	return nil
}

// opWrite is what an operation asks of the API server: its kind, target and the content it
// writes (a driver may update the objects in place with the server's answers).
type opWrite struct {
	Kind         OpKind
	Node, Pool   string
	ExactVersion bool
	Owners       []metav1.OwnerReference
	AllocStatus  *ipwardenv1.NodeIPAllocationStatus
	PoolStatus   *ipwardenv1.IPPoolStatus
	Claim        string
	ClaimStatus  *ipamclaimsv1.IPAMClaimStatus
}

func normalOp(op Op) opWrite {
	w := opWrite{Kind: op.Kind, Node: op.Node, Pool: op.PoolName, ExactVersion: op.ExactVersion}
	if op.Alloc != nil {
		w.Owners = op.Alloc.OwnerReferences
		if op.Kind == OpNodeStatus {
			st := op.Alloc.Status.DeepCopy()
			st.Conditions = withoutTransitionTimes(st.Conditions)
			w.AllocStatus = st
		}
	}
	if op.Pool != nil {
		st := op.Pool.Status.DeepCopy()
		st.Conditions = withoutTransitionTimes(st.Conditions)
		w.PoolStatus = st
	}
	if op.Claim != nil {
		st := op.Claim.Status.DeepCopy()
		st.Conditions = withoutTransitionTimes(st.Conditions)
		w.Claim, w.ClaimStatus = op.Claim.Namespace+"/"+op.Claim.Name, st
	}
	return w
}

// withoutTransitionTimes clears the conditions' transition times (the API's helpers stamp them
// from the wall clock), in place.
func withoutTransitionTimes(cs []metav1.Condition) []metav1.Condition {
	for i := range cs {
		cs[i].LastTransitionTime = metav1.Time{}
	}
	return cs
}

package controller

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"

	ipamclaimsv1 "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
)

// The machine's ordering rules, each driven through a scripted API server: world performs the
// operations Ready lists against objects in memory, lands them unless the script says otherwise,
// and delivers what landed back as the informers would.

type world struct {
	t      *testing.T
	m      *Machine
	now    time.Time
	allocs map[string]*ipwardenv1.NodeIPAllocation
	pools  map[string]*ipwardenv1.IPPool
	nodes  map[string]bool
	pods   map[string]addr.Set // what each node's running pods report (OpListNodePods)
	rv     int
	queue  []Op
	events []Event
	done   []string // answered operations, "kind name", in order
	// answer, when set, may answer an operation itself (ok true) with an error.
	answer func(op Op) (error, bool)
	// hold, when set, keeps matching operations in flight until release.
	hold func(op Op) bool
	held []Op
	// rawPools: lead does not give the pools the status the record computes (their first pool
	// pass writes it).
	rawPools bool
	fenced   error
	claims   map[ClaimKey]*ipamclaimsv1.IPAMClaim // IPAMClaims (ipamclaims_test.go)
}

func newWorld(t *testing.T, opts Options, pools ...ipwardenv1.IPPool) *world {
	t.Helper()
	if opts.ClaimSettle == 0 {
		opts.ClaimSettle = -1
	}
	if opts.PoolSettle == 0 {
		opts.PoolSettle = -1
	}
	w := &world{t: t, m: NewMachine(opts, NewMetrics(nil), logr.Discard()), now: t0,
		allocs: map[string]*ipwardenv1.NodeIPAllocation{}, pools: map[string]*ipwardenv1.IPPool{}, nodes: map[string]bool{}}
	for i := range pools {
		p := pools[i].DeepCopy()
		p.Generation, p.UID = 1, types.UID("uid-"+p.Name)
		w.pools[p.Name] = p
	}
	return w
}

func (w *world) version() string { w.rv++; return fmt.Sprint(w.rv) }

// lead makes the machine lead from the world's objects, as holder (empty: unfenced), and
// delivers them as the informers' first list.
func (w *world) lead(holder string) {
	w.t.Helper()
	var pools []ipwardenv1.IPPool
	for _, p := range sortedKeys(w.pools) {
		pools = append(pools, *w.pools[p])
	}
	var allocs []ipwardenv1.NodeIPAllocation
	for _, a := range sortedKeys(w.allocs) {
		allocs = append(allocs, *w.allocs[a])
	}
	if !w.rawPools {
		tmp := NewState(DefaultExhaustionMarks)
		tmp.Rebuild(pools, allocs, w.now)
		for i, p := range pools {
			st, _ := tmp.PoolStatus(p.Name, ipwardenv1.IPPoolStatus{}, p.Generation, w.now)
			w.pools[p.Name].Status = st
			pools[i].Status = st
		}
	}
	var stamp *ipwardenv1.Fence
	if holder != "" {
		stamp = &ipwardenv1.Fence{Holder: holder, Epoch: 2}
	}
	if err := w.m.Lead(pools, allocs, stamp, w.now); err != nil {
		w.t.Fatal(err)
	}
	for _, p := range pools {
		w.m.PoolChanged(w.pools[p.Name], w.now)
	}
	for _, n := range sortedKeys(w.nodes) {
		w.m.NodeChanged(nodeObj(n), w.now)
	}
	for _, a := range allocs {
		w.m.AllocChanged(w.allocs[a.Name], w.now)
	}
	for _, k := range sortedClaimKeys(w.claims) {
		w.m.ClaimChanged(w.claims[k], w.now)
	}
}

func nodeObj(name string) *metav1.PartialObjectMetadata {
	return &metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID("u-" + name)}}
}

// addNode creates a Node and, unless noAlloc, its NodeIPAllocation owned by it with spec and
// the addresses held in pool p.
func (w *world) addNode(name string, sp ipwardenv1.NodeIPAllocationSpec, held ...string) {
	w.nodes[name] = true
	a := allocWith(name, "p", held...)
	a.Spec = sp
	a.Generation, a.UID, a.ResourceVersion = 1, types.UID("a-"+name), w.version()
	a.OwnerReferences = replaceNodeOwner(nil, nodeObj(name))
	w.allocs[name] = &a
}

// setSpec is the agent writing a node's spec (a new generation, delivered by the informer).
func (w *world) setSpec(name string, sp ipwardenv1.NodeIPAllocationSpec) {
	a := w.allocs[name].DeepCopy()
	a.Spec = sp
	a.Generation++
	a.ResourceVersion = w.version()
	w.allocs[name] = a
	w.m.AllocChanged(a, w.now)
}

// step runs Ready once: issues its operations into the queue and records its events.
func (w *world) step() Ready {
	w.m.Tick(w.now)
	rd := w.m.Ready(w.now)
	w.m.Advance()
	w.queue = append(w.queue, rd.Ops...)
	w.events = append(w.events, rd.Events...)
	if rd.Fenced != nil && w.fenced == nil {
		w.fenced = rd.Fenced
	}
	return rd
}

// run answers operations until the machine is at rest (nothing queued, nothing in flight but
// what hold keeps, nothing due within the scheduler's 100 ms pacing: the clock moves to it) and
// returns the operations answered in this run.
func (w *world) run() []string {
	w.t.Helper()
	start := len(w.done)
	for range 10000 {
		rd := w.step()
		if len(w.queue) == 0 {
			if !rd.Wake.IsZero() && rd.Wake.Sub(w.now) <= 100*time.Millisecond {
				w.now = rd.Wake
				continue
			}
			return w.done[start:]
		}
		op := w.queue[0]
		w.queue = w.queue[1:]
		if w.hold != nil && w.hold(op) {
			w.held = append(w.held, op)
			continue
		}
		w.perform(op)
	}
	w.t.Fatal("the machine did not come to rest")
	return nil
}

// release answers the operations hold kept, in order.
func (w *world) release() {
	held := w.held
	w.held = nil
	for _, op := range held {
		w.perform(op)
	}
}

func opName(op Op) string {
	name := op.Node
	if op.PoolName != "" {
		name = op.PoolName
	}
	if op.Claim != nil {
		name = op.Claim.Namespace + "/" + op.Claim.Name
	}
	return strings.TrimSpace(op.Kind.String() + " " + name)
}

var errTimeout = apierrors.NewTimeoutError("no answer", 1)

func (w *world) perform(op Op) {
	w.done = append(w.done, opName(op))
	r := OpResult{ID: op.ID}
	if w.answer != nil {
		if err, ok := w.answer(op); ok {
			r.Err = err
			w.m.Done(r, w.now)
			return
		}
	}
	gr := schema.GroupResource{Group: "ipwarden.io", Resource: "x"}
	switch op.Kind {
	case OpCreateAllocation:
		a := op.Alloc.DeepCopy()
		a.Generation, a.UID, a.ResourceVersion = 1, types.UID("a-"+a.Name), w.version()
		w.allocs[a.Name] = a
		defer w.m.AllocChanged(a, w.now)
	case OpDeleteAllocation:
		delete(w.allocs, op.Node)
		defer w.m.AllocDeleted(op.Node, w.now)
	case OpPatchOwner:
		a := op.Alloc.DeepCopy()
		a.ResourceVersion = w.version()
		w.allocs[a.Name] = a
		r.Alloc = a
		defer w.m.AllocChanged(a, w.now)
	case OpNodeStatus:
		cur := w.allocs[op.Node]
		if cur == nil {
			r.Err = apierrors.NewNotFound(gr, op.Node)
			break
		}
		if cur.ResourceVersion != op.Alloc.ResourceVersion {
			r.Err = apierrors.NewConflict(gr, op.Node, errors.New("changed"))
			break
		}
		a := cur.DeepCopy()
		a.Status = op.Alloc.Status
		a.ResourceVersion = w.version()
		w.allocs[op.Node] = a
		r.Alloc = a
		defer w.m.AllocChanged(a, w.now)
	case OpPoolStatus:
		cur := w.pools[op.PoolName]
		if cur.ResourceVersion != op.Pool.ResourceVersion {
			r.Err = apierrors.NewConflict(gr, op.PoolName, errors.New("changed"))
			break
		}
		p := cur.DeepCopy()
		p.Status = op.Pool.Status
		p.ResourceVersion = w.version()
		w.pools[op.PoolName] = p
		r.Pool = p
		defer w.m.PoolChanged(p, w.now)
	case OpReadNode:
		if !w.nodes[op.Node] {
			r.Err = apierrors.NewNotFound(gr, op.Node)
		}
	case OpReadAllocation:
		if a := w.allocs[op.Node]; a != nil {
			r.Alloc = a.DeepCopy()
		} else {
			r.Err = apierrors.NewNotFound(gr, op.Node)
		}
	case OpReadPool:
		r.Pool = w.pools[op.PoolName].DeepCopy()
	case OpReadAgentLease:
		r.Err = apierrors.NewNotFound(gr, op.Node)
	case OpListAllocations:
		for _, n := range sortedKeys(w.allocs) {
			r.Allocs = append(r.Allocs, *w.allocs[n])
		}
	case OpListNodePods:
		r.PodAddrs = w.pods[op.Node]
	case OpClaimStatus:
		k := ClaimKey{op.Claim.Namespace, op.Claim.Name}
		cur := w.claims[k]
		if cur == nil || cur.UID != op.Claim.UID {
			r.Err = apierrors.NewNotFound(gr, k.String())
			break
		}
		if cur.ResourceVersion != op.Claim.ResourceVersion {
			r.Err = apierrors.NewConflict(gr, k.String(), errors.New("changed"))
			break
		}
		c := cur.DeepCopy()
		c.Status = op.Claim.Status
		c.ResourceVersion = w.version()
		w.claims[k] = c
		r.Claim = c
		defer w.m.ClaimChanged(c, w.now)
	case OpListClaims:
		r.ClaimUIDs = map[string]bool{}
		for _, c := range w.claims {
			r.ClaimUIDs[string(c.UID)] = true
		}
	}
	w.m.Done(r, w.now)
}

func (w *world) statusHeldBy(node string) addr.Set {
	var out addr.Set
	for _, p := range w.allocs[node].Status.Pools {
		s, _ := addr.ParseSet(p.Addresses)
		out = out.Union(s)
	}
	return out
}

func (w *world) eventReasons() []string {
	var out []string
	for _, e := range w.events {
		out = append(out, e.Reason)
	}
	return out
}

// A node's lifecycle write comes before its fill, and a take-back's cooling record before the
// node's status: the first operations of one sync, by what the node's objects are.
func TestMachineLifecycleWrites(t *testing.T) {
	tests := []struct {
		name  string
		setup func(w *world)
		want  []string
	}{
		{"a new node gets its NodeIPAllocation", func(w *world) {
			w.nodes["n"] = true
		}, []string{"create NodeIPAllocation n", "write NodeIPAllocation status n"}},
		{"a node asking for addresses is filled", func(w *world) {
			w.addNode("n", spec("p", 4))
		}, []string{"write NodeIPAllocation status n", "write IPPool status p"}},
		{"a take-back writes the cooling record first", func(w *world) {
			w.addNode("n", spec("p", 2, "10.0.0.3-10.0.0.4"), "10.0.0.1-10.0.0.4")
		}, []string{"write IPPool status p", "write NodeIPAllocation status n"}},
		{"a stale owner is fixed before the fill", func(w *world) {
			w.addNode("n", spec("p", 4))
			w.allocs["n"].OwnerReferences[0].UID = "u-old"
		}, []string{"patch NodeIPAllocation owner n", "write NodeIPAllocation status n", "write IPPool status p"}},
		{"a deleted node: asked of the API server, cooling record, then the delete", func(w *world) {
			w.addNode("n", spec("p", 4), "10.0.0.1-10.0.0.4")
			delete(w.nodes, "n")
		}, []string{"read Node n", "read agent Lease n", "write IPPool status p", "delete NodeIPAllocation n"}},
		{"a node no pool selects, holding nothing, loses its object", func(w *world) {
			w.addNode("n", ipwardenv1.NodeIPAllocationSpec{})
			sel := w.pools["p"]
			sel.Spec.NodeSelector = &metav1.LabelSelector{MatchLabels: map[string]string{"pool": "p"}}
		}, []string{"delete NodeIPAllocation n"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, Options{AgentLeaseNamespace: "ns"}, testPool("p", "10.0.0.0/28", time.Minute))
			tc.setup(w)
			w.lead("")
			if got := w.run(); !slices.Equal(got, tc.want) {
				t.Fatalf("operations %v, want %v", got, tc.want)
			}
		})
	}
}

// Claims before fills: a new leader grants claimed addresses at once but fills from the free pool
// only once every node acknowledged it, or when --claim-settle passes (with an event naming the
// nodes that did not).
func TestMachineClaimsBeforeFills(t *testing.T) {
	for _, tc := range []struct {
		name      string
		ack       bool // b acknowledges the leader
		wantEvent string
	}{
		{"every node acknowledges", true, ""},
		{"a node stays silent past the bound", false, "LeaderNotAcknowledged"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, Options{ClaimSettle: time.Minute}, testPool("p", "10.0.0.0/28", time.Minute))
			claim := spec("p", 4)
			claim.Pools[0].Claimed = []ipwardenv1.AddressBlock{"10.0.0.7"}
			claim.AcknowledgedLeader = "leader"
			w.addNode("a", claim)
			w.addNode("b", spec("p", 4))
			w.lead("leader")
			w.run()
			if got := w.statusHeldBy("a"); !got.Equal(set(t, "10.0.0.7")) {
				t.Fatalf("before the acknowledgements a holds %v, want its claim 10.0.0.7 only", got)
			}
			if got := w.statusHeldBy("b"); !got.IsEmpty() {
				t.Fatalf("before the acknowledgements b was filled: %v", got)
			}
			if tc.ack {
				sp := spec("p", 4)
				sp.AcknowledgedLeader = "leader"
				w.setSpec("b", sp)
				w.now = w.now.Add(time.Second)
			} else {
				w.now = w.now.Add(time.Minute)
			}
			w.run()
			if count(w.statusHeldBy("a")) != 4 || count(w.statusHeldBy("b")) != 4 {
				t.Fatalf("after the settle a holds %v, b %v; want 4 each", w.statusHeldBy("a"), w.statusHeldBy("b"))
			}
			if got := slices.Contains(w.eventReasons(), "LeaderNotAcknowledged"); got != (tc.wantEvent != "") {
				t.Fatalf("events %v", w.eventReasons())
			}
		})
	}
}

// A pool that appears while the controller leads hands out none of its free addresses until every
// node observed it (spec.observedPools), or --pool-settle passes.
func TestMachinePoolSettle(t *testing.T) {
	for _, tc := range []struct {
		name      string
		observe   bool
		wantEvent string
	}{
		{"every node observes the new pool", true, "PoolSettling"},
		{"a node stays silent past the bound", false, "PoolSettleTimedOut"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, Options{PoolSettle: time.Minute})
			w.addNode("a", spec("p", 4))
			w.lead("")
			w.run()
			p := testPool("p", "10.0.0.0/28", time.Minute)
			p.Generation, p.UID, p.ResourceVersion = 1, "uid-p", w.version()
			w.pools["p"] = &p
			w.m.PoolChanged(&p, w.now)
			w.run()
			if got := w.statusHeldBy("a"); !got.IsEmpty() {
				t.Fatalf("a was filled from a pool it has not observed: %v", got)
			}
			if tc.observe {
				sp := spec("p", 4)
				sp.ObservedPools = []ipwardenv1.ObservedPool{{Pool: "p", UID: "uid-p", Generation: 1}}
				w.setSpec("a", sp)
				w.now = w.now.Add(time.Second)
			} else {
				w.now = w.now.Add(time.Minute)
			}
			w.run()
			if count(w.statusHeldBy("a")) != 4 {
				t.Fatalf("after the settle a holds %v", w.statusHeldBy("a"))
			}
			if !slices.Contains(w.eventReasons(), tc.wantEvent) {
				t.Fatalf("events %v, want %s", w.eventReasons(), tc.wantEvent)
			}
		})
	}
}

// A new pool that selects nodes a and d waits for a's report, and for the silent nodes (d, whose
// agent is down, and b and c, which another pool selects) only podReadAfter: then their pods are
// read (a's are not: it reported), and unless a pod of theirs uses an address of the new pool (the
// previous IPAM's), a is filled then, long before --pool-settle. A read that fails is made again.
func TestMachinePoolSettleWaitsForTheNodesItMayServe(t *testing.T) {
	for _, tc := range []struct {
		name     string
		cPods    string // what node c's running pods report
		failOnce bool   // the first read of b's pods fails
		filledAt time.Duration
		event    string
	}{
		{"no silent node's pod uses the new addresses", "10.0.0.9", false, podReadAfter, "PoolSettling"},
		{"a read fails and is made again", "", true, 2 * podReadAfter, "PoolSettling"},
		{"a pod on silent node c uses one", "10.1.0.3", false, time.Minute, "PoolSettleTimedOut"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, Options{PoolSettle: time.Minute}, testPool("p", "10.0.0.0/28", time.Minute))
			w.pods = map[string]addr.Set{"b": set(t, "10.0.0.5")}
			if tc.cPods != "" {
				w.pods["c"] = set(t, tc.cPods)
			}
			failed := false
			w.answer = func(op Op) (error, bool) {
				if tc.failOnce && op.Kind == OpListNodePods && op.Node == "b" && !failed {
					failed = true
					return errTimeout, true
				}
				return nil, false
			}
			for _, n := range []string{"a", "b", "c", "d"} {
				w.addNode(n, spec("p", 0))
			}
			w.lead("")
			w.run()
			for _, n := range []string{"a", "d"} {
				obj := nodeObj(n)
				obj.Labels = map[string]string{"pool": "q"}
				w.m.NodeChanged(obj, w.now)
			}
			q := testPool("q", "10.1.0.0/28", time.Minute)
			q.Spec.NodeSelector = &metav1.LabelSelector{MatchLabels: map[string]string{"pool": "q"}}
			q.Generation, q.UID, q.ResourceVersion = 1, "uid-q", w.version()
			w.pools["q"] = &q
			start := w.now
			w.m.PoolChanged(&q, w.now)
			w.setSpec("a", ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "q", Requested: 4}},
				ObservedPools: []ipwardenv1.ObservedPool{{Pool: "q", UID: "uid-q", Generation: 1}}})
			var reads []string
			for w.now.Sub(start) <= 2*time.Minute && count(w.statusHeldBy("a")) == 0 {
				for _, op := range w.run() {
					if strings.HasPrefix(op, OpListNodePods.String()) {
						reads = append(reads, op)
					}
				}
				if count(w.statusHeldBy("a")) == 0 {
					w.now = w.now.Add(time.Second)
				}
			}
			if got := w.now.Sub(start); count(w.statusHeldBy("a")) != 4 || got < tc.filledAt || got > tc.filledAt+time.Second {
				t.Fatalf("a holds %v %s after the pool appeared, want 4 addresses within a second after %s", w.statusHeldBy("a"), got, tc.filledAt)
			}
			want := []string{"list the node's Pods b", "list the node's Pods c", "list the node's Pods d"}
			if tc.failOnce {
				want = append(want, "list the node's Pods b")
			}
			if !slices.Equal(reads, want) {
				t.Fatalf("pod reads %v, want %v (the reporting node's pods are never read)", reads, want)
			}
			if !slices.Contains(w.eventReasons(), tc.event) {
				t.Fatalf("events %v, want %s", w.eventReasons(), tc.event)
			}
		})
	}
}

// Many silent nodes (a fleet whose agents are not started yet) are read at most maxPodReads at a
// time; the rest as answers come back, and the pool fills once every one was read.
func TestMachinePoolSettleBoundsPodReads(t *testing.T) {
	w := newWorld(t, Options{PoolSettle: time.Minute}, testPool("p", "10.0.0.0/24", time.Minute))
	const silent = maxPodReads + 5
	for i := range silent {
		w.addNode(fmt.Sprintf("s%02d", i), spec("p", 0))
	}
	w.addNode("a", spec("p", 0))
	w.lead("")
	w.run()
	q := testPool("q", "10.1.0.0/28", time.Minute)
	q.Generation, q.UID, q.ResourceVersion = 1, "uid-q", w.version()
	w.pools["q"] = &q
	w.m.PoolChanged(&q, w.now)
	w.setSpec("a", ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "q", Requested: 4}},
		ObservedPools: []ipwardenv1.ObservedPool{{Pool: "q", UID: "uid-q", Generation: 1}}})
	w.hold = func(op Op) bool { return op.Kind == OpListNodePods }
	w.run()
	if len(w.held) != 0 {
		t.Fatalf("%d pod reads before podReadAfter", len(w.held))
	}
	w.now = w.now.Add(podReadAfter)
	w.run()
	if len(w.held) != maxPodReads {
		t.Fatalf("%d pod reads in flight, want %d", len(w.held), maxPodReads)
	}
	w.hold = nil
	w.release()
	w.run()
	reads := 0
	for _, op := range w.done {
		if strings.HasPrefix(op, OpListNodePods.String()) {
			reads++
		}
	}
	if reads != silent || count(w.statusHeldBy("a")) != 4 {
		t.Fatalf("%d pod reads, a holds %v; want %d reads and 4 addresses", reads, w.statusHeldBy("a"), silent)
	}
}

// While agents are still reporting a new pool, silent nodes' pods are not read: the reads start
// podReadAfter after the last report.
func TestMachinePoolSettleReadsOnceReportsStop(t *testing.T) {
	w := newWorld(t, Options{PoolSettle: time.Minute}, testPool("p", "10.0.0.0/28", time.Minute))
	for _, n := range []string{"a", "b", "e"} {
		w.addNode(n, spec("p", 0))
	}
	w.lead("")
	w.run()
	q := testPool("q", "10.1.0.0/28", time.Minute)
	q.Generation, q.UID, q.ResourceVersion = 1, "uid-q", w.version()
	w.pools["q"] = &q
	start := w.now
	w.m.PoolChanged(&q, w.now)
	observe := func(n string, requested int32) {
		w.setSpec(n, ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "q", Requested: requested}},
			ObservedPools: []ipwardenv1.ObservedPool{{Pool: "q", UID: "uid-q", Generation: 1}}})
	}
	observe("a", 4)
	firstRead, reportedAt := time.Duration(-1), time.Duration(-1)
	for w.now.Sub(start) <= 10*time.Second && count(w.statusHeldBy("a")) == 0 {
		if reportedAt < 0 && w.now.Sub(start) >= 1500*time.Millisecond {
			observe("e", 0) // a slow agent's report
			reportedAt = w.now.Sub(start)
		}
		for _, op := range w.run() {
			if strings.HasPrefix(op, OpListNodePods.String()) && firstRead < 0 {
				firstRead = w.now.Sub(start)
			}
		}
		w.now = w.now.Add(500 * time.Millisecond)
	}
	if want := reportedAt + podReadAfter; reportedAt < 0 || firstRead < want || firstRead > want+time.Second {
		t.Fatalf("first pod read %s after the pool appeared, want at %s (the last report plus %s)", firstRead, want, podReadAfter)
	}
	if count(w.statusHeldBy("a")) != 4 {
		t.Fatalf("a holds %v", w.statusHeldBy("a"))
	}
}

// What each outcome of the node status write leads to: a conflict re-reads and writes again; a
// write with no answer is settled from a fresh read before the node is planned again; a status a
// newer leader wrote stops this one.
func TestMachineStatusWriteOutcomes(t *testing.T) {
	for _, tc := range []struct {
		name       string
		first      error
		newerFence bool
		want       []string
		wantHeld   int
		fenced     bool
	}{
		{"landed", nil, false, []string{"write NodeIPAllocation status n"}, 4, false},
		{"conflict", apierrors.NewConflict(gr, "n", errors.New("changed")), false,
			[]string{"write NodeIPAllocation status n", "read NodeIPAllocation n", "write NodeIPAllocation status n"}, 4, false},
		{"conflict with a newer leader's status", apierrors.NewConflict(gr, "n", errors.New("changed")), true,
			[]string{"write NodeIPAllocation status n", "read NodeIPAllocation n"}, 0, true},
		{"no answer, landed", errTimeout, false,
			[]string{"write NodeIPAllocation status n", "read NodeIPAllocation n"}, 4, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, Options{}, testPool("p", "10.0.0.0/28", time.Minute))
			w.addNode("n", spec("p", 4))
			calls := 0
			w.answer = func(op Op) (error, bool) {
				if op.Kind != OpNodeStatus {
					return nil, false
				}
				calls++
				if calls > 1 || tc.first == nil {
					return nil, false
				}
				if tc.newerFence {
					a := w.allocs["n"].DeepCopy()
					a.Status.Fence = &ipwardenv1.Fence{Holder: "newer", Epoch: 9}
					w.allocs["n"] = a
				}
				if tc.first == errTimeout { // it landed; the answer was lost
					a := w.allocs["n"].DeepCopy()
					a.Status = op.Alloc.Status
					a.ResourceVersion = w.version()
					w.allocs["n"] = a
				}
				return tc.first, true
			}
			w.lead("leader")
			w.m.state.EndSettle()
			var ops []string
			for _, o := range w.run() {
				if !strings.HasPrefix(o, "write IPPool") {
					ops = append(ops, o)
				}
			}
			if tc.first == errTimeout {
				// The next sync starts from a fresh read; the record adopts what landed.
				if !w.m.state.HasPending("n") {
					w.t.Fatal("a write with no answer left nothing pending")
				}
				w.now = w.now.Add(time.Hour)
				w.m.enqueue("n", w.now)
				for _, o := range w.run() {
					if !strings.HasPrefix(o, "write IPPool") && !strings.HasPrefix(o, "list") {
						ops = append(ops, o)
					}
				}
			}
			if !slices.Equal(ops, tc.want) {
				t.Fatalf("operations %v, want %v", ops, tc.want)
			}
			if got := count(w.m.state.HeldBy("n")["p"]); got != tc.wantHeld || w.m.state.HasPending("n") {
				t.Fatalf("record holds %d (pending %v), want %d", got, w.m.state.HasPending("n"), tc.wantHeld)
			}
			if (w.fenced != nil) != tc.fenced {
				t.Fatalf("fenced: %v, want %v", w.fenced, tc.fenced)
			}
		})
	}
}

// A fill that takes addresses from a node waits for a pool status write computed after its
// cooling record: not one already in flight. A pool status conflict re-reads the pool and writes
// again; past three conflicts the fill fails and the node keeps its addresses.
func TestMachinePoolWriteCarriesTheCoolingRecord(t *testing.T) {
	for _, tc := range []struct {
		name      string
		conflicts int
		want      []string
		committed bool
	}{
		{"a write in flight is not enough", 0, []string{"write IPPool status p", "write IPPool status p", "write NodeIPAllocation status n"}, true},
		{"a conflict re-reads the pool", 1, []string{"write IPPool status p", "write IPPool status p", "read IPPool p", "write IPPool status p", "write NodeIPAllocation status n"}, true},
		{"four conflicts fail the fill", 4, []string{"write IPPool status p", "write IPPool status p", "read IPPool p", "write IPPool status p",
			"read IPPool p", "write IPPool status p", "read IPPool p", "write IPPool status p"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, Options{}, testPool("p", "10.0.0.0/28", time.Minute))
			w.rawPools = true // the first pool pass writes its status
			w.addNode("n", spec("p", 4), "10.0.0.1-10.0.0.4")
			w.lead("")
			// The pool pass's write is held in flight while n gives two back.
			first := true
			w.hold = func(op Op) bool {
				if op.Kind == OpPoolStatus && first {
					first = false
					return true
				}
				return false
			}
			w.run()
			if len(w.held) != 1 {
				t.Fatalf("held %v", w.held)
			}
			conflicts, writes := 0, 0
			w.answer = func(op Op) (error, bool) {
				if op.Kind != OpPoolStatus {
					return nil, false
				}
				if writes++; writes >= 2 && conflicts < tc.conflicts {
					conflicts++
					return apierrors.NewConflict(gr, "p", errors.New("changed")), true
				}
				return nil, false
			}
			start := len(w.done)
			w.setSpec("n", spec("p", 2, "10.0.0.3-10.0.0.4"))
			w.now = w.now.Add(time.Second)
			w.step()
			if slices.ContainsFunc(w.queue, func(op Op) bool { return op.Kind == OpNodeStatus }) {
				t.Fatal("the node's status was written while the only pool write in flight predates its cooling record")
			}
			w.release()
			w.run()
			got := w.done[start:]
			if !slices.Equal(got, tc.want) {
				t.Fatalf("operations %v, want %v", got, tc.want)
			}
			if held := count(w.statusHeldBy("n")); (held == 2) != tc.committed {
				t.Fatalf("n holds %d, committed %v", held, tc.committed)
			}
		})
	}
}

// A node left short is refilled when addresses come back, even when they come back while its
// own fill is in flight (recorded short from the plan, not the commit).
func TestMachineRefillsAStarvedNodeWhoseFillWasInFlight(t *testing.T) {
	w := newWorld(t, Options{}, testPool("p", "10.0.0.0/28", 0))
	w.addNode("b", spec("p", 14), "10.0.0.1-10.0.0.14")
	w.addNode("a", ipwardenv1.NodeIPAllocationSpec{})
	w.lead("")
	w.run()
	// a asks for 4; its status write is held in flight while b gives 2 back (cooled).
	w.hold = func(op Op) bool { return op.Kind == OpNodeStatus && op.Node == "a" && len(w.held) == 0 }
	w.setSpec("a", spec("p", 4))
	w.run()
	if len(w.held) != 1 {
		t.Fatalf("a's write is not in flight: %v", w.done)
	}
	w.hold = nil
	rel := spec("p", 12, "10.0.0.13-10.0.0.14")
	rel.Pools[0].ReleasingCooled = rel.Pools[0].Releasing
	w.now = w.now.Add(time.Second)
	w.setSpec("b", rel)
	w.run()
	w.release()
	w.now = w.now.Add(time.Second)
	w.run()
	if got := w.statusHeldBy("a"); !got.Equal(set(t, "10.0.0.13-10.0.0.14")) {
		t.Fatalf("a holds %v, want what b gave back", got)
	}
}

// One task per node, and at most Workers at once.
func TestMachineBoundsTasks(t *testing.T) {
	w := newWorld(t, Options{Workers: 2}, testPool("p", "10.0.0.0/24", time.Minute))
	for i := range 6 {
		w.addNode(fmt.Sprintf("n%d", i), spec("p", 4))
	}
	w.hold = func(Op) bool { return true }
	w.lead("")
	w.step()
	for range 5 {
		w.run()
	}
	if len(w.held) != 2 {
		t.Fatalf("%d operations in flight with 2 workers: %v", len(w.held), w.held)
	}
	w.hold = nil
	for len(w.held) > 0 {
		w.release()
		w.run()
	}
	for i := range 6 {
		if n := count(w.statusHeldBy(fmt.Sprintf("n%d", i))); n != 4 {
			t.Fatalf("n%d holds %d", i, n)
		}
	}
}

// The audit runs on the machine's goroutine between steps: addresses reserved by fills in flight
// are the nodes', never returned as leaked nor reported as held twice.
func TestMachineAuditWhileFillsAreInFlight(t *testing.T) {
	w := newWorld(t, Options{AuditPeriod: time.Minute}, testPool("p", "10.0.0.0/28", 0))
	w.addNode("a", spec("p", 4))
	w.addNode("b", spec("p", 4))
	w.lead("")
	w.hold = func(op Op) bool { return op.Kind == OpNodeStatus }
	w.run()
	w.hold = nil
	w.now = w.now.Add(time.Minute)
	if got := w.run(); !slices.Contains(got, "list NodeIPAllocations") { // while both fills are in flight
		t.Fatalf("no audit ran: %v", got)
	}
	if twice, leaked := gauge(t, w.m.metrics.AddressesTwice), counter(t, w.m.metrics.GCCollected); twice != 0 || leaked != 0 {
		t.Fatalf("the audit reported %v addresses held twice and returned %v as leaked", twice, leaked)
	}
	w.release()
	w.run()
	if a, b := w.statusHeldBy("a"), w.statusHeldBy("b"); count(a) != 4 || count(b) != 4 || a.Overlaps(b) {
		t.Fatalf("a holds %v, b %v", a, b)
	}
}

func counter(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// --- VM addresses (IPAMClaim) -------------------------------------------------------------------

func sortedClaimKeys(m map[ClaimKey]*ipamclaimsv1.IPAMClaim) []ClaimKey {
	out := make([]ClaimKey, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.SortFunc(out, func(a, b ClaimKey) int { return strings.Compare(a.String(), b.String()) })
	return out
}

// addClaim creates the IPAMClaim vmKey with uid (delivered at lead, or now when leading).
func (w *world) addClaim(uid string, leading bool) {
	if w.claims == nil {
		w.claims = map[ClaimKey]*ipamclaimsv1.IPAMClaim{}
	}
	c := &ipamclaimsv1.IPAMClaim{ObjectMeta: metav1.ObjectMeta{Namespace: vmKey.Namespace, Name: vmKey.Name, UID: types.UID(uid), ResourceVersion: w.version()},
		Spec: ipamclaimsv1.IPAMClaimSpec{Network: "net"}}
	w.claims[vmKey] = c
	if leading {
		w.m.ClaimChanged(c, w.now)
	}
}

func (w *world) deleteClaim() {
	delete(w.claims, vmKey)
	w.m.ClaimDeleted(vmKey.Namespace, vmKey.Name, w.now)
}

// Durable first: the pool status write that records a claim's binding lands before the node
// status write that grants its address, and the claim's status follows both; when the binding's
// write fails, no node status grants the address and the claim's status is not written.
func TestMachineClaimBindingLandsBeforeTheGrant(t *testing.T) {
	for _, tc := range []struct {
		name     string
		poolErr  error
		want     []string
		granted  bool
		claimIPs int
	}{
		{"landed", nil, []string{"write IPPool status p", "write NodeIPAllocation status n", "write IPAMClaim status vms/vm-a.net"}, true, 1},
		{"the binding's write is rejected", apierrors.NewInvalid(schema.GroupKind{Kind: "IPPool"}, "p", nil), []string{"write IPPool status p"}, false, 0},
		{"the binding's write has no answer", errTimeout, []string{"write IPPool status p"}, false, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newWorld(t, Options{}, testPool("p", "10.0.0.0/28", time.Minute))
			w.addNode("n", useSpec(0, use("u1", false, false, "")))
			w.addClaim("u1", false)
			w.lead("")
			w.answer = func(op Op) (error, bool) {
				if op.Kind == OpPoolStatus && tc.poolErr != nil {
					return tc.poolErr, true
				}
				return nil, false
			}
			got := w.run()
			if tc.poolErr != nil {
				got = slices.Compact(got) // the retries repeat the pool write
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("operations %v, want %v", got, tc.want)
			}
			if held := w.statusHeldBy("n"); held.IsEmpty() == tc.granted {
				t.Fatalf("n holds %v", held)
			}
			c := w.claims[vmKey]
			if len(c.Status.IPs) != tc.claimIPs {
				t.Fatalf("claim status %+v", c.Status)
			}
			if tc.granted {
				if want := w.statusHeldBy("n").String() + "/28"; c.Status.IPs[0] != want || c.Status.OwnerPod == nil || c.Status.OwnerPod.Name != "virt-launcher-u1" ||
					c.Status.Conditions[0].Reason != ipwardenv1.ClaimReasonAllocated {
					t.Fatalf("claim status %+v, want %s", c.Status, want)
				}
				if b := w.pools["p"].Status.IPAMClaims; len(b) != 1 || b[0].UID != "u1" {
					t.Fatalf("pool bindings %+v", b)
				}
			}
		})
	}
}

// A live migration: the target's node gets the claim's address only after the shared grant is
// recorded, the source's node is asked to list it in wantedElsewhere, and when the source gives
// its copy back the address stays with the target, neither cooling nor free, and the grant ends.
// A pod of another claim, or a third holder, is refused with the holder named.
func TestMachineSharedGrant(t *testing.T) {
	for _, tc := range []struct {
		name    string
		target  ipwardenv1.ClaimUse
		shared  bool
		refusal string
	}{
		{"a migration target of the same claim", use("u1", false, true, ""), true, ""},
		{"a second pod without the migration label", use("u1", false, false, ""), false, "IPAMClaim vms/vm-a.net is attached on node x"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool := testPool("p", "10.0.0.0/28", time.Minute)
			pool.Status.IPAMClaims = []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")}
			w := newWorld(t, Options{}, pool)
			w.rawPools = true
			w.addNode("x", useSpec(1, use("u1", true, false, "10.0.0.5")), "10.0.0.5")
			w.addNode("y", useSpec(0, tc.target))
			w.addClaim("u1", false)
			w.lead("")
			got := w.run()
			if !tc.shared {
				if w.statusHeldBy("y").Contains(netip.MustParseAddr("10.0.0.5")) {
					t.Fatal("y holds it")
				}
				r := w.allocs["y"].Status.Pools[0].ClaimRefused
				if len(r) != 1 || r[0].Reason != tc.refusal {
					t.Fatalf("refused %+v", r)
				}
				if !slices.Contains(w.eventReasons(), refusedAttached) {
					t.Fatalf("events %v", w.eventReasons())
				}
				return
			}
			pw, ny := slices.Index(got, "write IPPool status p"), slices.Index(got, "write NodeIPAllocation status y")
			if pw < 0 || ny < pw {
				t.Fatalf("operations %v: the shared grant is not recorded before y's status", got)
			}
			if !w.statusHeldBy("y").Contains(netip.MustParseAddr("10.0.0.5")) {
				t.Fatal("y does not hold it")
			}
			for _, n := range []string{"x", "y"} {
				if we := w.allocs[n].Status.Pools[0].WantedElsewhere; len(we) != 1 || we[0] != "10.0.0.5" {
					t.Fatalf("%s wantedElsewhere %v", n, we)
				}
			}
			if sh := w.pools["p"].Status.Shared; len(sh) != 1 || !slices.Equal(sh[0].Nodes, []string{"x", "y"}) {
				t.Fatalf("shared %+v", sh)
			}
			// The source's DEL: x gives it back.
			w.setSpec("x", ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "p", Releasing: []ipwardenv1.AddressBlock{"10.0.0.5"}}}})
			w.setSpec("y", useSpec(1, use("u1", true, true, "10.0.0.5")))
			w.now = w.now.Add(2 * time.Second)
			w.run()
			if w.statusHeldBy("x").Contains(netip.MustParseAddr("10.0.0.5")) || !w.statusHeldBy("y").Contains(netip.MustParseAddr("10.0.0.5")) {
				t.Fatalf("x %v, y %v", w.statusHeldBy("x"), w.statusHeldBy("y"))
			}
			if st := w.pools["p"].Status; len(st.Shared) != 0 || len(st.Cooling) != 0 || len(st.IPAMClaims) != 1 {
				t.Fatalf("pool status %+v", st)
			}
			if we := w.allocs["y"].Status.Pools[0].WantedElsewhere; len(we) != 0 {
				t.Fatalf("y still lists %v in wantedElsewhere", we)
			}
			if w.m.State().pools["p"].alloc.Cooling().Contains(netip.MustParseAddr("10.0.0.5")) {
				t.Fatal("the address y holds cools")
			}
		})
	}
}

// A claim restarted on another node: the old node's status lists the address in wantedElsewhere
// once no attachment there uses it, and the new node gets it once it is given back.
func TestMachineClaimHandBack(t *testing.T) {
	pool := testPool("p", "10.0.0.0/28", time.Minute)
	pool.Status.IPAMClaims = []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")}
	w := newWorld(t, Options{}, pool)
	w.rawPools = true
	w.addNode("x", useSpec(1), "10.0.0.5") // the VM's old pod is gone; its agent kept the address
	w.addNode("y", useSpec(0, use("u1", false, false, "")))
	w.addClaim("u1", false)
	w.lead("")
	w.run()
	if we := w.allocs["x"].Status.Pools[0].WantedElsewhere; len(we) != 1 || we[0] != "10.0.0.5" {
		t.Fatalf("x wantedElsewhere %v", we)
	}
	if !w.statusHeldBy("y").IsEmpty() {
		t.Fatal("y holds it while x does")
	}
	w.setSpec("x", ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "p", Releasing: []ipwardenv1.AddressBlock{"10.0.0.5"}}}})
	w.now = w.now.Add(2 * time.Second)
	w.run()
	if w.statusHeldBy("y").String() != "10.0.0.5" {
		t.Fatalf("y holds %v", w.statusHeldBy("y"))
	}
}

// Release: a binding goes (one pool status write) only when a fresh list of the claims lacks
// it and no node lists a use of it; a failed list releases nothing.
func TestMachineClaimRelease(t *testing.T) {
	for _, tc := range []struct {
		name    string
		used    bool
		listErr error
		deleted bool
		release bool
		lists   bool
	}{
		{"the claim is gone and unused", false, nil, true, true, true},
		{"the claim is gone but a node still uses it", true, nil, true, false, false},
		{"the list fails", false, errTimeout, true, false, true},
		{"the periodic list finds the claim", false, nil, false, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool := testPool("p", "10.0.0.0/28", time.Minute)
			pool.Status.IPAMClaims = []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")}
			w := newWorld(t, Options{AuditPeriod: time.Minute}, pool)
			w.rawPools = true
			sp := useSpec(1)
			if tc.used {
				sp = useSpec(1, use("u1", true, false, "10.0.0.5"))
			}
			w.addNode("x", sp, "10.0.0.5")
			w.addClaim("u1", false)
			w.lead("")
			w.run()
			w.answer = func(op Op) (error, bool) {
				if op.Kind == OpListClaims && tc.listErr != nil {
					return tc.listErr, true
				}
				return nil, false
			}
			start := len(w.done)
			if tc.deleted {
				w.deleteClaim()
			} else {
				w.now = w.now.Add(time.Minute) // the audit's period
			}
			w.run()
			w.now = w.now.Add(2 * time.Second) // the pool's status writes are paced
			w.run()
			got := w.done[start:]
			if slices.Contains(got, "list IPAMClaims") != tc.lists {
				t.Fatalf("operations %v", got)
			}
			if released := len(w.pools["p"].Status.IPAMClaims) == 0; released != tc.release {
				t.Fatalf("released %v, want %v", released, tc.release)
			}
			if w.statusHeldBy("x").String() != "10.0.0.5" {
				t.Fatal("the holder lost the address")
			}
		})
	}
}

// A restarted controller keeps the bindings: a claim's address stays out of ordinary fills even
// while the pool is full, and goes to the claim's next pod.
func TestMachineRestartKeepsClaims(t *testing.T) {
	w := newWorld(t, Options{}, testPool("p", "10.0.0.0/29", 0))
	w.addNode("n", useSpec(0, use("u1", false, false, "")))
	w.addClaim("u1", false)
	w.lead("")
	w.run()
	bound := w.statusHeldBy("n")
	if count(bound) != 1 {
		t.Fatalf("n holds %v", bound)
	}
	// The VM stops: n gives the address back. Then another controller leads.
	w.setSpec("n", ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "p", Releasing: []ipwardenv1.AddressBlock{ipwardenv1.AddressBlock(bound.String())}}}})
	w.run()
	w.m = NewMachine(w.m.Options(), NewMetrics(nil), logr.Discard())
	w.rawPools = true
	w.addNode("o", spec("p", 6))
	w.lead("")
	w.run()
	if w.statusHeldBy("o").Overlaps(bound) {
		t.Fatalf("o got the claim's address %v", bound)
	}
	w.setSpec("n", useSpec(0, use("u1", false, false, "")))
	w.run()
	if !w.statusHeldBy("n").Equal(bound) {
		t.Fatalf("n holds %v, want %v", w.statusHeldBy("n"), bound)
	}
}

// The claim's status: written when it differs from what the record says, after a restart for a
// claim whose pod is attached too; a refusal keeps the addresses it asks for.
func TestMachineClaimStatus(t *testing.T) {
	for _, tc := range []struct {
		name    string
		ips     []string // the claim's status.ips before
		cond    bool     // the claim already says IPsAllocated True
		attach  bool     // x's pod is attached (else a pod waits on y for the claim)
		writes  int
		wantIPs []string
		reason  string
	}{
		{"attached after a restart, status lost", nil, false, true, 1, []string{"10.0.0.5/28"}, ipwardenv1.ClaimReasonAllocated},
		{"attached, status right", []string{"10.0.0.5/28"}, true, true, 0, []string{"10.0.0.5/28"}, ipwardenv1.ClaimReasonAllocated},
		{"an import names another claim's address", []string{"10.0.0.6"}, false, false, 1, []string{"10.0.0.6"}, ipwardenv1.ClaimReasonAddressConflict},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool := testPool("p", "10.0.0.0/28", time.Minute)
			if tc.attach {
				pool.Status.IPAMClaims = []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")}
			} else {
				pool.Status.IPAMClaims = []ipwardenv1.ClaimBinding{{Address: "10.0.0.6", Namespace: "vms", Name: "other", UID: "u9"}}
			}
			w := newWorld(t, Options{}, pool)
			w.rawPools = true
			if tc.attach {
				w.addNode("x", useSpec(1, use("u1", true, false, "10.0.0.5")), "10.0.0.5")
			} else {
				w.addNode("y", useSpec(0, use("u1", false, false, "")))
			}
			w.addClaim("u1", false)
			c := w.claims[vmKey]
			c.Status.IPs = tc.ips
			if tc.cond {
				c.Status.OwnerPod = &ipamclaimsv1.OwnerPod{Name: "virt-launcher-u1"}
				c.Status.Conditions = []metav1.Condition{{Type: ipwardenv1.ClaimConditionIPsAllocated, Status: metav1.ConditionTrue,
					Reason: ipwardenv1.ClaimReasonAllocated, Message: "ipwarden bound the address to this claim in IPPool p", LastTransitionTime: metav1.NewTime(t0)}}
			}
			w.lead("")
			writes := 0
			for _, op := range w.run() {
				if strings.HasPrefix(op, "write IPAMClaim status") {
					writes++
				}
			}
			if writes != tc.writes {
				t.Fatalf("%d claim status writes, want %d", writes, tc.writes)
			}
			st := w.claims[vmKey].Status
			if !slices.Equal(st.IPs, tc.wantIPs) || len(st.Conditions) != 1 || st.Conditions[0].Reason != tc.reason {
				t.Fatalf("status %+v", st)
			}
		})
	}
}

// The claim paths are deterministic: a fresh machine fed the same inputs asks for the same
// operations (a migration, its give-back, a claim deleted and released).
func TestMachineClaimReplay(t *testing.T) {
	pool := testPool("p", "10.0.0.0/28", time.Minute)
	pool.Status.IPAMClaims = []ipwardenv1.ClaimBinding{binding("10.0.0.5", "u1")}
	w := newWorld(t, Options{}, pool)
	w.rawPools = true
	w.addNode("x", useSpec(1, use("u1", true, false, "10.0.0.5")), "10.0.0.5")
	w.addNode("y", useSpec(0, use("u1", false, true, "")))
	w.addClaim("u1", false)
	w.m.Record()
	w.lead("")
	w.run()
	w.setSpec("x", ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "p", Releasing: []ipwardenv1.AddressBlock{"10.0.0.5"}}}})
	w.setSpec("y", useSpec(1, use("u1", true, true, "10.0.0.5")))
	w.now = w.now.Add(2 * time.Second)
	w.run()
	w.deleteClaim()
	w.setSpec("y", ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "p", Releasing: []ipwardenv1.AddressBlock{"10.0.0.5"}}}})
	w.now = w.now.Add(2 * time.Second)
	w.run()
	w.now = w.now.Add(2 * time.Second)
	w.run()
	if len(w.pools["p"].Status.IPAMClaims) != 0 {
		t.Fatal("not released")
	}
	got, err := Replay(NewMachine(w.m.Options(), NewMetrics(nil), logr.Discard()), w.m.Script())
	if err != nil {
		t.Fatal(err)
	}
	if err := SameOps(w.m.Issued(), got); err != nil {
		t.Fatal(err)
	}
	kinds := map[OpKind]bool{}
	for _, op := range got {
		kinds[op.Kind] = true
	}
	if !kinds[OpClaimStatus] || !kinds[OpListClaims] {
		t.Fatalf("the script has no claim operations: %v", kinds)
	}
}

package sim

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/controller"
	"github.com/ipwarden/ipwarden/internal/ippool"
)

const (
	// poolName is the simulated IPPool.
	poolName = "pods"
	// network is the CNI network name of every attachment.
	network = "sim"
	// ifName is every attachment's interface.
	ifName = "eth0"
)

// epoch is time 0 of the virtual clock. Any fixed instant works; the real code only compares
// and adds times.
var epoch = time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)

// Result is what a run produced.
type Result struct {
	Summary Summary
	Series  []Sample
}

type podState uint8

const (
	podNew     podState = iota // created, not yet bound
	podBound                   // bound to its node, ADD not yet arrived
	podWaiting                 // ADD waiting for an address
	podRunning                 // has its address
	podStopped                 // gone
)

type pod struct {
	node    int32
	key     ipam.Key
	state   podState
	counted bool // a start inside the measured window (not an initial pod of a warm start)
	failed  bool // waited beyond --address-wait
	addAt   time.Duration
	addID   uint64 // its ADD in its node's machine
}

// pubSpec is a spec an agent wrote that the controller's informer has not delivered yet.
type pubSpec struct {
	gen    int64
	req    int
	rel    addr.Set
	cooled addr.Set
}

// node is one node: its agent's machine (the real agent.Machine, driven here with journal writes
// that land at once) and what the controller knows about it.
type node struct {
	name    string
	m       *agent.Machine
	adds    map[uint64]int32 // ADDs the machine has not answered, by request id
	pending []ipam.Pod       // bound pods with no address yet: the agent's demand before ADD
	waiters []int32          // pods whose ADD waits, oldest first
	running int
	held    int // addresses held, as the agent knows from the last status it saw

	// The agent's last published request; writing while its write is in flight, kicked when
	// something changed meanwhile.
	writing, kicked bool
	pubReq          int
	pubRel          addr.Set
	pubCooled       addr.Set
	pubGen          int64
	specQ           []pubSpec

	// alloc is the node's NodeIPAllocation as the API server stores it: the spec the agent
	// wrote last that reached the controller, the status the controller wrote last.
	alloc   *ipwardenv1.NodeIPAllocation
	statusQ []addr.Set // written holdings the agent has not seen yet

	raiseAt  time.Duration // when the agent asked for more than it holds; -1 when satisfied
	coolWake time.Duration // a scheduled evCooled (the machine's Wake); -1 when none
	wakeAt   time.Duration // a scheduled evAgentWake; -1 when none
}

// simulator is one run's world. Everything happens on one goroutine, in agenda order.
type simulator struct {
	cfg   Config
	rng   *rand.Rand
	now   time.Duration
	q     agenda
	err   error
	nodes []*node
	index map[string]int32
	pods  []pod
	trace map[[2]string]int32 // running trace pods by node and name

	// Controller: the real controller.Machine, driven on the virtual clock (drive).
	m          *controller.Machine
	metrics    *controller.Metrics
	inflight   map[uint64]controller.Op // operations the machine issued that have not landed
	limiter    *tokenBucket             // the controller's client rate limit
	wakeAt     time.Duration            // the machine's timer; -1 when none is pending
	rv         int64                    // the API server's resourceVersion counter
	poolObj    *ipwardenv1.IPPool       // the IPPool as the API server stores it
	poolStatus ipwardenv1.IPPoolStatus  // its status, last written
	agentPool  ipam.Pool
	// agentMetrics are the agents' machines' metrics (one registry-less set for every node).
	agentMetrics *agent.Metrics

	// Workload.
	arrivalMean float64 // seconds between pod starts on one node
	lifeMean    float64 // seconds a pod lives

	// Measurements, counted only once the warm start is done.
	counting                     bool
	started, initialRunning      int
	gotAddress                   int // counted pods that got an address with no wait
	waits                        []time.Duration
	failed, gaveUp               int
	agentWrites, nodeWrites      int64
	agentRaises, agentReleases   int64
	poolWrites                   int64
	fillLatency                  []time.Duration
	starvedFills                 int
	maxQueue                     int
	exhaustedAt, firstStarved    time.Duration
	firstFailed                  time.Duration
	flagSince                    time.Duration // when the exhausted flag was last set; -1 when clear
	exhaustedFor                 time.Duration
	series                       []Sample
	heldHist, usedHist, idleHist countHist
	spareHist                    countHist // held - demand (the agent's), per node and sample
	spareRestHist                countHist // the same for nodes at rest: no release delay running
	rangesHist                   countHist
}

// Run simulates cfg and returns its summary and time series.
func Run(cfg Config) (*Result, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := &simulator{
		cfg:          cfg,
		rng:          rand.New(rand.NewPCG(cfg.Seed, 0x1b873593)),
		index:        map[string]int32{},
		wakeAt:       -1,
		inflight:     map[uint64]controller.Op{},
		exhaustedAt:  -1,
		firstStarved: -1,
		firstFailed:  -1,
		flagSince:    -1,
		agentMetrics: agent.NewMetrics(nil),
	}
	if err := s.setup(); err != nil {
		return nil, err
	}
	for s.q.len() > 0 && s.q.peek() <= cfg.Duration && s.err == nil {
		ev := s.q.pop()
		s.now = ev.at
		s.handle(ev)
	}
	if s.err != nil {
		return nil, s.err
	}
	s.now = cfg.Duration
	if len(s.series) == 0 || s.series[len(s.series)-1].At != cfg.Duration {
		s.sample()
	}
	return &Result{Summary: s.summary(), Series: s.series}, nil
}

// t converts virtual time to the wall-clock-shaped time the real code takes.
func t(d time.Duration) time.Time { return epoch.Add(d) }

func (s *simulator) fail(err error) {
	if s.err == nil {
		s.err = fmt.Errorf("simulation stopped at %s: %w (this is a bug in ipwarden; please report it with the command line)", s.now, err)
	}
}

// setup builds the pool, the nodes, the controller and the initial agenda.
func (s *simulator) setup() error {
	cfg := s.cfg
	spec, err := cfg.PoolSpec()
	if err != nil {
		return err
	}
	s.poolObj = &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: poolName, UID: "pool-uid", Generation: 1, CreationTimestamp: metav1.NewTime(epoch)}, Spec: spec}
	parsed, err := ippool.Parse(spec)
	if err != nil {
		return err
	}
	s.agentPool = ipam.PoolOf(poolName, parsed, false)

	s.limiter = newTokenBucket(cfg.KubeAPIQPS, cfg.KubeAPIBurst)

	names := cfg.nodeNames()
	s.nodes = make([]*node, len(names))
	for i, name := range names {
		n := &node{name: name, m: agent.NewMachine(ipam.New(name), agent.MachineConfig{Node: name, AddressWait: cfg.AddressWait,
			Log: logr.Discard(), Metrics: s.agentMetrics}), adds: map[uint64]int32{}, raiseAt: -1, coolWake: -1, wakeAt: -1}
		n.alloc = &ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID("alloc-" + name),
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: name, UID: nodeUID(name)}}}}
		s.nodes[i] = n
		n.m.SetPools([]ipam.Pool{s.agentPool}, []string{poolName}, t(0))
		s.settle(int32(i))
		s.index[name] = int32(i)
	}
	if cfg.Trace == nil && cfg.Churn > 0 {
		s.arrivalMean = 60 / cfg.Churn
		s.lifeMean = cfg.PodsPerNode * s.arrivalMean
	}

	s.warmStart(cfg.Start == StartWarm)
	if err := s.startController(); err != nil {
		return err
	}
	s.counting = true
	if cfg.Start == StartCold {
		for i := range s.nodes {
			for range s.initialPods() {
				s.schedulePod(int32(i), 0, s.lifetime())
			}
		}
	}
	// Every agent publishes what it needs as it starts (a warm agent finds nothing to change),
	// and the pool's exhausted flag as the warm start left it reaches the agents.
	for i := range s.nodes {
		s.recompute(int32(i))
	}
	if s.poolStatus.Exhausted {
		s.setFlag(true)
		s.q.push(0, evPoolFlag, 0, 1)
	}

	if cfg.Trace != nil {
		s.trace = map[[2]string]int32{}
		s.q.push(cfg.Trace.Events[0].At, evTraceNext, 0, 0)
	} else if s.arrivalMean > 0 {
		for i := range s.nodes {
			s.q.push(s.exp(s.arrivalMean), evArrival, int32(i), 0)
		}
	}
	for range cfg.Burst {
		s.schedulePod(0, cfg.BurstAt, -1)
	}
	for i := range s.nodes {
		s.q.push(time.Duration(s.rng.Float64()*float64(cfg.AgentResync)), evAgentResync, int32(i), 0)
	}
	s.drive()
	for at := time.Duration(0); at <= cfg.Duration; at += cfg.SampleInterval {
		s.q.push(at, evSample, 0, 0)
	}
	return nil
}

// nodeNames are the trace's nodes or node-00000, node-00001, ...
func (c Config) nodeNames() []string {
	if c.Trace != nil {
		return c.Trace.Nodes
	}
	out := make([]string, c.Nodes)
	for i := range out {
		out[i] = fmt.Sprintf("node-%05d", i)
	}
	return out
}

// warmStart puts every node in the state a long-running cluster would have (warm; otherwise
// none runs yet), with the statuses the controller wrote: each node's initial pods running on
// addresses filled by the controller's own State, instantly and uncounted. The controller then
// starts leading from those objects, as a new leader does from a LIST.
func (s *simulator) warmStart(warm bool) {
	now := t(0)
	st := controller.NewState(controller.DefaultExhaustionMarks)
	st.SetPool(s.poolObj)
	for i, n := range s.nodes {
		id := int32(i)
		var initial []int32
		if warm {
			for range s.initialPods() {
				pid := s.newPod(id)
				s.bind(pid)
				initial = append(initial, pid)
			}
			s.recompute(id)
			n.alloc.Spec, n.alloc.Generation = specOf(n.pubReq, n.pubRel, n.pubCooled), n.pubGen
		}
		f := st.PlanFill(n.name, n.alloc.Spec, now)
		n.alloc.Status = controller.NodeStatus(n.alloc.Status, n.alloc.Spec, n.alloc.Generation, f)
		st.Commit(f, now)
		s.rv++
		n.alloc.ResourceVersion = strconv.FormatInt(s.rv, 10)
		if !warm {
			continue
		}
		held := heldOf(f)
		n.m.SetHoldings(map[string]addr.Set{poolName: held}, agent.RecordOf{}, now)
		n.held = count(held)
		for _, pid := range initial {
			s.podAdd(pid)
		}
		s.settle(id)
		s.initialRunning += n.running
		n.raiseAt = -1
		for _, pid := range initial {
			if s.pods[pid].state == podRunning {
				if life := s.lifetime(); life >= 0 {
					s.q.push(life, evPodStop, pid, 0)
				}
			}
		}
		// Pods the pool could not place start waiting at time 0, like any other start.
		for _, pid := range n.waiters {
			p := &s.pods[pid]
			p.counted = true
			s.started++
			if life := s.lifetime(); life >= 0 {
				s.q.push(life, evPodStop, pid, 0)
			}
		}
	}
	s.poolStatus, _ = st.PoolStatus(poolName, ipwardenv1.IPPoolStatus{}, 1, now)
	s.poolObj.Status = s.poolStatus
}

// startController makes the controller's machine lead from the cluster's objects and hands it
// the informers' first lists.
func (s *simulator) startController() error {
	cfg := s.cfg
	resync := cfg.ControllerResync
	if resync <= 0 {
		resync = 2*cfg.Duration + time.Hour // never within the run
	}
	s.metrics = controller.NewMetrics(nil)
	s.m = controller.NewMachine(controller.Options{
		Workers:            cfg.ControllerWorkers,
		MinSyncInterval:    cfg.MinSyncInterval,
		ResyncPeriod:       resync,
		PoolStatusInterval: cfg.PoolStatusInterval,
		AuditPeriod:        2*cfg.Duration + time.Hour, // the simulated API server loses nothing to audit
		ClaimSettle:        -1,                         // no leader election: no agent acknowledges
		PoolSettle:         -1,                         // the pool exists before the nodes
	}, s.metrics, logr.Discard())
	if cfg.onMachine != nil {
		cfg.onMachine(s.m)
	}
	allocs := make([]ipwardenv1.NodeIPAllocation, len(s.nodes))
	for i, n := range s.nodes {
		allocs[i] = *n.alloc
	}
	now := t(0)
	if err := s.m.Lead([]ipwardenv1.IPPool{*s.poolObj}, allocs, nil, now); err != nil {
		return err
	}
	s.m.PoolChanged(s.poolObj, now)
	for _, n := range s.nodes {
		s.m.NodeChanged(&metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Name: n.name, UID: nodeUID(n.name)}}, now)
		s.m.AllocChanged(n.alloc, now)
	}
	return nil
}

func nodeUID(name string) types.UID { return types.UID("node-" + name) }

// initialPods is the number of pods a node runs at time 0: Poisson with mean PodsPerNode, the
// stationary count of Poisson arrivals with exponential lifetimes.
func (s *simulator) initialPods() int {
	if s.cfg.Trace != nil {
		return 0
	}
	return poisson(s.rng, s.cfg.PodsPerNode)
}

// lifetime draws a synthetic pod's lifetime; -1 means it runs to the end.
func (s *simulator) lifetime() time.Duration {
	if s.lifeMean <= 0 {
		return -1
	}
	return s.exp(s.lifeMean)
}

// exp draws an exponential duration with the given mean in seconds.
func (s *simulator) exp(meanSeconds float64) time.Duration {
	return time.Duration(s.rng.ExpFloat64() * meanSeconds * 1e9)
}

// poisson draws a Poisson variate: Knuth's method for small means, a rounded normal otherwise.
func poisson(r *rand.Rand, mean float64) int {
	if mean <= 0 {
		return 0
	}
	if mean > 30 {
		return max(int(math.Round(mean+r.NormFloat64()*math.Sqrt(mean))), 0)
	}
	l, k, p := math.Exp(-mean), 0, 1.0
	for {
		p *= r.Float64()
		if p <= l {
			return k
		}
		k++
	}
}

// newPod creates a pod of node i.
func (s *simulator) newPod(i int32) int32 {
	id := int32(len(s.pods))
	name := "p" + strconv.Itoa(int(id))
	s.pods = append(s.pods, pod{node: i, key: ipam.Key{ContainerID: name, IfName: ifName}})
	return id
}

// schedulePod creates a pod of node i that is bound at 'at' and stops life later (never when
// life < 0).
func (s *simulator) schedulePod(i int32, at, life time.Duration) int32 {
	pid := s.newPod(i)
	s.q.push(at, evPodBind, pid, 0)
	if life >= 0 {
		s.q.push(at+life, evPodStop, pid, 0)
	}
	return pid
}

func (s *simulator) handle(ev event) {
	switch ev.kind {
	case evSample:
		s.sample()
	case evArrival:
		s.schedulePod(ev.a, s.now, s.lifetime())
		s.q.push(s.now+s.exp(s.arrivalMean), evArrival, ev.a, 0)
	case evTraceNext:
		s.traceEvent(int(ev.b))
	case evPodBind:
		p := &s.pods[ev.a]
		if p.state != podNew {
			return
		}
		p.counted = s.counting
		s.started++
		s.bind(ev.a)
		s.recompute(p.node)
		s.q.push(s.now+s.cfg.AddDelay, evPodAdd, ev.a, 0)
	case evPodAdd:
		s.podAdd(ev.a)
	case evPodStop:
		s.podStop(ev.a)
	case evCooled:
		n := s.nodes[ev.a]
		if n.coolWake == s.now {
			n.coolWake = -1
		}
		n.m.Tick(t(s.now))
		s.settle(ev.a)
	case evAgentWake:
		n := s.nodes[ev.a]
		if n.wakeAt == s.now {
			n.wakeAt = -1
		}
		s.recompute(ev.a)
	case evAgentResync:
		s.recompute(ev.a)
		s.q.push(s.now+s.cfg.AgentResync, evAgentResync, ev.a, 0)
	case evAgentWritten:
		n := s.nodes[ev.a]
		n.writing = false
		s.q.push(s.now+s.cfg.WatchDelay, evSpecArrive, ev.a, 0)
		if n.kicked {
			n.kicked = false
			s.recompute(ev.a)
		}
	case evSpecArrive:
		s.specArrive(ev.a)
	case evOpDone:
		s.opDone(uint64(ev.b))
	case evStatusArrive:
		s.statusArrive(ev.a)
	case evPoolFlag:
		s.agentPool.Exhausted = ev.b == 1
		for i, n := range s.nodes {
			n.m.SetPools([]ipam.Pool{s.agentPool}, []string{poolName}, t(s.now))
			s.settle(int32(i))
			s.recompute(int32(i))
		}
	case evMachineWake:
		if s.wakeAt == s.now {
			s.wakeAt = -1
		}
		s.drive()
	}
}

// traceEvent plays trace event k and schedules the next one.
func (s *simulator) traceEvent(k int) {
	evs := s.cfg.Trace.Events
	ev := evs[k]
	i := s.index[ev.Node]
	key := [2]string{ev.Node, ev.Pod}
	if ev.Stop {
		if pid, ok := s.trace[key]; ok {
			delete(s.trace, key)
			s.podStop(pid)
		}
	} else {
		pid := s.newPod(i)
		s.trace[key] = pid
		s.handle(event{at: s.now, kind: evPodBind, a: pid})
	}
	if k+1 < len(evs) {
		s.q.push(evs[k+1].At, evTraceNext, 0, int64(k+1))
	}
}

// --- agent -----------------------------------------------------------------------------------
//
// Each node's agent is the real agent.Machine: the simulator is its driver, as agent.Service is
// on a node. Its journal writes land at once (a millisecond is nothing on this clock); its
// answers start or fail the pods' ADDs. The order of ADDs, their waits and deadlines, and what a
// DEL frees are the machine's.

// bind makes a pod bound to its node: the agent's pod watch sees it and counts it as demand.
func (s *simulator) bind(pid int32) {
	p := &s.pods[pid]
	n := s.nodes[p.node]
	p.state = podBound
	n.pending = append(n.pending, ipam.Pod{Ref: ipam.PodRef{UID: p.key.ContainerID}})
	n.m.SetPods(n.pending, t(s.now))
}

// unbind drops a pod from the agent's list of pods waiting for an address.
func (s *simulator) unbind(pid int32) {
	p := &s.pods[pid]
	n := s.nodes[p.node]
	uid := p.key.ContainerID
	if i := slices.IndexFunc(n.pending, func(x ipam.Pod) bool { return x.Ref.UID == uid }); i >= 0 {
		n.pending = slices.Delete(n.pending, i, i+1)
		n.m.SetPods(n.pending, t(s.now))
	}
}

// request is the CNI request of pod p.
func request(op cniproto.Op, p *pod) cniproto.Request {
	return cniproto.Request{Op: op, ContainerID: p.key.ContainerID, IfName: p.key.IfName, Network: network,
		Pod: cniproto.Pod{UID: p.key.ContainerID}}
}

// podAdd is a pod's CNI ADD, handed to its node's machine: answered at once, or waiting there.
func (s *simulator) podAdd(pid int32) {
	p := &s.pods[pid]
	if p.state != podBound {
		return
	}
	n := s.nodes[p.node]
	p.addAt = s.now
	p.state = podWaiting
	n.waiters = append(n.waiters, pid)
	s.sendAdd(pid)
	if s.counting {
		s.recompute(p.node) // the agent's round after an ADD
	}
}

// sendAdd hands pod pid's ADD to its node's machine and carries out what follows.
func (s *simulator) sendAdd(pid int32) {
	p := &s.pods[pid]
	n := s.nodes[p.node]
	id := n.m.Request(request(cniproto.OpAdd, p), t(s.now))
	n.adds[id] = pid
	p.addID = id
	s.settle(p.node)
}

// settle carries out node i's machine's Ready until it wants nothing more: writes land at once,
// answers start pods or fail their ADDs (the runtime sends the ADD again at once), and its wake
// is scheduled.
func (s *simulator) settle(i int32) {
	n := s.nodes[i]
	for {
		rd := n.m.Ready()
		n.m.Advance()
		if len(rd.Writes) == 0 && len(rd.Answers) == 0 {
			s.wakeNode(i, rd.Wake)
			return
		}
		for _, w := range rd.Writes {
			n.m.Written(w.ID, nil, t(s.now))
		}
		for _, a := range rd.Answers {
			pid, ok := n.adds[a.ID]
			if !ok {
				continue // a DEL's or a fact's answer
			}
			delete(n.adds, a.ID)
			if a.Resp == nil || a.Resp.Error != nil {
				s.addFailed(pid, a)
				continue
			}
			s.addAnswered(pid)
		}
	}
}

// wakeNode schedules node i's machine's Tick at wake.
func (s *simulator) wakeNode(i int32, wake time.Time) {
	if wake.IsZero() {
		return
	}
	n := s.nodes[i]
	if d := max(wake.Sub(epoch), s.now); n.coolWake < 0 || d < n.coolWake {
		n.coolWake = d
		s.q.push(d, evCooled, i, 0)
	}
}

// addAnswered is pod pid's ADD answered with an address.
func (s *simulator) addAnswered(pid int32) {
	p := &s.pods[pid]
	n := s.nodes[p.node]
	if i := slices.Index(n.waiters, pid); i >= 0 {
		n.waiters = slices.Delete(n.waiters, i, i+1)
	}
	p.state = podRunning
	n.running++
	s.unbind(pid)
	if p.counted {
		if w := s.now - p.addAt; w > 0 {
			s.waits = append(s.waits, w)
		} else {
			s.gotAddress++
		}
	}
}

// addFailed is pod pid's ADD answered with an error: past --address-wait the runtime reports the
// pod's start failed once and sends the ADD again; a pod that stopped meanwhile is done.
func (s *simulator) addFailed(pid int32, a agent.Answer) {
	p := &s.pods[pid]
	if p.state != podWaiting {
		return
	}
	if a.Resp == nil || a.Resp.Error == nil || a.Resp.Error.Code != cniproto.CodeTryAgainLater {
		s.fail(fmt.Errorf("ADD of %s on %s: %+v", p.key, s.nodes[p.node].name, a.Resp))
		return
	}
	if !p.failed {
		p.failed = true
		s.failed++
		if s.firstFailed < 0 {
			s.firstFailed = s.now
		}
	}
	n := s.nodes[p.node]
	id := n.m.Request(request(cniproto.OpAdd, p), t(s.now))
	n.adds[id] = pid
	p.addID = id
}

// podStop is a pod's end: DEL if it has an address, else its ADD is canceled.
func (s *simulator) podStop(pid int32) {
	p := &s.pods[pid]
	n := s.nodes[p.node]
	switch p.state {
	case podRunning:
		n.m.Request(request(cniproto.OpDel, p), t(s.now))
		n.running--
	case podWaiting:
		p.state = podStopped
		n.m.Cancel(p.addID, t(s.now))
		if i := slices.Index(n.waiters, pid); i >= 0 {
			n.waiters = slices.Delete(n.waiters, i, i+1)
		}
		s.unbind(pid)
		if p.counted {
			s.gaveUp++
		}
	case podBound:
		s.unbind(pid)
	default:
		p.state = podStopped
		return
	}
	p.state = podStopped
	s.settle(p.node)
	s.recompute(p.node)
}

// recompute is the agent's pool monitor: a release round of the machine (mark free addresses
// beyond the target releasing), then publish the request if it changed (one spec write).
func (s *simulator) recompute(i int32) {
	n := s.nodes[i]
	if n.writing {
		// The monitor is busy writing the last request; kicks coalesce into one more round.
		n.kicked = true
		return
	}
	now := t(s.now)
	id := n.m.ReleaseRound(now, false)
	var round *agent.Round
	for round == nil {
		rd := n.m.Ready()
		n.m.Advance()
		for _, w := range rd.Writes {
			n.m.Written(w.ID, nil, now)
		}
		for _, a := range rd.Answers {
			if a.ID == id {
				round = a.Round
			}
		}
		if len(rd.Writes) == 0 && round == nil {
			s.fail(fmt.Errorf("the release round of %s was not answered", n.name))
			return
		}
	}
	s.settle(i)
	// The monitor's timer: a round when a release delay ends or a counted cooling address
	// cools (the target may drop then with no other event).
	if wake := earliest(round.NextRelease, round.NextCooled); !wake.IsZero() {
		if d := wake.Sub(epoch); n.wakeAt < 0 || d < n.wakeAt {
			n.wakeAt = d
			s.q.push(d, evAgentWake, i, 0)
		}
	}
	req, rel, cooled := 0, addr.Set{}, addr.Set{}
	desired := round.Spec
	for _, r := range desired {
		if r.Pool == poolName {
			req, rel, cooled = r.Requested, r.Releasing, r.ReleasingCooled
		}
	}
	published := []ipam.PoolRequest{{Pool: poolName, Requested: n.pubReq, Releasing: n.pubRel, ReleasingCooled: n.pubCooled}}
	if n.pubGen > 0 && !ipam.SpecWorthWriting(published, desired) {
		return
	}
	raise := req > n.pubReq || n.pubGen == 0
	release := !n.pubRel.ContainsSet(rel)
	n.pubReq, n.pubRel, n.pubCooled = req, rel, cooled
	n.pubGen++
	if !s.counting {
		return // the warm start hands the spec to the controller itself
	}
	s.agentWrites++
	switch {
	case raise:
		s.agentRaises++
	case release:
		s.agentReleases++
	}
	n.specQ = append(n.specQ, pubSpec{gen: n.pubGen, req: req, rel: rel, cooled: cooled})
	n.writing = true
	s.q.push(s.now+s.cfg.AgentLatency, evAgentWritten, i, 0)
	held, _ := n.m.Holding(poolName)
	if avail := count(held.Subtract(rel)); req > avail {
		if n.raiseAt < 0 {
			n.raiseAt = s.now
		}
	} else {
		n.raiseAt = -1
	}
}

// statusArrive: the agent sees a status the controller wrote.
func (s *simulator) statusArrive(i int32) {
	n := s.nodes[i]
	held := n.statusQ[0]
	n.statusQ = n.statusQ[1:]
	n.m.SetHoldings(map[string]addr.Set{poolName: held}, agent.RecordOf{}, t(s.now))
	n.held = count(held)
	s.settle(i)
	s.recompute(i)
	if n.raiseAt >= 0 && count(held.Subtract(n.pubRel)) >= n.pubReq {
		if s.counting {
			s.fillLatency = append(s.fillLatency, s.now-n.raiseAt)
		}
		n.raiseAt = -1
	}
}

// --- controller ------------------------------------------------------------------------------

// earliest returns the earlier of two times, ignoring zero ones.
func earliest(a, b time.Time) time.Time {
	if a.IsZero() || (!b.IsZero() && b.Before(a)) {
		return b
	}
	return a
}

// specOf is the NodeIPAllocation spec of a published request.
func specOf(req int, rel, cooled addr.Set) ipwardenv1.NodeIPAllocationSpec {
	r := ipwardenv1.NodePoolRequest{Pool: poolName, Requested: int32(req)}
	for _, b := range rel.Strings() {
		r.Releasing = append(r.Releasing, ipwardenv1.AddressBlock(b))
	}
	for _, b := range cooled.Strings() {
		r.ReleasingCooled = append(r.ReleasingCooled, ipwardenv1.AddressBlock(b))
	}
	return ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{r}}
}

// heldOf is a fill's holding of the pool after the write.
func heldOf(f *controller.Fill) addr.Set {
	if pf, ok := f.Pools[poolName]; ok {
		return pf.Held
	}
	return addr.Set{}
}

// heldIn is a status's holding of the pool.
func heldIn(st ipwardenv1.NodeIPAllocationStatus) addr.Set {
	for _, p := range st.Pools {
		if p.Pool == poolName {
			set, _ := addr.ParseSet(p.Addresses)
			return set
		}
	}
	return addr.Set{}
}

func count(s addr.Set) int {
	n, _ := s.Size().Uint64()
	return int(n)
}

func (s *simulator) version() string {
	s.rv++
	return strconv.FormatInt(s.rv, 10)
}

// specArrive: the controller's informer delivers a node's spec (a new generation).
func (s *simulator) specArrive(i int32) {
	n := s.nodes[i]
	ps := n.specQ[0]
	n.specQ = n.specQ[1:]
	a := *n.alloc // the status objects are shared, never changed
	a.Spec, a.Generation, a.ResourceVersion = specOf(ps.req, ps.rel, ps.cooled), ps.gen, s.version()
	n.alloc = &a
	s.m.AllocChanged(n.alloc, t(s.now))
	s.drive()
}

// drive is the simulator's driver of the controller's machine, as Controller.run is on the API
// server: the clock in, Ready out, each operation performed on the virtual clock and its
// outcome fed back when it lands (opDone).
func (s *simulator) drive() {
	now := t(s.now)
	s.m.Tick(now)
	rd := s.m.Ready(now)
	s.m.Advance()
	for _, e := range rd.Events {
		if _, ok := e.Object.(*ipwardenv1.NodeIPAllocation); ok && e.Reason == "PoolExhausted" && s.counting {
			s.starvedFills++ // a committed fill left its node short
			if s.firstStarved < 0 {
				s.firstStarved = s.now
			}
		}
	}
	for _, op := range rd.Ops {
		s.perform(op)
	}
	if q := s.m.Scheduler().Len(); q > s.maxQueue && s.counting {
		s.maxQueue = q
	}
	if !rd.Wake.IsZero() {
		d := max(rd.Wake.Sub(epoch), s.now)
		if s.wakeAt < 0 || d < s.wakeAt {
			s.wakeAt = d
			s.q.push(d, evMachineWake, 0, 0)
		}
	}
}

// perform starts an operation: a write waits for the client's rate limit, then takes the write
// latency. The simulated API server stores every write (no conflict, no failure).
func (s *simulator) perform(op controller.Op) {
	switch op.Kind {
	case controller.OpNodeStatus, controller.OpPoolStatus:
	default:
		s.fail(fmt.Errorf("the controller asked for %v of %s, which the simulated cluster never needs", op.Kind, op.Node+op.PoolName))
		return
	}
	s.inflight[op.ID] = op
	s.q.push(max(s.limiter.take(s.now), s.now)+s.cfg.ControllerLatency, evOpDone, 0, int64(op.ID))
}

// opDone: an operation landed. The API server stores it and answers; the node's agent sees a
// status after the watch delay, the agents see a new exhausted flag after it too.
func (s *simulator) opDone(id uint64) {
	op := s.inflight[id]
	delete(s.inflight, id)
	r := controller.OpResult{ID: id}
	switch op.Kind {
	case controller.OpNodeStatus:
		i := s.index[op.Node]
		n := s.nodes[i]
		a := op.Alloc
		a.ResourceVersion = s.version()
		n.alloc = a
		r.Alloc = a
		if s.counting {
			s.nodeWrites++
		}
		n.statusQ = append(n.statusQ, heldIn(a.Status))
		s.q.push(s.now+s.cfg.WatchDelay, evStatusArrive, i, 0)
	case controller.OpPoolStatus:
		p := op.Pool
		p.ResourceVersion = s.version()
		was := s.poolStatus.Exhausted
		s.poolObj, s.poolStatus = p, p.Status
		r.Pool = p
		if s.counting {
			s.poolWrites++
		}
		if p.Status.Exhausted != was {
			s.setFlag(p.Status.Exhausted)
			b := int64(0)
			if p.Status.Exhausted {
				b = 1
			}
			s.q.push(s.now+s.cfg.WatchDelay, evPoolFlag, 0, b)
		}
	}
	s.m.Done(r, t(s.now))
	s.drive()
}

// syncs is the number of node syncs the machine ran (its sync duration histogram's count).
func (s *simulator) syncs() int {
	var m dto.Metric
	h, ok := s.metrics.SyncDuration.WithLabelValues("node").(prometheus.Histogram)
	if !ok || h.Write(&m) != nil {
		return 0
	}
	return int(m.GetHistogram().GetSampleCount())
}

// setFlag records the exhausted flag's changes for the summary.
func (s *simulator) setFlag(on bool) {
	if on {
		if s.exhaustedAt < 0 {
			s.exhaustedAt = s.now
		}
		if s.flagSince < 0 {
			s.flagSince = s.now
		}
		return
	}
	if s.flagSince >= 0 {
		s.exhaustedFor += s.now - s.flagSince
		s.flagSince = -1
	}
}

// --- measurement -----------------------------------------------------------------------------

// sample appends a row to the time series and adds every node to the per-node histograms.
func (s *simulator) sample() {
	smp := Sample{
		At:               s.now,
		Capacity:         s.poolStatus.Capacity,
		FailedTotal:      s.failed,
		Queue:            s.m.Scheduler().Len(),
		AgentWrites:      s.agentWrites,
		NodeStatusWrites: s.nodeWrites,
		PoolStatusWrites: s.poolWrites,
	}
	smp.Allocated, smp.Cooling = s.m.State().PoolUsage(poolName, t(s.now))
	smp.Exhausted = s.poolStatus.Exhausted
	for _, n := range s.nodes {
		smp.Held += int64(n.held)
		smp.InUse += int64(n.running)
		smp.Running += n.running
		smp.Waiting += len(n.waiters)
		s.heldHist.add(n.held)
		s.usedHist.add(n.running)
		s.idleHist.add(n.held - n.running)
		releasing, demand, resting := n.m.PoolUse(poolName)
		spare := n.held - releasing - demand
		s.spareHist.add(spare)
		if resting {
			s.spareRestHist.add(spare)
		}
		h, _ := n.m.Holding(poolName)
		s.rangesHist.add(h.NumRanges())
	}
	s.series = append(s.series, smp)
}

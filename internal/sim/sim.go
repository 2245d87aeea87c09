package sim

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"time"

	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
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
}

// pubSpec is a spec an agent wrote that the controller's informer has not delivered yet.
type pubSpec struct {
	gen int64
	req int
	rel addr.Set
}

// node is one node: its agent's ipam State and what the controller knows about it.
type node struct {
	name    string
	st      *ipam.State
	pending []ipam.Pod // bound pods with no address yet: the agent's demand before ADD
	waiters []int32    // pods whose ADD waits, oldest first
	running int
	held    int // addresses held, as the agent knows from the last status it saw

	// The agent's last published request; writing while its write is in flight, kicked when
	// something changed meanwhile.
	writing, kicked bool
	pubReq          int
	pubRel          addr.Set
	pubGen          int64
	specQ           []pubSpec

	// The controller's view: the spec its informer delivered, the status it last wrote.
	spec    ipwardenv1.NodeIPAllocationSpec
	specGen int64
	status  ipwardenv1.NodeIPAllocationStatus
	ctlHeld int
	statusQ []addr.Set // written holdings the agent has not seen yet

	raiseAt  time.Duration // when the agent asked for more than it holds; -1 when satisfied
	coolWake time.Duration // a scheduled evCooled; -1 when none
}

// job is a controller worker's status write in flight.
type job struct {
	node   int32
	seq    *controller.Sequence // the controller's step machine; its node status write is in flight
	fill   *controller.Fill
	status ipwardenv1.NodeIPAllocationStatus
	at     time.Time
	added  int64 // addresses the fill reserved
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

	// Controller.
	ctl         *controller.State
	sched       *controller.Scheduler
	jobs        []job
	idle        []int
	limiter     *tokenBucket // the controller's client rate limit
	schedWakeAt time.Duration
	poolObj     ipwardenv1.IPPool
	poolStatus  ipwardenv1.IPPoolStatus // the last status PoolStatus computed that was written
	pm          poolModel
	poolWaiting bool // the pool loop is in its coalescing wait
	poolWakeDue bool // a wake-up arrived during the wait
	poolTickDue bool // a tick arrived during the wait
	agentPool   ipam.Pool

	// Workload.
	arrivalMean float64 // seconds between pod starts on one node
	lifeMean    float64 // seconds a pod lives

	// Measurements, counted only once the warm start is done.
	counting                       bool
	started, initialRunning        int
	gotAddress                     int // counted pods that got an address with no wait
	waits                          []time.Duration
	failed, gaveUp                 int
	agentWrites, nodeWrites        int64
	agentRaises, agentReleases     int64
	poolWrites                     int64
	fillLatency                    []time.Duration
	syncs, noopSyncs, starvedFills int
	maxQueue                       int
	exhaustedAt, firstStarved      time.Duration
	firstFailed                    time.Duration
	flagSince                      time.Duration // when the exhausted flag was last set; -1 when clear
	exhaustedFor                   time.Duration
	series                         []Sample
	heldHist, usedHist, idleHist   countHist
	rangesHist                     countHist
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
		schedWakeAt:  -1,
		exhaustedAt:  -1,
		firstStarved: -1,
		firstFailed:  -1,
		flagSince:    -1,
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
	s.poolObj = ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: poolName, Generation: 1, CreationTimestamp: metav1.NewTime(epoch)}, Spec: spec}
	s.ctl = controller.NewState(controller.DefaultExhaustionMarks)
	s.ctl.SetPool(&s.poolObj)
	s.poolStatus, _ = s.ctl.PoolStatus(poolName, ipwardenv1.IPPoolStatus{}, 1, t(0))
	parsed, err := ippool.Parse(spec)
	if err != nil {
		return err
	}
	s.agentPool = ipam.PoolOf(poolName, parsed, false)

	s.sched = controller.NewScheduler(cfg.MinSyncInterval, 250*time.Millisecond, 2*time.Minute)
	s.limiter = newTokenBucket(cfg.KubeAPIQPS, cfg.KubeAPIBurst)
	s.jobs = make([]job, cfg.ControllerWorkers)
	for w := cfg.ControllerWorkers - 1; w >= 0; w-- {
		s.idle = append(s.idle, w)
	}

	names := cfg.nodeNames()
	s.nodes = make([]*node, len(names))
	for i, name := range names {
		n := &node{name: name, st: ipam.New(name), raiseAt: -1, coolWake: -1}
		n.st.SetPools([]ipam.Pool{s.agentPool}, []string{poolName})
		s.nodes[i] = n
		s.index[name] = int32(i)
	}
	if cfg.Trace == nil && cfg.Churn > 0 {
		s.arrivalMean = 60 / cfg.Churn
		s.lifeMean = cfg.PodsPerNode * s.arrivalMean
	}

	if cfg.Start == StartWarm {
		s.warmStart()
	}
	s.pm.capacity = s.poolStatus.Capacity
	s.pm.last = s.pm.print(s.poolStatus.Exhausted)
	if s.pm.last.allocated != s.poolStatus.Allocated || s.pm.last.nodes != int64(s.poolStatus.Nodes) {
		return fmt.Errorf("internal error: the pool model counts %d allocated on %d nodes, PoolStatus %d on %d",
			s.pm.last.allocated, s.pm.last.nodes, s.poolStatus.Allocated, s.poolStatus.Nodes)
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
	if s.pm.last.exhausted {
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
	s.q.push(cfg.PoolStatusInterval, evPoolTick, 0, 0)
	if cfg.ControllerResync > 0 {
		s.q.push(cfg.ControllerResync, evResync, 0, 0)
	}
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

// warmStart puts every node in the state a long-running cluster would have: its initial pods
// running on addresses the controller filled. It drives the same code as the run, instantly
// and uncounted.
func (s *simulator) warmStart() {
	now := t(0)
	for i, n := range s.nodes {
		id := int32(i)
		var initial []int32
		for range s.initialPods() {
			pid := s.newPod(id)
			s.bind(pid)
			initial = append(initial, pid)
		}
		s.recompute(id)
		n.spec, n.specGen = specOf(n.pubReq, n.pubRel), n.pubGen
		f := s.ctl.PlanFill(n.name, n.spec, now)
		n.status = controller.NodeStatus(n.status, n.spec, n.specGen, f)
		s.ctl.Commit(f, now)
		held := heldOf(f)
		s.setCtlHeld(n, count(held))
		n.st.SetHolding(poolName, held)
		n.held = count(held)
		for _, pid := range initial {
			s.pods[pid].state = podWaiting
			n.waiters = append(n.waiters, pid)
		}
		s.retryWaiters(id)
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
			n.st.AddWaiter(p.key, p.key.ContainerID, nil)
			s.q.push(s.cfg.AddressWait, evAddDeadline, pid, 0)
			if life := s.lifetime(); life >= 0 {
				s.q.push(life, evPodStop, pid, 0)
			}
		}
	}
	if st, ok := s.ctl.PoolStatus(poolName, s.poolStatus, 1, now); ok {
		s.poolStatus = st
	}
}

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
	case evAddDeadline:
		p := &s.pods[ev.a]
		if p.state == podWaiting && !p.failed {
			p.failed = true
			s.failed++
			if s.firstFailed < 0 {
				s.firstFailed = s.now
			}
		}
	case evCooled:
		n := s.nodes[ev.a]
		if n.coolWake == s.now {
			n.coolWake = -1
		}
		s.retryWaiters(ev.a)
	case evAgentResync:
		s.recompute(ev.a)
		s.retryWaiters(ev.a)
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
	case evWriteDone:
		s.writeDone(int(ev.a))
	case evStatusArrive:
		s.statusArrive(ev.a)
	case evPoolFlag:
		s.agentPool.Exhausted = ev.b == 1
		for i, n := range s.nodes {
			n.st.SetPools([]ipam.Pool{s.agentPool}, []string{poolName})
			s.recompute(int32(i))
		}
	case evPoolTick:
		s.q.push(s.now+s.cfg.PoolStatusInterval, evPoolTick, 0, 0)
		if s.poolWaiting {
			s.poolTickDue = true
			return
		}
		s.poolPass()
	case evPoolWake:
		s.poolWaiting = false
		s.poolPass()
		if s.poolTickDue {
			s.poolTickDue = false
			s.poolPass()
		}
		if s.poolWakeDue {
			s.poolWakeDue = false
			s.wakePools()
		}
	case evSchedWake:
		if s.schedWakeAt == s.now {
			s.schedWakeAt = -1
		}
		s.dispatch()
	case evResync:
		s.q.push(s.now+s.cfg.ControllerResync, evResync, 0, 0)
		for i := range s.nodes {
			s.enqueue(int32(i))
		}
		for _, p := range s.ctl.PoolNames() {
			s.ctl.MarkPoolDirty(p)
		}
		s.pm.dirty = true
		s.wakePools()
		s.dispatch()
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

// bind makes a pod bound to its node: the agent's pod watch sees it and counts it as demand.
func (s *simulator) bind(pid int32) {
	p := &s.pods[pid]
	n := s.nodes[p.node]
	p.state = podBound
	n.pending = append(n.pending, ipam.Pod{Ref: ipam.PodRef{UID: p.key.ContainerID}})
	n.st.SetPods(n.pending)
}

// unbind drops a pod from the agent's list of pods waiting for an address.
func (s *simulator) unbind(pid int32) {
	p := &s.pods[pid]
	n := s.nodes[p.node]
	uid := p.key.ContainerID
	if i := slices.IndexFunc(n.pending, func(x ipam.Pod) bool { return x.Ref.UID == uid }); i >= 0 {
		n.pending = slices.Delete(n.pending, i, i+1)
		n.st.SetPods(n.pending)
	}
}

// podAdd is a pod's CNI ADD: it queues behind any ADD already waiting on the node.
func (s *simulator) podAdd(pid int32) {
	p := &s.pods[pid]
	if p.state != podBound {
		return
	}
	n := s.nodes[p.node]
	p.addAt = s.now
	p.state = podWaiting
	n.waiters = append(n.waiters, pid)
	s.retryWaiters(p.node)
	if p.state == podWaiting {
		n.st.AddWaiter(p.key, p.key.ContainerID, nil)
		s.q.push(s.now+s.cfg.AddressWait, evAddDeadline, pid, 0)
	}
	s.recompute(p.node) // the agent's round after an ADD
}

// retryWaiters hands addresses to the node's waiting ADDs, oldest first, as long as the agent
// has one; then it wakes the node when its next cooling address becomes usable.
func (s *simulator) retryWaiters(i int32) {
	n := s.nodes[i]
	now := t(s.now)
	for len(n.waiters) > 0 {
		pid := n.waiters[0]
		p := &s.pods[pid]
		_, _, err := n.st.Add(ipam.AddRequest{Key: p.key, Network: network, Pod: ipam.PodRef{UID: p.key.ContainerID}}, now)
		if err != nil {
			if _, short := errors.AsType[*ipam.ShortError](err); !short {
				s.fail(fmt.Errorf("ADD of %s on %s: %w", p.key, n.name, err))
			}
			break
		}
		n.st.ConfirmAdd(p.key)
		n.waiters = n.waiters[1:]
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
	if len(n.waiters) > 0 {
		if next := n.st.NextCooled(now); !next.IsZero() {
			d := next.Sub(epoch)
			if n.coolWake < 0 || d < n.coolWake {
				n.coolWake = d
				s.q.push(d, evCooled, i, 0)
			}
		}
	}
}

// podStop is a pod's end: DEL if it has an address, else it stops waiting.
func (s *simulator) podStop(pid int32) {
	p := &s.pods[pid]
	n := s.nodes[p.node]
	switch p.state {
	case podRunning:
		plan, err := n.st.PlanDel(p.key, t(s.now))
		if err != nil {
			s.fail(fmt.Errorf("DEL of %s on %s: %w", p.key, n.name, err))
			return
		}
		n.st.ApplyDel(plan)
		n.running--
	case podWaiting:
		n.st.RemoveWaiter(p.key)
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
	s.recompute(p.node)
	s.retryWaiters(p.node)
}

// recompute is the agent's pool monitor: mark free addresses beyond the target releasing, then
// publish the request if it changed (one spec write).
func (s *simulator) recompute(i int32) {
	n := s.nodes[i]
	if n.writing {
		// The monitor is busy writing the last request; kicks coalesce into one more round.
		n.kicked = true
		return
	}
	n.st.Release(t(s.now))
	req, rel := 0, addr.Set{}
	for _, r := range n.st.Spec() {
		if r.Pool == poolName {
			req, rel = r.Requested, r.Releasing
		}
	}
	if n.pubGen > 0 && req == n.pubReq && rel.Equal(n.pubRel) {
		return
	}
	raise := req > n.pubReq || n.pubGen == 0
	release := !n.pubRel.ContainsSet(rel)
	n.pubReq, n.pubRel = req, rel
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
	n.specQ = append(n.specQ, pubSpec{gen: n.pubGen, req: req, rel: rel})
	n.writing = true
	s.q.push(s.now+s.cfg.AgentLatency, evAgentWritten, i, 0)
	held, _ := n.st.Holding(poolName)
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
	n.st.SetHolding(poolName, held)
	n.held = count(held)
	s.recompute(i)
	s.retryWaiters(i)
	if n.raiseAt >= 0 && count(held.Subtract(n.pubRel)) >= n.pubReq {
		if s.counting {
			s.fillLatency = append(s.fillLatency, s.now-n.raiseAt)
		}
		n.raiseAt = -1
	}
}

// --- controller ------------------------------------------------------------------------------

// specOf is the NodeIPAllocation spec of a published request.
func specOf(req int, rel addr.Set) ipwardenv1.NodeIPAllocationSpec {
	r := ipwardenv1.NodePoolRequest{Pool: poolName, Requested: int32(req)}
	for _, b := range rel.Strings() {
		r.Releasing = append(r.Releasing, ipwardenv1.AddressBlock(b))
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

func count(s addr.Set) int {
	n, _ := s.Size().Uint64()
	return int(n)
}

// specArrive: the controller's informer delivers a node's spec (a new generation) and the
// event handler queues the node with its need.
func (s *simulator) specArrive(i int32) {
	n := s.nodes[i]
	ps := n.specQ[0]
	n.specQ = n.specQ[1:]
	n.spec, n.specGen = specOf(ps.req, ps.rel), ps.gen
	s.enqueue(i)
	s.dispatch()
}

// enqueue marks a node dirty with its current need, as Controller.enqueue does.
func (s *simulator) enqueue(i int32) {
	n := s.nodes[i]
	s.sched.Add(n.name, s.ctl.NeedOfNode(n.name, n.spec), t(s.now))
	if q := s.sched.Len(); q > s.maxQueue && s.counting {
		s.maxQueue = q
	}
}

// dispatch hands ready nodes to idle workers, most urgent first.
func (s *simulator) dispatch() {
	for len(s.idle) > 0 {
		key, ok, next := s.sched.Next(t(s.now))
		if !ok {
			if !next.IsZero() {
				d := next.Sub(epoch)
				if s.schedWakeAt < 0 || d < s.schedWakeAt {
					s.schedWakeAt = d
					s.q.push(d, evSchedWake, 0, 0)
				}
			}
			return
		}
		s.sync(s.index[key])
	}
}

// sync is Controller.fill for one node, through the controller's own step machine
// (State.StartFill): the writes it returns (the cooling record of removals first, then the
// node's status) are performed in its order on the virtual clock, and each outcome is reported
// back with Advance. A sync that changes nothing costs no write and no time.
func (s *simulator) sync(i int32) {
	n := s.nodes[i]
	now := t(s.now)
	if s.counting {
		s.syncs++
	}
	// A node with no need whose status already answers its spec generation (most nodes in a
	// full pass) would plan nothing and produce the status it has: skip the work, not the
	// scheduling.
	if !s.cfg.exact && n.specGen == n.status.ObservedGeneration && s.ctl.NeedOfNode(n.name, n.spec) == (controller.Need{}) {
		s.sched.Done(n.name, false, now)
		if s.counting {
			s.noopSyncs++
		}
		return
	}
	// The controller's own step machine decides the writes and their order (steps.go); the
	// simulator performs them on its virtual clock, as Controller.run does on the API server.
	q := s.ctl.StartFill(n.name, &ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: n.name, Generation: n.specGen},
		Spec: n.spec, Status: n.status}, now)
	f := q.Fill()
	if len(f.Starved) > 0 {
		s.pm.starved = true // PlanFill marked the pool starved and dirty, aborted or not
		s.pm.dirty = true
	}
	if pf := f.Pools[poolName]; pf != nil && pf.Plan.Add > 0 {
		s.pm.expireBatches(s.now, s.cfg.ReuseCooldown) // PlanFill asked Available
	}
	if q.Result() == controller.NoChange {
		s.sched.Done(n.name, false, now)
		if s.counting {
			s.noopSyncs++
		}
		return
	}
	added := int64(0)
	for _, pf := range f.Pools {
		added += int64(count(pf.Added))
	}
	s.pm.inflight += added // reserved by PlanFill until Commit
	// Each write waits for the client's rate limit, then takes the write latency; the worker
	// is busy throughout.
	done := s.now
	write := func() { done = max(s.limiter.take(s.now), done) + s.cfg.ControllerLatency }
	step, _ := q.Next()
	for ; step.Kind == controller.StepPoolStatus; step, _ = q.Next() {
		// Write-ahead: the pool's status gains the cooling record (StartFill recorded it)
		// before the node's status drops the addresses.
		until := now.Add(s.ctl.CooldownOf(step.Pool))
		s.pm.records = append(s.pm.records, until.Sub(epoch))
		s.pm.recAdded++
		s.pm.dirty = true
		if s.flushPool() {
			write()
		}
		q.Advance(controller.Landed)
	}
	if step.Kind != controller.StepNodeStatus {
		s.fail(fmt.Errorf("internal error: the fill's last step is %v, not the node status", step.Kind))
		return
	}
	w := s.idle[len(s.idle)-1]
	s.idle = s.idle[:len(s.idle)-1]
	write()
	s.jobs[w] = job{node: i, seq: q, fill: f, status: step.Status, at: now, added: added}
	s.q.push(done, evWriteDone, int32(w), 0)
}

func sortedPools(f *controller.Fill) []string {
	out := make([]string, 0, len(f.Pools))
	for p := range f.Pools {
		out = append(out, p)
	}
	slices.Sort(out)
	return out
}

// writeDone: a worker's status write landed. Commit, then what Controller.afterFill does.
func (s *simulator) writeDone(w int) {
	j := s.jobs[w]
	s.jobs[w] = job{}
	n := s.nodes[j.node]
	j.seq.Advance(controller.Landed) // commits the fill
	n.status = j.status
	if s.counting {
		s.nodeWrites++
	}
	held := heldOf(j.fill)
	s.setCtlHeld(n, count(held))
	s.pm.inflight -= j.added
	for _, pf := range j.fill.Pools {
		if r := int64(count(pf.Removed)); r > 0 {
			s.pm.free(j.at.Sub(epoch), r)
		}
		if !pf.Added.IsEmpty() || !pf.Removed.IsEmpty() {
			s.pm.dirty = true
		}
	}
	n.statusQ = append(n.statusQ, held)
	s.q.push(s.now+s.cfg.WatchDelay, evStatusArrive, j.node, 0)

	woke := false
	for _, pool := range sortedPools(j.fill) {
		pf := j.fill.Pools[pool]
		if !pf.Added.IsEmpty() || !pf.Removed.IsEmpty() {
			woke = true
		}
		if !pf.Removed.IsEmpty() {
			s.refill(s.ctl.Refill(pool))
		}
	}
	if len(j.fill.Starved) > 0 && s.counting {
		s.starvedFills++
		if s.firstStarved < 0 {
			s.firstStarved = s.now
		}
	}
	if woke || len(j.fill.Starved) > 0 {
		s.wakePools()
	}
	s.sched.Done(n.name, false, t(s.now))
	s.idle = append(s.idle, w)
	s.dispatch()
}

// refill queues nodes a pool left short, in name order so runs are reproducible.
func (s *simulator) refill(names []string) {
	slices.Sort(names)
	for _, name := range names {
		if i, ok := s.index[name]; ok {
			s.enqueue(i)
		}
	}
}

// wakePools is Controller.wakePools: the pool loop writes after a quarter interval, and a wake
// during that wait makes it go round once more.
func (s *simulator) wakePools() {
	if s.poolWaiting {
		s.poolWakeDue = true
		return
	}
	s.poolWaiting = true
	s.q.push(s.now+s.cfg.PoolStatusInterval/4, evPoolWake, 0, 0)
}

// poolPass is one round of Controller.poolLoop: refill nodes whose pool has cooled-down
// addresses again, then write dirty pool statuses.
func (s *simulator) poolPass() {
	s.refill(s.ctl.MarkExpiredCooling(t(s.now)))
	s.pm.markExpired(s.now, s.cfg.ReuseCooldown)
	dirty := s.pm.dirty
	if s.cfg.exact {
		if real := len(s.ctl.DirtyPools()) > 0; real != dirty {
			s.fail(fmt.Errorf("pool model says dirty=%v, State.DirtyPools says %v", dirty, real))
		}
	}
	if dirty && s.flushPool() {
		s.limiter.take(s.now) // the pool loop shares the controller's client
	}
	s.dispatch()
}

// flushPool is Controller.flushPool: compute the pool status (exhaustion hysteresis included)
// and write it if it changed. A new exhausted flag reaches the agents after the watch delay.
//
// State.PoolStatus is linear in the number of ranges the pool's addresses fall into, which at
// thousands of nodes would make it most of a run. So poolModel tracks exactly the numbers the
// status is made of, and the exhausted flag is computed by the function PoolStatus applies
// (State.Marks.Exhausted) from the same inputs: the previous flag, the free count and whether a
// fill fell short since the last status. Tests run with Config.exact, which also computes
// every status with PoolStatus and stops the run if the two disagree on anything that matters.
func (s *simulator) flushPool() bool {
	s.pm.computed(s.now, s.cfg.ReuseCooldown)
	fp := s.pm.print(false)
	fp.exhausted = s.ctl.Marks.Exhausted(s.pm.last.exhausted, s.pm.capacity-fp.allocated, s.pm.capacity,
		int64(max(s.cfg.Scaling.BatchSize, 1)), s.pm.starved)
	s.pm.starved = false
	if s.cfg.exact {
		st, _ := s.ctl.PoolStatus(poolName, s.poolStatus, s.poolObj.Generation, t(s.now))
		changed := !equality.Semantic.DeepEqual(st, s.poolStatus)
		if changed != (fp != s.pm.last) || st.Allocated != fp.allocated || int64(st.Nodes) != fp.nodes || st.Exhausted != fp.exhausted {
			s.fail(fmt.Errorf("pool status model disagrees with PoolStatus: model %+v (changed %v), status allocated %d nodes %d exhausted %v cooling records %d (changed %v)",
				fp, fp != s.pm.last, st.Allocated, st.Nodes, st.Exhausted, len(st.Cooling), changed))
		}
		if changed {
			s.poolStatus = st
		}
	} else {
		// What PoolStatus does to the allocator: expire cooled-down addresses. The refill list
		// is not PoolStatus's business; the pool loop asks for it itself.
		_ = s.ctl.MarkExpiredCooling(t(s.now))
	}
	if fp == s.pm.last {
		return false
	}
	was := s.pm.last.exhausted
	s.pm.last = fp
	if s.counting {
		s.poolWrites++
	}
	if fp.exhausted != was {
		s.setFlag(fp.exhausted)
		b := int64(0)
		if fp.exhausted {
			b = 1
		}
		s.q.push(s.now+s.cfg.WatchDelay, evPoolFlag, 0, b)
	}
	return true
}

// setCtlHeld records what the controller's record says a node holds.
func (s *simulator) setCtlHeld(n *node, c int) {
	s.pm.held += int64(c - n.ctlHeld)
	switch {
	case n.ctlHeld == 0 && c > 0:
		s.pm.holders++
	case n.ctlHeld > 0 && c == 0:
		s.pm.holders--
	}
	n.ctlHeld = c
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
		Capacity:         s.pm.capacity,
		FailedTotal:      s.failed,
		Queue:            s.sched.Len(),
		AgentWrites:      s.agentWrites,
		NodeStatusWrites: s.nodeWrites,
		PoolStatusWrites: s.poolWrites,
	}
	cooling := s.pm.coolingAt(s.now, s.cfg.ReuseCooldown)
	smp.Cooling = cooling
	smp.Allocated = s.pm.held + s.pm.inflight + cooling
	smp.Exhausted = s.pm.last.exhausted
	for _, n := range s.nodes {
		smp.Held += int64(n.held)
		smp.InUse += int64(n.running)
		smp.Running += n.running
		smp.Waiting += len(n.waiters)
		s.heldHist.add(n.held)
		s.usedHist.add(n.running)
		s.idleHist.add(n.held - n.running)
		h, _ := n.st.Holding(poolName)
		s.rangesHist.add(h.NumRanges())
	}
	s.series = append(s.series, smp)
}

package sim

import "time"

// Summary is what a run measured, as `ipwarden simulate -o json` prints it. Times are seconds.
type Summary struct {
	Scenario   Scenario          `json:"scenario"`
	Pool       PoolSummary       `json:"pool"`
	PerNode    NodeSummary       `json:"perNode"`
	Pods       PodSummary        `json:"pods"`
	APIWrites  WriteSummary      `json:"apiWrites"`
	Controller ControllerSummary `json:"controller"`
	Exhaustion ExhaustionSummary `json:"exhaustion"`
}

// Scenario echoes the inputs.
type Scenario struct {
	Nodes                    int      `json:"nodes"`
	PodsPerNode              float64  `json:"podsPerNode"`
	ChurnPerNodePerMinute    float64  `json:"churnPerNodePerMinute"`
	TraceEvents              int      `json:"traceEvents,omitempty"`
	PoolCIDRs                []string `json:"poolCIDRs"`
	PoolExclude              []string `json:"poolExclude,omitempty"`
	BatchSize                int      `json:"batchSize"`
	BufferPercent            int      `json:"bufferPercent"`
	MaxPerNode               int      `json:"maxPerNode"`
	ReleaseSlackPercent      int      `json:"releaseSlackPercent"`
	ReleaseDelaySeconds      float64  `json:"releaseDelaySeconds"`
	ReuseCooldownSeconds     float64  `json:"reuseCooldownSeconds"`
	ControllerWorkers        int      `json:"controllerWorkers"`
	ControllerLatencySeconds float64  `json:"controllerLatencySeconds"`
	KubeAPIQPS               float64  `json:"kubeAPIQPS"`
	KubeAPIBurst             int      `json:"kubeAPIBurst"`
	WatchDelaySeconds        float64  `json:"watchDelaySeconds"`
	AgentLatencySeconds      float64  `json:"agentLatencySeconds"`
	AgentResyncSeconds       float64  `json:"agentResyncSeconds"`
	AddDelaySeconds          float64  `json:"addDelaySeconds"`
	AddressWaitSeconds       float64  `json:"addressWaitSeconds"`
	DurationSeconds          float64  `json:"durationSeconds"`
	Start                    Start    `json:"start"`
	Burst                    int      `json:"burst,omitempty"`
	BurstAtSeconds           float64  `json:"burstAtSeconds,omitempty"`
	Seed                     uint64   `json:"seed"`
}

// PoolSummary is the pool over time (over the samples).
type PoolSummary struct {
	Capacity int64 `json:"capacity"`
	// Allocated is held by nodes plus cooling down in the pool: what other nodes cannot get.
	Allocated Stats `json:"allocated"`
	// InUse is what pods use.
	InUse Stats `json:"inUse"`
	// AllocatedPercent and InUsePercent are the means as shares of the capacity; PeakAllocatedPercent the maximum.
	AllocatedPercent     float64 `json:"allocatedPercent"`
	PeakAllocatedPercent float64 `json:"peakAllocatedPercent"`
	InUsePercent         float64 `json:"inUsePercent"`
	// UsedOfHeldPercent is the mean share of held addresses that pods use.
	UsedOfHeldPercent float64 `json:"usedOfHeldPercent"`
}

// NodeSummary is addresses per node, over every node at every sample.
type NodeSummary struct {
	Held Stats `json:"held"`
	Used Stats `json:"used"`
	// Idle is held minus used: the warm spare plus addresses cooling down on the node.
	Idle Stats `json:"idle"`
	// Spare is held minus the agent's demand (in use, cooling on the node, pods bound without
	// an address yet), at least 0. At rest it is at most SpareBound.
	Spare Stats `json:"spare"`
	// SpareAtRest is Spare over the nodes at rest: no release delay running (a node beyond the
	// bound gives back when its delay ends).
	SpareAtRest Stats `json:"spareAtRest"`
	// SpareBound is batch*(buffer+releaseSlack): docs/design.md's economy target, at rest a
	// node holds at most demand + batch*(buffer+1) with the default slack.
	SpareBound int `json:"spareBound"`
	// Runs counts the contiguous address ranges a node holds: one route each at best, so fewer
	// means node routes aggregate better.
	Runs Stats `json:"runs"`
}

// PodSummary is what pods saw.
type PodSummary struct {
	// Started counts pods bound during the run (a warm start's initial pods are InitialRunning).
	Started        int `json:"started"`
	InitialRunning int `json:"initialRunning,omitempty"`
	// Waited counts started pods whose ADD did not get an address at once.
	Waited        int     `json:"waited"`
	WaitedPercent float64 `json:"waitedPercent"`
	// Wait is over the pods that waited; WaitAll over every pod whose ADD arrived. Pods still
	// waiting at the end count with their wait so far.
	Wait    Stats `json:"waitSeconds"`
	WaitAll Stats `json:"waitAllSeconds"`
	// Failed counts pods whose ADD waited longer than the address wait (CNI error 11).
	Failed int `json:"failed"`
	// StillWaiting at the end; GaveUp stopped while waiting.
	StillWaiting int `json:"stillWaiting"`
	GaveUp       int `json:"gaveUp,omitempty"`
	// NeverStarted counts started pods that never got an address: still waiting at the end, or
	// stopped while waiting.
	NeverStarted int `json:"neverStarted"`
}

// WriteSummary counts API writes the way the components make them: an agent writes its spec
// once per change of its request, the controller a node's status once per fill or take-back and
// a pool's status when it changed (coalesced per interval).
type WriteSummary struct {
	AgentSpec int64 `json:"agentSpec"`
	// AgentRaises are spec writes that raised the request; AgentReleases those that listed
	// new addresses to give back. The rest lower the request or clear the releasing list
	// once the controller took the addresses.
	AgentRaises   int64 `json:"agentRaises"`
	AgentReleases int64 `json:"agentReleases"`
	NodeStatus    int64 `json:"nodeStatus"`
	PoolStatus    int64 `json:"poolStatus"`
	Total         int64 `json:"total"`
	// PerSecond is Total over the simulated time.
	PerSecond           float64 `json:"perSecond"`
	AgentPerSecond      float64 `json:"agentSpecPerSecond"`
	NodeStatusPerSecond float64 `json:"nodeStatusPerSecond"`
	PoolStatusPerSecond float64 `json:"poolStatusPerSecond"`
	// PerPodStart is agent and node status writes per pod start (docs/design.md's target: at most
	// 1/batchSize).
	PerPodStart float64 `json:"perPodStart"`
	// PerPodStartAll adds the pool status writes (cooling records of give-backs, counts).
	PerPodStartAll float64 `json:"perPodStartAll"`
}

// ControllerSummary is the controller's work.
type ControllerSummary struct {
	// FillLatency is from an agent raising its request above its holding to the agent seeing
	// the fill.
	FillLatency Stats `json:"fillLatencySeconds"`
	Fills       int   `json:"fills"`
	// Syncs counts node syncs; NoopSyncs those that found nothing to write.
	Syncs        int `json:"syncs"`
	NoopSyncs    int `json:"noopSyncs"`
	StarvedFills int `json:"starvedFills"`
	MaxQueue     int `json:"maxQueue"`
}

// ExhaustionSummary says whether and when the pool ran out. Nil times mean never.
type ExhaustionSummary struct {
	// ExhaustedAt is when the pool's exhausted flag was first set (time to exhaustion).
	ExhaustedAt *float64 `json:"exhaustedAtSeconds"`
	// ExhaustedSeconds is how long the flag was set in all.
	ExhaustedSeconds float64 `json:"exhaustedSeconds"`
	// FirstStarvedFill is when a fill first fell short for lack of addresses.
	FirstStarvedFill *float64 `json:"firstStarvedFillSeconds"`
	// FirstFailedPod is when a pod first waited beyond the address wait.
	FirstFailedPod *float64 `json:"firstFailedPodSeconds"`
}

func secs(d time.Duration) float64 { return round3(d.Seconds()) }

func optSecs(d time.Duration) *float64 {
	if d < 0 {
		return nil
	}
	v := secs(d)
	return &v
}

func pct(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return round2(100 * a / b)
}

func (s *simulator) summary() Summary {
	cfg := s.cfg
	spec, _ := cfg.PoolSpec() // Run checked it
	sum := Summary{Scenario: Scenario{
		Nodes: len(s.nodes), PodsPerNode: cfg.PodsPerNode, ChurnPerNodePerMinute: cfg.Churn,
		BatchSize: cfg.Scaling.BatchSize, BufferPercent: cfg.Scaling.BufferPercent, MaxPerNode: cfg.Scaling.MaxPerNode,
		ReleaseSlackPercent: cfg.Scaling.ReleaseSlackPercent, ReleaseDelaySeconds: secs(cfg.Scaling.ReleaseDelay),
		ReuseCooldownSeconds: secs(cfg.ReuseCooldown), ControllerWorkers: cfg.ControllerWorkers,
		ControllerLatencySeconds: secs(cfg.ControllerLatency), KubeAPIQPS: cfg.KubeAPIQPS, KubeAPIBurst: cfg.KubeAPIBurst,
		WatchDelaySeconds:   secs(cfg.WatchDelay),
		AgentLatencySeconds: secs(cfg.AgentLatency), AgentResyncSeconds: secs(cfg.AgentResync), AddDelaySeconds: secs(cfg.AddDelay),
		AddressWaitSeconds: secs(cfg.AddressWait), DurationSeconds: secs(cfg.Duration),
		Start: cfg.Start, Burst: cfg.Burst, Seed: cfg.Seed,
	}}
	if cfg.Burst > 0 {
		sum.Scenario.BurstAtSeconds = secs(cfg.BurstAt)
	}
	for _, c := range spec.CIDRs {
		sum.Scenario.PoolCIDRs = append(sum.Scenario.PoolCIDRs, string(c))
	}
	for _, e := range spec.Exclude {
		sum.Scenario.PoolExclude = append(sum.Scenario.PoolExclude, string(e))
	}
	if cfg.Trace != nil {
		sum.Scenario.PodsPerNode, sum.Scenario.ChurnPerNodePerMinute = 0, 0
		sum.Scenario.TraceEvents = len(cfg.Trace.Events)
	}

	// Pool over the samples.
	var alloc, inUse countHistF
	var usedOfHeld float64
	var peak int64
	for _, smp := range s.series {
		alloc.add(float64(smp.Allocated))
		inUse.add(float64(smp.InUse))
		peak = max(peak, smp.Allocated)
		if smp.Held > 0 {
			usedOfHeld += float64(smp.InUse) / float64(smp.Held)
		}
	}
	capacity := s.poolStatus.Capacity
	sum.Pool = PoolSummary{
		Capacity: capacity, Allocated: alloc.stats(), InUse: inUse.stats(),
		AllocatedPercent: pct(alloc.mean(), float64(capacity)), PeakAllocatedPercent: pct(float64(peak), float64(capacity)),
		InUsePercent: pct(inUse.mean(), float64(capacity)),
	}
	if len(s.series) > 0 {
		sum.Pool.UsedOfHeldPercent = round2(100 * usedOfHeld / float64(len(s.series)))
	}
	sum.PerNode = NodeSummary{Held: s.heldHist.stats(), Used: s.usedHist.stats(), Idle: s.idleHist.stats(), Runs: s.rangesHist.stats(),
		Spare: s.spareHist.stats(), SpareAtRest: s.spareRestHist.stats(), SpareBound: (cfg.Scaling.BatchSize*(cfg.Scaling.BufferPercent+cfg.Scaling.ReleaseSlackPercent) + 99) / 100}

	// Pods.
	waits := s.waits
	still := 0
	for _, n := range s.nodes {
		for _, pid := range n.waiters {
			if p := s.pods[pid]; p.counted {
				waits = append(waits, s.now-p.addAt)
				still++
			}
		}
	}
	sum.Pods = PodSummary{
		Started: s.started, InitialRunning: s.initialRunning, Waited: len(waits),
		WaitedPercent: pct(float64(len(waits)), float64(len(waits)+s.gotAddress)),
		Wait:          durationStats(waits, 0), WaitAll: durationStats(waits, s.gotAddress),
		Failed: s.failed, StillWaiting: still, GaveUp: s.gaveUp, NeverStarted: still + s.gaveUp,
	}

	// Writes.
	d := cfg.Duration.Seconds()
	w := WriteSummary{AgentSpec: s.agentWrites, AgentRaises: s.agentRaises, AgentReleases: s.agentReleases,
		NodeStatus: s.nodeWrites, PoolStatus: s.poolWrites}
	w.Total = w.AgentSpec + w.NodeStatus + w.PoolStatus
	w.PerSecond = round3(float64(w.Total) / d)
	w.AgentPerSecond = round3(float64(w.AgentSpec) / d)
	w.NodeStatusPerSecond = round3(float64(w.NodeStatus) / d)
	w.PoolStatusPerSecond = round3(float64(w.PoolStatus) / d)
	if s.started > 0 {
		w.PerPodStart = round3(float64(w.AgentSpec+w.NodeStatus) / float64(s.started))
		w.PerPodStartAll = round3(float64(w.Total) / float64(s.started))
	}
	sum.APIWrites = w

	sum.Controller = ControllerSummary{
		FillLatency: durationStats(s.fillLatency, 0), Fills: int(s.nodeWrites), Syncs: s.syncs(),
		NoopSyncs: max(s.syncs()-int(s.nodeWrites), 0), StarvedFills: s.starvedFills, MaxQueue: s.maxQueue,
	}

	exhaustedFor := s.exhaustedFor
	if s.flagSince >= 0 {
		exhaustedFor += s.now - s.flagSince
	}
	sum.Exhaustion = ExhaustionSummary{
		ExhaustedAt: optSecs(s.exhaustedAt), ExhaustedSeconds: secs(exhaustedFor),
		FirstStarvedFill: optSecs(s.firstStarved), FirstFailedPod: optSecs(s.firstFailed),
	}
	return sum
}

// countHistF accumulates float observations for Stats (samples are few: keep them all).
type countHistF struct{ v []float64 }

func (h *countHistF) add(x float64) { h.v = append(h.v, x) }

func (h *countHistF) mean() float64 {
	if len(h.v) == 0 {
		return 0
	}
	var s float64
	for _, x := range h.v {
		s += x
	}
	return s / float64(len(h.v))
}

func (h *countHistF) stats() Stats {
	st := floatStats(h.v, 0)
	st.Mean = round2(h.mean())
	return st
}

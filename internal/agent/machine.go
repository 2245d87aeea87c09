package agent

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// Machine is the node's state as a single-owner machine, in the style of etcd's raft and of the
// controller's Machine: one owner feeds it inputs, each given the time (a CNI request, the
// outcome of a journal write or of a pod read, a fact read from the API server, a cancel, the
// clock), and what it wants done comes out of Ready as data: the journal writes to start, the
// answers to give, the pod reads to make, the events to record, when to wake it next. A driver
// carries them out and feeds the outcomes back, then acknowledges them with Advance. Two drivers
// exist: Service (the CNI socket, the journal, the API server) and `ipwarden simulate`
// (internal/sim, a virtual clock and writes that land at once). The machine owns the ipam.State;
// nothing else reads or changes it. It records metrics and logs as it decides (a sink: they
// order nothing).
//
// The ordering rules, each with a table test in machine_test.go:
//   - an ADD is answered only after the journal write that records its attachment landed; a
//     refused write aborts its plan and the ADD fails with nothing handed out (addWritten);
//   - requests for one attachment (ADD, DEL, CHECK, a conditional free) run one at a time, in
//     the order they came; the next starts when the one before is finished, its write included
//     (keys);
//   - a DEL is answered at once, but its addresses stay assigned, and its attachment busy, until
//     its journal write lands (delWritten); a refused write keeps the attachment;
//   - a barrier (LIST, GC, HANDBACK, the agent's stop) is answered once every DEL answered before
//     it is journaled;
//   - an ADD of a pod the node does not know first reads the pod's annotations (Read); a failed
//     read fails it, unless the node served the pod's earlier sandbox;
//   - an ADD short of addresses waits, oldest first, and is tried again after every change, until
//     --address-wait passes or its caller goes; each time it is still short the pool monitor is
//     asked for a round at once (KickNow); one that meets a rebuild's write in flight waits for it
//     without a deadline;
//   - facts read from the API server and rebuilds (pools, holdings, the record mark, rebuilt
//     attachments, the release round, the handback mark) are planned one at a time, each against
//     the state the one before left: the next is planned once the previous one's write landed;
//   - an ADD is planned only while the gate lets it (machine_gate.go): the agent serves, the node
//     is not handed back, no other holder of the node's Lease was seen, and the first
//     reconciliation is done (or the journal has addresses to serve from). It is asked at every
//     attempt, so an ADD waiting for addresses fails as soon as any of them stops holding; past
//     the Lease's permit an ADD waits for a re-check of the Lease (Recheck) first;
//   - an ADD whose pod references an IPAMClaim gets only the claim's bound address, waiting
//     (listed in the spec) for the binding and the grant, failing on the controller's refusal
//     or at --address-wait; it shares the address with an attachment of the same claim UID only
//     for a live migration (ipam/claim.go, machine_claim_test.go).
//
// The DRA kubelet plugin's Prepare and Unprepare, and the level reconcile of reservations against
// the claims, are inputs too; their rules are in machine_dra.go.
type Machine struct {
	cfg     MachineConfig
	st      *ipam.State
	log     logr.Logger
	metrics *Metrics
	now     time.Time // the time of the input being handled
	// holdPastDeadline: the hold's deadline passed with addresses still held (reported once).
	holdPastDeadline bool

	next     uint64
	reqs     map[uint64]*mreq
	keys     map[ipam.Key][]uint64 // per attachment: the request running, then those queued behind it
	waiting  []uint64              // ADDs waiting for an address or a rebuild's write, oldest first
	writes   map[uint64]uint64     // journal write -> the request or fact it is for
	delsOpen map[uint64]bool       // DELs answered whose writes are in flight, by request
	barriers []mbarrier
	facts    []*mfact // facts to plan, in order; facts[0] is being written when factWriting
	factBusy bool

	conflicts map[ipam.Address]ipam.Key
	gate      gate
	rd        Ready
}

// MachineConfig configures a Machine.
type MachineConfig struct {
	Node string
	// AddressWait bounds how long an ADD waits for addresses.
	AddressWait time.Duration
	// ReadsPods: the driver reads the annotations of pods the node does not know (Read).
	ReadsPods bool
	// HoldMarker: the driver keeps the hold's marker in the state directory (Ready.Marker).
	HoldMarker bool
	// Sandbox says whether a network namespace exists (a rebuild's check); nil: unknown.
	Sandbox func(netns string) ipam.Sandbox
	// Gated: ADD is planned only as the gate allows (the node's Lease, the first reconciliation
	// or a journal with holdings; see gate). Off: only readiness and the handback mark refuse it.
	Gated bool
	// LeaseNamespace is the namespace of the node's Lease, for the gate's refusal.
	LeaseNamespace string
	Log            logr.Logger
	Metrics        *Metrics
}

// Ready is what the machine wants done now.
type Ready struct {
	// Writes are the journal writes to start. Each one's outcome comes back with Written.
	Writes []Write
	// Answers are the outcomes of requests and facts, for whoever waits on them.
	Answers []Answer
	// Reads are the pod reads to make; each one's outcome comes back with PodRead.
	Reads []PodRead
	// Events are Kubernetes events to record on the node's NodeIPAllocation.
	Events []NodeEvent
	// Marker, when set, is the hold's marker to write (Until set) or remove (zero Until).
	Marker *time.Time
	// Kick asks the pool monitor for a round soon; KickNow, at once (an ADD waits).
	Kick, KickNow bool
	// Changed: the state changed; a driver's waiter on a condition of it looks again.
	Changed bool
	// Recheck asks the driver to re-check the node's Lease now (an ADD past the permit waits for
	// it), then to feed LeaseChecked.
	Recheck bool
	// Wake is when the machine wants Tick next (zero: only inputs wake it).
	Wake time.Time
}

// Write is one journal write. Lazy: a DEL already answered, which may wait briefly to share the
// next write's transaction. Add: the write of an ADD (the failpoint holds those). Release: a
// DEL's (or a free's) attachment while the node is handed back: once the write landed, and
// before its outcome is fed back, the driver removes host-local's reservations of it.
// Reserve: an ADD's addresses to make unavailable in the previous IPAM's store before the
// journal write (machine_previous.go): when that fails, the journal write is not made and the
// outcome is that failure; when the journal write fails after it, the reservation is removed
// again. Unreserve: a free's reservations to remove from the previous IPAM's store once the
// write landed, before its outcome is fed back.
type Write struct {
	ID        uint64
	Change    ipam.Change
	Lazy      bool
	Add       bool
	Release   *ipam.Attachment
	Reserve   *Reserve
	Unreserve *Reserve
}

// PodRead asks the driver for a pod's annotations and namespace (for pool choice), and for the
// IPAMClaim the attachment references (IfName, Network and ClaimArg locate the reference;
// claim.go).
type PodRead struct {
	ID                   uint64
	Namespace, Name, UID string
	IfName, Network      string
	ClaimArg             string
}

// NodeEvent is a Kubernetes event on the node's NodeIPAllocation.
type NodeEvent struct{ Type, Reason, Message string }

// Answer is the outcome of a request or a fact.
type Answer struct {
	ID uint64
	// Resp is a CNI request's answer.
	Resp *cniproto.Response
	// Att is the attachment an ADD created (the driver rolls it back when the plugin went away)
	// or a conditional free freed; nil when none.
	Att *ipam.Attachment
	// Err is the journal's refusal of a fact or a conditional free.
	Err error
	// Round is a release round's result.
	Round *Round
	// N is a rebuild's count of attachments recorded, or a recovery's of reservations.
	N int
	// Recovery is a recovery's decision on each claim's status entry (machine_dra.go).
	Recovery []ipam.RecoveryOutcome
}

type reqKind uint8

const (
	reqAdd reqKind = iota
	reqDel
	reqCheck
	reqFreeIf // a conditional free: rollback of an unanswered ADD, the leak collector
)

type reqStage uint8

const (
	stageQueued  reqStage = iota // behind another request of its attachment
	stageReading                 // its pod's annotations are being read
	stageWaiting                 // short of addresses, or behind a rebuild's write
	stageWriting                 // its journal write is in flight
)

// mreq is a request the machine holds.
type mreq struct {
	id       uint64
	kind     reqKind
	stage    reqStage
	key      ipam.Key
	add      ipam.AddRequest
	check    []string // CHECK: prevResult addresses
	accept   func(ipam.Attachment) bool
	start    time.Time // ADD: when it first looked for addresses (its turn came, its pod read)
	deadline time.Time // ADD: when it stops waiting for addresses (start + --address-wait)
	waiter   bool      // registered as waiting with the state (demand)
	inFlight bool      // waiting for a rebuild's write, not for addresses
	canceled bool
	att      ipam.Attachment
	plan     ipam.Plan
	reserve  ipam.ReserveRequest // a DRA Prepare's (machine_dra.go)
}

type mbarrier struct {
	id   uint64
	dels map[uint64]bool // the DELs answered and in flight when it came
}

// mfact is a fact or a rebuild: planned when its turn comes, journaled, applied.
type mfact struct {
	id      uint64
	what    string
	plan    func(m *Machine) ipam.Plan
	applied func(m *Machine, p ipam.Plan, a *Answer) // after the plan is applied (not when refused)
	plan0   ipam.Plan
}

// NewMachine returns a machine over st (already restored from the journal).
func NewMachine(st *ipam.State, cfg MachineConfig) *Machine {
	if cfg.Metrics == nil {
		cfg.Metrics = NewMetrics(nil)
	}
	if cfg.Sandbox == nil {
		cfg.Sandbox = func(string) ipam.Sandbox { return ipam.SandboxUnknown }
	}
	return &Machine{cfg: cfg, st: st, log: cfg.Log, metrics: cfg.Metrics, reqs: map[uint64]*mreq{}, keys: map[ipam.Key][]uint64{},
		writes: map[uint64]uint64{}, delsOpen: map[uint64]bool{}, conflicts: map[ipam.Address]ipam.Key{},
		gate: gate{node: cfg.Node, leaseNS: cfg.LeaseNamespace, enforce: cfg.Gated}}
}

func (m *Machine) id() uint64 { m.next++; return m.next }

// Ready returns what the machine wants done; call Advance once it is carried out.
func (m *Machine) Ready() Ready {
	rd := m.rd
	rd.Wake = m.wake()
	return rd
}

// Advance acknowledges the last Ready.
func (m *Machine) Advance() { m.rd = Ready{} }

func (m *Machine) answer(a Answer) { m.rd.Answers = append(m.rd.Answers, a) }

// changed marks that addresses may have become usable: the waiting ADDs try again.
func (m *Machine) changed() {
	m.rd.Changed = true
	waiting := m.waiting
	m.waiting = nil
	for _, id := range waiting {
		if r := m.reqs[id]; r != nil && r.stage == stageWaiting {
			m.retry(r)
		}
	}
}

// retry tries waiting request r again.
func (m *Machine) retry(r *mreq) {
	switch r.kind {
	case reqAdd:
		m.tryAdd(r)
	case reqPrepare:
		m.tryPrepare(r)
	case reqUnprepare:
		m.tryUnprepare(r)
	default:
		m.tryDel(r)
	}
}

// wait parks request r until the next change (inFlight: a rebuild's write, no deadline).
func (m *Machine) wait(r *mreq, inFlight bool) {
	r.stage, r.inFlight = stageWaiting, inFlight
	if !slices.Contains(m.waiting, r.id) {
		m.waiting = append(m.waiting, r.id)
	}
}

// wake is the earliest deadline the machine waits for: a waiting ADD's, a cooling address the
// waiting ADDs could use, the hold's end.
func (m *Machine) wake() time.Time {
	var w time.Time
	earliest := func(t time.Time) {
		if !t.IsZero() && (w.IsZero() || t.Before(w)) {
			w = t
		}
	}
	short := false
	for _, id := range m.waiting {
		if r := m.reqs[id]; r != nil && !r.inFlight {
			earliest(r.deadline)
			short = true
		}
	}
	if short {
		earliest(m.st.NextCooled(m.now))
	}
	if on, until := m.st.Hold(); on && until.After(m.now) {
		earliest(until) // past it, what still holds waits for pod events and runtime readings
	}
	return w
}

// Tick is the clock: waiting ADDs past their deadline fail, cooled addresses are tried, the hold
// is evaluated.
func (m *Machine) Tick(now time.Time) {
	m.now = now
	m.evaluateHold()
	m.changed()
}

// --- requests ----------------------------------------------------------------------------------

// Request takes a CNI ADD, DEL or CHECK whose key and identity the caller validated, and returns
// its id; the answer comes out of Ready.
func (m *Machine) Request(req cniproto.Request, now time.Time) uint64 {
	m.now = now
	r := &mreq{id: m.id(), key: ipam.Key{ContainerID: req.ContainerID, IfName: req.IfName}}
	switch req.Op {
	case cniproto.OpAdd:
		r.kind = reqAdd
		r.add = ipam.AddRequest{Key: r.key, Network: req.Network, Netns: req.Netns, Pools: req.Pools, PoolNetwork: req.PoolNetwork,
			Pod:      ipam.PodRef{Namespace: req.Pod.Namespace, Name: req.Pod.Name, UID: req.Pod.UID},
			Previous: previousStore(req.Previous, req.Network), ClaimArg: req.IPAMClaimReference}
	case cniproto.OpDel:
		r.kind = reqDel
	default:
		r.kind = reqCheck
		r.check = req.PrevAddresses
	}
	if resp := m.gate.refuseStarting(); resp != nil && r.kind != reqAdd {
		// DEL and CHECK wait for nothing; an ADD asks the gate when its turn comes (run).
		m.answer(Answer{ID: r.id, Resp: resp})
		return r.id
	}
	m.enqueue(r)
	return r.id
}

// FreeIf frees the attachment key as a DEL does, answered once journaled, only if it is
// confirmed (not in flight) and accept approves it, decided when its turn comes.
func (m *Machine) FreeIf(key ipam.Key, accept func(ipam.Attachment) bool, now time.Time) uint64 {
	m.now = now
	r := &mreq{id: m.id(), kind: reqFreeIf, key: key, accept: accept}
	m.enqueue(r)
	return r.id
}

func (m *Machine) enqueue(r *mreq) {
	m.reqs[r.id] = r
	q := append(m.keys[r.key], r.id)
	m.keys[r.key] = q
	if len(q) == 1 {
		m.run(r)
	}
}

// finish ends request r: the next one of its attachment runs.
func (m *Machine) finish(r *mreq) {
	delete(m.reqs, r.id)
	q := m.keys[r.key]
	if len(q) > 0 && q[0] == r.id {
		q = q[1:]
	}
	if len(q) == 0 {
		delete(m.keys, r.key)
		return
	}
	m.keys[r.key] = q
	m.run(m.reqs[q[0]])
}

func (m *Machine) reply(r *mreq, resp *cniproto.Response) {
	m.answer(Answer{ID: r.id, Resp: resp})
	m.finish(r)
}

// run starts request r, first of its attachment.
func (m *Machine) run(r *mreq) {
	switch r.kind {
	case reqAdd:
		if resp := m.gateRefusal(); resp != nil {
			m.reply(r, resp) // refused before its pod is read
			return
		}
		_, known := m.st.Attachment(r.key)
		if m.cfg.ReadsPods && !known && r.add.Pod.Namespace != "" && r.add.Pod.Name != "" {
			r.stage = stageReading
			m.rd.Reads = append(m.rd.Reads, PodRead{ID: r.id, Namespace: r.add.Pod.Namespace, Name: r.add.Pod.Name, UID: r.add.Pod.UID,
				IfName: r.key.IfName, Network: r.add.Network, ClaimArg: r.add.ClaimArg})
			return
		}
		m.tryAdd(r)
	case reqDel, reqFreeIf:
		m.tryDel(r)
	case reqCheck:
		m.reply(r, m.checkAnswer(r))
	case reqPrepare:
		m.tryPrepare(r)
	case reqUnprepare:
		m.tryUnprepare(r)
	}
}

// ErrPodReaderAway is a pod read's outcome while the agent starts with the API server away:
// the agent has no pod reader yet, and has found the API server unreachable (PodRead).
var ErrPodReaderAway = errors.New("the agent is starting and the API server is away: it has no pod reader yet")

// PodRead is the outcome of the read of request id's pod.
func (m *Machine) PodRead(id uint64, meta ipam.PodMeta, err error, now time.Time) {
	m.now = now
	r := m.reqs[id]
	if r == nil || r.stage != stageReading {
		return
	}
	if err != nil {
		// The watch does not know the pod and the API server cannot be asked. Choosing pools
		// as if it had no annotations would silently ignore its (or its namespace's) pools,
		// static and sticky addresses. A pod whose earlier sandbox this node served gets its
		// addresses back without them (the node keeps serving restarted sandboxes through an
		// outage); any other waits for the API server: the runtime retries. Except while the
		// agent starts with the API server away (ErrPodReaderAway): then it is served from the
		// journal without annotations, as documented. A claim named in args.cni never is.
		adopts := r.add.Pod.UID != "" && m.st.HasPod(r.add.Pod.UID)
		if blind := errors.Is(err, ErrPodReaderAway) && !adopts && r.add.ClaimArg == ""; blind {
			m.log.Info("the API server is away: serving an ADD from the journal without its pod's annotations",
				"pod", r.add.Pod.Namespace+"/"+r.add.Pod.Name)
			r.add.Meta = ipam.PodMeta{}
			m.tryAdd(r)
			return
		}
		if !adopts || r.add.ClaimArg != "" {
			m.metrics.PodUnknown.Inc()
			m.reply(r, errResp(cniproto.CodeTryAgainLater,
				fmt.Sprintf("ipwarden: the agent on node %s cannot read pod %s/%s's annotations: its watch has not seen the pod and the API server did not answer: %s",
					m.cfg.Node, r.add.Pod.Namespace, r.add.Pod.Name, cniproto.Truncate(err.Error(), 200)),
				"pool choice needs the pod's and its namespace's ipwarden.io annotations; is the API server reachable from this node? the runtime retries"))
			return
		}
		m.log.Info("cannot read the pod's annotations; its earlier sandbox's addresses are handed back", "pod", r.add.Pod.Namespace+"/"+r.add.Pod.Name, "error", err.Error())
		// A VM pod's earlier sandbox had its IPAMClaim on this interface: the new one has the
		// same claim (never an ordinary address).
		meta = ipam.PodMeta{Claim: m.st.EarlierClaim(r.add.Pod.UID, r.key.IfName)}
	}
	r.add.Meta = meta
	m.tryAdd(r)
}

// Cancel says request id's caller went away: an ADD waiting for addresses fails now. Other
// requests are not canceled (a DEL or a free finishes).
func (m *Machine) Cancel(id uint64, now time.Time) {
	m.now = now
	r := m.reqs[id]
	if r == nil {
		return
	}
	r.canceled = true
	if r.kind == reqAdd && r.stage == stageWaiting {
		m.tryAdd(r)
	}
}

// tryAdd plans ADD r: answer it (repeated, refused), write it, or let it wait. The gate is
// asked first, at every attempt.
func (m *Machine) tryAdd(r *mreq) {
	if m.gateAdd(r) {
		return
	}
	now := m.now
	if r.start.IsZero() {
		// The wait for addresses (and ipwarden_agent_ip_wait_seconds) starts once the ADD's
		// turn came and its pod was read.
		r.start, r.deadline = now, now.Add(m.cfg.AddressWait)
	}
	var rebuilt addr.Set
	if r.add.Previous != nil {
		rebuilt = m.rebuiltAddrs(r.add.Pod.UID) // before Add adopts them
	}
	att, ch, err := m.st.Add(r.add, now)
	var short *ipam.ShortError
	if errors.As(err, &short) {
		if !now.Before(r.deadline) || r.canceled {
			msg := m.shortMessage(short, now)
			m.metrics.IPWait.Observe(now.Sub(r.start).Seconds())
			m.dropWaiter(r)
			m.reply(r, errResp(cniproto.CodeTryAgainLater, msg,
				fmt.Sprintf("the ipwarden agent on node %s waited %s for the controller (--address-wait); the runtime retries", m.cfg.Node, m.cfg.AddressWait)))
			return
		}
		m.wait(r, false)
		// Still short after any change: the pool monitor's round runs at once (it coalesces),
		// so a node that got part of its request asks for the rest without a quiet time.
		m.rd.KickNow = true
		if !r.waiter {
			pools, _ := m.st.ResolvePools(r.add)
			m.st.AddWaiter(r.key, r.add.Pod.UID, pools, short.Wanted...)
			m.st.SetWaiterClaims(r.key, short.Claims)
			r.waiter = true
			if on, _ := m.st.Hold(); on && m.evaluateHold() {
				// A pod with an ADD here settles the hold, which ended: try again at once.
				m.changed()
			}
		} else if len(short.Claims) > 0 {
			// A claim's wait changes as its binding and grant land (the node lists it in its
			// spec until it is served).
			m.st.SetWaiterClaims(r.key, short.Claims)
		}
		return
	}
	var inFlight *ipam.InFlightError
	if errors.As(err, &inFlight) {
		// A rebuild is recording the pod's addresses (ipam.PlanRebuild): wait for its journal
		// write, then adopt them.
		if r.canceled {
			m.dropWaiter(r)
			m.reply(r, errResp(cniproto.CodeTryAgainLater, "ipwarden: "+inFlight.Error(), "the runtime retries"))
			return
		}
		m.wait(r, true)
		return
	}
	if err == nil {
		r.waiter = false // Add removed the waiter
	}
	m.dropWaiter(r)
	if err != nil {
		m.reply(r, addError(err))
		return
	}
	m.metrics.IPWait.Observe(now.Sub(r.start).Seconds())
	if ch.IsEmpty() {
		m.reply(r, m.result(att)) // a repeated ADD
		return
	}
	// The answer waits for the journal write: an address a runtime was told is on disk first.
	r.stage, r.att, r.plan = stageWriting, att, ipam.AddPlan{Key: r.key, Change: ch}
	m.write(r.id, ch, false, true)
	m.rd.Writes[len(m.rd.Writes)-1].Reserve = m.withoutShared(reserveOf(att, rebuilt))
}

// dropWaiter removes r's demand from the state, if it registered one.
func (m *Machine) dropWaiter(r *mreq) {
	if r.waiter {
		m.st.RemoveWaiter(r.key)
		r.waiter = false
		m.rd.Kick = true
	}
}

// runtimeShowsUse reports whether the runtime's last reading (held only during the hold after a
// lost journal) shows a sandbox of a rebuilt attachment's pod, or one with one of its addresses:
// then no conditional free (the leak collector's, whose pod is gone from the API) releases it. A
// deleted pod is not a stopped sandbox, and the runtime is the proof that it is not stopped yet; a
// rebuilt attachment has no network namespace path the collector could look at instead. (The
// other conditional free, an unanswered ADD's rollback, never concerns a rebuilt attachment.)
func (m *Machine) runtimeShowsUse(att ipam.Attachment) bool {
	ev := m.st.Sandboxes()
	if !ev.Known || !att.Key.IsRebuilt() {
		return false
	}
	if ev.Shows(att.Pod.UID) {
		return true
	}
	uses := ev.Uses()
	for _, ad := range att.Addresses {
		if uses.Contains(ad.Addr) {
			return true
		}
	}
	return false
}

func (m *Machine) write(owner uint64, ch ipam.Change, lazy, add bool) {
	w := m.id()
	m.writes[w] = owner
	m.rd.Writes = append(m.rd.Writes, Write{ID: w, Change: ch, Lazy: lazy, Add: add})
}

// tryDel plans DEL (or conditional free) r.
func (m *Machine) tryDel(r *mreq) {
	att, found := m.st.Attachment(r.key)
	if r.kind == reqFreeIf && found && (m.st.Pending(r.key) || m.runtimeShowsUse(att) || !r.accept(att)) {
		m.answer(Answer{ID: r.id})
		m.finish(r)
		return
	}
	plan, err := m.st.PlanDel(r.key, m.now)
	var inFlight *ipam.InFlightError
	if errors.As(err, &inFlight) {
		// A rebuild moving one of its addresses to a pod that reports it holds it
		// (ipam.PlanRebuild): wait for its journal write, then decide again.
		m.wait(r, true)
		return
	}
	if err != nil || !plan.Found {
		if r.kind != reqDel {
			m.answer(Answer{ID: r.id, Err: err})
			m.finish(r)
			return
		}
		if err != nil {
			m.reply(r, errResp(cniproto.CodeTryAgainLater, "ipwarden: cannot release the attachment: "+err.Error(),
				"the addresses stay assigned; the runtime retries DEL"))
			return
		}
		m.reply(r, &cniproto.Response{})
		return
	}
	r.stage, r.att, r.plan = stageWriting, att, plan
	if r.kind == reqDel {
		// Answered at once: the addresses stay assigned, in memory and on disk, until the write
		// lands, and the attachment stays busy until then.
		m.answer(Answer{ID: r.id, Resp: &cniproto.Response{}})
		m.delsOpen[r.id] = true
		m.metrics.ReleasesInFlight.Inc()
	}
	m.write(r.id, plan.Changes(), r.kind == reqDel, false)
	if m.st.HandedBack() != nil {
		m.rd.Writes[len(m.rd.Writes)-1].Release = &att
	}
	m.rd.Writes[len(m.rd.Writes)-1].Unreserve = m.withoutShared(reserveOf(att, addr.Set{}))
}

// Written is the outcome of journal write id.
func (m *Machine) Written(id uint64, err error, now time.Time) {
	m.now = now
	owner, ok := m.writes[id]
	if !ok {
		return
	}
	delete(m.writes, id)
	if f := m.factOf(owner); f != nil {
		m.factWritten(f, err)
		return
	}
	r := m.reqs[owner]
	if r == nil {
		return
	}
	what := map[reqKind]string{reqAdd: "add", reqDel: "del", reqFreeIf: "del", reqPrepare: "prepare", reqUnprepare: "del"}[r.kind]
	if err != nil {
		m.st.Abort(r.plan)
		if !isReserveError(err) {
			m.metrics.JournalRefused.WithLabelValues(what).Inc()
		}
	} else {
		m.st.Apply(r.plan)
	}
	switch r.kind {
	case reqAdd:
		m.addWritten(r, err)
	case reqPrepare:
		m.prepareWritten(r, err)
	default:
		m.delWritten(r, err)
	}
	m.changed()
}

// addWritten answers ADD r once its write landed or was refused.
func (m *Machine) addWritten(r *mreq, err error) {
	if err != nil && m.reserveRefused(r, err) {
		return
	}
	if err != nil {
		m.reply(r, errResp(cniproto.CodeTryAgainLater, "ipwarden: cannot record the attachment in the journal: "+cniproto.Truncate(err.Error(), 300),
			"nothing was handed out; check the agent's --state-dir disk"))
		return
	}
	att := r.att
	m.log.V(1).Info("ADD", "attachment", cniproto.Truncate(r.key.String(), logIDBytes), "pod", att.Pod.String(), "addresses", fmtAddresses(att.Addresses))
	if att.Claim != nil {
		// A VM's address (rare, and the one an operator asks about later).
		m.log.Info("handed out an IPAMClaim's address", "attachment", cniproto.Truncate(r.key.String(), logIDBytes), "pod", att.Pod.String(),
			"claim", att.Claim.String(), "uid", att.Claim.UID, "addresses", fmtAddresses(att.Addresses), "migrationTarget", att.Claim.MigrationTarget)
	}
	if on, _ := m.st.Hold(); on {
		m.evaluateHold()
	}
	m.rd.Kick = true
	m.answer(Answer{ID: r.id, Resp: m.result(att), Att: &att})
	m.finish(r)
}

// delWritten finishes DEL (or conditional free) r once its write landed or was refused.
func (m *Machine) delWritten(r *mreq, err error) {
	att := r.att
	if r.kind == reqDel {
		delete(m.delsOpen, r.id)
		m.metrics.ReleasesInFlight.Dec()
		m.releaseBarriers()
		if err != nil {
			m.log.Error(err, "the journal refused a DEL already answered: its addresses stay assigned until the leak collector frees them",
				"attachment", cniproto.Truncate(r.key.String(), logIDBytes), "pod", att.Pod.String(), "addresses", fmtAddresses(att.Addresses))
		}
	} else if err != nil {
		m.answer(Answer{ID: r.id, Err: err})
	} else {
		m.answer(Answer{ID: r.id, Att: &att})
	}
	if err == nil {
		m.log.V(1).Info("DEL", "attachment", r.key.String(), "pod", att.Pod.String(), "addresses", fmtAddresses(att.Addresses))
		m.rd.Kick = true
	}
	m.finish(r)
}

// Barrier returns an id answered once every DEL answered before it is journaled.
func (m *Machine) Barrier(now time.Time) uint64 {
	m.now = now
	b := mbarrier{id: m.id(), dels: make(map[uint64]bool, len(m.delsOpen))}
	for id := range m.delsOpen {
		b.dels[id] = true
	}
	m.barriers = append(m.barriers, b)
	m.releaseBarriers()
	return b.id
}

func (m *Machine) releaseBarriers() {
	kept := m.barriers[:0]
	for _, b := range m.barriers {
		for id := range b.dels {
			if !m.delsOpen[id] {
				delete(b.dels, id)
			}
		}
		if len(b.dels) > 0 {
			kept = append(kept, b)
			continue
		}
		m.answer(Answer{ID: b.id})
	}
	m.barriers = kept
}

// --- facts -------------------------------------------------------------------------------------

// Fact queues a fact or a rebuild: plan runs when its turn comes (against the state the facts
// before it left), its change is journaled, the plan applied, then applied runs; the answer
// carries the journal's refusal.
func (m *Machine) Fact(what string, plan func(m *Machine) ipam.Plan, applied func(m *Machine, p ipam.Plan, a *Answer), now time.Time) uint64 {
	m.now = now
	f := &mfact{id: m.id(), what: what, plan: plan, applied: applied}
	m.facts = append(m.facts, f)
	m.nextFact()
	return f.id
}

func (m *Machine) factOf(id uint64) *mfact {
	if m.factBusy && len(m.facts) > 0 && m.facts[0].id == id {
		return m.facts[0]
	}
	return nil
}

// nextFact plans the facts whose turn came: one with an empty change applies at once and
// changes no address (waiting ADDs are not tried again for it: a pod event or a monitor round
// that changes nothing costs no retries).
func (m *Machine) nextFact() {
	for !m.factBusy && len(m.facts) > 0 {
		f := m.facts[0]
		f.plan0 = f.plan(m)
		if f.plan0 == nil || isEmpty(f.plan0) {
			// Nothing to journal: applied at once.
			m.facts = m.facts[1:]
			if f.plan0 != nil {
				m.st.Apply(f.plan0)
			}
			a := Answer{ID: f.id}
			if f.applied != nil {
				f.applied(m, f.plan0, &a)
			}
			m.answer(a)
			continue
		}
		m.factBusy = true
		m.write(f.id, f.plan0.Changes(), false, false)
	}
}

func (m *Machine) factWritten(f *mfact, err error) {
	m.factBusy = false
	m.facts = m.facts[1:]
	a := Answer{ID: f.id, Err: err}
	if err != nil {
		m.st.Abort(f.plan0)
		m.metrics.JournalRefused.WithLabelValues(f.what).Inc()
		m.log.Error(err, "the journal refused a change of the node's state; the state is unchanged and the change is retried", "change", f.what)
	} else {
		m.st.Apply(f.plan0)
		if f.applied != nil {
			f.applied(m, f.plan0, &a)
		}
	}
	m.answer(a)
	m.changed()
	m.nextFact()
}

// --- the hold ----------------------------------------------------------------------------------

// StartHold begins the unattributed hold after a rebuild of a lost or damaged journal (see
// ipam.StartHold), or resumes one a restart interrupted, until until at the latest.
func (m *Machine) StartHold(until, now time.Time) {
	m.now = now
	n := m.st.StartHold(until)
	if n == 0 {
		m.log.Info("rebuilt journal: every held address is accounted for; no hold")
		m.marker(time.Time{})
		return
	}
	m.marker(until)
	m.holdPastDeadline = false
	m.metrics.HoldActive.Set(1)
	ev := m.st.Sandboxes()
	m.log.Info("rebuilt journal: holding addresses of unknown owner out of use until every pod that may run is accounted for on each pool's network (docs/design.md, \"The node forgets\")",
		"addresses", n, "until", until.UTC().Format(time.RFC3339), "runtimeAsked", ev.Known, "runtimeSandboxes", len(ev.Sandboxes))
	if m.evaluateHold() {
		m.changed()
	}
}

func (m *Machine) marker(until time.Time) {
	if m.cfg.HoldMarker {
		m.rd.Marker = &until
	}
}

// evaluateHold frees what may leave the unattributed hold now and ends the hold when nothing is
// left (ipam.DecideHold); it says whether it freed anything.
func (m *Machine) evaluateHold() bool {
	if on, _ := m.st.Hold(); !on {
		return false
	}
	d := m.st.EvaluateHold(m.now)
	if !d.Release {
		if d.Reason == ipam.HoldReasonDeadline && !m.holdPastDeadline {
			m.holdPastDeadline = true
			left := 0
			for _, st := range m.st.Stats(m.now) {
				left += st.Unattributed
			}
			m.log.Info("the hold's deadline (--rebuild-hold) passed; addresses the runtime shows in use, and a secondary network's addresses while sandboxes that predate the lost journal run without network-status, stay held",
				"held", left, "freed", d.Freed())
			m.rd.Events = append(m.rd.Events, NodeEvent{Type: corev1.EventTypeWarning, Reason: ReasonHoldExpired, Message: fmt.Sprintf(
				"the hold after the journal was rebuilt reached --rebuild-hold with %d addresses still possibly in use: they stay held while the container runtime shows sandboxes that predate the lost journal "+
					"and their pods report nothing on those addresses' networks (Multus' network-status); they are freed once those sandboxes are gone", left)})
		}
		if n := d.Freed(); n > 0 {
			kv := []any{"addresses", n}
			for pool, free := range d.Free {
				if !free.IsEmpty() {
					kv = append(kv, "pool."+pool, free.String())
				}
			}
			m.log.Info("addresses left the unattributed hold: every pod that may run is accounted for on their pools' networks, and nothing on the node uses them", kv...)
			m.rd.Kick = true
			m.rd.Changed = true
			return true
		}
		return false
	}
	m.metrics.HoldActive.Set(0)
	m.marker(time.Time{})
	kv := []any{"reason", d.Reason}
	if len(d.Waiting) > 0 {
		kv = append(kv, "unreported", len(d.Waiting), "firstUnreported", d.Waiting[0].String())
	}
	m.log.Info("unattributed hold ended: the held addresses are free", kv...)
	if d.Reason == ipam.HoldReasonDeadline && len(d.Waiting) > 0 {
		names := make([]string, 0, 5)
		for i, p := range d.Waiting {
			if i == 5 {
				names = append(names, fmt.Sprintf("and %d more", len(d.Waiting)-5))
				break
			}
			names = append(names, p.String())
		}
		m.rd.Events = append(m.rd.Events, NodeEvent{Type: corev1.EventTypeWarning, Reason: ReasonHoldExpired, Message: fmt.Sprintf(
			"the hold after the journal was rebuilt ran out (--rebuild-hold) with pods that never reported their addresses (%s); "+
				"the node's addresses of unknown owner are free again: if one of those pods runs, check it with `ipwarden check`",
			strings.Join(names, ", "))})
	}
	m.rd.Kick = true
	m.rd.Changed = true
	return true
}

// --- answers -----------------------------------------------------------------------------------

// result renders att as the plugin's ADD answer.
func (m *Machine) result(att ipam.Attachment) *cniproto.Response {
	cfgs := map[string]ipam.Pool{}
	for _, a := range att.Addresses {
		cfgs[a.Pool], _ = m.st.PoolConfig(a.Pool)
	}
	return result(att, cfgs)
}

// shortMessage says which pools are short and why.
func (m *Machine) shortMessage(short *ipam.ShortError, now time.Time) string {
	parts := make([]string, len(short.Pools))
	for i, p := range short.Pools {
		parts[i] = fmt.Sprintf("pool %s: %s", p, m.st.Reason(p, now))
	}
	for _, w := range short.Wanted {
		parts = append(parts, fmt.Sprintf("static address %s of pool %s: the controller has not moved it to this node yet (is ipwarden controller running?)", w.Addr, w.Pool))
	}
	if len(short.Pools) == 0 && len(short.Wanted) == 0 && len(short.Claims) > 0 {
		// A claim's ADD waits for the controller's record and grant, never for a free address.
		var cs []string
		for _, c := range short.Claims {
			cs = append(cs, ipam.ClaimWaitMessage(c))
		}
		return "ipwarden: " + strings.Join(cs, "; ") + " on node " + m.cfg.Node + " (is ipwarden controller running?)"
	}
	for _, c := range short.Claims {
		parts = append(parts, ipam.ClaimWaitMessage(c))
	}
	return "ipwarden: no free address on node " + m.cfg.Node + ": " + strings.Join(parts, "; ")
}

// checkAnswer answers CHECK r: the attachment exists and holds the addresses of prevResult.
func (m *Machine) checkAnswer(r *mreq) *cniproto.Response {
	att, err := m.st.Check(r.key)
	if err != nil {
		return errResp(cniproto.CodeUnknownContainer, "ipwarden: "+err.Error(), "the runtime should recreate the sandbox")
	}
	return checkPrev(r.key, att, r.check)
}

func isEmpty(p ipam.Plan) bool { ch := p.Changes(); return ch.IsEmpty() }

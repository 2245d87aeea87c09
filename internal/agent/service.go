package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/gc"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/agent/journal"
	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// Committer writes state machine changes durably; the journal implements it.
type Committer interface {
	Commit(ipam.Change) error
}

// lazyCommitter is a Committer that can let a change wait briefly for company
// (journal.Journal.CommitLazy).
type lazyCommitter interface {
	CommitLazy(ipam.Change) error
}

// Service answers the CNI plugin's requests from the node's state: it owns the ipam.State, writes
// every change to the journal before it applies it (an ADD answered early hands out only
// addresses the journal already reserves, and a DEL answered early keeps its addresses assigned
// until its write lands), serializes requests per attachment, and lets an ADD wait a bounded time
// for addresses. The Kubernetes side feeds it pools, holdings and pods.
type Service struct {
	node        string
	journal     Committer
	now         func() time.Time
	addressWait time.Duration
	gcGrace     time.Duration
	gcDryRunOn  bool
	rebuildHold time.Duration
	holdDir     string
	netnsDirs   []string
	gcr         *gcReporter
	log         logr.Logger
	metrics     *Metrics

	// factMu serializes the plans of facts read from the API server and of rebuilds (SetPools,
	// SetHoldings, NoteSpecWritten, rebuild) from plan to apply: each is planned against the
	// state the one before left. CNI requests never take it.
	factMu sync.Mutex

	mu      sync.Mutex
	st      *ipam.State
	changed chan struct{} // closed and replaced whenever an address may have become usable

	// hooks are the functions the parts around the service hand it, set once they exist and
	// read without s.mu (an ADD takes s.mu only to plan and to apply); hooksMu serializes the
	// setters.
	hooks   atomic.Pointer[hooks]
	hooksMu sync.Mutex

	keys  keyLocks
	rel   releases // DELs answered before their journal write finished
	ready atomic.Bool
	gate  gate
	// conflicts remembers reported conflicts so each is logged once.
	conflicts map[ipam.Address]ipam.Key
	// prev reads the previous IPAM's reservations at ADDs (previous.go).
	prev previousReads
}

// ServiceOptions configure NewService.
type ServiceOptions struct {
	Node string
	// AddressWait bounds how long an ADD waits for the controller when the node has no free
	// address.
	AddressWait time.Duration
	// GCGrace protects attachments younger than it from CNI GC.
	GCGrace time.Duration
	// GCDryRun makes the leak collector and CNI GC report what they would free and free nothing.
	GCDryRun bool
	// RebuildHold bounds the unattributed hold after a rebuild of the journal (default 5m).
	RebuildHold time.Duration
	// HoldDir is where the hold's marker lives (the state directory; "" keeps no marker), so an
	// agent restarted during the hold holds again.
	HoldDir string
	// NetnsDirs: where LIST looks for the attachments' network namespaces (default
	// DefaultNetnsDirs).
	NetnsDirs []string
	// LeaseNamespace is the namespace of the node's Lease, for error messages.
	LeaseNamespace string
	// Gated: ADD is served only as the gate allows (the node's Lease, the first reconciliation
	// or a journal with holdings; see gate). Run sets it; tests of the request paths leave it off.
	Gated bool
	// Now is the clock (time.Now when nil).
	Now     func() time.Time
	Log     logr.Logger
	Metrics *Metrics
}

// NewService returns a service over st (already restored from the journal).
func NewService(st *ipam.State, journal Committer, opts ServiceOptions) *Service {
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Metrics == nil {
		opts.Metrics = NewMetrics(nil)
	}
	if opts.RebuildHold <= 0 {
		opts.RebuildHold = 5 * time.Minute
	}
	if opts.NetnsDirs == nil {
		opts.NetnsDirs = DefaultNetnsDirs
	}
	if m := st.HandedBack(); m != nil {
		opts.Metrics.HandedBack.Set(1)
		opts.Log.Info("the node is handed back: every ADD is refused until the handback is undone", "to", m.To, "network", m.Network,
			"at", m.At.UTC().Format(time.RFC3339))
	}
	return &Service{
		node:        opts.Node,
		journal:     journal,
		now:         opts.Now,
		addressWait: opts.AddressWait,
		gcGrace:     opts.GCGrace,
		gcDryRunOn:  opts.GCDryRun,
		rebuildHold: opts.RebuildHold,
		holdDir:     opts.HoldDir,
		netnsDirs:   opts.NetnsDirs,
		gcr:         newGCReporter(opts.Log.WithName("gc"), opts.Metrics),
		log:         opts.Log,
		metrics:     opts.Metrics,
		st:          st,
		changed:     make(chan struct{}),
		conflicts:   map[ipam.Address]ipam.Key{},
		gate:        gate{node: opts.Node, leaseNS: opts.LeaseNamespace, enforce: opts.Gated},
	}
}

// hooks are the functions the parts around the service hand it.
type hooks struct {
	// kick and kickNow ask the pool monitor for a round (Monitor.Kick, Monitor.KickNow).
	kick, kickNow func()
	// lookup reads a pod from the API server (Kube.GetPod); CNI GC re-checks candidates with it.
	lookup func(context.Context, gc.Name) gc.Lookup
	// podMeta reads a pod's annotations and namespace for pool choice (Kube.PodMeta).
	podMeta func(ctx context.Context, namespace, name, uid string) (ipam.PodMeta, error)
}

func (s *Service) getHooks() hooks {
	if h := s.hooks.Load(); h != nil {
		return *h
	}
	return hooks{}
}

// setHook changes the hooks with set.
func (s *Service) setHook(set func(*hooks)) {
	s.hooksMu.Lock()
	defer s.hooksMu.Unlock()
	h := s.getHooks()
	set(&h)
	s.hooks.Store(&h)
}

// SetKick sets the functions that ask the pool monitor to recompute the node's request: kick
// soon (changes coalesce), and now, for an ADD that waits for an address (Monitor.Kick and
// Monitor.KickNow).
func (s *Service) SetKick(kick, now func()) {
	s.setHook(func(h *hooks) { h.kick, h.kickNow = kick, now })
}

func (s *Service) kick() {
	if f := s.getHooks().kick; f != nil {
		f()
	}
}

func (s *Service) kickNow() {
	if f := s.getHooks().kickNow; f != nil {
		f()
	}
}

// SetReady marks the service as serving (after the start-up reconciliation).
func (s *Service) SetReady(ready bool) { s.ready.Store(ready) }

// Ready reports whether the service serves.
func (s *Service) Ready() bool { return s.ready.Load() }

// notifyLocked wakes every waiting ADD. s.mu must be held.
func (s *Service) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// roundResult is what one pool monitor round needs from the state.
type roundResult struct {
	marked      map[string]addr.Set // addresses newly marked releasing, per pool
	spec        []ipam.PoolRequest
	nextCooled  time.Time
	nextRelease time.Time // when a pool's release delay ends (zero: none runs)
	stats       []ipam.PoolStats
	attachments int
	handback    *ipam.HandbackMark // the handback mark, nil when none
}

// releaseRound marks what is beyond each pool's target as releasing (plan, journal, then apply
// or abort: the marks are undone when the journal write fails) and returns the request to
// publish. The target counted addresses cooling at the state's clock, which is at least now:
// every one of them leaves its cooldown no earlier than nextCooled.
func (s *Service) releaseRound() (roundResult, error) {
	s.mu.Lock()
	now := s.now()
	plan := s.st.Release(now)
	s.mu.Unlock()
	if !plan.Change.IsEmpty() {
		if err := s.commit(plan, "release"); err != nil {
			return roundResult{}, fmt.Errorf("journal the addresses to release: %w", err)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return roundResult{
		marked:      plan.Marked,
		spec:        s.st.Spec(),
		nextCooled:  s.st.NextCooled(now),
		nextRelease: s.st.NextRelease(),
		stats:       s.st.Stats(s.now()),
		attachments: s.st.NumAttachments(),
		handback:    s.st.HandedBack(),
	}, nil
}

// recordUse is what re-creating the node's NodeIPAllocation needs: the record mark (set once the
// node had one) and how many attachments use addresses.
func (s *Service) recordUse() (ipam.RecordMark, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.st.Mark(), s.st.NumAttachments()
}

// servedSummary is the pools the node serves, the number of attachments, and which of names
// are not pools the agent knows.
func (s *Service) servedSummary(names []string) (served []string, attachments int, unknown []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, n := range names {
		if _, ok := s.st.PoolConfig(n); !ok {
			unknown = append(unknown, n)
		}
	}
	return s.st.Served(), s.st.NumAttachments(), unknown
}

// demand is the named pool's demand (tests).
func (s *Service) demand(pool string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.st.Demand(pool)
}

// ObservedPools is ipam.State.Observed: the pools whose running pods' addresses the node has
// recorded; read it before Spec so the claims written with it account for them.
func (s *Service) ObservedPools() []ipam.ObservedPool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.st.Observed()
}

// Spec is the node's request as the state computes it now (requested, releasing, claimed).
func (s *Service) Spec() []ipam.PoolRequest {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.st.Spec()
}

// commit runs the one commit protocol (package ipam, plan.go) for a plan made under the lock:
// journal it outside the lock, then apply it, or abort it when the journal refused it (counted
// by change, what). A plan that changes something wakes the waiting ADDs.
func (s *Service) commit(p ipam.Plan, what string) error {
	return s.commitThen(p, what, nil)
}

// commitThen is commit, running applied (when set) under the same hold of the lock once the plan
// is applied.
func (s *Service) commitThen(p ipam.Plan, what string, applied func()) error {
	return s.commitVia(p, what, applied, s.journal.Commit)
}

// commitVia is commitThen writing the journal with write.
func (s *Service) commitVia(p ipam.Plan, what string, applied func(), write func(ipam.Change) error) error {
	ch := p.Changes()
	err := write(ch)
	s.mu.Lock()
	if err != nil {
		s.st.Abort(p)
	} else {
		s.st.Apply(p)
		if applied != nil {
			applied()
		}
	}
	if !ch.IsEmpty() {
		s.notifyLocked()
	}
	s.mu.Unlock()
	if err != nil {
		s.metrics.JournalRefused.WithLabelValues(what).Inc()
	}
	return err
}

// commitFact commits the plan of a fact read from the API server, or of a rebuild, and logs a
// refusal: the state is as it was, and the caller's next reading retries.
func (s *Service) commitFact(p ipam.Plan, what string) error {
	err := s.commit(p, what)
	if err != nil {
		s.log.Error(err, "the journal refused a change of the node's state; the state is unchanged and the change is retried", "change", what)
	}
	return err
}

// SetPools hands the service the pools' settings and the pools that select the node. When the
// journal refuses them the state keeps the settings it had, and the error is returned.
func (s *Service) SetPools(pools []ipam.Pool, served []string) error {
	s.factMu.Lock()
	defer s.factMu.Unlock()
	s.mu.Lock()
	plan := s.st.PlanPools(pools, served)
	s.mu.Unlock()
	if err := s.commitFact(plan, "pools"); err != nil {
		return fmt.Errorf("journal the pools' settings: %w", err)
	}
	s.kick()
	return nil
}

// RecordOf identifies the NodeIPAllocation a holding was read from: its UID and generation,
// and whether it is older than the node's own record mark (ipam.IsRewound), confirmed by a fresh
// read from the API server.
type RecordOf struct {
	UID        string
	Generation int64
	Rewound    bool
}

// Rewound says whether an object (uid, generation) is older than the node's record mark.
func (s *Service) Rewound(uid string, generation int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.st.Rewound(uid, generation)
}

// SetRecordMissing tells the service whether the node's NodeIPAllocation is missing; while it
// is, no address is handed out of the free set.
func (s *Service) SetRecordMissing(missing bool) {
	s.mu.Lock()
	was := s.st.RecordMissing()
	s.st.SetRecordMissing(missing)
	s.notifyLocked()
	s.mu.Unlock()
	if missing && !was {
		s.log.Info("the node's NodeIPAllocation is missing: no new address is handed out until it is back", "nodeIPAllocation", s.node)
	}
}

// NoteSpecWritten records that the agent wrote its spec to the object uid, producing
// generation: the record mark that later reads are compared with. When the journal refuses it
// the mark stays where it was (logged and counted); the next reading of the record
// (SetHoldings) or spec write moves it.
func (s *Service) NoteSpecWritten(uid string, generation int64) {
	s.factMu.Lock()
	defer s.factMu.Unlock()
	s.mu.Lock()
	m, moves := ipam.NextMarkOnWrite(s.st.Mark(), uid, generation)
	var plan ipam.MarkPlan
	if moves {
		plan = s.st.PlanMark(m)
	}
	s.mu.Unlock()
	if !moves {
		return
	}
	_ = s.commitFact(plan, "mark")
}

// SetHoldings hands the service what the controller reports the node holds, per pool; pools
// missing from holdings but known to the state hold nothing. rec says which object it came
// from: a rewound one's extra addresses are distrusted first (ipam.State.PlanHoldings), and the
// record mark moves to it. Holdings and mark are journaled together, then applied; when the
// journal refuses them the state is as it was and the error is returned.
func (s *Service) SetHoldings(holdings map[string]addr.Set, rec RecordOf) error {
	s.factMu.Lock()
	defer s.factMu.Unlock()
	s.mu.Lock()
	plan := s.st.PlanHoldings(holdings, rec.Rewound, s.now())
	batch := ipam.Batch{plan}
	if m, moves := ipam.NextMarkOnRead(s.st.Mark(), rec.UID, rec.Generation, rec.Rewound); moves {
		batch = append(batch, s.st.PlanMark(m))
	}
	s.mu.Unlock()
	if err := s.commitFact(batch, "holdings"); err != nil {
		return fmt.Errorf("journal the node's holdings: %w", err)
	}
	if rec.Rewound {
		s.metrics.RecordRewinds.Inc()
		s.log.Info("the node's NodeIPAllocation is older than this node's last write (etcd restored, or the object re-created): "+
			"addresses it shows that the node had given back are released again, and addresses its pods use are claimed",
			"uid", rec.UID, "generation", rec.Generation, "released", fmtSets(plan.Distrusted))
	}
	s.mu.Lock()
	s.st.SetRecordMissing(false)
	s.reportConflictsLocked()
	s.notifyLocked()
	s.mu.Unlock()
	s.kick()
	return nil
}

// reportConflictsLocked logs attachments whose addresses the node no longer holds, once each.
// A running pod keeps its address; the conflict shows in the metrics until it is freed.
func (s *Service) reportConflictsLocked() {
	now := map[ipam.Address]ipam.Key{}
	for _, st := range s.st.Stats(s.now()) {
		for a, k := range s.st.Conflicts(st.Pool) {
			ad := ipam.Address{Pool: st.Pool, Addr: a}
			now[ad] = k
			if _, seen := s.conflicts[ad]; !seen {
				att, _ := s.st.Attachment(k)
				if k.IsRebuilt() {
					// Recorded from the pod's status (a pod of the previous IPAM, or a lost
					// journal): the node claims it; only a claim the controller cannot grant
					// is a conflict (it reports those).
					s.log.Info("claiming an address a running pod reports that the node does not hold",
						"pool", st.Pool, "address", a.String(), "pod", att.Pod.String(), "podUID", att.Pod.UID)
					continue
				}
				s.log.Error(nil, "conflict: an attachment uses an address the node no longer holds; it keeps serving the pod",
					"pool", st.Pool, "address", a.String(), "attachment", k.String(), "pod", att.Pod.String(), "podUID", att.Pod.UID)
				s.metrics.Conflicts.Inc()
			}
		}
	}
	s.conflicts = now
}

// SetPods hands the service the pods bound to the node. The addresses running pods report that no
// attachment accounts for are recorded, as at start-up (Rebuild), on every call: a pod that got its
// address from the previous IPAM (the node's CNI configuration was switched to ipwarden while it
// ran, or the pod started before the switch reached the node) is adopted as soon as it reports
// one, so its address is claimed and never handed to another pod (docs/operations.md, "Moving from
// another IPAM"). During the unattributed hold the hold is evaluated after.
func (s *Service) SetPods(pods []ipam.Pod) {
	s.mu.Lock()
	s.st.SetPods(pods)
	on, _ := s.st.Hold()
	s.mu.Unlock()
	if _, err := s.rebuild(pods, 1); err != nil {
		if on {
			s.log.Error(err, "cannot journal attachments rebuilt during the unattributed hold; the hold stays on")
		} else {
			s.log.Error(err, "cannot journal the attachments of pods whose addresses no attachment accounts for; the next pod event retries")
		}
	} else if on {
		s.evaluateHold()
	}
	s.kick()
}

// SetNamespaces hands the service the namespaces, for the pool choice of the node's pods.
func (s *Service) SetNamespaces(ns map[string]ipam.Namespace) {
	s.mu.Lock()
	s.st.SetNamespaces(ns)
	s.mu.Unlock()
}

// SetRefused hands the service the wanted addresses the controller refused, per pool.
func (s *Service) SetRefused(refused map[string]map[netip.Addr]string) {
	s.mu.Lock()
	s.st.SetRefused(refused)
	s.notifyLocked() // a waiting ADD for a refused address fails now
	s.mu.Unlock()
}

// SetWantedElsewhere hands the service the held addresses other nodes' pods ask for by name;
// the pool monitor gives back those no attachment uses.
func (s *Service) SetWantedElsewhere(m map[string]addr.Set) {
	s.mu.Lock()
	s.st.SetWantedElsewhere(m)
	s.mu.Unlock()
	s.kick()
}

// SetPodMeta sets how an ADD reads its pod's annotations and namespace (Kube.PodMeta).
func (s *Service) SetPodMeta(f func(ctx context.Context, namespace, name, uid string) (ipam.PodMeta, error)) {
	s.setHook(func(h *hooks) { h.podMeta = f })
}

// ReasonHoldExpired is the Warning event on the node's NodeIPAllocation when the hold after a
// rebuild ran out with pods that never reported their addresses.
const ReasonHoldExpired = "UnattributedHoldExpired"

// SetPodLookup sets how CNI GC reads a pod from the API server before it frees an attachment.
func (s *Service) SetPodLookup(f func(context.Context, gc.Name) gc.Lookup) {
	s.setHook(func(h *hooks) { h.lookup = f })
}

// StartHold begins the unattributed hold after a rebuild of a lost or damaged journal (see
// ipam.StartHold), or resumes one a restart interrupted: held addresses no attachment accounts
// for stay out of use until every pod on the node has reported its addresses or is gone, at the
// latest until until (now + --rebuild-hold for a new hold). A marker in HoldDir records the hold
// until it ends.
func (s *Service) StartHold(until time.Time) {
	s.mu.Lock()
	now := s.now()
	n := s.st.StartHold(until)
	s.mu.Unlock()
	if n == 0 {
		s.log.Info("rebuilt journal: every held address is accounted for; no hold")
		s.clearHoldMarker()
		return
	}
	if s.holdDir != "" {
		if err := journal.MarkHold(s.holdDir, until); err != nil {
			s.log.Error(err, "cannot record the hold in the state directory; a restart during the hold would not resume it")
		}
	}
	s.watchHold("rebuilt journal: holding addresses of unknown owner out of use until every pod on the node has reported its addresses or is gone",
		n, now, until)
}

// watchHold reports a hold that started at now, holding n addresses until until at the latest
// (the metric, the log line msg), and evaluates it now and at its deadline.
func (s *Service) watchHold(msg string, n int, now, until time.Time) {
	s.metrics.HoldActive.Set(1)
	s.log.Info(msg, "addresses", n, "until", until.UTC().Format(time.RFC3339))
	time.AfterFunc(until.Sub(now), s.evaluateHold)
	s.evaluateHold()
}

func (s *Service) clearHoldMarker() {
	if s.holdDir == "" {
		return
	}
	if err := journal.ClearHold(s.holdDir); err != nil {
		s.log.Error(err, "cannot remove the hold marker; the next start holds again")
	}
}

// evaluateHold ends the unattributed hold when its condition holds, and reports it.
func (s *Service) evaluateHold() {
	s.mu.Lock()
	d := s.st.EvaluateHold(s.now())
	if d.Release {
		s.notifyLocked()
	}
	s.mu.Unlock()
	if !d.Release {
		return
	}
	s.metrics.HoldActive.Set(0)
	s.clearHoldMarker()
	kv := []any{"reason", d.Reason}
	if len(d.Waiting) > 0 {
		kv = append(kv, "unreported", len(d.Waiting), "firstUnreported", d.Waiting[0].String())
	}
	s.log.Info("unattributed hold ended: the held addresses are free", kv...)
	if d.Reason == ipam.HoldReasonDeadline && len(d.Waiting) > 0 {
		names := make([]string, 0, 5)
		for i, p := range d.Waiting {
			if i == 5 {
				names = append(names, fmt.Sprintf("and %d more", len(d.Waiting)-5))
				break
			}
			names = append(names, p.String())
		}
		s.gcr.event(nil, corev1.EventTypeWarning, ReasonHoldExpired, fmt.Sprintf(
			"the hold after the journal was rebuilt ran out (--rebuild-hold) with pods that never reported their addresses (%s); "+
				"the node's addresses of unknown owner are free again: if one of those pods runs, check it with `ipwarden check`",
			strings.Join(names, ", ")))
	}
	s.kick()
}

// holdStatus reports the hold for LIST, or nil.
func (s *Service) holdStatusLocked() *cniproto.Hold {
	on, until := s.st.Hold()
	if !on {
		return nil
	}
	h := &cniproto.Hold{Until: until}
	for _, st := range s.st.Stats(s.now()) {
		h.Addresses += st.Unattributed
	}
	waiting := s.st.HoldWaiting()
	for i, p := range waiting {
		if i == 20 {
			h.MoreWaiting = len(waiting) - 20
			break
		}
		h.WaitingFor = append(h.WaitingFor, p.String())
	}
	return h
}

// Rebuild records attachments for running pods whose addresses no attachment accounts for (see
// ipam.State.Rebuild) and journals them before the service serves.
func (s *Service) Rebuild(pods []ipam.Pod) (int, error) {
	return s.rebuild(pods, 0)
}

// rebuild is Rebuild with its problems logged at verbosity v (the hold repeats it on every pod
// event, so it logs them only at debug level). It plans the rebuild (reserving what it touches),
// journals it, then applies it; when the journal refuses it nothing was recorded.
func (s *Service) rebuild(pods []ipam.Pod, v int) (int, error) {
	s.factMu.Lock()
	defer s.factMu.Unlock()
	s.mu.Lock()
	plan := s.st.PlanRebuild(pods, s.now(), func(netns string) ipam.Sandbox {
		switch lookSandbox(netns, s.netnsDirs) {
		case gc.SandboxExists:
			return ipam.SandboxExists
		case gc.SandboxGone:
			return ipam.SandboxGone
		}
		return ipam.SandboxUnknown
	})
	s.mu.Unlock()
	for _, p := range plan.Problems {
		s.log.V(v).Info("rebuild: " + p)
	}
	if err := s.commitFact(plan, "rebuild"); err != nil {
		return 0, fmt.Errorf("journal rebuilt attachments: %w", err)
	}
	for _, a := range plan.Change.PutAttachments {
		if !a.Key.IsRebuilt() {
			continue // an attachment of another pod that lost an address the pod's report won
		}
		s.log.Info("recorded an attachment from the pod's status.podIPs (a pod the journal did not know: taken over from the previous IPAM, or a lost journal)",
			"pod", a.Pod.String(), "podUID", a.Pod.UID, "addresses", fmtAddresses(a.Addresses))
	}
	return len(plan.Change.PutAttachments), nil
}

func fmtAddresses(as []ipam.Address) string {
	parts := make([]string, len(as))
	for i, a := range as {
		parts[i] = a.Pool + "=" + a.Addr.String()
	}
	return strings.Join(parts, ",")
}

// Handle answers one plugin request.
func (s *Service) Handle(ctx context.Context, req cniproto.Request) *cniproto.Response {
	resp, _ := s.HandleRequest(ctx, req)
	return resp
}

// HandleRequest answers one plugin request. For an ADD that created an attachment it also
// returns undo, which rolls the attachment back (journal and state) when the answer cannot reach
// the plugin.
func (s *Service) HandleRequest(ctx context.Context, req cniproto.Request) (resp *cniproto.Response, undo func()) {
	start := s.now()
	if req.Op == cniproto.OpAdd {
		resp, undo = s.addRequest(ctx, req)
	} else {
		resp = s.handle(ctx, req)
	}
	if req.Op == cniproto.OpAdd || req.Op == cniproto.OpDel || req.Op == cniproto.OpCheck || req.Op == cniproto.OpGC {
		s.metrics.OpDuration.WithLabelValues(string(req.Op)).Observe(s.now().Sub(start).Seconds())
	}
	if resp.Error != nil {
		s.metrics.Errors.WithLabelValues(string(req.Op), fmt.Sprint(resp.Error.Code)).Inc()
		s.log.Info("request failed", "op", req.Op, "containerID", cniproto.Truncate(req.ContainerID, logIDBytes), "ifname", req.IfName,
			"pod", req.Pod.Namespace+"/"+req.Pod.Name, "code", resp.Error.Code, "error", resp.Error.Msg)
	}
	return resp, undo
}

// addRequest runs an ADD and, when it created an attachment, returns how to roll it back.
func (s *Service) addRequest(ctx context.Context, req cniproto.Request) (*cniproto.Response, func()) {
	if bad := s.notReady(req); bad != nil {
		return bad, nil
	}
	if r := s.handedBackError(); r != nil {
		return r, nil
	}
	if r := s.gate.refuseAddNow(ctx); r != nil {
		return r, nil
	}
	resp, created := s.add(ctx, req)
	if created == nil {
		return resp, nil
	}
	key, at := created.Key, created.Created
	return resp, func() { s.rollbackAdd(key, at) }
}

// rollbackAdd frees the attachment key created at at by an ADD whose plugin went away before it
// got the answer: the runtime treats the ADD as failed, so nothing will ever use these addresses.
func (s *Service) rollbackAdd(key ipam.Key, at time.Time) {
	att, freed, err := s.delKeyIf(key, func(a ipam.Attachment) bool { return a.Created.Equal(at) })
	if err != nil {
		s.log.Error(err, "cannot roll back an ADD whose plugin went away; the runtime's DEL or the leak collector frees it",
			"attachment", cniproto.Truncate(key.String(), logIDBytes))
		return
	}
	if freed {
		s.metrics.AbandonedAdds.Inc()
		s.log.Info("rolled back an ADD: the plugin went away before the agent answered", "attachment", cniproto.Truncate(key.String(), logIDBytes),
			"pod", att.Pod.String(), "addresses", fmtAddresses(att.Addresses))
	}
}

func (s *Service) notReady(req cniproto.Request) *cniproto.Response {
	if req.Op != cniproto.OpList && req.Op != cniproto.OpStatus && !s.Ready() {
		return errResp(cniproto.CodeTryAgainLater, "the ipwarden agent on node "+s.node+" is starting and not serving yet",
			"it serves once it has reconciled its journal with the API server")
	}
	return nil
}

func (s *Service) handle(ctx context.Context, req cniproto.Request) *cniproto.Response {
	if bad := s.notReady(req); bad != nil {
		return bad
	}
	switch req.Op {
	case cniproto.OpAdd:
		resp, _ := s.addRequest(ctx, req)
		return resp
	case cniproto.OpDel:
		return s.del(req)
	case cniproto.OpCheck:
		return s.check(req)
	case cniproto.OpGC:
		if err := s.rel.wait(ctx); err != nil { // judge journaled attachments, not in-flight ones
			return errResp(cniproto.CodeTryAgainLater, "ipwarden: GC waited for requests being journaled: "+err.Error(), "")
		}
		return s.gc(ctx, req)
	case cniproto.OpStatus:
		return s.status()
	case cniproto.OpList:
		if r := s.gate.refuseList(); r != nil {
			return r
		}
		if err := s.rel.wait(ctx); err != nil {
			return errResp(cniproto.CodeTryAgainLater, "ipwarden: LIST waited for DELs being journaled: "+err.Error(), "")
		}
		return s.list()
	case cniproto.OpHandback:
		return s.handback(ctx, req)
	}
	return errResp(cniproto.CodeInternal, fmt.Sprintf("unknown operation %q", cniproto.Truncate(string(req.Op), 16)), "")
}

func errResp(code uint, msg, details string) *cniproto.Response {
	return &cniproto.Response{Error: &cniproto.Error{Code: code, Msg: msg, Details: details}}
}

func validKey(req cniproto.Request) (ipam.Key, *cniproto.Response) {
	if req.ContainerID == "" || req.IfName == "" {
		return ipam.Key{}, errResp(cniproto.CodeInvalidConfig, "ipwarden: CNI_CONTAINERID and CNI_IFNAME must be set", "")
	}
	return ipam.Key{ContainerID: req.ContainerID, IfName: req.IfName}, nil
}

// missingIdentity says which pod identity an ADD lacks, or "". Namespace and name are required:
// without them the leak collector can never find the attachment's pod, so it could never free
// it. K8S_POD_UID is optional: runtimes before containerd 1.x's CRI plugin and dockershim did not
// pass it; without it the collector matches the pod by name.
func missingIdentity(p cniproto.Pod) string {
	var miss []string
	if p.Namespace == "" {
		miss = append(miss, "K8S_POD_NAMESPACE")
	}
	if p.Name == "" {
		miss = append(miss, "K8S_POD_NAME")
	}
	return strings.Join(miss, " and ")
}

// podMetaTimeout bounds the read of a pod's annotations at ADD when the cache lacks it.
const podMetaTimeout = 5 * time.Second

// add hands out addresses, waiting up to addressWait for the controller if a pool is short. It
// returns the attachment it created, if it created one.
func (s *Service) add(ctx context.Context, req cniproto.Request) (*cniproto.Response, *ipam.Attachment) {
	key, bad := validKey(req)
	if bad != nil {
		return bad, nil
	}
	if miss := missingIdentity(req.Pod); miss != "" && !req.NonKubernetes {
		return errResp(cniproto.CodeInvalidConfig, "ipwarden: the ADD carries no pod identity: CNI_ARGS lacks "+miss,
			"ipwarden needs the pod's namespace and name to free its address when the pod is gone; for containers that are not "+
				"Kubernetes pods set \"allowNonKubernetes\": true in the plugin's configuration"), nil
	}
	// What the previous IPAM reserved stays out of use: read before the ADD picks (previous.go).
	if resp := s.readPrevious(ctx, req); resp != nil {
		return resp, nil
	}
	defer s.keys.lock(key)()

	areq := ipam.AddRequest{Key: key, Network: req.Network, Netns: req.Netns, Pools: req.Pools, PoolNetwork: req.PoolNetwork,
		Pod: ipam.PodRef{Namespace: req.Pod.Namespace, Name: req.Pod.Name, UID: req.Pod.UID}}
	// A plain ADD holds s.mu three times: to see whether it is a repeated ADD (only a new one
	// reads the pod's annotations, outside the lock), to plan, and to apply (commitThen). A
	// repeated ADD plans under the first hold.
	readMeta := s.getHooks().podMeta
	s.mu.Lock()
	_, known := s.st.Attachment(key)
	if readMeta != nil && !known && req.Pod.Namespace != "" && req.Pod.Name != "" {
		s.mu.Unlock()
		rctx, cancel := context.WithTimeout(ctx, podMetaTimeout)
		meta, err := readMeta(rctx, req.Pod.Namespace, req.Pod.Name, req.Pod.UID)
		cancel()
		s.mu.Lock()
		if err != nil {
			// The watch does not know the pod and the API server cannot be asked. Choosing pools
			// as if it had no annotations would silently ignore its (or its namespace's) pools,
			// static and sticky addresses. A pod whose earlier sandbox this node served gets its
			// addresses back without them (the node keeps serving restarted sandboxes through an
			// outage); any other waits for the API server: the runtime retries.
			if adopts := req.Pod.UID != "" && s.st.HasPod(req.Pod.UID); !adopts {
				s.mu.Unlock()
				s.metrics.PodUnknown.Inc()
				return errResp(cniproto.CodeTryAgainLater,
					fmt.Sprintf("ipwarden: the agent on node %s cannot read pod %s/%s's annotations: its watch has not seen the pod and the API server did not answer: %s",
						s.node, req.Pod.Namespace, req.Pod.Name, cniproto.Truncate(err.Error(), 200)),
					"pool choice needs the pod's and its namespace's ipwarden.io annotations; is the API server reachable from this node? the runtime retries"), nil
			}
			s.log.Info("cannot read the pod's annotations; its earlier sandbox's addresses are handed back", "pod", req.Pod.Namespace+"/"+req.Pod.Name, "error", err.Error())
		}
		areq.Meta = meta
	}
	// s.mu is held at the top of every turn of the loop.
	start := s.now()
	deadline := start.Add(s.addressWait)
	waiting := false
	defer func() {
		if waiting {
			s.mu.Lock()
			s.st.RemoveWaiter(key)
			s.mu.Unlock()
			s.kick()
		}
	}()
	for {
		now := s.now()
		att, ch, err := s.st.Add(areq, now)
		var short *ipam.ShortError
		if errors.As(err, &short) {
			if !now.Before(deadline) || ctx.Err() != nil {
				msg := s.shortMessageLocked(short, now)
				s.mu.Unlock()
				s.metrics.IPWait.Observe(s.now().Sub(start).Seconds())
				return errResp(cniproto.CodeTryAgainLater, msg,
					fmt.Sprintf("the ipwarden agent on node %s waited %s for the controller (--address-wait); the runtime retries", s.node, s.addressWait)), nil
			}
			if !waiting {
				pools, _ := s.st.ResolvePools(areq)
				s.st.AddWaiter(key, areq.Pod.UID, pools, short.Wanted...)
				waiting = true
				if on, _ := s.st.Hold(); on {
					s.mu.Unlock()
					s.evaluateHold() // a pod with an ADD here settles the hold
					s.mu.Lock()
					continue // which may have ended it: try again at once
				}
			}
			changed := s.changed
			wake := deadline
			if next := s.st.NextCooled(now); !next.IsZero() && next.Before(wake) {
				wake = next
			}
			s.mu.Unlock()
			s.kickNow()
			timer := time.NewTimer(wake.Sub(now))
			select {
			case <-changed:
			case <-timer.C:
			case <-ctx.Done():
			}
			timer.Stop()
			s.mu.Lock()
			continue
		}
		var inFlight *ipam.InFlightError
		if errors.As(err, &inFlight) {
			// A rebuild is recording the pod's addresses (ipam.PlanRebuild): wait for its
			// journal write, then adopt them.
			changed := s.changed
			s.mu.Unlock()
			select {
			case <-changed:
			case <-ctx.Done():
				return errResp(cniproto.CodeTryAgainLater, "ipwarden: "+inFlight.Error(), "the runtime retries"), nil
			}
			s.mu.Lock()
			continue
		}
		if err == nil && waiting {
			waiting = false // Add removed the waiter
		}
		cfgs := map[string]ipam.Pool{}
		if err == nil {
			for _, a := range att.Addresses {
				cfgs[a.Pool], _ = s.st.PoolConfig(a.Pool)
			}
		}
		s.mu.Unlock()
		if err != nil {
			return addError(err), nil
		}
		s.metrics.IPWait.Observe(s.now().Sub(start).Seconds())
		if ch.IsEmpty() {
			return result(att, cfgs), nil // a repeated ADD
		}
		// The answer waits for the journal write: an address a runtime was told is on disk first.
		if h := beforeAddWrite; h != nil {
			h()
		}
		var holdOn bool
		if err := s.commitThen(ipam.AddPlan{Key: key, Change: ch}, "add", func() { holdOn, _ = s.st.Hold() }); err != nil {
			return errResp(cniproto.CodeTryAgainLater, "ipwarden: cannot record the attachment in the journal: "+cniproto.Truncate(err.Error(), 300),
				"nothing was handed out; check the agent's --state-dir disk"), nil
		}
		s.log.V(1).Info("ADD", "attachment", cniproto.Truncate(key.String(), logIDBytes), "pod", att.Pod.String(), "addresses", fmtAddresses(att.Addresses))
		if holdOn {
			s.evaluateHold()
		}
		s.kick()
		return result(att, cfgs), &att
	}
}

// beforeAddWrite, when set (a build with the failpoints tag), runs before an ADD's journal
// write: the crash tests hold it there and kill or stop the agent.
var beforeAddWrite func()

// shortMessageLocked says which pools are short and why.
func (s *Service) shortMessageLocked(short *ipam.ShortError, now time.Time) string {
	parts := make([]string, len(short.Pools))
	for i, p := range short.Pools {
		parts[i] = fmt.Sprintf("pool %s: %s", p, s.st.Reason(p, now))
	}
	for _, w := range short.Wanted {
		parts = append(parts, fmt.Sprintf("static address %s of pool %s: the controller has not moved it to this node yet (is ipwarden controller running?)", w.Addr, w.Pool))
	}
	return "ipwarden: no free address on node " + s.node + ": " + strings.Join(parts, "; ")
}

func addError(err error) *cniproto.Response {
	var ce *ipam.ConfigError
	var np *ipam.NoPoolsError
	var pc *ipam.PoolChoiceError
	var su *ipam.StaticUnavailableError
	var hb *ipam.HandedBackError
	switch {
	case errors.As(err, &hb):
		return errResp(cniproto.CodeHandedBack, "ipwarden: "+hb.Error(),
			"nothing was handed out; this refusal lasts until the handback is undone, retrying does not help")
	case errors.As(err, &ce):
		return errResp(cniproto.CodeInvalidConfig, "ipwarden: network configuration field "+ce.Error(),
			"name pools that select this node, or leave \"pools\" out to use all of them")
	case errors.As(err, &np):
		return errResp(cniproto.CodeTryAgainLater, "ipwarden: "+np.Error(), "")
	case errors.As(err, &su):
		return errResp(cniproto.CodeTryAgainLater, "ipwarden: "+su.Error(),
			"nothing was handed out and no address was taken from anyone; the runtime retries")
	case errors.As(err, &pc):
		return errResp(cniproto.CodeInvalidConfig, "ipwarden: "+pc.Error(),
			"nothing was handed out; see the pools' nodeSelector and namespaceSelector (kubectl get ippools -o yaml)")
	}
	return errResp(cniproto.CodeInternal, "ipwarden: "+err.Error(), "")
}

// result renders an attachment as the plugin's ADD answer: addresses with their pool network's
// prefix length and gateway, and the pools' routes.
func result(att ipam.Attachment, cfgs map[string]ipam.Pool) *cniproto.Response {
	resp := &cniproto.Response{}
	seen := map[ipam.Route]bool{}
	for _, a := range att.Addresses {
		cfg := cfgs[a.Pool]
		ip := cniproto.IP{Pool: a.Pool, Address: cfg.Prefix(a.Addr).String()}
		if cfg.Gateway.IsValid() {
			ip.Gateway = cfg.Gateway.String()
		}
		resp.IPs = append(resp.IPs, ip)
		for _, r := range cfg.Routes {
			if seen[r] {
				continue
			}
			seen[r] = true
			rt := cniproto.Route{Dst: r.Dst.String()}
			if r.GW.IsValid() {
				rt.GW = r.GW.String()
			}
			resp.Routes = append(resp.Routes, rt)
		}
	}
	return resp
}

// del frees an attachment: journal first, then memory. Unknown attachments succeed.
//
// The answer does not wait for the journal write (about a millisecond of fsync, a tenth of a
// pod's ADD+DEL): the addresses stay assigned, in memory and on disk, until the write lands, so
// nothing can hand them out before. The attachment's lock is held until then, so a request for
// the same attachment (a repeated DEL, an ADD, a CHECK) waits for it, and LIST waits for every
// DEL answered before it. If the write fails or the agent dies first, the journal still holds
// the attachment: the leak collector frees it once its pod or sandbox is confirmed gone, as for
// a DEL that never came. Nothing is ever freed early; at worst it is freed late.
func (s *Service) del(req cniproto.Request) *cniproto.Response {
	key, bad := validKey(req)
	if bad != nil {
		return bad
	}
	unlock := s.keys.lock(key)
	att, plan, err := s.planDel(key, nil)
	if err != nil || !plan.Found {
		unlock()
		if err != nil {
			return errResp(cniproto.CodeTryAgainLater, "ipwarden: cannot release the attachment: "+err.Error(),
				"the addresses stay assigned; the runtime retries DEL")
		}
		return &cniproto.Response{}
	}
	id := s.rel.start()
	s.metrics.ReleasesInFlight.Inc()
	go func() {
		defer func() {
			unlock()
			s.rel.finish(id)
			s.metrics.ReleasesInFlight.Dec()
		}()
		if err := s.finishDel(key, att, plan, true); err != nil {
			s.log.Error(err, "the journal refused a DEL already answered: its addresses stay assigned until the leak collector frees them",
				"attachment", cniproto.Truncate(key.String(), logIDBytes), "pod", att.Pod.String(), "addresses", fmtAddresses(att.Addresses))
		}
	}()
	return &cniproto.Response{}
}

// WaitReleases returns once every DEL answered before the call is journaled and applied, or
// with ctx's error.
func (s *Service) WaitReleases(ctx context.Context) error { return s.rel.wait(ctx) }

// delKeyIf frees the attachment key as DEL does, and returns once it is journaled: journal
// first, then its addresses go to the back of their cooling queues. With accept set, it frees
// only a confirmed (not in-flight) attachment that accept approves, decided under the
// attachment's lock, so a request racing the caller's decision is never undone. It returns the
// freed attachment and whether it freed one.
func (s *Service) delKeyIf(key ipam.Key, accept func(ipam.Attachment) bool) (ipam.Attachment, bool, error) {
	unlock := s.keys.lock(key)
	defer unlock()
	att, plan, err := s.planDel(key, accept)
	if err != nil || !plan.Found {
		return ipam.Attachment{}, false, err
	}
	if err := s.finishDel(key, att, plan, false); err != nil {
		return ipam.Attachment{}, false, err
	}
	return att, true, nil
}

// planDel decides the DEL of key; the caller holds the key's lock. With accept set, it plans
// nothing (an empty plan) unless the attachment is confirmed and accept approves it.
func (s *Service) planDel(key ipam.Key, accept func(ipam.Attachment) bool) (ipam.Attachment, ipam.DelPlan, error) {
	for {
		s.mu.Lock()
		att, found := s.st.Attachment(key)
		if found && accept != nil && (s.st.Pending(key) || !accept(att)) {
			s.mu.Unlock()
			return ipam.Attachment{}, ipam.DelPlan{}, nil
		}
		plan, err := s.st.PlanDel(key, s.now())
		var inFlight *ipam.InFlightError
		if errors.As(err, &inFlight) {
			// A rebuild moving one of its addresses to a pod that reports it holds it
			// (ipam.PlanRebuild): wait for its journal write, then decide again.
			changed := s.changed
			s.mu.Unlock()
			<-changed
			continue
		}
		s.mu.Unlock()
		return att, plan, err
	}
}

// finishDel journals and applies a planned DEL; the caller holds the key's lock. With lazy
// (a DEL already answered) the journal write may wait briefly to share the next ADD's
// transaction (journal.Linger).
func (s *Service) finishDel(key ipam.Key, att ipam.Attachment, plan ipam.DelPlan, lazy bool) error {
	write := s.journal.Commit
	if lc, ok := s.journal.(lazyCommitter); ok && lazy {
		write = lc.CommitLazy
	}
	if err := s.commitVia(plan, "del", nil, write); err != nil {
		return err
	}
	s.log.V(1).Info("DEL", "attachment", key.String(), "pod", att.Pod.String(), "addresses", fmtAddresses(att.Addresses))
	s.releaseHandedBack(att)
	s.kick()
	return nil
}

// check verifies that the attachment exists and holds the addresses of prevResult.
func (s *Service) check(req cniproto.Request) *cniproto.Response {
	key, bad := validKey(req)
	if bad != nil {
		return bad
	}
	unlock := s.keys.lock(key)
	defer unlock()
	s.mu.Lock()
	att, err := s.st.Check(key)
	s.mu.Unlock()
	if err != nil {
		return errResp(cniproto.CodeUnknownContainer, "ipwarden: "+err.Error(), "the runtime should recreate the sandbox")
	}
	have := map[netip.Addr]bool{}
	for _, a := range att.Addresses {
		have[a.Addr] = true
	}
	for _, p := range req.PrevAddresses {
		pfx, err := netip.ParsePrefix(p)
		if err != nil {
			return errResp(cniproto.CodeInvalidConfig, fmt.Sprintf("ipwarden: prevResult address %q: %v", p, err), "")
		}
		if !have[pfx.Addr()] {
			return errResp(cniproto.CodeInternal, fmt.Sprintf("ipwarden: attachment %s does not hold %s of its prevResult (it holds %s)",
				key, pfx.Addr(), fmtAddresses(att.Addresses)), "")
		}
		delete(have, pfx.Addr())
	}
	if len(req.PrevAddresses) > 0 && len(have) > 0 {
		return errResp(cniproto.CodeInternal, fmt.Sprintf("ipwarden: attachment %s holds addresses missing from its prevResult (%s)",
			key, fmtAddresses(att.Addresses)), "")
	}
	return &cniproto.Response{}
}

// gc frees the network's attachments the runtime no longer lists, older than the grace period
// (CNI GC). A GC without a valid-attachments list carries no information and frees nothing (an
// error says so). Each candidate is re-read from the API server first: an attachment whose pod
// still exists (by UID; by name when the ADD carried no UID) is kept, as is one whose pod cannot
// be read; only attachments of pods that are gone, or that carry no pod identity at all
// ("allowNonKubernetes"), are freed. With --gc-dry-run it reports and frees nothing.
func (s *Service) gc(ctx context.Context, req cniproto.Request) *cniproto.Response {
	if !req.HasValidAttachments {
		s.log.Info("CNI GC without cni.dev/valid-attachments: freeing nothing", "network", cniproto.Truncate(req.Network, 64))
		return errResp(cniproto.CodeInvalidConfig, "ipwarden: GC without cni.dev/valid-attachments frees nothing",
			"the runtime must list the attachments that are still valid; without the list every attachment would look stale")
	}
	valid := make([]ipam.Key, len(req.ValidAttachments))
	for i, a := range req.ValidAttachments {
		valid[i] = ipam.Key{ContainerID: a.ContainerID, IfName: a.IfName}
	}
	s.mu.Lock()
	stale := s.st.Stale(req.Network, valid, s.now().Add(-s.gcGrace))
	var cands []gc.Candidate
	for _, k := range stale {
		if att, ok := s.st.Attachment(k); ok {
			cands = append(cands, gc.Candidate{Attachment: gcAttachment(att, false)})
		}
	}
	s.mu.Unlock()
	lookup := s.getHooks().lookup
	freed := 0
	var errs []string
	why := "the container runtime no longer lists the attachment (CNI GC, network " + req.Network + ") and "
	for _, c := range cands {
		s.metrics.GCCandidates.WithLabelValues(PathCNIGC).Inc()
		reason := why + "it names no pod (allowNonKubernetes)"
		if c.Pod.Name != "" {
			if lookup == nil {
				errs = append(errs, fmt.Sprintf("%s: the agent cannot read pods", c.Key))
				continue
			}
			rctx, cancel := context.WithTimeout(ctx, 15*time.Second)
			l := lookup(rctx, gc.Name{Namespace: c.Pod.Namespace, Name: c.Pod.Name})
			cancel()
			v := gc.Judge(c.Pod, l)
			if !v.Free {
				if v.Reason == gc.ReasonAPIError {
					s.metrics.GCFailed.WithLabelValues(PathCNIGC).Inc()
					errs = append(errs, fmt.Sprintf("%s: %v", c.Key, l.Err))
				} else {
					s.metrics.GCKept.WithLabelValues(PathCNIGC).Inc()
					s.log.Info("CNI GC: kept an attachment the runtime no longer lists: the API server shows its pod",
						"attachment", cniproto.Truncate(c.Key.String(), logIDBytes), "pod", c.Pod.String(), "podUID", c.Pod.UID)
				}
				continue
			}
			reason = why + "its pod no longer exists"
		}
		ok, err := s.collect(PathCNIGC, c, reason)
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v", c.Key, err))
			continue
		}
		if ok {
			freed++
		}
	}
	if len(errs) > 0 {
		return errResp(cniproto.CodeTryAgainLater, "ipwarden: GC could not free "+cniproto.Truncate(strings.Join(errs, "; "), 1000), "")
	}
	return &cniproto.Response{Freed: freed}
}

// status reports whether the agent can serve ADD: it must be ready and some pool must select the
// node (CNI STATUS; code 50 otherwise).
func (s *Service) status() *cniproto.Response {
	if !s.Ready() {
		return errResp(cniproto.CodeNotAvailable, "the ipwarden agent on node "+s.node+" is starting and not serving yet", "")
	}
	if r := s.gate.refuseAdd(); r != nil {
		return errResp(cniproto.CodeNotAvailable, r.Error.Msg, r.Error.Details)
	}
	resp := &cniproto.Response{Node: s.node, Pools: s.poolStatus()}
	s.mu.Lock()
	served := s.st.Served()
	s.mu.Unlock()
	if len(served) == 0 {
		return errResp(cniproto.CodeNotAvailable, (&ipam.NoPoolsError{Node: s.node}).Error(), "")
	}
	return resp
}

func (s *Service) poolStatus() []cniproto.PoolStatus {
	s.mu.Lock()
	stats := s.st.Stats(s.now())
	s.mu.Unlock()
	out := make([]cniproto.PoolStatus, len(stats))
	for i, st := range stats {
		out[i] = cniproto.PoolStatus{Pool: st.Pool, Served: st.Served, Held: st.Held, InUse: st.InUse, Free: st.Free,
			Cooling: st.Cooling, Releasing: st.Releasing, Requested: st.Requested, Conflicts: st.Conflicts, Exhausted: st.Exhausted,
			Unattributed: st.Unattributed, Adopted: st.Adopted, PreviousReserved: st.PreviousReserved}
	}
	return out
}

// list reports every attachment and pool.
func (s *Service) list() *cniproto.Response {
	resp := &cniproto.Response{Node: s.node, Pools: s.poolStatus()}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, a := range s.st.Attachments() {
		cfgs := map[string]ipam.Pool{}
		var conflicts []string
		for _, ad := range a.Addresses {
			cfgs[ad.Pool], _ = s.st.PoolConfig(ad.Pool)
			if held, known := s.st.Holding(ad.Pool); known && !held.Contains(ad.Addr) {
				conflicts = append(conflicts, ad.Addr.String())
			}
		}
		r := result(a, cfgs)
		resp.Attachments = append(resp.Attachments, cniproto.Attachment{
			ContainerID: a.Key.ContainerID, IfName: a.Key.IfName, Network: a.Network,
			Pod: cniproto.Pod{Namespace: a.Pod.Namespace, Name: a.Pod.Name, UID: a.Pod.UID},
			IPs: r.IPs, Created: a.Created, Rebuilt: a.Rebuilt, Conflicts: conflicts,
			Netns: a.Netns, Sandbox: lookSandbox(a.Netns, s.netnsDirs).String(),
		})
	}
	resp.Hold = s.holdStatusLocked()
	if m := s.st.HandedBack(); m != nil {
		resp.Handback = &cniproto.HandbackStatus{Marked: true, At: m.At, To: m.To, Network: m.Network, Dir: m.Dir}
	}
	return resp
}

// keyLocks serializes requests per attachment.
type keyLocks struct {
	mu sync.Mutex
	m  map[ipam.Key]*keyLock
}

type keyLock struct {
	mu   sync.Mutex
	refs int
}

func (l *keyLocks) lock(k ipam.Key) (unlock func()) {
	l.mu.Lock()
	if l.m == nil {
		l.m = map[ipam.Key]*keyLock{}
	}
	e := l.m[k]
	if e == nil {
		e = &keyLock{}
		l.m[k] = e
	}
	e.refs++
	l.mu.Unlock()
	e.mu.Lock()
	return func() {
		e.mu.Unlock()
		l.mu.Lock()
		e.refs--
		if e.refs == 0 {
			delete(l.m, k)
		}
		l.mu.Unlock()
	}
}

func fmtSets(m map[string]addr.Set) string {
	out := ""
	for _, k := range slices.Sorted(maps.Keys(m)) {
		if out != "" {
			out += "; "
		}
		out += k + ": " + m[k].String()
	}
	return out
}

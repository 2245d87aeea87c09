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

// Service is the driver of the node's Machine (machine.go) on a real node: it answers the CNI
// plugin's requests, performs the machine's journal writes and pod reads and feeds their outcomes
// back, records its events, and wakes it at the time it asks. The Kubernetes side feeds it pools,
// holdings and pods. Whoever holds mu owns the machine for one input: it feeds the input and
// carries out what the machine then wants done (writes start in their own goroutines, answers go
// to the callers waiting on them). Nothing else touches the node's state.
type Service struct {
	node       string
	journal    Committer
	now        func() time.Time
	gcGrace    time.Duration
	gcDryRunOn bool
	readsPods  bool // ServiceOptions.ReadsPods
	holdDir    string
	netnsDirs  []string
	gcr        *gcReporter
	log        logr.Logger
	metrics    *Metrics

	// mu: the machine's owner (see above). step and call are the only places that take it.
	mu       sync.Mutex
	m        *Machine
	waits    map[uint64]*waiter // callers waiting on an answer, by input id
	changedC chan struct{}      // closed and replaced whenever the state changed
	timer    *time.Timer        // the machine's next Tick
	timerAt  time.Time
	hooks    atomic.Pointer[hooks] // set under mu, read without it

	// handingBack: a handback or its undo runs (one at a time).
	handingBack atomic.Bool
	// prev reads the previous IPAM's reservations at ADDs (previous.go).
	prev previousReads
	// reader is how an ADD's pod read waits for the pod reader while the agent starts.
	reader podReader
}

// podReader is the start-up's pod reader (ServiceOptions.ReadsPods): an ADD's pod read waits
// until SetPodMeta sets the reader (the informers are created: the usual start, about a
// second), or until the API server is found away (setAPIError), when the read's outcome is
// ErrPodReaderAway (the machine serves the ADD from the journal without the pod's annotations,
// as documented: docs/design.md, "The agent serves from its journal"). Without the wait an ADD in that second was served as if its pod had no
// annotations: a VM's launcher got an ordinary address instead of its IPAMClaim's.
type podReader struct {
	ready    chan struct{} // closed by SetPodMeta
	away     chan struct{} // closed by the first setAPIError before ready
	once     sync.Once
	awayOnce sync.Once
}

func newPodReader() podReader {
	return podReader{ready: make(chan struct{}), away: make(chan struct{})}
}

// waiter is a caller waiting on an answer of the machine.
type waiter struct {
	ch  chan Answer
	ctx context.Context // the request's, for the reads made for it
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
	// ReadsPods: the agent reads pods from the API server (Run sets it): an ADD's pod read
	// waits for the reader while the agent starts (podReader).
	ReadsPods bool
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
	if opts.NetnsDirs == nil {
		opts.NetnsDirs = DefaultNetnsDirs
	}
	if m := st.HandedBack(); m != nil {
		opts.Metrics.HandedBack.Set(1)
		opts.Log.Info("the node is handed back: every ADD is refused until the handback is undone", "to", m.To, "network", m.Network,
			"at", m.At.UTC().Format(time.RFC3339))
	}
	dirs := opts.NetnsDirs
	m := NewMachine(st, MachineConfig{Node: opts.Node, AddressWait: opts.AddressWait, HoldMarker: opts.HoldDir != "",
		Sandbox: func(netns string) ipam.Sandbox {
			switch lookSandbox(netns, dirs) {
			case gc.SandboxExists:
				return ipam.SandboxExists
			case gc.SandboxGone:
				return ipam.SandboxGone
			}
			return ipam.SandboxUnknown
		}, Gated: opts.Gated, ReadsPods: opts.ReadsPods, LeaseNamespace: opts.LeaseNamespace, Log: opts.Log, Metrics: opts.Metrics})
	m.SetReady(false, opts.Now()) // SetReady(true) once the start-up let it serve
	return &Service{
		readsPods:  opts.ReadsPods,
		reader:     newPodReader(),
		node:       opts.Node,
		journal:    journal,
		now:        opts.Now,
		gcGrace:    opts.GCGrace,
		gcDryRunOn: opts.GCDryRun,
		holdDir:    opts.HoldDir,
		netnsDirs:  opts.NetnsDirs,
		gcr:        newGCReporter(opts.Log.WithName("gc"), opts.Metrics),
		log:        opts.Log,
		metrics:    opts.Metrics,
		m:          m,
		waits:      map[uint64]*waiter{},
		changedC:   make(chan struct{}),
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
	// claim reads an IPAMClaim an ADD's pod references (claimReader.Read); nil: none can be
	// read, and such an ADD fails.
	claim func(ctx context.Context, namespace, name string) (ClaimObject, error)
	// recheck re-checks the node's Lease for ADDs past its permit (NodeLease.recheck;
	// Ready.Recheck).
	recheck func(context.Context)
}

func (s *Service) getHooks() hooks {
	if h := s.hooks.Load(); h != nil {
		return *h
	}
	return hooks{}
}

// setHook changes the hooks with set.
func (s *Service) setHook(set func(*hooks)) {
	s.step(func(m *Machine, _ time.Time) {
		h := s.getHooks()
		set(&h)
		s.hooks.Store(&h)
		m.cfg.ReadsPods = s.readsPods || h.podMeta != nil
	})
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

// SetReady marks the service as serving (after the start-up reconciliation): a fact of the
// machine, which refuses ADD, DEL and CHECK until then (Machine.SetReady).
func (s *Service) SetReady(ready bool) {
	s.step(func(m *Machine, now time.Time) { m.SetReady(ready, now) })
}

// Ready reports whether the service serves.
func (s *Service) Ready() (ok bool) {
	s.read(func(m *Machine) { ok = m.Serving() })
	return ok
}

// --- the driver --------------------------------------------------------------------------------

// step feeds the machine one input and carries out what it then wants done.
func (s *Service) step(input func(m *Machine, now time.Time)) {
	s.mu.Lock()
	now := s.now()
	s.m.now = now
	input(s.m, now)
	after := s.flushLocked()
	s.mu.Unlock()
	after()
}

// call feeds the machine an input that is answered later (it returns the answer's id) and waits
// for the answer. When ctx ends first, a cancelable input is canceled (the machine answers it
// soon: an ADD waiting for addresses fails) and its answer awaited; any other is abandoned, and
// call returns ctx's error.
func (s *Service) call(ctx context.Context, cancelable bool, input func(m *Machine, now time.Time) uint64) (Answer, error) {
	w := &waiter{ch: make(chan Answer, 1), ctx: ctx}
	s.mu.Lock()
	now := s.now()
	s.m.now = now
	id := input(s.m, now)
	s.waits[id] = w
	after := s.flushLocked()
	s.mu.Unlock()
	after()
	select {
	case a := <-w.ch:
		return a, nil
	case <-ctx.Done():
	}
	if !cancelable {
		s.step(func(*Machine, time.Time) { delete(s.waits, id) })
		select {
		case a := <-w.ch: // answered meanwhile
			return a, nil
		default:
		}
		return Answer{}, ctx.Err()
	}
	s.step(func(m *Machine, now time.Time) { m.Cancel(id, now) })
	return <-w.ch, nil
}

// flushLocked carries out the machine's Ready (s.mu is held): answers go to their callers,
// writes and reads start in their own goroutines, the hold marker is written, the timer set. It
// returns what runs once s.mu is released: the pool monitor's kicks and events.
func (s *Service) flushLocked() (after func()) {
	rd := s.m.Ready()
	s.m.Advance()
	for _, a := range rd.Answers {
		if w := s.waits[a.ID]; w != nil {
			delete(s.waits, a.ID)
			w.ch <- a
		}
	}
	for _, w := range rd.Writes {
		go s.perform(w)
	}
	for _, r := range rd.Reads {
		ctx := context.Background()
		if w := s.waits[r.ID]; w != nil {
			ctx = w.ctx
		}
		go s.readPod(ctx, r)
	}
	if rd.Recheck {
		go s.recheckLease()
	}
	if rd.Marker != nil {
		s.writeMarker(*rd.Marker)
	}
	if rd.Changed {
		close(s.changedC)
		s.changedC = make(chan struct{})
	}
	s.setTimerLocked(rd.Wake)
	if !rd.Kick && !rd.KickNow && len(rd.Events) == 0 {
		return func() {}
	}
	return func() {
		for _, e := range rd.Events {
			s.gcr.event(nil, e.Type, e.Reason, e.Message)
		}
		if rd.KickNow {
			s.kickNow()
		}
		if rd.Kick {
			s.kick()
		}
	}
}

// perform writes w to the journal, with ipwarden's reservation in the previous IPAM's store
// before (Write.Reserve) or its removal after (Write.Unreserve), removes host-local's files of a
// DEL's attachment freed while the node is handed back, and feeds the outcome back.
func (s *Service) perform(w Write) {
	write := s.journal.Commit
	if lc, ok := s.journal.(lazyCommitter); ok && w.Lazy {
		write = lc.CommitLazy
	}
	if w.Reserve != nil {
		// First the previous IPAM's store, under its lock: a refusal is the write's outcome,
		// and nothing is journaled.
		if err := s.reservePrevious(*w.Reserve); err != nil {
			s.step(func(m *Machine, now time.Time) { m.Written(w.ID, err, now) })
			return
		}
	}
	if h := beforeAddWrite; h != nil && w.Add {
		h()
	}
	err := write(w.Change)
	if h := afterAddWrite; h != nil && w.Add {
		h()
	}
	if err != nil && w.Reserve != nil {
		s.releasePrevious(*w.Reserve) // nothing is handed out
	}
	if err == nil && w.Unreserve != nil {
		s.releasePrevious(*w.Unreserve)
	}
	if err == nil && w.Release != nil {
		// Before Written: the attachment stays busy, and a barrier (LIST, HANDBACK, the stop)
		// unanswered, until host-local's file of it is gone too.
		s.releaseHandedBack(*w.Release)
	}
	s.step(func(m *Machine, now time.Time) { m.Written(w.ID, err, now) })
}

// readPod reads the pod of request r for its pool choice and feeds the outcome back.
func (s *Service) readPod(ctx context.Context, r PodRead) {
	var meta ipam.PodMeta
	err := errors.New("the agent cannot read pods")
	if s.getHooks().podMeta == nil && s.readsPods {
		select {
		case <-s.reader.ready:
		case <-s.reader.away:
			// The machine decides what an ADD without its pod's annotations gets (PodRead).
			s.step(func(m *Machine, now time.Time) { m.PodRead(r.ID, ipam.PodMeta{}, ErrPodReaderAway, now) })
			return
		case <-ctx.Done():
			err = fmt.Errorf("the agent is still connecting to the API server: %w", ctx.Err())
		}
	}
	if f := s.getHooks().podMeta; f != nil {
		rctx, cancel := context.WithTimeout(ctx, podMetaTimeout)
		meta, err = f(rctx, r.Namespace, r.Name, r.UID)
		if err == nil {
			meta = claimMeta(rctx, r, meta, s.getHooks().claim)
		}
		cancel()
	}
	s.step(func(m *Machine, now time.Time) { m.PodRead(r.ID, meta, err, now) })
}

// recheckLease re-checks the node's Lease for the ADDs past the permit (Ready.Recheck): the
// Lease keeper's round feeds what it found (SetLease), then the machine hears the re-check ended.
func (s *Service) recheckLease() {
	if f := s.getHooks().recheck; f != nil {
		ctx, cancel := context.WithTimeout(context.Background(), recheckEvery)
		f(ctx)
		cancel()
	}
	s.step(func(m *Machine, now time.Time) { m.LeaseChecked(now) })
}

// setTimerLocked makes the machine Tick at wake (zero: no timer).
func (s *Service) setTimerLocked(wake time.Time) {
	if wake.Equal(s.timerAt) {
		return
	}
	s.timerAt = wake
	if s.timer != nil {
		s.timer.Stop()
		s.timer = nil
	}
	if wake.IsZero() {
		return
	}
	s.timer = time.AfterFunc(wake.Sub(s.now()), func() {
		s.step(func(m *Machine, now time.Time) {
			if s.timerAt.Equal(wake) {
				s.timerAt = time.Time{}
			}
			m.Tick(now)
		})
	})
}

// writeMarker writes the hold's marker (until set) or removes it.
func (s *Service) writeMarker(until time.Time) {
	if s.holdDir == "" {
		return
	}
	if until.IsZero() {
		if err := journal.ClearHold(s.holdDir); err != nil {
			s.log.Error(err, "cannot remove the hold marker; the next start holds again")
		}
		return
	}
	if err := journal.MarkHold(s.holdDir, until); err != nil {
		s.log.Error(err, "cannot record the hold in the state directory; a restart during the hold would not resume it")
	}
}

// read runs f on the machine (a query, or an input that needs no answer).
func (s *Service) read(f func(m *Machine)) { s.step(func(m *Machine, _ time.Time) { f(m) }) }

// fact feeds the machine a fact (Machine.Fact) and waits for its outcome.
func (s *Service) fact(input func(m *Machine, now time.Time) uint64) Answer {
	a, _ := s.call(context.Background(), false, input)
	return a
}

// --- facts and queries -------------------------------------------------------------------------

// releaseRound marks what is beyond each pool's target as releasing (Machine.ReleaseRound) and
// returns what the pool monitor publishes.
func (s *Service) releaseRound() (Round, error) {
	a := s.fact(func(m *Machine, now time.Time) uint64 { return m.ReleaseRound(now, true) })
	if a.Err != nil {
		return Round{}, fmt.Errorf("journal the addresses to release: %w", a.Err)
	}
	return *a.Round, nil
}

// recordUse is what re-creating the node's NodeIPAllocation needs: the record mark (set once the
// node had one) and how many attachments use addresses.
func (s *Service) recordUse() (mark ipam.RecordMark, n int) {
	s.read(func(m *Machine) { mark, n = m.st.Mark(), m.st.NumAttachments() })
	return mark, n
}

// servedSummary is the pools the node serves, the number of attachments, and which of names
// are not pools the agent knows.
func (s *Service) servedSummary(names []string) (served []string, attachments int, unknown []string) {
	s.read(func(m *Machine) {
		for _, n := range names {
			if _, ok := m.st.PoolConfig(n); !ok {
				unknown = append(unknown, n)
			}
		}
		served, attachments = m.st.Served(), m.st.NumAttachments()
	})
	return served, attachments, unknown
}

// demand is the named pool's demand (tests).
func (s *Service) demand(pool string) (n int) {
	s.read(func(m *Machine) { n = m.st.Demand(pool) })
	return n
}

// ObservedPools is ipam.State.Observed: the pools whose running pods' addresses the node has
// recorded; read it before Spec so the claims written with it account for them.
func (s *Service) ObservedPools() (obs []ipam.ObservedPool) {
	s.read(func(m *Machine) { obs = m.st.Observed() })
	return obs
}

// Spec is the node's request as the state computes it now (requested, releasing, claimed).
func (s *Service) Spec() (spec []ipam.PoolRequest) {
	s.read(func(m *Machine) { spec = m.st.Spec() })
	return spec
}

// SetPools hands the service the pools' settings and the pools that select the node. When the
// journal refuses them the state keeps the settings it had, and the error is returned.
func (s *Service) SetPools(pools []ipam.Pool, served []string) error {
	a := s.fact(func(m *Machine, now time.Time) uint64 { return m.SetPools(pools, served, now) })
	if a.Err != nil {
		return fmt.Errorf("journal the pools' settings: %w", a.Err)
	}
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

// Mark returns the node's record mark.
func (s *Service) Mark() (mark ipam.RecordMark) {
	s.read(func(m *Machine) { mark = m.st.Mark() })
	return mark
}

// Rewound says whether an object (uid, generation) is older than the node's record mark.
func (s *Service) Rewound(uid string, generation int64) (rewound bool) {
	s.read(func(m *Machine) { rewound = m.st.Rewound(uid, generation) })
	return rewound
}

// SetRecordMissing tells the service whether the node's NodeIPAllocation is missing; while it
// is, no address is handed out of the free set.
func (s *Service) SetRecordMissing(missing bool) {
	s.read(func(m *Machine) { m.SetRecordMissing(missing) })
}

// NoteSpecWritten records that the agent wrote its spec to the object uid, producing
// generation: the record mark that later reads are compared with. When the journal refuses it
// the mark stays where it was (logged and counted); the next reading of the record
// (SetHoldings) or spec write moves it.
func (s *Service) NoteSpecWritten(uid string, generation int64) {
	s.fact(func(m *Machine, now time.Time) uint64 { return m.NoteSpecWritten(uid, generation, now) })
}

// SetHoldings hands the service what the controller reports the node holds, per pool; pools
// missing from holdings but known to the state hold nothing. rec says which object it came
// from: a rewound one's extra addresses are distrusted first (ipam.State.PlanHoldings), and the
// record mark moves to it. Holdings and mark are journaled together, then applied; when the
// journal refuses them the state is as it was and the error is returned.
func (s *Service) SetHoldings(holdings map[string]addr.Set, rec RecordOf) error {
	a := s.fact(func(m *Machine, now time.Time) uint64 { return m.SetHoldings(holdings, rec, now) })
	if a.Err != nil {
		return fmt.Errorf("journal the node's holdings: %w", a.Err)
	}
	return nil
}

// SetPods hands the service the pods bound to the node. The addresses running pods report that no
// attachment accounts for are recorded, as at start-up (Rebuild), on every call: a pod that got its
// address from the previous IPAM (the node's CNI configuration was switched to ipwarden while it
// ran, or the pod started before the switch reached the node) is adopted as soon as it reports
// one, so its address is claimed and never handed to another pod (docs/operations.md, "Moving from
// another IPAM"). During the unattributed hold the hold is evaluated after.
func (s *Service) SetPods(pods []ipam.Pod) {
	on := false
	s.step(func(m *Machine, now time.Time) {
		m.SetPods(pods, now)
		on, _ = m.st.Hold()
	})
	if _, err := s.rebuild(pods, 1); err != nil {
		if on {
			s.log.Error(err, "cannot journal attachments rebuilt during the unattributed hold; the hold stays on")
		} else {
			s.log.Error(err, "cannot journal the attachments of pods whose addresses no attachment accounts for; the next pod event retries")
		}
	} else if on {
		s.step(func(m *Machine, now time.Time) { m.EvaluateHold(now) })
	}
	s.kick()
}

// SetNamespaces hands the service the namespaces, for the pool choice of the node's pods.
func (s *Service) SetNamespaces(ns map[string]ipam.Namespace) {
	s.read(func(m *Machine) { m.SetNamespaces(ns) })
}

// SetRefused hands the service the wanted addresses the controller refused, per pool.
func (s *Service) SetRefused(refused map[string]map[netip.Addr]string) {
	s.step(func(m *Machine, now time.Time) { m.SetRefused(refused, now) })
}

// SetClaimRefused hands the service the IPAMClaims the controller refuses the node, per pool.
func (s *Service) SetClaimRefused(refused map[string]map[string]string) {
	s.step(func(m *Machine, now time.Time) { m.SetClaimRefused(refused, now) })
}

// SetWantedElsewhere hands the service the held addresses other nodes' pods ask for by name;
// the pool monitor gives back those no attachment uses.
func (s *Service) SetWantedElsewhere(w map[string]addr.Set) {
	s.read(func(m *Machine) { m.SetWantedElsewhere(w) })
}

// SetClaimReader sets how an ADD reads the IPAMClaim its pod references (claimReader.Read).
func (s *Service) SetClaimReader(f func(ctx context.Context, namespace, name string) (ClaimObject, error)) {
	s.setHook(func(h *hooks) { h.claim = f })
}

// SetPodMeta sets how an ADD reads its pod's annotations and namespace (Kube.PodMeta).
func (s *Service) SetPodMeta(f func(ctx context.Context, namespace, name, uid string) (ipam.PodMeta, error)) {
	s.setHook(func(h *hooks) { h.podMeta = f })
	if f != nil {
		s.reader.once.Do(func() { close(s.reader.ready) })
	}
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
	s.step(func(m *Machine, now time.Time) { m.StartHold(until, now) })
}

// SetSandboxes hands the machine a reading of the container runtime's pod sandboxes.
func (s *Service) SetSandboxes(ev ipam.NodeSandboxes) {
	s.step(func(m *Machine, now time.Time) { m.SetSandboxes(ev, now) })
}

// RefreshSandboxes hands the machine a new reading during the hold, records what it shows (a
// rebuild with the pods last set) and evaluates the hold.
func (s *Service) RefreshSandboxes(ev ipam.NodeSandboxes) {
	var pods []ipam.Pod
	s.step(func(m *Machine, now time.Time) {
		m.SetSandboxes(ev, now)
		pods = m.Pods()
	})
	if _, err := s.rebuild(pods, 1); err != nil {
		s.log.Error(err, "cannot journal attachments rebuilt during the unattributed hold; the hold stays on")
		return
	}
	s.step(func(m *Machine, now time.Time) { m.EvaluateHold(now) })
	s.kick()
}

// Hold reports whether the unattributed hold is on, and its deadline.
func (s *Service) Hold() (on bool, until time.Time) {
	s.read(func(m *Machine) { on, until = m.st.Hold() })
	return on, until
}

// holdStatus reports the hold for LIST, or nil.
func holdStatus(m *Machine) *cniproto.Hold {
	on, until := m.st.Hold()
	if !on {
		return nil
	}
	h := &cniproto.Hold{Until: until}
	for _, st := range m.st.Stats(m.now) {
		h.Addresses += st.Unattributed
	}
	waiting := m.st.HoldWaiting()
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
// event, so it logs them only at debug level): a fact, planned (reserving what it touches),
// journaled, then applied; when the journal refuses it nothing was recorded.
func (s *Service) rebuild(pods []ipam.Pod, v int) (int, error) {
	a := s.fact(func(m *Machine, now time.Time) uint64 { return m.Rebuild(pods, v, now) })
	if a.Err != nil {
		return 0, fmt.Errorf("journal rebuilt attachments: %w", a.Err)
	}
	return a.N, nil
}

// RecoverReservations re-creates the DRA reservations the claims' status entries evs name
// after a lost or damaged journal (Machine.RecoverReservations), journaled before it returns;
// when the journal refuses it nothing was recorded. It returns how many it recovered.
func (s *Service) RecoverReservations(evs []ipam.ReservationEvidence) (int, error) {
	a := s.fact(func(m *Machine, now time.Time) uint64 { return m.RecoverReservations(evs, now) })
	if a.Err != nil {
		return 0, fmt.Errorf("journal DRA reservations recovered from their claims: %w", a.Err)
	}
	return a.N, nil
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

// addRequest runs an ADD and, when it created an attachment, returns how to roll it back. The
// machine asks the gate (readiness, the handback mark, the node's Lease) when it plans it.
func (s *Service) addRequest(ctx context.Context, req cniproto.Request) (*cniproto.Response, func()) {
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

// notReady refuses the requests the driver serves itself (GC, HANDBACK) while the agent is
// starting. The machine refuses ADD, DEL and CHECK itself (Machine.SetReady); LIST and STATUS
// answer for themselves.
func (s *Service) notReady(req cniproto.Request) *cniproto.Response {
	switch req.Op {
	case cniproto.OpAdd, cniproto.OpDel, cniproto.OpCheck, cniproto.OpList, cniproto.OpStatus:
		return nil
	}
	var r *cniproto.Response
	s.read(func(m *Machine) { r = m.gate.refuseStarting() })
	return r
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
		if err := s.WaitReleases(ctx); err != nil { // judge journaled attachments, not in-flight ones
			return errResp(cniproto.CodeTryAgainLater, "ipwarden: GC waited for requests being journaled: "+err.Error(), "")
		}
		return s.gc(ctx, req)
	case cniproto.OpStatus:
		return s.status()
	case cniproto.OpList:
		var r *cniproto.Response
		s.read(func(m *Machine) { r = m.gate.refuseList() })
		if r != nil {
			return r
		}
		if err := s.WaitReleases(ctx); err != nil {
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

// add runs an ADD through the machine (Machine.Request): it returns the answer and the
// attachment it created, if it created one.
func (s *Service) add(ctx context.Context, req cniproto.Request) (*cniproto.Response, *ipam.Attachment) {
	if _, bad := validKey(req); bad != nil {
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
	a, _ := s.call(ctx, true, func(m *Machine, now time.Time) uint64 { return m.Request(req, now) })
	return a.Resp, a.Att
}

// beforeAddWrite, when set (a build with the failpoints tag), runs before an ADD's journal
// write: the crash tests hold it there and kill or stop the agent.
var beforeAddWrite func()

// afterAddWrite, when set (a build with the failpoints tag), runs once an ADD's journal write
// returned and before its outcome is fed back (and the ADD answered).
var afterAddWrite func()

func addError(err error) *cniproto.Response {
	var ce *ipam.ConfigError
	var np *ipam.NoPoolsError
	var pc *ipam.PoolChoiceError
	var su *ipam.StaticUnavailableError
	var hb *ipam.HandedBackError
	var cl *ipam.ClaimError
	switch {
	case errors.As(err, &cl):
		return errResp(cniproto.CodeTryAgainLater, "ipwarden: "+cl.Error(),
			"nothing was handed out: a pod that references an IPAMClaim gets only the claim's address (docs/design.md, \"VM addresses\"); the runtime retries")
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

// del frees an attachment (Machine.Request): unknown attachments succeed.
//
// The answer does not wait for the journal write (about a millisecond of fsync, a tenth of a
// pod's ADD+DEL): the addresses stay assigned, in memory and on disk, until the write lands, so
// nothing can hand them out before. The attachment stays busy until then, so a request for the
// same attachment (a repeated DEL, an ADD, a CHECK) waits for it, and LIST waits for every
// DEL answered before it. If the write fails or the agent dies first, the journal still holds
// the attachment: the leak collector frees it once its pod or sandbox is confirmed gone, as for
// a DEL that never came. Nothing is ever freed early; at worst it is freed late.
func (s *Service) del(req cniproto.Request) *cniproto.Response {
	if _, bad := validKey(req); bad != nil {
		return bad
	}
	a, _ := s.call(context.Background(), false, func(m *Machine, now time.Time) uint64 { return m.Request(req, now) })
	return a.Resp
}

// WaitReleases returns once every DEL answered before the call is journaled and applied, or
// with ctx's error.
func (s *Service) WaitReleases(ctx context.Context) error {
	_, err := s.call(ctx, false, func(m *Machine, now time.Time) uint64 { return m.Barrier(now) })
	return err
}

// delKeyIf frees the attachment key as DEL does, and returns once it is journaled: journal
// first, then its addresses go to the back of their cooling queues. With accept set, it frees
// only a confirmed (not in-flight) attachment that accept approves, decided when its turn
// comes, so a request racing the caller's decision is never undone. It returns the freed
// attachment and whether it freed one.
func (s *Service) delKeyIf(key ipam.Key, accept func(ipam.Attachment) bool) (ipam.Attachment, bool, error) {
	a, _ := s.call(context.Background(), false, func(m *Machine, now time.Time) uint64 { return m.FreeIf(key, accept, now) })
	if a.Err != nil || a.Att == nil {
		return ipam.Attachment{}, false, a.Err
	}
	return *a.Att, true, nil
}

// check verifies that the attachment exists and holds the addresses of prevResult.
func (s *Service) check(req cniproto.Request) *cniproto.Response {
	if _, bad := validKey(req); bad != nil {
		return bad
	}
	a, _ := s.call(context.Background(), false, func(m *Machine, now time.Time) uint64 { return m.Request(req, now) })
	return a.Resp
}

// checkPrev checks att against a CHECK's prevResult addresses.
func checkPrev(key ipam.Key, att ipam.Attachment, prev []string) *cniproto.Response {
	have := map[netip.Addr]bool{}
	for _, a := range att.Addresses {
		have[a.Addr] = true
	}
	for _, p := range prev {
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
	if len(prev) > 0 && len(have) > 0 {
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
	var cands []gc.Candidate
	s.step(func(m *Machine, now time.Time) {
		for _, k := range m.st.Stale(req.Network, valid, now.Add(-s.gcGrace)) {
			if att, ok := m.st.Attachment(k); ok {
				cands = append(cands, gc.Candidate{Attachment: gcAttachment(att, false)})
			}
		}
	})
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
	var resp *cniproto.Response
	s.read(func(m *Machine) {
		if !m.Serving() {
			resp = errResp(cniproto.CodeNotAvailable, "the ipwarden agent on node "+s.node+" is starting and not serving yet", "")
			return
		}
		if r := m.gate.refuseAdd(); r != nil {
			resp = errResp(cniproto.CodeNotAvailable, r.Error.Msg, r.Error.Details)
			return
		}
		if len(m.st.Served()) == 0 {
			resp = errResp(cniproto.CodeNotAvailable, (&ipam.NoPoolsError{Node: s.node}).Error(), "")
			return
		}
		resp = &cniproto.Response{Node: s.node, Pools: poolStatus(m)}
	})
	return resp
}

func poolStatus(m *Machine) []cniproto.PoolStatus {
	stats := m.st.Stats(m.now)
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
	var resp *cniproto.Response
	var atts []ipam.Attachment
	s.read(func(m *Machine) {
		resp = &cniproto.Response{Node: s.node, Pools: poolStatus(m)}
		atts = m.st.Attachments()
		for _, a := range atts {
			cfgs := map[string]ipam.Pool{}
			var conflicts []string
			for _, ad := range a.Addresses {
				cfgs[ad.Pool], _ = m.st.PoolConfig(ad.Pool)
				if held, known := m.st.Holding(ad.Pool); known && !held.Contains(ad.Addr) {
					conflicts = append(conflicts, ad.Addr.String())
				}
			}
			r := result(a, cfgs)
			la := cniproto.Attachment{
				ContainerID: a.Key.ContainerID, IfName: a.Key.IfName, Network: a.Network,
				Pod: cniproto.Pod{Namespace: a.Pod.Namespace, Name: a.Pod.Name, UID: a.Pod.UID},
				IPs: r.IPs, Created: a.Created, Rebuilt: a.Rebuilt, Conflicts: conflicts, Netns: a.Netns,
			}
			if c := a.Claim; c != nil {
				la.Claim = &cniproto.Claim{Namespace: c.Namespace, Name: c.Name, UID: c.UID, MigrationTarget: c.MigrationTarget}
			}
			resp.Attachments = append(resp.Attachments, la)
		}
		resp.Hold = holdStatus(m)
		if hb := m.st.HandedBack(); hb != nil {
			resp.Handback = &cniproto.HandbackStatus{Marked: true, At: hb.At, To: hb.To, Network: hb.Network, Dir: hb.Dir}
		}
	})
	// The sandboxes are looked at outside the machine (a stat each).
	for i := range resp.Attachments {
		resp.Attachments[i].Sandbox = lookSandbox(resp.Attachments[i].Netns, s.netnsDirs).String()
	}
	return resp
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

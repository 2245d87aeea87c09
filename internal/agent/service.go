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
	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// Committer writes state machine changes durably; the journal implements it.
type Committer interface {
	Commit(ipam.Change) error
}

// Service answers the CNI plugin's requests from the node's state: it owns the ipam.State, writes
// every change to the journal before it answers, serializes requests per attachment, and lets an
// ADD wait a bounded time for addresses. The Kubernetes side feeds it pools, holdings and pods.
type Service struct {
	node        string
	journal     Committer
	now         func() time.Time
	addressWait time.Duration
	gcGrace     time.Duration
	gcDryRun    bool
	gcr         *gcReporter
	log         logr.Logger
	metrics     *Metrics

	mu      sync.Mutex
	st      *ipam.State
	changed chan struct{} // closed and replaced whenever an address may have become usable
	kickFn  func()

	keys  keyLocks
	ready atomic.Bool
	// conflicts remembers reported conflicts so each is logged once.
	conflicts map[ipam.Address]ipam.Key
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
	return &Service{
		node:        opts.Node,
		journal:     journal,
		now:         opts.Now,
		addressWait: opts.AddressWait,
		gcGrace:     opts.GCGrace,
		gcDryRun:    opts.GCDryRun,
		gcr:         newGCReporter(opts.Log.WithName("gc"), opts.Metrics),
		log:         opts.Log,
		metrics:     opts.Metrics,
		st:          st,
		changed:     make(chan struct{}),
		kickFn:      func() {},
		conflicts:   map[ipam.Address]ipam.Key{},
	}
}

// SetKick sets the function that asks the pool monitor to recompute the node's request.
func (s *Service) SetKick(f func()) {
	s.mu.Lock()
	s.kickFn = f
	s.mu.Unlock()
}

func (s *Service) kick() {
	s.mu.Lock()
	f := s.kickFn
	s.mu.Unlock()
	f()
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

// With runs f with the state locked, for the Kubernetes side and tests.
func (s *Service) With(f func(st *ipam.State)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f(s.st)
}

// commitBestEffort journals a change whose loss a restart repairs (pool settings, holdings, and
// forgetting releasing or cooling addresses the controller took back).
func (s *Service) commitBestEffort(ch ipam.Change, what string) {
	if ch.IsEmpty() {
		return
	}
	if err := s.journal.Commit(ch); err != nil {
		s.log.Error(err, "cannot journal "+what+"; a restart recomputes it")
	}
}

// SetPools hands the service the pools' settings and the pools that select the node.
func (s *Service) SetPools(pools []ipam.Pool, served []string) {
	s.mu.Lock()
	ch := s.st.SetPools(pools, served)
	s.notifyLocked()
	s.mu.Unlock()
	s.commitBestEffort(ch, "pool settings")
	s.kick()
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
// generation: the record mark that later reads are compared with.
func (s *Service) NoteSpecWritten(uid string, generation int64) {
	s.mu.Lock()
	ch := ipam.Change{}
	if m := s.st.Mark(); m.UID != uid || generation > m.Generation {
		ch = s.st.SetMark(ipam.RecordMark{UID: uid, Generation: generation})
	}
	s.mu.Unlock()
	s.commitBestEffort(ch, "record mark")
}

// SetHoldings hands the service what the controller reports the node holds, per pool; pools
// missing from holdings but known to the state hold nothing. rec says which object it came
// from: a rewound one's extra addresses are distrusted first (ipam.State.Distrust), and the
// record mark moves to it.
func (s *Service) SetHoldings(holdings map[string]addr.Set, rec RecordOf) {
	s.mu.Lock()
	var ch ipam.Change
	now := s.now()
	if rec.Rewound {
		dch, marked := s.st.Distrust(holdings, now)
		ch.Merge(dch)
		ch.Merge(s.st.SetMark(ipam.RecordMark{UID: rec.UID, Generation: rec.Generation}))
		s.metrics.RecordRewinds.Inc()
		s.log.Info("the node's NodeIPAllocation is older than this node's last write (etcd restored, or the object re-created): "+
			"addresses it shows that the node had given back are released again, and addresses its pods use are claimed",
			"uid", rec.UID, "generation", rec.Generation, "released", fmtSets(marked))
	} else if m := s.st.Mark(); rec.UID != "" && (m.UID == "" || (m.UID == rec.UID && rec.Generation > m.Generation)) {
		ch.Merge(s.st.SetMark(ipam.RecordMark{UID: rec.UID, Generation: rec.Generation}))
	}
	names := slices.Sorted(func(yield func(string) bool) {
		for n := range holdings {
			if !yield(n) {
				return
			}
		}
	})
	for _, st := range s.st.Stats(s.now()) {
		if _, ok := holdings[st.Pool]; !ok {
			names = append(names, st.Pool)
		}
	}
	for _, n := range names {
		ch.Merge(s.st.SetHolding(n, holdings[n]))
	}
	s.st.SetRecordMissing(false)
	s.reportConflictsLocked()
	s.notifyLocked()
	s.mu.Unlock()
	s.commitBestEffort(ch, "holdings")
	s.kick()
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
				s.log.Error(nil, "conflict: an attachment uses an address the node no longer holds; it keeps serving the pod",
					"pool", st.Pool, "address", a.String(), "attachment", k.String(), "pod", att.Pod.String(), "podUID", att.Pod.UID)
				s.metrics.Conflicts.Inc()
			}
		}
	}
	s.conflicts = now
}

// SetPods hands the service the pods bound to the node.
func (s *Service) SetPods(pods []ipam.Pod) {
	s.mu.Lock()
	s.st.SetPods(pods)
	s.mu.Unlock()
	s.kick()
}

// Rebuild records attachments for running pods whose addresses no attachment accounts for (see
// ipam.State.Rebuild) and journals them before the service serves.
func (s *Service) Rebuild(pods []ipam.Pod) (int, error) {
	s.mu.Lock()
	ch, problems := s.st.Rebuild(pods, s.now())
	s.mu.Unlock()
	for _, p := range problems {
		s.log.Info("rebuild: " + p)
	}
	if err := s.journal.Commit(ch); err != nil {
		return 0, fmt.Errorf("journal rebuilt attachments: %w", err)
	}
	for _, a := range ch.PutAttachments {
		s.log.Info("rebuilt an attachment from the pod's status.podIPs", "pod", a.Pod.String(), "podUID", a.Pod.UID,
			"addresses", fmtAddresses(a.Addresses))
	}
	return len(ch.PutAttachments), nil
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
	start := s.now()
	resp := s.handle(ctx, req)
	if req.Op == cniproto.OpAdd || req.Op == cniproto.OpDel || req.Op == cniproto.OpCheck || req.Op == cniproto.OpGC {
		s.metrics.OpDuration.WithLabelValues(string(req.Op)).Observe(s.now().Sub(start).Seconds())
	}
	if resp.Error != nil {
		s.metrics.Errors.WithLabelValues(string(req.Op), fmt.Sprint(resp.Error.Code)).Inc()
		s.log.Info("request failed", "op", req.Op, "containerID", req.ContainerID, "ifname", req.IfName,
			"pod", req.Pod.Namespace+"/"+req.Pod.Name, "code", resp.Error.Code, "error", resp.Error.Msg)
	}
	return resp
}

func (s *Service) handle(ctx context.Context, req cniproto.Request) *cniproto.Response {
	if req.Op != cniproto.OpList && req.Op != cniproto.OpStatus && !s.Ready() {
		return errResp(cniproto.CodeTryAgainLater, "the ipwarden agent on node "+s.node+" is starting and not serving yet",
			"it serves once it has reconciled its journal with the API server")
	}
	switch req.Op {
	case cniproto.OpAdd:
		return s.add(ctx, req)
	case cniproto.OpDel:
		return s.del(req)
	case cniproto.OpCheck:
		return s.check(req)
	case cniproto.OpGC:
		return s.gc(req)
	case cniproto.OpStatus:
		return s.status()
	case cniproto.OpList:
		return s.list()
	}
	return errResp(cniproto.CodeInternal, fmt.Sprintf("unknown operation %q", req.Op), "")
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

// add hands out addresses, waiting up to addressWait for the controller if a pool is short.
func (s *Service) add(ctx context.Context, req cniproto.Request) *cniproto.Response {
	key, bad := validKey(req)
	if bad != nil {
		return bad
	}
	unlock := s.keys.lock(key)
	defer unlock()

	areq := ipam.AddRequest{Key: key, Network: req.Network, Pools: req.Pools,
		Pod: ipam.PodRef{Namespace: req.Pod.Namespace, Name: req.Pod.Name, UID: req.Pod.UID}}
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
		s.mu.Lock()
		now := s.now()
		att, ch, err := s.st.Add(areq, now)
		var short *ipam.ShortError
		if errors.As(err, &short) {
			if !now.Before(deadline) || ctx.Err() != nil {
				msg := s.shortMessageLocked(short, now)
				s.mu.Unlock()
				s.metrics.IPWait.Observe(s.now().Sub(start).Seconds())
				return errResp(cniproto.CodeTryAgainLater, msg,
					fmt.Sprintf("the ipwarden agent on node %s waited %s for the controller (--address-wait); the runtime retries", s.node, s.addressWait))
			}
			if !waiting {
				s.st.AddWaiter(key, areq.Pod.UID, req.Pools)
				waiting = true
			}
			changed := s.changed
			wake := deadline
			if next := s.st.NextCooled(now); !next.IsZero() && next.Before(wake) {
				wake = next
			}
			s.mu.Unlock()
			s.kick()
			timer := time.NewTimer(wake.Sub(now))
			select {
			case <-changed:
			case <-timer.C:
			case <-ctx.Done():
			}
			timer.Stop()
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
			return addError(err)
		}
		s.metrics.IPWait.Observe(s.now().Sub(start).Seconds())
		if !ch.IsEmpty() {
			if err := s.journal.Commit(ch); err != nil {
				s.mu.Lock()
				s.st.AbortAdd(key)
				s.notifyLocked()
				s.mu.Unlock()
				return errResp(cniproto.CodeTryAgainLater, "ipwarden: cannot record the attachment in the journal: "+err.Error(),
					"nothing was handed out; check the agent's --state-dir disk")
			}
			s.mu.Lock()
			s.st.ConfirmAdd(key)
			s.mu.Unlock()
			s.log.V(1).Info("ADD", "attachment", key.String(), "pod", att.Pod.String(), "addresses", fmtAddresses(att.Addresses))
			s.kick()
		}
		return result(att, cfgs)
	}
}

// shortMessageLocked says which pools are short and why.
func (s *Service) shortMessageLocked(short *ipam.ShortError, now time.Time) string {
	parts := make([]string, len(short.Pools))
	for i, p := range short.Pools {
		parts[i] = fmt.Sprintf("pool %s: %s", p, s.st.Reason(p, now))
	}
	return "ipwarden: no free address on node " + s.node + ": " + strings.Join(parts, "; ")
}

func addError(err error) *cniproto.Response {
	var ce *ipam.ConfigError
	var np *ipam.NoPoolsError
	switch {
	case errors.As(err, &ce):
		return errResp(cniproto.CodeInvalidConfig, "ipwarden: network configuration field "+ce.Error(),
			"name pools that select this node, or leave \"pools\" out to use all of them")
	case errors.As(err, &np):
		return errResp(cniproto.CodeTryAgainLater, "ipwarden: "+np.Error(), "")
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
func (s *Service) del(req cniproto.Request) *cniproto.Response {
	key, bad := validKey(req)
	if bad != nil {
		return bad
	}
	if err := s.delKey(key); err != nil {
		return errResp(cniproto.CodeTryAgainLater, "ipwarden: cannot record the release in the journal: "+err.Error(),
			"the addresses stay assigned; the runtime retries DEL")
	}
	return &cniproto.Response{}
}

func (s *Service) delKey(key ipam.Key) error {
	_, _, err := s.delKeyIf(key, nil)
	return err
}

// delKeyIf frees the attachment key as DEL does: journal first, then its addresses go to the back
// of their cooling queues. With accept set, it frees only a confirmed (not in-flight) attachment
// that accept approves, decided under the attachment's lock, so a request racing the caller's
// decision is never undone. It returns the freed attachment and whether it freed one.
func (s *Service) delKeyIf(key ipam.Key, accept func(ipam.Attachment) bool) (ipam.Attachment, bool, error) {
	unlock := s.keys.lock(key)
	defer unlock()
	s.mu.Lock()
	att, found := s.st.Attachment(key)
	if found && accept != nil && (s.st.Pending(key) || !accept(att)) {
		s.mu.Unlock()
		return ipam.Attachment{}, false, nil
	}
	plan, err := s.st.PlanDel(key, s.now())
	s.mu.Unlock()
	if err != nil {
		return ipam.Attachment{}, false, err
	}
	if !plan.Found {
		return ipam.Attachment{}, false, nil
	}
	if err := s.journal.Commit(plan.Change); err != nil {
		return ipam.Attachment{}, false, err
	}
	s.mu.Lock()
	s.st.ApplyDel(plan)
	s.notifyLocked()
	s.mu.Unlock()
	s.log.V(1).Info("DEL", "attachment", key.String(), "pod", att.Pod.String(), "addresses", fmtAddresses(att.Addresses))
	s.kick()
	return att, true, nil
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
// (CNI GC). The runtime's list is the truth here, not the pod objects: a live pod's old sandbox
// is exactly what it collects. With --gc-dry-run it reports and frees nothing.
func (s *Service) gc(req cniproto.Request) *cniproto.Response {
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
	freed := 0
	var errs []string
	why := "the container runtime no longer lists the attachment (CNI GC, network " + req.Network + ")"
	for _, c := range cands {
		s.metrics.GCCandidates.WithLabelValues(PathCNIGC).Inc()
		ok, err := s.collect(PathCNIGC, c, why)
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v", c.Key, err))
			continue
		}
		if ok {
			freed++
		}
	}
	if len(errs) > 0 {
		return errResp(cniproto.CodeTryAgainLater, "ipwarden: GC could not free "+strings.Join(errs, "; "), "")
	}
	return &cniproto.Response{Freed: freed}
}

// status reports whether the agent can serve ADD: it must be ready and some pool must select the
// node (CNI STATUS; code 50 otherwise).
func (s *Service) status() *cniproto.Response {
	if !s.Ready() {
		return errResp(cniproto.CodeNotAvailable, "the ipwarden agent on node "+s.node+" is starting and not serving yet", "")
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
			Cooling: st.Cooling, Releasing: st.Releasing, Requested: st.Requested, Conflicts: st.Conflicts, Exhausted: st.Exhausted}
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
		})
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

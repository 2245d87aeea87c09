package agent

// The agent's first promise, searched for by generated fault sequences: an address the agent
// answered to a runtime, or may have answered, never goes to a second sandbox while the first
// can still use it. The model drives the real Service over the real ipam.State and the real
// journal (bbolt in a temporary directory) and restarts the way Run and catchUp do, reading only
// what the agent itself wrote. It keeps its own record of what every runtime was told, and fails
// as soon as one address is live for two sandboxes, or a live sandbox's address is not on disk
// at a restart.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/gc"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/agent/journal"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/scaling"
)

// faultJournal is the real journal with the faults a real disk and a real kill give: refused
// writes (a full disk) and, once the process is killed, no write at all.
type faultJournal struct {
	mu      sync.RWMutex // held for reading by every write; kill takes it for writing
	j       *journal.Journal
	dead    bool
	failMu  sync.Mutex
	refuse  int // writes still to refuse
	refused int
}

var errDiskFull = errors.New("write journal: no space left on device")

func (f *faultJournal) Commit(ch ipam.Change) error     { return f.write(ch, false) }
func (f *faultJournal) CommitLazy(ch ipam.Change) error { return f.write(ch, true) }

func (f *faultJournal) write(ch ipam.Change, lazy bool) error {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.dead {
		return errors.New("the agent was killed")
	}
	f.failMu.Lock()
	refuse := f.refuse > 0
	if refuse {
		f.refuse--
		f.refused++
	}
	f.failMu.Unlock()
	if refuse {
		return errDiskFull
	}
	if lazy {
		return f.j.CommitLazy(ch)
	}
	return f.j.Commit(ch)
}

// kill ends every write: one in flight lands or not (it holds the read lock), none starts after.
func (f *faultJournal) kill() {
	f.mu.Lock()
	f.dead = true
	f.mu.Unlock()
}

type modelPod struct {
	ref     ipam.PodRef
	ips     []netip.Addr // status.podIPs as the API shows it (may be stale)
	inAPI   bool         // false: deleted (force-deleted: its sandbox may still run)
	visible bool         // the agent's watch has delivered it
	n       int          // sandboxes made so far
	phase   string       // "", or "Succeeded" once its containers ended and its sandboxes are gone
}

type modelSandbox struct {
	key     ipam.Key
	network string // CNI network name
	pod     *modelPod
	addr    netip.Addr
	netns   string
}

const modelNode = "node-m"

var (
	modelPodPool = ipam.Pool{Name: "pod", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.9.0.0/27")},
		Scaling: scaling.Params{BatchSize: 4, BufferPercent: 50, MaxPerNode: 12}, Cooldown: 30 * time.Second}
	modelStoragePool = ipam.Pool{Name: "st", Network: "storage", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.9.1.0/27")},
		Scaling: scaling.Params{BatchSize: 4, BufferPercent: 50, MaxPerNode: 12}, Cooldown: 30 * time.Second}
	modelPools = []ipam.Pool{modelPodPool, modelStoragePool}
)

type model struct {
	t        testing.TB
	rng      *rand.Rand
	dir      string // the agent's state directory
	netnsDir string // where sandboxes' network namespaces are (files here)
	step     int
	log      []string // the events so far, for a failure's report

	mu    sync.Mutex
	now   time.Time // plus the real time since start: an ADD's wait for the controller ends
	start time.Time

	fj      *faultJournal
	svc     *Service
	apiAway bool // restarted while the API server is away: not reconciled yet
	empty   bool // the journal was empty at this start (catchUp's journalEmpty)

	pods     []*modelPod
	live     map[ipam.Key]*modelSandbox // what the runtime was told and still runs
	ghosts   map[netip.Addr]bool        // answered by an older agent, recorded only as reserved ahead
	holdings map[string]addr.Set        // the controller's grants to the node
	resting  map[netip.Addr]time.Time   // taken back by the controller, resting
	nextCID  int
	counts   map[string]int
}

func (m *model) clock() time.Time {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.now.Add(time.Since(m.start))
}

func (m *model) advance(d time.Duration) {
	m.mu.Lock()
	m.now = m.now.Add(d)
	m.mu.Unlock()
}

func (m *model) event(format string, args ...any) {
	m.log = append(m.log, fmt.Sprintf("%d: ", m.step)+fmt.Sprintf(format, args...))
	if len(m.log) > 40 {
		m.log = m.log[1:]
	}
}

func (m *model) fatalf(format string, args ...any) {
	m.t.Helper()
	m.t.Fatalf("step %d: %s\nlast events:\n  %s", m.step, fmt.Sprintf(format, args...), strings.Join(m.log, "\n  "))
}

// boot starts the agent the way Run does: open (or recover) the journal, restore the state,
// serve from the journal as the gate allows, then reconcile with the API server unless it is
// away. Before anything, every address a live sandbox was told must be on disk.
func (m *model) boot(apiAway bool) {
	m.t.Helper()
	j, snap, recovered, err := journal.OpenOrRecover(m.dir, journal.Options{Node: modelNode}, m.clock())
	if err != nil {
		m.fatalf("open journal: %v", err)
	}
	if recovered != nil {
		m.fatalf("the journal was damaged: %+v", recovered)
	}
	m.checkOnDisk(snap)
	st := ipam.New(modelNode)
	if problems := st.Restore(snap); len(problems) > 0 {
		m.fatalf("restore: %v", problems)
	}
	st.ClampFuture(m.clock())
	if m.fj != nil {
		m.counts["refused by the disk"] += m.fj.refused
	}
	m.fj = &faultJournal{j: j}
	m.svc = NewService(st, m.fj, ServiceOptions{Node: modelNode, AddressWait: time.Millisecond, GCGrace: 0,
		NetnsDirs: []string{m.netnsDir}, RebuildHold: time.Hour, HoldDir: m.dir, Gated: true, Now: m.clock, Log: logr.Discard()})
	offline := st.CanServeOffline()
	if _, interrupted, _ := journal.HeldUntil(m.dir); interrupted && offline {
		offline = false
	}
	m.svc.setServeOffline(offline)
	m.svc.SetPodLookup(m.lookup)
	m.svc.SetReady(true)
	m.empty = snap.IsEmpty()
	m.apiAway = true
	if !apiAway {
		m.reconcile()
	}
}

// reconcile is catchUp's part once the API server answers: pools, holdings and pods, the
// rebuild, and the hold when the journal was empty or a hold was interrupted.
func (m *model) reconcile() {
	m.t.Helper()
	names := []string{modelPodPool.Name, modelStoragePool.Name}
	if err := m.svc.SetPools(modelPools, names); err != nil {
		m.event("reconcile refused: %v", err)
		return // the journal refused: catchUp retries later
	}
	if err := m.svc.SetHoldings(m.cloneHoldings(), RecordOf{}); err != nil {
		m.event("reconcile refused: %v", err)
		return
	}
	m.svc.SetPods(m.visiblePods())
	if _, err := m.svc.Rebuild(m.visiblePods()); err != nil {
		m.event("rebuild refused: %v", err)
		return
	}
	heldUntil, interrupted, _ := journal.HeldUntil(m.dir)
	if m.empty || interrupted {
		until := m.clock().Add(time.Hour)
		if interrupted && !heldUntil.IsZero() {
			until = heldUntil
		}
		m.svc.StartHold(until)
	}
	m.svc.setSynced()
	m.apiAway = false
	m.event("reconciled")
}

func (m *model) cloneHoldings() map[string]addr.Set {
	out := map[string]addr.Set{}
	for k, v := range m.holdings {
		out[k] = v
	}
	return out
}

func (m *model) visiblePods() []ipam.Pod {
	var out []ipam.Pod
	for _, p := range m.pods {
		if !p.inAPI || !p.visible {
			continue
		}
		out = append(out, ipam.Pod{Ref: p.ref, IPs: slices.Clone(p.ips), Finished: p.phase == "Succeeded"})
	}
	return out
}

func (m *model) lookup(_ context.Context, n gc.Name) gc.Lookup {
	for _, p := range m.pods {
		if p.inAPI && p.ref.Namespace == n.Namespace && p.ref.Name == n.Name {
			return gc.Lookup{Name: n, Found: true, UID: p.ref.UID}
		}
	}
	return gc.Lookup{Name: n}
}

// checkOnDisk: every address a live sandbox was told is on disk, in that sandbox's attachment,
// or (an older agent's answer) recorded as reserved ahead.
func (m *model) checkOnDisk(snap ipam.Snapshot) {
	m.t.Helper()
	att := map[ipam.Key][]ipam.Address{}
	for _, a := range snap.Attachments {
		att[a.Key] = a.Addresses
	}
	for k, sb := range m.live {
		if slices.ContainsFunc(att[k], func(a ipam.Address) bool { return a.Addr == sb.addr }) {
			continue
		}
		m.fatalf("live sandbox %s was told %s, which the journal does not attach to it (attachment %v)", k, sb.addr, att[k])
	}
	for a := range m.ghosts {
		if !slices.ContainsFunc(snap.Ahead, func(r ipam.Address) bool { return r.Addr == a }) {
			m.fatalf("an older agent's answer %s lost its record of a reservation ahead", a)
		}
	}
}

// told checks an ADD's answer against every live sandbox and records it.
func (m *model) told(sb *modelSandbox) {
	m.t.Helper()
	for k, o := range m.live {
		if o.addr == sb.addr && k != sb.key {
			m.fatalf("ADD %s was answered %s, which live sandbox %s (pod %s) was told", sb.key, sb.addr, k, o.pod.ref.Name)
		}
	}
	if m.ghosts[sb.addr] {
		m.fatalf("ADD %s was answered %s, which an older agent answered before its crash (recorded as reserved ahead)", sb.key, sb.addr)
	}
	m.live[sb.key] = sb
}

func (m *model) request(op cniproto.Op, sb *modelSandbox) cniproto.Request {
	req := cniproto.Request{Op: op, ContainerID: sb.key.ContainerID, IfName: sb.key.IfName, Network: sb.network, Netns: sb.netns,
		Pod: cniproto.Pod{Namespace: sb.pod.ref.Namespace, Name: sb.pod.ref.Name, UID: sb.pod.ref.UID}}
	if sb.network == "storage-net" {
		req.PoolNetwork = "storage"
	}
	return req
}

// addNew makes a new sandbox for a pod (a new pod, or a re-created sandbox of one) on the pod
// network or on the storage network (net1, as Multus attaches a second interface).
func (m *model) addNew() {
	var pod *modelPod
	if len(m.pods) > 0 && m.rng.IntN(3) > 0 {
		pod = m.pods[m.rng.IntN(len(m.pods))]
		if !pod.inAPI || pod.phase != "" {
			pod = nil
		}
	}
	if pod == nil {
		n := len(m.pods)
		pod = &modelPod{ref: ipam.PodRef{Namespace: "ns", Name: fmt.Sprintf("p%d", n), UID: fmt.Sprintf("uid-%d", n)}, inAPI: true,
			visible: m.rng.IntN(4) > 0}
		m.pods = append(m.pods, pod)
	}
	pod.n++
	m.nextCID++
	network, ifname := "podnet", "eth0"
	if m.rng.IntN(3) == 0 {
		network, ifname = "storage-net", "net1"
	}
	sb := &modelSandbox{key: ipam.Key{ContainerID: fmt.Sprintf("c%d", m.nextCID), IfName: ifname}, network: network, pod: pod,
		netns: filepath.Join(m.netnsDir, fmt.Sprintf("cni-%d", m.nextCID))}
	if err := os.WriteFile(sb.netns, nil, 0o600); err != nil {
		m.t.Fatal(err)
	}
	m.add(sb, "ADD")
}

func (m *model) add(sb *modelSandbox, what string) {
	m.t.Helper()
	resp := m.svc.Handle(context.Background(), m.request(cniproto.OpAdd, sb))
	if resp.Error != nil {
		m.event("%s %s (pod %s) refused: %s", what, sb.key, sb.pod.ref.Name, resp.Error.Msg)
		m.counts["add refused"]++
		// The runtime cleans up a failed ADD with a DEL; the sandbox never ran.
		m.svc.Handle(context.Background(), m.request(cniproto.OpDel, sb))
		_ = os.Remove(sb.netns)
		return
	}
	sb.addr = netip.MustParsePrefix(resp.IPs[0].Address).Addr()
	if m.rng.IntN(20) == 0 {
		// The answer is lost on its way (the plugin was killed): the runtime calls DEL.
		m.event("%s %s answered %s, answer lost", what, sb.key, sb.addr)
		m.counts["answer lost"]++
		m.svc.Handle(context.Background(), m.request(cniproto.OpDel, sb))
		_ = os.Remove(sb.netns)
		return
	}
	m.event("%s %s (pod %s, %s) = %s", what, sb.key, sb.pod.ref.Name, sb.network, sb.addr)
	m.counts["add"]++
	m.told(sb)
}

func (m *model) randomLive() *modelSandbox {
	if len(m.live) == 0 {
		return nil
	}
	keys := make([]ipam.Key, 0, len(m.live))
	for k := range m.live {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i].String() < keys[j].String() })
	return m.live[keys[m.rng.IntN(len(keys))]]
}

func (m *model) stepOnce() {
	m.t.Helper()
	switch op := m.rng.IntN(100); {
	case op < 28:
		m.addNew()
	case op < 33: // the runtime repeats the ADD of a live sandbox: the same address
		sb := m.randomLive()
		if sb == nil {
			return
		}
		resp := m.svc.Handle(context.Background(), m.request(cniproto.OpAdd, sb))
		if resp.Error != nil {
			m.event("repeated ADD %s refused: %s", sb.key, resp.Error.Msg)
			return
		}
		if got := netip.MustParsePrefix(resp.IPs[0].Address).Addr(); got != sb.addr {
			m.fatalf("repeated ADD %s = %s, first answered %s", sb.key, got, sb.addr)
		}
	case op < 48: // the runtime stops a sandbox: DEL, then its network namespace goes
		sb := m.randomLive()
		if sb == nil {
			return
		}
		resp := m.svc.Handle(context.Background(), m.request(cniproto.OpDel, sb))
		if resp.Error != nil {
			m.event("DEL %s refused: %s", sb.key, resp.Error.Msg)
			return // the runtime retries later; the sandbox keeps its address meanwhile
		}
		m.event("DEL %s (%s)", sb.key, sb.addr)
		m.counts["del"]++
		delete(m.live, sb.key)
		_ = os.Remove(sb.netns)
	case op < 54: // a pod reports its status.podIPs: its live eth0 address, or nothing new (stale)
		sb := m.randomLive()
		if sb == nil || sb.network != "podnet" {
			return
		}
		sb.pod.ips = []netip.Addr{sb.addr}
		m.event("pod %s reports %s", sb.pod.ref.Name, sb.addr)
		m.svc.SetPods(m.visiblePods())
	case op < 58: // the watch delivers a pod late, or has not yet
		if len(m.pods) == 0 {
			return
		}
		p := m.pods[m.rng.IntN(len(m.pods))]
		p.visible = !p.visible
		m.event("pod %s visible=%v", p.ref.Name, p.visible)
		m.svc.SetPods(m.visiblePods())
	case op < 60: // a pod is force-deleted: its sandboxes may still run
		if len(m.pods) == 0 {
			return
		}
		p := m.pods[m.rng.IntN(len(m.pods))]
		p.inAPI = false
		m.event("pod %s force-deleted", p.ref.Name)
		m.svc.SetPods(m.visiblePods())
	case op < 65: // CNI GC: the runtime lists its valid attachments of one network, truthfully
		network := []string{"podnet", "storage-net"}[m.rng.IntN(2)]
		var valid []cniproto.AttachmentID
		for k, sb := range m.live {
			if sb.network == network {
				valid = append(valid, cniproto.AttachmentID{ContainerID: k.ContainerID, IfName: k.IfName})
			}
		}
		resp := m.svc.Handle(context.Background(), cniproto.Request{Op: cniproto.OpGC, Network: network, HasValidAttachments: true, ValidAttachments: valid})
		m.event("GC %s (%d valid): freed %d", network, len(valid), resp.Freed)
		m.counts["gc"]++
	case op < 73:
		m.controllerSync()
	case op < 77: // the agent gives back what it does not need
		if _, err := m.svc.releaseRound(); err != nil {
			m.event("release refused: %v", err)
		} else {
			m.event("release round")
		}
	case op < 83:
		d := time.Duration(m.rng.IntN(40)) * time.Second
		m.advance(d)
		m.event("clock +%s", d)
	case op < 87: // the disk fills up for the next few writes
		n := 1 + m.rng.IntN(3)
		m.fj.failMu.Lock()
		m.fj.refuse += n
		m.fj.failMu.Unlock()
		m.event("disk full for %d writes", n)
		m.counts["refused writes"] += n
	case op < 91: // SIGKILL, then a start, perhaps with the API server away
		m.fj.kill()
		if err := m.fj.j.Close(); err != nil {
			m.fatalf("close: %v", err)
		}
		away := m.rng.IntN(3) == 0
		m.event("SIGKILL; restart (API away: %v)", away)
		m.counts["kill"]++
		m.boot(away)
	case op < 95: // SIGTERM: the agent's clean stop, then a start
		if err := m.svc.WaitReleases(context.Background()); err != nil {
			m.fatalf("wait releases: %v", err)
		}
		if err := m.fj.j.Close(); err != nil {
			m.fatalf("close: %v", err)
		}
		away := m.rng.IntN(3) == 0
		m.event("SIGTERM; restart (API away: %v)", away)
		m.counts["stop"]++
		m.boot(away)
	default:
		if m.apiAway {
			m.reconcile()
		}
	}
}

// controllerSync plays the controller for the node: it takes back what the node releases (that
// rests a minute) and fills the node's request from the pool's free addresses.
func (m *model) controllerSync() {
	now := m.clock()
	for _, req := range m.svc.Spec() {
		var cidr netip.Prefix
		for _, p := range modelPools {
			if p.Name == req.Pool {
				cidr = p.CIDRs[0]
			}
		}
		held := m.holdings[req.Pool]
		back := req.Releasing.Intersect(held)
		for _, a := range back.Addrs(1 << 10) {
			m.resting[a] = now
		}
		held = held.Subtract(back)
		deficit := req.Requested - count(held)
		all := addr.SetOfPrefixes(cidr)
		for _, a := range all.Subtract(held).Addrs(1 << 10) {
			if deficit <= 0 {
				break
			}
			if t, ok := m.resting[a]; ok && now.Sub(t) < time.Minute {
				continue
			}
			held = held.Union(addr.SetOfAddrs(a))
			deficit--
		}
		m.holdings[req.Pool] = held
	}
	if m.apiAway {
		return
	}
	if err := m.svc.SetHoldings(m.cloneHoldings(), RecordOf{}); err != nil {
		m.event("holdings refused: %v", err)
		return
	}
	m.event("controller sync: %v", m.holdings)
}

func count(s addr.Set) int { n, _ := s.Size().Uint64(); return int(n) }

// olderAgent leaves, as an agent of format 2 that answered ADDs before their journal writes
// would have, records of two free addresses reserved ahead, one of which that agent told a
// sandbox before it was killed: the sandbox runs, unknown to the journal.
func (m *model) olderAgent() {
	m.t.Helper()
	m.controllerSync()
	usable, _ := modelPodPool.Usable()
	free := m.holdings["pod"].Intersect(usable)
	for _, sb := range m.live {
		free = free.Subtract(addr.SetOfAddrs(sb.addr))
	}
	as := free.Addrs(2)
	if len(as) < 2 {
		return
	}
	var ch ipam.Change
	for _, a := range as {
		ch.PutAhead = append(ch.PutAhead, ipam.Address{Pool: "pod", Addr: a})
	}
	if err := m.fj.j.Commit(ch); err != nil {
		m.fatalf("older agent's records: %v", err)
	}
	m.ghosts[as[0]] = true
	m.fj.kill()
	if err := m.fj.j.Close(); err != nil {
		m.fatalf("close: %v", err)
	}
	m.event("an older agent answered %s from its reservations ahead %v and was killed", as[0], as)
	m.boot(false)
	if got := m.svc.lostAhead(); got != 2 {
		m.fatalf("after the older agent's crash LostAhead = %d, want 2", got)
	}
}

func runModel(t testing.TB, seed uint64, steps int) map[string]int {
	m := &model{t: t, rng: rand.New(rand.NewPCG(seed, 0x1ead)), dir: t.TempDir(), netnsDir: t.TempDir(),
		now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC), start: time.Now(), live: map[ipam.Key]*modelSandbox{}, ghosts: map[netip.Addr]bool{},
		holdings: map[string]addr.Set{"pod": {}, "st": {}}, resting: map[netip.Addr]time.Time{}, counts: map[string]int{}}
	m.boot(false)
	if m.rng.IntN(2) == 0 {
		m.olderAgent()
	}
	for m.step = 0; m.step < steps; m.step++ {
		m.stepOnce()
	}
	// A last start: everything live is on disk.
	if err := m.svc.WaitReleases(context.Background()); err != nil {
		t.Fatal(err)
	}
	m.fj.kill()
	if err := m.fj.j.Close(); err != nil {
		t.Fatal(err)
	}
	m.boot(false)
	if err := m.fj.j.Close(); err != nil {
		t.Fatal(err)
	}
	return m.counts
}

// TestModelNoAddressAnsweredTwice searches generated sequences of ADDs (new pods, re-created
// sandboxes, secondary interfaces), DELs, lost answers, pod reports (stale ones too), pods the
// watch has not delivered, force-deleted pods, CNI GC, controller grants and take-backs,
// give-backs, clock steps, refused journal writes, SIGKILL and SIGTERM restarts (some with the
// API server away), and an older agent's crash with addresses reserved ahead.
func TestModelNoAddressAnsweredTwice(t *testing.T) {
	total := map[string]int{}
	for seed := range 40 {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			for k, v := range runModel(t, uint64(seed), 400) {
				total[k] += v
			}
		})
	}
	// The generator reaches every kind of event (a changed generator that stops reaching one
	// fails here, not silently).
	for _, kind := range []string{"add", "add refused", "answer lost", "del", "gc", "refused writes", "refused by the disk", "kill", "stop"} {
		if total[kind] == 0 {
			t.Errorf("no %q event in any run: %v", kind, total)
		}
	}
	t.Logf("events: %v", total)
}

// FuzzModel runs the model from fuzzed seeds (make fuzz).
func FuzzModel(f *testing.F) {
	f.Add(uint64(1), uint16(200))
	f.Fuzz(func(t *testing.T, seed uint64, steps uint16) {
		runModel(t, seed, int(steps%400))
	})
}

func (s *Service) lostAhead() (n int) {
	s.locked(func(st *ipam.State) { n = st.LostAhead() })
	return n
}

package agent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/gc"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/scaling"
)

// memJournal is an in-memory journal: Snapshot.Apply of every commit, with failure injection.
type memJournal struct {
	mu   sync.Mutex
	snap ipam.Snapshot
	fail error
	n    int
	// block, when set, holds every write until it is closed.
	block chan struct{}
	// twice records an address that two journaled attachments held at once.
	twice []string
}

func (j *memJournal) Commit(ch ipam.Change) error {
	j.mu.Lock()
	block := j.block
	j.mu.Unlock()
	if block != nil {
		<-block
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.fail != nil {
		return j.fail
	}
	j.snap = j.snap.Apply(ch)
	j.n++
	owner := map[ipam.Address]ipam.Key{}
	for _, a := range j.snap.Attachments {
		for _, ad := range a.Addresses {
			if o, ok := owner[ad]; ok {
				j.twice = append(j.twice, fmt.Sprintf("%s held by %s and %s", ad.Addr, o, a.Key))
			}
			owner[ad] = a.Key
		}
	}
	return nil
}

// neverTwice fails t if the journal ever recorded an address held by two attachments.
func (j *memJournal) neverTwice(t *testing.T) {
	t.Helper()
	j.mu.Lock()
	defer j.mu.Unlock()
	if len(j.twice) > 0 {
		t.Fatalf("the journal recorded an address held twice: %v", j.twice)
	}
}

func (j *memJournal) setBlock(c chan struct{}) {
	j.mu.Lock()
	j.block = c
	j.mu.Unlock()
}

func (j *memJournal) setFail(err error) {
	j.mu.Lock()
	j.fail = err
	j.mu.Unlock()
}

func (j *memJournal) snapshot() ipam.Snapshot {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.snap
}

// fakePublisher records published specs, and can check the journal at publish time.
type fakePublisher struct {
	mu    sync.Mutex
	specs [][]ipam.PoolRequest
	check func([]ipam.PoolRequest)
}

func (p *fakePublisher) PublishSpec(_ context.Context, reqs []ipam.PoolRequest) (bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.check != nil {
		p.check(reqs)
	}
	if n := len(p.specs); n > 0 && fmt.Sprint(p.specs[n-1]) == fmt.Sprint(reqs) {
		return false, nil
	}
	p.specs = append(p.specs, reqs)
	return true, nil
}

func (p *fakePublisher) last() []ipam.PoolRequest {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.specs) == 0 {
		return nil
	}
	return p.specs[len(p.specs)-1]
}

var (
	testV4 = ipam.Pool{Name: "v4", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.1.0.0/16")}, Gateway: netip.MustParseAddr("10.1.0.1"),
		Routes:  []ipam.Route{{Dst: netip.MustParsePrefix("0.0.0.0/0")}},
		Scaling: scaling.Params{BatchSize: 4, BufferPercent: 50, MaxPerNode: 32}, Cooldown: time.Hour}
	testV6 = ipam.Pool{Name: "v6", CIDRs: []netip.Prefix{netip.MustParsePrefix("fd01::/64")},
		Scaling: scaling.Params{BatchSize: 4, BufferPercent: 50, MaxPerNode: 32}, Cooldown: time.Hour}
)

type svcHarness struct {
	t   *testing.T
	svc *Service
	j   *memJournal
	pub *fakePublisher
	mon *Monitor
}

func newSvc(t *testing.T, wait time.Duration, pools ...ipam.Pool) *svcHarness {
	t.Helper()
	j := &memJournal{}
	svc := NewService(ipam.New("node-a"), j, ServiceOptions{Node: "node-a", AddressWait: wait, GCGrace: time.Minute, Log: logr.Discard()})
	var names []string
	for _, p := range pools {
		names = append(names, p.Name)
	}
	svc.SetPools(pools, names)
	pub := &fakePublisher{}
	h := &svcHarness{t: t, svc: svc, j: j, pub: pub, mon: NewMonitor(svc, pub, time.Hour, logr.Discard())}
	svc.SetKick(h.mon.Kick, h.mon.KickNow)
	svc.SetReady(true)
	return h
}

func (h *svcHarness) hold(holdings map[string]string) {
	h.t.Helper()
	m := map[string]addr.Set{}
	for p, s := range holdings {
		m[p] = addr.MustParseSetString(s)
	}
	h.svc.SetHoldings(m, RecordOf{})
}

func addReq(cid string, pools ...string) cniproto.Request {
	return cniproto.Request{Op: cniproto.OpAdd, ContainerID: cid, IfName: "eth0", Network: "net", Pools: pools,
		Pod: cniproto.Pod{Namespace: "ns", Name: "pod-" + cid, UID: "uid-" + cid}}
}

// do handles req and waits until the journal writes of answered requests (a DEL is answered
// before its write) have landed, so the test sees a settled state.
func (h *svcHarness) do(req cniproto.Request) *cniproto.Response {
	resp := h.svc.Handle(context.Background(), req)
	if err := h.svc.WaitReleases(context.Background()); err != nil {
		h.t.Fatal(err)
	}
	return resp
}

func TestServiceAddResultHasPrefixGatewayRoutes(t *testing.T) {
	h := newSvc(t, time.Second, testV4, testV6)
	h.hold(map[string]string{"v4": "10.1.0.10-10.1.0.20", "v6": "fd01::a-fd01::f"})
	resp := h.do(addReq("c1"))
	if resp.Error != nil {
		t.Fatal(resp.Error)
	}
	want := "[{v4 10.1.0.10/16 10.1.0.1} {v6 fd01::a/64 }] [{0.0.0.0/0 }]"
	if got := fmt.Sprint(resp.IPs, resp.Routes); got != want {
		t.Fatalf("ADD result %s, want %s", got, want)
	}
	again := h.do(addReq("c1"))
	if fmt.Sprint(again.IPs) != fmt.Sprint(resp.IPs) {
		t.Fatalf("repeated ADD %v, first %v", again.IPs, resp.IPs)
	}
	if len(h.j.snapshot().Attachments) != 1 {
		t.Fatal("attachment not journaled")
	}
}

// TestServiceAddWaitsForController: with nothing held the ADD waits, raises the request, and
// succeeds once the (fake) controller fills it.
func TestServiceAddWaitsForController(t *testing.T) {
	// In a synctest bubble, synctest.Wait returns once the ADD waits and the monitor is idle.
	synctest.Test(t, func(t *testing.T) {
		h := newSvc(t, 10*time.Second, testV4)
		ctx, cancel := context.WithCancel(context.Background())
		ran := make(chan struct{})
		go func() { h.mon.Run(ctx); close(ran) }()
		defer func() { cancel(); <-ran }()
		done := make(chan *cniproto.Response, 1)
		go func() { done <- h.do(addReq("c1")) }()
		// The monitor publishes a request; the controller answers it.
		synctest.Wait()
		if spec := h.pub.last(); len(spec) != 1 || spec[0].Requested < 4 {
			t.Fatalf("no request published: %v", spec)
		}
		select {
		case resp := <-done:
			t.Fatalf("ADD finished with nothing held: %+v", resp)
		default:
		}
		h.hold(map[string]string{"v4": "10.1.1.0/30"})
		synctest.Wait()
		select {
		case resp := <-done:
			if resp.Error != nil || resp.IPs[0].Address != "10.1.1.0/16" {
				t.Fatalf("ADD after fill: %+v %v", resp.IPs, resp.Error)
			}
		default:
			t.Fatal("ADD did not finish after the holding arrived")
		}
	})
}

func TestServiceAddTimesOutWithReason(t *testing.T) {
	h := newSvc(t, 100*time.Millisecond, testV4, testV6)
	h.hold(map[string]string{"v4": "10.1.0.5"})
	start := time.Now()
	resp := h.do(addReq("c1"))
	if resp.Error == nil || resp.Error.Code != cniproto.CodeTryAgainLater {
		t.Fatalf("ADD with no v6 address: %+v", resp)
	}
	if time.Since(start) < 100*time.Millisecond {
		t.Fatal("ADD did not wait --address-wait")
	}
	for _, want := range []string{"pool v6", "controller has not answered", "node node-a"} {
		if !strings.Contains(resp.Error.Msg, want) {
			t.Errorf("message %q does not mention %q", resp.Error.Msg, want)
		}
	}
	// All or nothing: the v4 address is still free.
	if resp := h.do(addReq("c2", "v4")); resp.Error != nil || resp.IPs[0].Address != "10.1.0.5/16" {
		t.Fatalf("v4 ADD after the failed dual-stack ADD: %+v", resp)
	}
}

func TestServiceConfigErrorAndNotReady(t *testing.T) {
	h := newSvc(t, time.Second, testV4)
	h.hold(map[string]string{"v4": "10.1.0.5"})
	if resp := h.do(addReq("c1", "nope")); resp.Error == nil || resp.Error.Code != cniproto.CodeInvalidConfig ||
		!strings.Contains(resp.Error.Msg, `field pools: pool "nope"`) {
		t.Fatalf("unknown pool: %+v", resp.Error)
	}
	h.svc.SetReady(false)
	if resp := h.do(addReq("c1")); resp.Error == nil || resp.Error.Code != cniproto.CodeTryAgainLater {
		t.Fatalf("ADD before ready: %+v", resp.Error)
	}
	if resp := h.do(cniproto.Request{Op: cniproto.OpStatus}); resp.Error == nil || resp.Error.Code != cniproto.CodeNotAvailable {
		t.Fatalf("STATUS before ready: %+v", resp.Error)
	}
}

func TestServiceConcurrentAdds(t *testing.T) {
	h := newSvc(t, time.Second, testV4)
	h.hold(map[string]string{"v4": "10.1.1.0/26"})
	var mu sync.Mutex
	byKey := map[string]map[string]bool{}
	owner := map[string]string{}
	var wg sync.WaitGroup
	for i := range 40 {
		wg.Go(func() {
			cid := fmt.Sprintf("c%d", i%20) // every attachment twice, concurrently
			resp := h.do(addReq(cid))
			if resp.Error != nil {
				t.Error(resp.Error)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if byKey[cid] == nil {
				byKey[cid] = map[string]bool{}
			}
			byKey[cid][resp.IPs[0].Address] = true
			if o, ok := owner[resp.IPs[0].Address]; ok && o != cid {
				t.Errorf("%s handed to %s and %s", resp.IPs[0].Address, o, cid)
			}
			owner[resp.IPs[0].Address] = cid
		})
	}
	wg.Wait()
	for cid, as := range byKey {
		if len(as) != 1 {
			t.Errorf("%s got different addresses for repeated ADDs: %v", cid, as)
		}
	}
}

func TestServiceJournalFailures(t *testing.T) {
	h := newSvc(t, 50*time.Millisecond, testV4)
	h.hold(map[string]string{"v4": "10.1.0.5"})
	h.j.setFail(errors.New("disk full"))
	resp := h.do(addReq("c1"))
	if resp.Error == nil || resp.Error.Code != cniproto.CodeTryAgainLater || !strings.Contains(resp.Error.Msg, "disk full") {
		t.Fatalf("ADD with a failing journal: %+v", resp.Error)
	}
	h.j.setFail(nil)
	if resp := h.do(addReq("c2")); resp.Error != nil || resp.IPs[0].Address != "10.1.0.5/16" {
		t.Fatalf("the address of the failed ADD is not free again: %+v", resp)
	}
	// A DEL is answered before its journal write: when the write fails, the attachment keeps
	// its address (the leak collector frees it once its pod is gone), and nothing else gets it.
	h.j.setFail(errors.New("disk full"))
	refused := testutil.ToFloat64(h.svc.metrics.JournalRefused.WithLabelValues("del"))
	if resp := h.do(cniproto.Request{Op: cniproto.OpDel, ContainerID: "c2", IfName: "eth0"}); resp.Error != nil {
		t.Fatalf("DEL: %v", resp.Error)
	}
	if err := h.svc.WaitReleases(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(h.svc.metrics.JournalRefused.WithLabelValues("del")); got != refused+1 {
		t.Fatalf("journal_refused_total{change=del} = %v, want %v", got, refused+1)
	}
	h.j.setFail(nil)
	if resp := h.do(addReq("c3")); resp.Error == nil {
		t.Fatalf("ADD c3 got %+v: the address of a DEL the journal refused was handed out", resp.IPs)
	}
	if resp := h.do(addReq("c2")); resp.Error != nil || resp.IPs[0].Address != "10.1.0.5/16" {
		t.Fatalf("after a refused DEL the attachment must still hold its address: %+v", resp)
	}
	for range 2 { // DEL is idempotent
		if resp := h.do(cniproto.Request{Op: cniproto.OpDel, ContainerID: "c2", IfName: "eth0"}); resp.Error != nil {
			t.Fatal(resp.Error)
		}
	}
	if resp := h.do(cniproto.Request{Op: cniproto.OpDel, ContainerID: "never", IfName: "eth0"}); resp.Error != nil {
		t.Fatal(resp.Error)
	}
}

// A DEL is answered before its journal write lands, but its address stays assigned until then:
// an ADD that needs it waits, LIST waits, and the journal never records it held twice.
func TestDelAnsweredBeforeItsJournalWrite(t *testing.T) {
	pool := testV4
	pool.Cooldown = 0
	h := newSvc(t, 10*time.Second, pool)
	h.hold(map[string]string{"v4": "10.1.0.5"})
	if r := h.do(addReq("c1")); r.Error != nil || r.IPs[0].Address != "10.1.0.5/16" {
		t.Fatalf("ADD c1: %+v", r)
	}
	block := make(chan struct{})
	h.j.setBlock(block)
	del := make(chan *cniproto.Response, 1)
	go func() {
		del <- h.svc.Handle(context.Background(), cniproto.Request{Op: cniproto.OpDel, ContainerID: "c1", IfName: "eth0"})
	}()
	select {
	case r := <-del:
		if r.Error != nil {
			t.Fatalf("DEL: %v", r.Error)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the DEL waited for its journal write")
	}
	if got := testutil.ToFloat64(h.svc.metrics.ReleasesInFlight); got != 1 {
		t.Fatalf("releases_in_flight = %v while the write is held, want 1", got)
	}
	add := make(chan *cniproto.Response, 1)
	go func() { add <- h.svc.Handle(context.Background(), addReq("c2")) }()
	list := make(chan *cniproto.Response, 1)
	go func() { list <- h.svc.Handle(context.Background(), cniproto.Request{Op: cniproto.OpList}) }()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	err := h.svc.WaitReleases(ctx)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("WaitReleases while the write is held: %v, want the deadline", err)
	}
	if snap := h.j.snapshot(); len(snap.Attachments) != 1 || snap.Attachments[0].Key.ContainerID != "c1" {
		t.Fatalf("journal while the write is held: %+v, want c1 only", snap.Attachments)
	}
	h.j.setBlock(nil)
	close(block)
	if r := <-add; r.Error != nil || r.IPs[0].Address != "10.1.0.5/16" {
		t.Fatalf("ADD c2 after the DEL landed: %+v", r)
	}
	if r := <-list; r.Error != nil {
		t.Fatalf("LIST: %v", r.Error)
	} else if len(r.Attachments) > 1 || len(r.Attachments) == 1 && r.Attachments[0].ContainerID != "c2" {
		t.Fatalf("LIST answered %+v: it must wait for the DEL answered before it", r.Attachments)
	}
	if err := h.svc.WaitReleases(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(h.svc.metrics.ReleasesInFlight); got != 0 {
		t.Fatalf("releases_in_flight = %v after the write, want 0", got)
	}
	h.j.neverTwice(t)
	if snap := h.j.snapshot(); len(snap.Attachments) != 1 || snap.Attachments[0].Key.ContainerID != "c2" {
		t.Fatalf("journal at the end: %+v, want c2 only", h.j.snapshot().Attachments)
	}
}

func TestServiceCheck(t *testing.T) {
	h := newSvc(t, time.Second, testV4)
	h.hold(map[string]string{"v4": "10.1.0.5-10.1.0.9"})
	h.do(addReq("c1"))
	chk := func(prev ...string) *cniproto.Error {
		return h.do(cniproto.Request{Op: cniproto.OpCheck, ContainerID: "c1", IfName: "eth0", PrevAddresses: prev}).Error
	}
	if err := chk("10.1.0.5/16"); err != nil {
		t.Fatal(err)
	}
	if err := chk("10.1.0.6/16"); err == nil || !strings.Contains(err.Msg, "does not hold 10.1.0.6") {
		t.Fatalf("CHECK with a wrong address: %v", err)
	}
	if err := h.do(cniproto.Request{Op: cniproto.OpCheck, ContainerID: "zz", IfName: "eth0"}).Error; err == nil || err.Code != cniproto.CodeUnknownContainer {
		t.Fatalf("CHECK of an unknown attachment: %v", err)
	}
}

// ipwarden-cni delegates a CHECK to the previous IPAM ("previous") when, and only when, the agent
// answers code 3: so code 3 means "no attachment for this container and interface", and every
// other CHECK failure answers another code.
func TestServiceCheckCodeUnknownOnlyForMissingAttachment(t *testing.T) {
	h := newSvc(t, time.Second, testV4)
	h.hold(map[string]string{"v4": "10.1.0.5-10.1.0.9"})
	h.do(addReq("c1"))
	for _, tc := range []struct {
		name    string
		req     cniproto.Request
		unknown bool
	}{
		{"unknown container", cniproto.Request{ContainerID: "old-pod", IfName: "eth0"}, true},
		{"known container, other interface", cniproto.Request{ContainerID: "c1", IfName: "net1"}, true},
		{"known attachment", cniproto.Request{ContainerID: "c1", IfName: "eth0"}, false},
		{"wrong prevResult address", cniproto.Request{ContainerID: "c1", IfName: "eth0", PrevAddresses: []string{"10.1.0.6/16"}}, false},
		{"bad prevResult address", cniproto.Request{ContainerID: "c1", IfName: "eth0", PrevAddresses: []string{"nope"}}, false},
		{"no container ID", cniproto.Request{IfName: "eth0"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.req.Op = cniproto.OpCheck
			err := h.do(tc.req).Error
			if got := err != nil && err.Code == cniproto.CodeUnknownContainer; got != tc.unknown {
				t.Fatalf("CHECK answered %v: code 3 is %v, want %v", err, got, tc.unknown)
			}
		})
	}
	h.svc.SetReady(false)
	if err := h.do(cniproto.Request{Op: cniproto.OpCheck, ContainerID: "old-pod", IfName: "eth0"}).Error; err == nil || err.Code != cniproto.CodeTryAgainLater {
		t.Fatalf("CHECK of an agent that is not ready: %v, want code 11 (not 3: the plugin must not ask the previous IPAM)", err)
	}
}

func TestServiceGC(t *testing.T) {
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	h := newSvc(t, time.Second, testV4)
	h.svc.now = clock
	h.hold(map[string]string{"v4": "10.1.1.0/28"})
	for _, cid := range []string{"keep", "gone1", "gone2"} {
		h.do(addReq(cid))
	}
	other := addReq("othernet")
	other.Network = "other"
	h.do(other)
	mu.Lock()
	now = now.Add(2 * time.Minute)
	mu.Unlock()
	h.do(addReq("young"))
	h.svc.SetPodLookup(func(_ context.Context, n gc.Name) gc.Lookup { return gc.Lookup{Name: n} }) // every pod is gone
	resp := h.do(cniproto.Request{Op: cniproto.OpGC, Network: "net", HasValidAttachments: true, ValidAttachments: []cniproto.AttachmentID{{ContainerID: "keep", IfName: "eth0"}}})
	if resp.Error != nil || resp.Freed != 2 {
		t.Fatalf("GC = %+v, want 2 freed", resp)
	}
	list := h.do(cniproto.Request{Op: cniproto.OpList})
	var left []string
	for _, a := range list.Attachments {
		left = append(left, a.ContainerID)
	}
	if got := strings.Join(left, ","); got != "keep,othernet,young" {
		t.Fatalf("after GC: %s", got)
	}
}

// TestMonitorJournalsReleasingBeforePublishing: when the monitor lowers the request, the released
// addresses are already in the journal when the spec is published.
func TestMonitorJournalsReleasingBeforePublishing(t *testing.T) {
	h := newSvc(t, time.Second, testV4)
	h.hold(map[string]string{"v4": "10.1.1.0/28"}) // 16 held, target 4
	h.pub.check = func(reqs []ipam.PoolRequest) {
		journaled := map[netip.Addr]bool{}
		for _, r := range h.j.snapshot().Releasing {
			journaled[r.Addr] = true
		}
		for _, r := range reqs {
			for _, a := range r.Releasing.Addrs(1 << 16) {
				if !journaled[a] {
					t.Errorf("published releasing %s before journaling it", a)
				}
			}
		}
	}
	if err := h.mon.Round(context.Background()); err != nil {
		t.Fatal(err)
	}
	spec := h.pub.last()
	if len(spec) != 1 || spec[0].Requested != 4 || spec[0].Releasing.Size().Lo != 12 {
		t.Fatalf("spec %+v", spec)
	}
	// A failed journal write publishes nothing new and keeps the addresses usable.
	h2 := newSvc(t, time.Second, testV4)
	h2.hold(map[string]string{"v4": "10.1.1.0/28"})
	h2.j.setFail(errors.New("disk full"))
	if err := h2.mon.Round(context.Background()); err == nil {
		t.Fatal("round succeeded with a failing journal")
	}
	if len(h2.pub.specs) != 0 {
		t.Fatal("published a release that was not journaled")
	}
	h2.j.setFail(nil)
	for i := range 16 {
		if resp := h2.do(addReq(fmt.Sprint(i))); resp.Error != nil {
			t.Fatalf("ADD %d after the failed release: %v", i, resp.Error)
		}
	}
}

// TestMonitorRoundWhenCooldownEnds: freed addresses count as demand while they cool down, so the
// monitor lowers the request when the cooldown ends, with no other event and long before resync.
func TestMonitorRoundWhenCooldownEnds(t *testing.T) {
	// In a synctest bubble the clock moves only when every goroutine waits: the cooldown ends
	// at a known instant, and synctest.Wait returns once the monitor has acted on it.
	synctest.Test(t, func(t *testing.T) {
		pool := testV4
		pool.Cooldown = 100 * time.Millisecond
		h := newSvc(t, time.Second, pool)
		h.hold(map[string]string{"v4": "10.1.1.0/28"})
		for i := range 8 {
			if resp := h.do(addReq(fmt.Sprint(i))); resp.Error != nil {
				t.Fatal(resp.Error)
			}
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { h.mon.Run(ctx); close(done) }()
		defer func() { cancel(); <-done }()
		for i := range 8 {
			h.do(cniproto.Request{Op: cniproto.OpDel, ContainerID: fmt.Sprint(i), IfName: "eth0"})
		}
		synctest.Wait()
		if spec := h.pub.last(); len(spec) != 1 || spec[0].Requested == 4 {
			t.Fatalf("while the freed addresses cool down: published %+v", spec)
		}
		time.Sleep(pool.Cooldown + time.Millisecond) // the fake clock: the cooldown ends, at once
		synctest.Wait()
		if spec := h.pub.last(); len(spec) != 1 || spec[0].Requested != 4 {
			t.Fatalf("the request did not drop to 4 when the cooldown ended: published %+v", spec)
		}
	})
}

func TestSocketPermissionsAndRoundTrip(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "run", "ipwarden")
	sock := filepath.Join(dir, "agent.sock")
	l, err := Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]os.FileMode{dir: 0o700, sock: 0o600} {
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != want {
			t.Errorf("%s mode %v, want %v", path, fi.Mode().Perm(), want)
		}
	}
	h := newSvc(t, time.Second, testV4)
	h.hold(map[string]string{"v4": "10.1.0.7"})
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error)
	go func() { served <- Serve(ctx, l, h.svc, time.Minute, logr.Discard()) }()
	resp, err := cniproto.Call(context.Background(), sock, addReq("c1"))
	if err != nil || resp.Error != nil || resp.IPs[0].Address != "10.1.0.7/16" {
		t.Fatalf("ADD over the socket: %+v %v", resp, err)
	}
	cancel()
	if err := <-served; err != nil {
		t.Fatal(err)
	}
	// A stale socket file is replaced on the next start.
	l2, err := Listen(sock)
	if err != nil {
		t.Fatalf("listen over a stale socket: %v", err)
	}
	l2.Close()
	if _, err := cniproto.Call(context.Background(), filepath.Join(dir, "nope.sock"), addReq("c1")); !cniproto.IsUnreachable(err) {
		t.Fatalf("call to a missing socket: %v", err)
	}
	for _, shared := range []string{"/run/agent.sock", "/tmp/agent.sock"} {
		if _, err := Listen(shared); err == nil || !strings.Contains(err.Error(), "is shared") {
			t.Errorf("Listen(%s) = %v, want a refusal of the shared directory", shared, err)
		}
	}
}

// A pod the node's previous IPAM gave an address (it reports it in status.podIPs, and the journal
// has no attachment for it) is adopted on the first pod event that shows it, not only at start-up:
// its address is journaled, counted as adopted, claimed from the controller when the node does
// not hold it, and never handed to another pod. A later ADD for the same pod (its sandbox
// re-created) keeps the address.
func TestServiceAdoptsPodsOfThePreviousIPAMAsTheyAppear(t *testing.T) {
	h := newSvc(t, 50*time.Millisecond, testV4)
	h.hold(map[string]string{"v4": "10.1.0.10-10.1.0.11"})
	old := ipam.Pod{Ref: ipam.PodRef{Namespace: "ns", Name: "old", UID: "uid-old"}, IPs: []netip.Addr{netip.MustParseAddr("10.1.0.10")}}
	outside := ipam.Pod{Ref: ipam.PodRef{Namespace: "ns", Name: "elsewhere", UID: "uid-elsewhere"}, IPs: []netip.Addr{netip.MustParseAddr("10.1.7.7")}}
	unpooled := ipam.Pod{Ref: ipam.PodRef{Namespace: "ns", Name: "unpooled", UID: "uid-unpooled"}, IPs: []netip.Addr{netip.MustParseAddr("192.168.9.9")}}
	hostNet := ipam.Pod{Ref: ipam.PodRef{Namespace: "ns", Name: "host", UID: "uid-host"}, IPs: []netip.Addr{netip.MustParseAddr("10.1.0.11")}, HostNetwork: true}
	h.svc.SetPods([]ipam.Pod{old, outside, unpooled, hostNet})

	snap := h.j.snapshot()
	if len(snap.Attachments) != 2 {
		t.Fatalf("journal after the pod event: %+v, want the two pods whose addresses lie in the pool adopted", snap.Attachments)
	}
	for _, a := range snap.Attachments {
		if !a.Rebuilt || (a.Pod.UID != "uid-old" && a.Pod.UID != "uid-elsewhere") {
			t.Fatalf("journaled %+v", a)
		}
	}
	var st []ipam.PoolStats
	h.svc.locked(func(s *ipam.State) { st = s.Stats(time.Now()) })
	if len(st) != 1 || st[0].Adopted != 2 || st[0].InUse != 2 {
		t.Fatalf("stats %+v, want 2 adopted in use", st)
	}
	// 10.1.7.7 is in use on this node but not held by it: it is claimed.
	if err := h.mon.Round(context.Background()); err != nil {
		t.Fatal(err)
	}
	if reqs := h.pub.last(); len(reqs) != 1 || !reqs[0].Claimed.Contains(netip.MustParseAddr("10.1.7.7")) {
		t.Fatalf("published %+v, want 10.1.7.7 claimed", reqs)
	}

	// The node holds 10.1.0.10 (the old pod's) and 10.1.0.11 (free: the host-network pod's
	// status is not an address the pod network uses). A new pod gets .11, the next one waits.
	if r := h.do(addReq("new1")); r.Error != nil || r.IPs[0].Address != "10.1.0.11/16" {
		t.Fatalf("ADD of a new pod: %+v", r)
	}
	if r := h.do(addReq("new2")); r.Error == nil {
		t.Fatalf("ADD of a second new pod got %+v: the old pod's address was handed out", r.IPs)
	}
	// The old pod's sandbox is re-created (now through ipwarden): it keeps its address.
	req := addReq("old-sandbox-2")
	req.Pod = cniproto.Pod{Namespace: "ns", Name: "old", UID: "uid-old"}
	if r := h.do(req); r.Error != nil || r.IPs[0].Address != "10.1.0.10/16" {
		t.Fatalf("ADD of the old pod's new sandbox: %+v", r)
	}
}

// A DEL frees a pod's address while the pod still reports it in status.podIPs: the kubelet reports
// a sandbox's end later, and a deleted pod keeps its status until it is gone. A pod event then
// must not adopt the address again (as a pod of the previous IPAM): it stays free for the next
// pod, whether the pod is being deleted or its sandbox is being re-created.
func TestServiceDoesNotAdoptAddressesItsDelFreed(t *testing.T) {
	pool := testV4
	pool.Cooldown = 0
	h := newSvc(t, 50*time.Millisecond, pool)
	h.hold(map[string]string{"v4": "10.1.0.10-10.1.0.11"})
	var pods []ipam.Pod
	for i, cid := range []string{"deleted", "restarted"} {
		r := h.do(addReq(cid))
		if r.Error != nil {
			t.Fatalf("ADD %s: %v", cid, r.Error)
		}
		ip := netip.MustParsePrefix(r.IPs[0].Address).Addr()
		pods = append(pods, ipam.Pod{Ref: ipam.PodRef{Namespace: "ns", Name: "pod-" + cid, UID: "uid-" + cid},
			IPs: []netip.Addr{ip}, Deleting: i == 0})
	}
	for _, cid := range []string{"deleted", "restarted"} {
		del := addReq(cid)
		del.Op = cniproto.OpDel
		if r := h.do(del); r.Error != nil {
			t.Fatalf("DEL %s: %v", cid, r.Error)
		}
	}
	if err := h.svc.WaitReleases(context.Background()); err != nil {
		t.Fatal(err)
	}
	h.svc.SetPods(pods)
	if snap := h.j.snapshot(); len(snap.Attachments) != 0 {
		t.Fatalf("journal after the pod event: %+v, want no attachment (the DEL freed both addresses)", snap.Attachments)
	}
	var st []ipam.PoolStats
	h.svc.locked(func(s *ipam.State) { st = s.Stats(time.Now()) })
	if len(st) != 1 || st[0].Adopted != 0 || st[0].InUse != 0 {
		t.Fatalf("stats %+v, want nothing adopted or in use", st)
	}
	for _, cid := range []string{"new1", "new2"} {
		if r := h.do(addReq(cid)); r.Error != nil {
			t.Fatalf("ADD %s: %v (the freed addresses were adopted again)", cid, r.Error)
		}
	}
}

package agent

// The agent's IO edges in one process: CNI GC without a list, GC re-checks against the API
// server, ADD without pod identity, ADDs whose plugin went away, and the socket's bounds. The
// socket tests use a real unix socket and Serve.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/gc"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

func TestGCWithoutListFreesNothing(t *testing.T) {
	h := newGCHarness(t, false, CollectorOptions{})
	h.addPod("a", "a", "u-a")
	h.addPod("b", "b", "u-b")
	h.advance(2 * time.Minute)
	resp := h.do(cniproto.Request{Op: cniproto.OpGC, Network: "net"})
	if resp.Error == nil || resp.Error.Code != cniproto.CodeInvalidConfig || !strings.Contains(resp.Error.Msg, "without cni.dev/valid-attachments frees nothing") {
		t.Fatalf("GC without a list: %+v", resp.Error)
	}
	if got := h.attachments(); got != "a,b" {
		t.Fatalf("attachments after GC without a list: %s", got)
	}
	// An empty list is a list: the runtime says nothing is valid.
	resp = h.do(cniproto.Request{Op: cniproto.OpGC, Network: "net", HasValidAttachments: true})
	if resp.Error != nil || resp.Freed != 2 {
		t.Fatalf("GC with an empty list: %+v", resp)
	}
}

// CNI GC re-reads each candidate's pod from the API server: a pod that exists keeps its
// attachment even when the runtime does not list it, an API error keeps it (and fails the GC), a
// pod whose name now belongs to another UID does not, and an attachment without pod identity is
// freed on the runtime's word.
func TestCNIGCRechecksAgainstTheAPIServer(t *testing.T) {
	h := newGCHarness(t, false, CollectorOptions{})
	h.addPod("live", "live", "u-live")
	h.addPod("reused", "reused", "u-old")
	h.addPod("anon", "", "")
	h.addPod("gone", "gone", "u-gone")
	h.pods.set(func(f *fakePods) {
		f.api[gc.Name{Namespace: "ns", Name: "live"}] = "u-live"
		f.api[gc.Name{Namespace: "ns", Name: "reused"}] = "u-new"
	})
	h.advance(2 * time.Minute)
	resp := h.do(cniproto.Request{Op: cniproto.OpGC, Network: "net", HasValidAttachments: true})
	if resp.Error != nil || resp.Freed != 3 {
		t.Fatalf("GC: %+v", resp)
	}
	if got := h.attachments(); got != "live" {
		t.Fatalf("attachments after GC: %s", got)
	}
	if h.metric("ipwarden_agent_gc_kept_total", PathCNIGC) != 1 {
		t.Fatal("kept metric")
	}
	h.pods.set(func(f *fakePods) { f.err = errors.New("connection refused") })
	delete(h.pods.api, gc.Name{Namespace: "ns", Name: "live"})
	resp = h.do(cniproto.Request{Op: cniproto.OpGC, Network: "net", HasValidAttachments: true})
	if resp.Error == nil || resp.Error.Code != cniproto.CodeTryAgainLater || h.attachments() != "live" {
		t.Fatalf("GC with the API server down: %+v, attachments %s", resp, h.attachments())
	}
}

func TestAddWithoutPodIdentity(t *testing.T) {
	h := newSvc(t, time.Second, testV4)
	h.hold(map[string]string{"v4": "10.1.1.0/28"})
	tests := []struct {
		name    string
		pod     cniproto.Pod
		nonK8s  bool
		missing string // "" when the ADD succeeds
	}{
		{"no identity", cniproto.Pod{}, false, "K8S_POD_NAMESPACE and K8S_POD_NAME"},
		{"no name", cniproto.Pod{Namespace: "ns", UID: "u"}, false, "K8S_POD_NAME"},
		{"no namespace", cniproto.Pod{Name: "web"}, false, "K8S_POD_NAMESPACE"},
		{"no UID (old runtime)", cniproto.Pod{Namespace: "ns", Name: "web"}, false, ""},
		{"allowNonKubernetes", cniproto.Pod{}, true, ""},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := cniproto.Request{Op: cniproto.OpAdd, ContainerID: "c" + string(rune('a'+i)), IfName: "eth0", Network: "net",
				Pod: tc.pod, NonKubernetes: tc.nonK8s}
			resp := h.do(req)
			if tc.missing == "" {
				if resp.Error != nil || len(resp.IPs) != 1 {
					t.Fatalf("ADD: %+v", resp)
				}
				return
			}
			if resp.Error == nil || resp.Error.Code != cniproto.CodeInvalidConfig || !strings.Contains(resp.Error.Msg, "lacks "+tc.missing) ||
				!strings.Contains(resp.Error.Details, "allowNonKubernetes") {
				t.Fatalf("ADD: %+v", resp.Error)
			}
			var ok bool
			h.svc.locked(func(st *ipam.State) { _, ok = st.Attachment(ipam.Key{ContainerID: req.ContainerID, IfName: "eth0"}) })
			if ok {
				t.Fatal("a refused ADD left an attachment")
			}
		})
	}
}

// gateJournal blocks commits until released.
type gateJournal struct {
	memJournal
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func (g *gateJournal) Commit(ch ipam.Change) error {
	if len(ch.PutAttachments) > 0 {
		g.once.Do(func() { close(g.entered) })
		<-g.release
	}
	return g.memJournal.Commit(ch)
}

// serveTest runs Serve on a real unix socket.
func serveTest(t *testing.T, svc *Service) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "s", "agent.sock")
	l, err := Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = Serve(ctx, l, svc, time.Minute, logr.Discard())
	}()
	t.Cleanup(func() { cancel(); <-done })
	return sock
}

// sendAndHangUp sends req as the plugin does (request, half-close) and then closes the
// connection without reading the answer, as a plugin the runtime killed.
func sendAndHangUp(t *testing.T, sock string, req cniproto.Request, before func()) {
	t.Helper()
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	req.Version = cniproto.Version
	if err := json.NewEncoder(conn).Encode(req); err != nil {
		t.Fatal(err)
	}
	_ = conn.(*net.UnixConn).CloseWrite()
	if before != nil {
		before()
	}
	conn.Close()
}

func wait(t *testing.T, what string, cond func() error) {
	t.Helper()
	if err := localcluster.WaitFor(context.Background(), 10*time.Second, 10*time.Millisecond, cond); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// An ADD whose plugin hangs up while the journal write is in flight is rolled back once it
// completes: its addresses are not kept for a sandbox the runtime gave up on.
func TestServeRollsBackAddWhosePluginHungUp(t *testing.T) {
	g := &gateJournal{entered: make(chan struct{}), release: make(chan struct{})}
	svc := NewService(ipam.New("node-a"), g, ServiceOptions{Node: "node-a", AddressWait: time.Second, Log: logr.Discard()})
	svc.SetPools([]ipam.Pool{testV4}, []string{"v4"})
	svc.SetHoldings(map[string]addrSet{"v4": mustSet("10.1.1.0/28")}, RecordOf{})
	svc.SetReady(true)
	sock := serveTest(t, svc)
	sendAndHangUp(t, sock, addReq("gone"), func() { <-g.entered })
	close(g.release)
	wait(t, "the abandoned ADD to be rolled back", func() error {
		if svc.numAttachments() != 0 || svc.metricsAbandoned() != 1 {
			return errors.New("not yet")
		}
		return nil
	})
	snap := g.snapshot()
	if len(snap.Attachments) != 0 || len(snap.Cooling) != 1 {
		t.Fatalf("journal after the rollback: %+v", snap)
	}
}

// An ADD waiting for addresses whose plugin hangs up stops waiting at once and records nothing.
func TestServeCancelsWaitingAddWhosePluginHungUp(t *testing.T) {
	j := &memJournal{}
	svc := NewService(ipam.New("node-a"), j, ServiceOptions{Node: "node-a", AddressWait: time.Hour, Log: logr.Discard()})
	svc.SetPools([]ipam.Pool{testV4}, []string{"v4"})
	svc.SetHoldings(map[string]addrSet{"v4": mustSet("10.1.1.0/32")}, RecordOf{})
	svc.SetReady(true)
	svc.Handle(context.Background(), addReq("first")) // takes the only address
	sock := serveTest(t, svc)
	start := time.Now()
	sendAndHangUp(t, sock, addReq("waits"), func() {
		wait(t, "the ADD to wait", func() error {
			if n := svc.demand("v4"); n < 2 {
				return errors.New("not waiting")
			}
			return nil
		})
	})
	wait(t, "the waiting ADD to stop", func() error {
		if n := svc.demand("v4"); n != 1 {
			return errors.New("still waiting")
		}
		return nil
	})
	if time.Since(start) > 5*time.Second || svc.numAttachments() != 1 {
		t.Fatalf("after %s: %d attachments", time.Since(start), svc.numAttachments())
	}
}

func call(t *testing.T, sock string, raw []byte) *cniproto.Response {
	t.Helper()
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	go func() {
		_, _ = conn.Write(raw)
		_ = conn.(*net.UnixConn).CloseWrite()
	}()
	var resp cniproto.Response
	if err := json.NewDecoder(conn).Decode(&resp); err != nil {
		t.Fatalf("no answer: %v", err)
	}
	return &resp
}

func TestServeBoundsRequests(t *testing.T) {
	h := newSvc(t, time.Second, testV4)
	h.hold(map[string]string{"v4": "10.1.1.0/28"})
	sock := serveTest(t, h.svc)
	big := `{"version":1,"op":"ADD","containerID":"` + strings.Repeat("x", 1<<20) + `"}`
	if resp := call(t, sock, []byte(big)); resp.Error == nil || !strings.Contains(resp.Error.Msg, "request larger than 65536 bytes") {
		t.Fatalf("1 MiB request: %+v", resp.Error)
	}
	long, _ := json.Marshal(cniproto.Request{Version: 1, Op: cniproto.OpAdd, ContainerID: strings.Repeat("c", 300), IfName: "eth0",
		Pod: cniproto.Pod{Namespace: "ns", Name: "p"}})
	resp := call(t, sock, long)
	if resp.Error == nil || resp.Error.Msg != "ipwarden: container ID (CNI_CONTAINERID) too long (300 bytes, at most 256)" {
		t.Fatalf("long container ID: %+v", resp.Error)
	}
	if resp := call(t, sock, []byte("{not json")); resp.Error == nil || resp.Error.Code != cniproto.CodeDecodingFailure {
		t.Fatalf("bad JSON: %+v", resp.Error)
	}
	// An idle connection is closed after requestReadTimeout.
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetReadDeadline(time.Now().Add(requestReadTimeout + 5*time.Second))
	var r cniproto.Response
	if err := json.NewDecoder(conn).Decode(&r); err != nil || r.Error == nil || r.Error.Code != cniproto.CodeIOFailure {
		t.Fatalf("idle connection: %v %+v", err, r.Error)
	}
}

// Connections whose request has not arrived are bounded (maxReaders): one beyond is answered
// "busy" at once, and a slot frees when one closes.
func TestServeBusy(t *testing.T) {
	old := maxReaders
	maxReaders = 2
	t.Cleanup(func() { maxReaders = old })
	h := newSvc(t, time.Second, testV4)
	h.hold(map[string]string{"v4": "10.1.1.0/28"})
	sock := serveTest(t, h.svc)
	var idle []net.Conn
	for range 2 {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, c)
	}
	defer func() {
		for _, c := range idle {
			c.Close()
		}
	}()
	wait(t, "two connections open", func() error {
		if n := h.svc.metrics.connsNow(); n != 2 {
			return errors.New("not yet")
		}
		return nil
	})
	req, _ := json.Marshal(cniproto.Request{Version: 1, Op: cniproto.OpStatus})
	resp := call(t, sock, req)
	if resp.Error == nil || resp.Error.Code != cniproto.CodeTryAgainLater || !strings.Contains(resp.Error.Msg, "busy") {
		t.Fatalf("third connection: %+v", resp.Error)
	}
	idle[0].Close()
	wait(t, "a slot to free", func() error {
		if resp := call(t, sock, req); resp.Error != nil {
			return errors.New(resp.Error.Msg)
		}
		return nil
	})
}

// Idle connections never hold a handling slot: with 1,000 of them open, far more than requests
// may be handled at once (maxConns 2), an ADD is answered within 1 s, not refused as busy or
// queued behind them. (Before, each accepted connection took a slot while its request was read,
// so 1,000 idle connections delayed an ADD by 21 s.) The idle connections are kept open for the
// whole test (requestReadTimeout raised), so every ADD is measured while all of them are.
func TestIdleConnectionsDoNotDelayARequest(t *testing.T) {
	const idleConns = 1000
	const bound = time.Second
	oldConns, oldRead := maxConns, requestReadTimeout
	maxConns, requestReadTimeout = 2, time.Minute
	t.Cleanup(func() { maxConns, requestReadTimeout = oldConns, oldRead })
	h := newSvc(t, time.Second, testV4)
	h.hold(map[string]string{"v4": "10.1.1.0/28"})
	sock := serveTest(t, h.svc)
	var idle []net.Conn
	defer func() {
		for _, c := range idle {
			c.Close()
		}
	}()
	for range idleConns {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, c)
	}
	// A slow client: half a request, then nothing.
	if _, err := idle[0].Write([]byte(`{"version":1,"op":`)); err != nil {
		t.Fatal(err)
	}
	wait(t, "the idle connections to be open", func() error {
		if n := h.svc.metrics.connsNow(); n != idleConns {
			return fmt.Errorf("%v open", n)
		}
		return nil
	})
	var slowest time.Duration
	for i := range 5 {
		req := addReq(fmt.Sprintf("behind-idle-%d", i))
		req.Version = cniproto.Version
		raw, _ := json.Marshal(req)
		start := time.Now()
		resp := call(t, sock, raw)
		took := time.Since(start)
		if resp.Error != nil || len(resp.IPs) != 1 {
			t.Fatalf("ADD %d behind %d idle connections: %+v", i, idleConns, resp)
		}
		if took > bound {
			t.Fatalf("ADD %d behind %d idle connections answered after %s, more than %s", i, idleConns, took, bound)
		}
		slowest = max(slowest, took)
	}
	t.Logf("slowest of 5 ADDs behind %d idle connections: %s", idleConns, slowest)
	if n := h.svc.metrics.connsNow(); n < idleConns {
		t.Fatalf("only %v connections open after the ADDs: the idle ones were not all open while they were answered", n)
	}
}

type addrSet = addr.Set

func mustSet(s string) addr.Set { return addr.MustParseSetString(s) }

// value reads a counter or gauge.
func value(t interface{ Fatal(...any) }, m prometheus.Metric) float64 {
	var d dto.Metric
	if err := m.Write(&d); err != nil {
		t.Fatal(err)
	}
	if d.Counter != nil {
		return d.Counter.GetValue()
	}
	return d.Gauge.GetValue()
}

// locked runs f with the service's state, as the machine's owner (Serve's goroutines change it).
func (s *Service) locked(f func(st *ipam.State)) {
	s.read(func(m *Machine) { f(m.st) })
}

// numAttachments and hold read the state under the service's lock.
func (s *Service) numAttachments() (n int) {
	s.locked(func(st *ipam.State) { n = st.NumAttachments() })
	return n
}

func (s *Service) hold() (on bool) {
	s.locked(func(st *ipam.State) { on, _ = st.Hold() })
	return on
}

func (s *Service) metricsAbandoned() float64 { return value(nil, s.metrics.AbandonedAdds) }

func (m *Metrics) connsNow() float64 { return value(nil, m.Conns) }

// The hold through the service: LIST shows it and the pods it waits for; an ADD for the one
// unreported pod settles it (its runtime asked again, so no earlier sandbox of it runs) and is
// served at once from the freed addresses, not after --address-wait.
func TestServiceHoldEndsOnTheUnreportedPodsADD(t *testing.T) {
	h := newSvc(t, 30*time.Second, testV4)
	h.hold(map[string]string{"v4": "10.1.1.0/30"})
	h.svc.SetPods([]ipam.Pod{{Ref: ipam.PodRef{Namespace: "ns", Name: "pod-web", UID: "uid-web"}}})
	h.svc.StartHold(time.Now().Add(time.Hour))
	list := h.do(cniproto.Request{Op: cniproto.OpList})
	if list.Hold == nil || list.Hold.Addresses != 4 || strings.Join(list.Hold.WaitingFor, ",") != "ns/pod-web" || list.Pools[0].Unattributed != 4 {
		t.Fatalf("LIST during the hold: %+v %+v", list.Hold, list.Pools)
	}
	if value(t, h.svc.metrics.HoldActive) != 1 {
		t.Fatal("hold metric")
	}
	start := time.Now()
	resp := h.do(addReq("web"))
	if resp.Error != nil || len(resp.IPs) != 1 {
		t.Fatalf("ADD of the unreported pod: %+v", resp)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the ADD waited %s", d)
	}
	if list := h.do(cniproto.Request{Op: cniproto.OpList}); list.Hold != nil || list.Pools[0].Unattributed != 0 {
		t.Fatalf("LIST after the hold: %+v", list.Hold)
	}
	if value(t, h.svc.metrics.HoldActive) != 0 {
		t.Fatal("hold metric after the hold")
	}
}

// A hold that runs out with a pod that never reported raises a Warning event naming the pod.
func TestServiceHoldDeadlineWarns(t *testing.T) {
	h := newGCHarness(t, false, CollectorOptions{})
	h.svc.SetPods([]ipam.Pod{{Ref: ipam.PodRef{Namespace: "ns", Name: "silent", UID: "u-silent"}}})
	h.svc.StartHold(h.now.Add(time.Minute))
	if !h.svc.hold() {
		t.Fatal("no hold")
	}
	h.advance(time.Minute)
	h.svc.step(func(m *Machine, now time.Time) { m.EvaluateHold(now) })
	if h.svc.hold() {
		t.Fatal("the hold outlived its deadline")
	}
	if ev := h.rec.find("NodeIPAllocation//node-a Warning UnattributedHoldExpired"); !strings.Contains(ev, "ns/silent") {
		t.Fatalf("events %q", h.rec.all())
	}
}

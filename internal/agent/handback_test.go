package agent

import (
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
)

func handbackReq(to string, mark bool) cniproto.Request {
	return cniproto.Request{Op: cniproto.OpHandback, Handback: &cniproto.HandbackRequest{To: to, Network: "net", Dir: "/var/lib/cni/networks/net", Mark: mark}}
}

const hostLocalV4 = `{"type": "host-local", "ranges": [[{"subnet": "10.1.0.0/24", "rangeStart": "10.1.0.10", "rangeEnd": "10.1.0.20"}]]}`

// After a handback every ADD is refused with CNI error 100 naming the time and the undo; DEL
// and CHECK keep working; the mark is journaled (a restart from the journal refuses ADD too),
// LIST and the metric show it, and --undo serves ADD again.
func TestServiceHandbackRefusesAddUntilUndone(t *testing.T) {
	h := newSvc(t, 100*time.Millisecond, testV4)
	h.hold(map[string]string{"v4": "10.1.0.10-10.1.0.20"})
	for _, c := range []string{"c1", "c2"} {
		if resp := h.do(addReq(c)); resp.Error != nil {
			t.Fatal(resp.Error)
		}
	}
	// The plan changes nothing and reports the attachments.
	plan := h.do(handbackReq(hostLocalV4, false))
	if plan.Error != nil || plan.Handback == nil || plan.Handback.Marked || len(plan.Handback.Attachments) != 2 {
		t.Fatalf("plan: %+v %+v", plan.Error, plan.Handback)
	}
	if resp := h.do(addReq("c3")); resp.Error != nil {
		t.Fatalf("ADD after a plan: %v", resp.Error)
	}
	resp := h.do(handbackReq(hostLocalV4, true))
	if resp.Error != nil || !resp.Handback.Marked || len(resp.Handback.Attachments) != 3 || resp.Handback.To != "host-local" {
		t.Fatalf("mark: %+v %+v", resp.Error, resp.Handback)
	}
	if got := resp.Handback.Attachments[0]; got.ContainerID != "c1" || got.IfName != "eth0" || got.Pod.Name != "pod-c1" ||
		strings.Join(got.Addresses, ",") != "10.1.0.10" {
		t.Fatalf("first attachment %+v", got)
	}
	at := resp.Handback.At
	if value(t, h.svc.metrics.HandedBack) != 1 {
		t.Fatal("ipwarden_agent_handed_back is not 1")
	}
	add := h.do(addReq("c4"))
	if add.Error == nil || add.Error.Code != cniproto.CodeHandedBack ||
		!strings.Contains(add.Error.Msg, "handed back to host-local at "+at.Format(time.RFC3339)) ||
		!strings.Contains(add.Error.Msg, "ipwarden agent handback --undo") {
		t.Fatalf("ADD after the handback: %+v", add.Error)
	}
	// A repeated ADD of an existing attachment is refused too: the node serves no ADD.
	if add := h.do(addReq("c1")); add.Error == nil || add.Error.Code != cniproto.CodeHandedBack {
		t.Fatalf("repeated ADD after the handback: %+v", add.Error)
	}
	if r := h.do(cniproto.Request{Op: cniproto.OpCheck, ContainerID: "c1", IfName: "eth0"}); r.Error != nil {
		t.Fatalf("CHECK after the handback: %v", r.Error)
	}
	if r := h.do(cniproto.Request{Op: cniproto.OpDel, ContainerID: "c2", IfName: "eth0"}); r.Error != nil {
		t.Fatalf("DEL after the handback: %v", r.Error)
	}
	if l := h.do(cniproto.Request{Op: cniproto.OpList}); l.Handback == nil || !l.Handback.Marked || len(l.Attachments) != 2 {
		t.Fatalf("LIST after the handback: %+v, %d attachments", l.Handback, len(l.Attachments))
	}
	// A handback again (the operator re-runs it) keeps the first mark's time.
	if again := h.do(handbackReq(hostLocalV4, true)); again.Error != nil || !again.Handback.At.Equal(at) {
		t.Fatalf("second handback: %+v %+v", again.Error, again.Handback)
	}

	// The journal holds the mark: a service restored from it refuses ADD.
	snap := h.j.snapshot()
	if snap.Handback == nil || !snap.Handback.At.Equal(at) {
		t.Fatalf("journal's mark %+v", snap.Handback)
	}
	st := ipam.New("node-a")
	st.Restore(snap)
	m := NewMetrics(nil)
	restarted := NewService(st, &memJournal{snap: snap}, ServiceOptions{Node: "node-a", AddressWait: time.Second, Log: logr.Discard(), Metrics: m})
	restarted.SetReady(true)
	if value(t, m.HandedBack) != 1 {
		t.Fatal("a restarted agent does not report ipwarden_agent_handed_back 1")
	}
	if r := restarted.Handle(t.Context(), addReq("c5")); r.Error == nil || r.Error.Code != cniproto.CodeHandedBack {
		t.Fatalf("ADD after a restart: %+v", r.Error)
	}

	undo := h.do(cniproto.Request{Op: cniproto.OpHandback, Handback: &cniproto.HandbackRequest{Undo: true}})
	if undo.Error != nil || undo.Handback == nil || undo.Handback.Marked || !undo.Handback.At.Equal(at) {
		t.Fatalf("undo: %+v %+v", undo.Error, undo.Handback)
	}
	if value(t, h.svc.metrics.HandedBack) != 0 || h.j.snapshot().Handback != nil {
		t.Fatal("the undo left the metric or the journal's mark")
	}
	if r := h.do(addReq("c4")); r.Error != nil {
		t.Fatalf("ADD after the undo: %v", r.Error)
	}
}

// A handback that cannot be done changes nothing: an address outside host-local's ranges, a
// target that is not host-local, attachments on another network.
func TestServiceHandbackRefusals(t *testing.T) {
	h := newSvc(t, 100*time.Millisecond, testV4)
	h.hold(map[string]string{"v4": "10.1.0.10-10.1.0.20"})
	if resp := h.do(addReq("c1")); resp.Error != nil {
		t.Fatal(resp.Error)
	}
	narrow := `{"type": "host-local", "ranges": [[{"subnet": "10.1.0.0/24", "rangeStart": "10.1.0.11", "rangeEnd": "10.1.0.20"}]]}`
	other := cniproto.Request{Op: cniproto.OpAdd, ContainerID: "c9", IfName: "net1", Network: "other",
		Pod: cniproto.Pod{Namespace: "ns", Name: "pod-c9", UID: "uid-c9"}}
	for _, tc := range []struct {
		name  string
		req   cniproto.Request
		setup func()
		want  string
	}{
		{name: "outside", req: handbackReq(narrow, true), want: "pod ns/pod-c1 uses 10.1.0.10, outside every range"},
		{name: "whereabouts", req: handbackReq(`{"type": "whereabouts", "range": "10.1.0.0/24"}`, true), want: "drain the node"},
		{name: "no network", req: cniproto.Request{Op: cniproto.OpHandback, Handback: &cniproto.HandbackRequest{To: hostLocalV4, Mark: true}}, want: "names no network"},
		{name: "another network", req: handbackReq(hostLocalV4, true), setup: func() {
			if r := h.do(other); r.Error != nil {
				t.Fatal(r.Error)
			}
		}, want: "pod ns/pod-c9 (network other)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.setup != nil {
				tc.setup()
			}
			resp := h.do(tc.req)
			if resp.Error == nil || !strings.Contains(resp.Error.Msg, tc.want) {
				t.Fatalf("handback: %+v, want an error with %q", resp.Error, tc.want)
			}
			if h.j.snapshot().Handback != nil || value(t, h.svc.metrics.HandedBack) != 0 {
				t.Fatal("a refused handback left a mark")
			}
			if r := h.do(addReq("a-" + tc.name)); r.Error != nil {
				t.Fatalf("ADD after a refused handback: %v", r.Error)
			}
		})
	}
}

// A DEL while the node is handed back (its configuration still names ipwarden) removes the
// reservation file naming that attachment, so host-local does not hold the address for good; a
// file host-local gave another container is kept.
func TestServiceDelWhileHandedBackReleasesTheFile(t *testing.T) {
	h := newSvc(t, 100*time.Millisecond, testV4)
	h.hold(map[string]string{"v4": "10.1.0.10-10.1.0.20"})
	for _, c := range []string{"c1", "c2"} {
		if resp := h.do(addReq(c)); resp.Error != nil {
			t.Fatal(resp.Error)
		}
	}
	dir := filepath.Join(t.TempDir(), "net")
	req := handbackReq(hostLocalV4, true)
	req.Handback.Dir = dir
	if resp := h.do(req); resp.Error != nil {
		t.Fatal(resp.Error)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	files := map[string]string{"10.1.0.10": "c1\r\neth0", "10.1.0.11": "someone-else\r\neth0"}
	for name, c := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(c), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []string{"c1", "c2"} {
		if r := h.do(cniproto.Request{Op: cniproto.OpDel, ContainerID: c, IfName: "eth0"}); r.Error != nil {
			t.Fatal(r.Error)
		}
	}
	if err := h.svc.WaitReleases(t.Context()); err != nil { // a DEL is answered before its journal write
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "10.1.0.10")); !os.IsNotExist(err) {
		t.Fatalf("the file of the deleted c1 is still there: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "10.1.0.11")); err != nil || string(b) != "someone-else\r\neth0" {
		t.Fatalf("another container's file: %q %v", b, err)
	}
}

// While the unattributed hold is on (the journal was rebuilt from the pods' status and some held
// addresses have no known owner yet), a pod may use an address the agent has no attachment for:
// it would get no reservation file, so the handback is refused and nothing is marked.
func TestServiceHandbackRefusedDuringTheUnattributedHold(t *testing.T) {
	h := newSvc(t, 100*time.Millisecond, testV4)
	h.hold(map[string]string{"v4": "10.1.0.10-10.1.0.20"})
	if resp := h.do(addReq("c1")); resp.Error != nil {
		t.Fatal(resp.Error)
	}
	// A running pod that has not reported its addresses keeps the hold on.
	h.svc.SetPods([]ipam.Pod{{Ref: ipam.PodRef{Namespace: "ns", Name: "silent", UID: "u-silent"}}})
	h.svc.StartHold(time.Now().Add(time.Hour))
	if !h.svc.hold() {
		t.Fatal("the hold did not start: the test proves nothing")
	}
	for _, mark := range []bool{false, true} {
		resp := h.do(handbackReq(hostLocalV4, mark))
		if resp.Error == nil || !strings.Contains(resp.Error.Msg, "no known owner") {
			t.Fatalf("handback (mark %v) during the hold: %+v, want a refusal naming the hold", mark, resp.Error)
		}
	}
	if h.j.snapshot().Handback != nil || value(t, h.svc.metrics.HandedBack) != 0 {
		t.Fatal("a handback refused during the hold left a mark")
	}
}

// An older agent's records of addresses reserved ahead (lost: possibly a running sandbox's,
// unknown to the journal) refuse the handback, from the start and whatever the pods report:
// host-local would get no file for them and could hand them out.
func TestServiceHandbackRefusedWithLostReservations(t *testing.T) {
	h := newSvc(t, 100*time.Millisecond, testV4)
	h.hold(map[string]string{"v4": "10.1.0.10-10.1.0.20"})
	if resp := h.do(addReq("c1")); resp.Error != nil {
		t.Fatal(resp.Error)
	}
	snap := h.j.snapshot().Apply(ipam.Change{PutAhead: []ipam.Address{{Pool: "v4", Addr: netip.MustParseAddr("10.1.0.15")}}})
	st := ipam.New("node-a")
	if problems := st.Restore(snap); len(problems) > 0 {
		t.Fatal(problems)
	}
	j := &memJournal{snap: snap}
	h.svc = NewService(st, j, ServiceOptions{Node: "node-a", AddressWait: 100 * time.Millisecond, Log: logr.Discard()})
	h.j = j
	h.svc.SetPools([]ipam.Pool{testV4}, []string{"v4"})
	h.svc.SetReady(true)
	for _, mark := range []bool{false, true} {
		resp := h.do(handbackReq(hostLocalV4, mark))
		if resp.Error == nil || !strings.Contains(resp.Error.Msg, "reserved ahead") {
			t.Fatalf("handback (mark %v) with a lost reservation: %+v, want a refusal naming it", mark, resp.Error)
		}
	}
	if j.snapshot().Handback != nil {
		t.Fatal("a refused handback left a mark")
	}
}

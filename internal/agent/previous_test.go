package agent

import (
	"github.com/ipwarden/ipwarden/internal/agent/ipam"

	"context"
	"encoding/json"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/previous"
)

func addrOfResp(t *testing.T, resp *cniproto.Response) string {
	t.Helper()
	if resp.Error != nil {
		t.Fatalf("ADD failed: %+v", resp.Error)
	}
	return strings.Split(resp.IPs[0].Address, "/")[0]
}

// The agent reads host-local's reservation files at every ADD whose configuration names
// host-local as "previous", before it picks: an address host-local reserved (a pod whose ADD went
// through host-local just before the switch) is never handed out; once host-local's DEL
// removes the file, the address is handed out again. An ADD without "previous" forgets the reading.
func TestServiceAddSkipsHostLocalReservations(t *testing.T) {
	h := newSvc(t, 100*time.Millisecond, testV4)
	h.hold(map[string]string{"v4": "10.1.0.10-10.1.0.14"})
	data := t.TempDir()
	dir := filepath.Join(data, "net")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	reserve := func(ip string) {
		if err := os.WriteFile(filepath.Join(dir, ip), []byte("old-sandbox\r\neth0"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	prev, _ := json.Marshal(map[string]any{"type": "host-local", "dataDir": data, "ranges": [][]map[string]string{{{"subnet": "10.1.0.0/16"}}}})
	add := func(cid string) *cniproto.Response {
		req := addReq(cid)
		req.Previous = prev
		return h.do(req)
	}

	reserve("10.1.0.10") // the lowest held address: the next ADD would take it
	if got := addrOfResp(t, add("c1")); got == "10.1.0.10" {
		t.Fatalf("ADD got %s, which host-local reserved", got)
	}
	// host-local now reserves another free one (an ADD that was in flight when the node
	// switched) and the next ADDs must not hand it out.
	reserve("10.1.0.12")
	for _, cid := range []string{"c2", "c3"} {
		if got := addrOfResp(t, add(cid)); got == "10.1.0.10" || got == "10.1.0.12" {
			t.Fatalf("ADD %s got %s, which host-local reserved", cid, got)
		}
	}
	if p := h.svc.status().Pools[0]; p.PreviousReserved != 2 || p.Free != 0 {
		t.Fatalf("pool status %+v: want 2 previous-reserved, none free", p)
	}
	if resp := add("c4"); resp.Error == nil {
		t.Fatalf("ADD got %v: the only addresses left are host-local's", resp.IPs)
	}

	// The old pod's DEL went to host-local: its file is gone, and the address is free again.
	if err := os.Remove(filepath.Join(dir, "10.1.0.12")); err != nil {
		t.Fatal(err)
	}
	if got := addrOfResp(t, add("c5")); got != "10.1.0.12" {
		t.Fatalf("ADD got %s, want 10.1.0.12, free once host-local released it", got)
	}

	// The configuration no longer names host-local: its reading is forgotten.
	if got := addrOfResp(t, h.do(addReq("c6"))); got != "10.1.0.10" {
		t.Fatalf("ADD without \"previous\" got %s, want 10.1.0.10: the reading is forgotten with it", got)
	}
	h.j.neverTwice(t)
}

// A previous IPAM whose reservations cannot be read fails the ADD with code 11 (the runtime
// retries) rather than pick without them: host-local's dataDir not visible to the agent, or the
// API server not answering the list of Whereabouts' IPPools. A bad "previous" object is a
// configuration error.
func TestServiceAddFailsWhenThePreviousIPAMCannotBeRead(t *testing.T) {
	h := newSvc(t, 100*time.Millisecond, testV4)
	h.hold(map[string]string{"v4": "10.1.0.10-10.1.0.13"})
	for _, tc := range []struct {
		name, prev string
		lister     func(context.Context) ([]previous.WhereaboutsPool, error)
		code       uint
		msg        string
	}{
		{name: "host-local dataDir not mounted", prev: `{"type": "host-local", "dataDir": "/nonexistent/ipwarden-test"}`,
			code: cniproto.CodeTryAgainLater, msg: "not visible to the agent"},
		{name: "Whereabouts without an API client", prev: `{"type": "whereabouts"}`, code: cniproto.CodeTryAgainLater, msg: "no API client"},
		{name: "Whereabouts' IPPools cannot be listed", prev: `{"type": "whereabouts"}`, code: cniproto.CodeTryAgainLater, msg: "connection refused",
			lister: func(context.Context) ([]previous.WhereaboutsPool, error) {
				return nil, errors.New("connection refused")
			}},
		{name: "a relative dataDir", prev: `{"type": "host-local", "dataDir": "data"}`, code: cniproto.CodeInvalidConfig, msg: "absolute"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.lister != nil {
				h.svc.SetWhereaboutsLister(tc.lister)
			}
			req := addReq("c-" + strings.ReplaceAll(tc.name, " ", "-"))
			req.Previous = json.RawMessage(tc.prev)
			resp := h.do(req)
			if resp.Error == nil || resp.Error.Code != tc.code || !strings.Contains(resp.Error.Msg, tc.msg) {
				t.Fatalf("ADD answered %+v, %+v; want code %d with %q", resp.IPs, resp.Error, tc.code, tc.msg)
			}
		})
	}
	// Another IPAM (nothing ipwarden can read) is no reason to fail: the ADD is served.
	req := addReq("c-calico")
	req.Previous = json.RawMessage(`{"type": "calico-ipam"}`)
	if got := addrOfResp(t, h.do(req)); got != "10.1.0.10" {
		t.Fatalf("ADD got %s", got)
	}
}

// With Whereabouts as "previous", the agent lists its IPPools at the ADD and hands out none of
// their allocations.
func TestServiceAddSkipsWhereaboutsReservations(t *testing.T) {
	h := newSvc(t, 100*time.Millisecond, testV4)
	h.hold(map[string]string{"v4": "10.1.0.10-10.1.0.13"})
	pools := []previous.WhereaboutsPool{{Name: "kube-system/10.1.0.0-16", Range: "10.1.0.0/16", Offsets: []string{"10", "11"}}}
	h.svc.SetWhereaboutsLister(func(context.Context) ([]previous.WhereaboutsPool, error) { return pools, nil })
	wb := &fakeWhereabouts{pools: []previous.WhereaboutsPool{{Name: "kube-system/10.1.0.0-16", Range: "10.1.0.0/16",
		Allocations: map[string]previous.WhereaboutsAllocation{"10": {ID: "a"}, "11": {ID: "b"}}}}}
	h.svc.SetWhereaboutsEditor(wb.edit)
	req := addReq("c1")
	req.Previous = json.RawMessage(`{"type": "whereabouts", "range": "10.1.0.0/16"}`)
	if got := addrOfResp(t, h.do(req)); got != "10.1.0.12" {
		t.Fatalf("ADD got %s, want 10.1.0.12: 10.1.0.10 and .11 are Whereabouts'", got)
	}
	if a := wb.pools[0].Allocations["12"]; a != (previous.WhereaboutsAllocation{ID: "ipwarden:c1", PodRef: "ns/pod-c1", IfName: "eth0"}) {
		t.Fatalf("ipwarden's allocation in Whereabouts' IPPool: %+v", a)
	}
	// Whereabouts' reservations are the cluster's, not the node's: nothing is claimed.
	var spec []ipam.PoolRequest
	h.svc.locked(func(st *ipam.State) { spec = st.Spec() })
	if len(spec) != 1 || !spec[0].Claimed.IsEmpty() {
		t.Fatalf("spec %+v: Whereabouts' reservations are not claimed", spec)
	}
}

// fakeWhereabouts is Whereabouts' IPPools in memory, edited as Kube.EditWhereaboutsPools does.
type fakeWhereabouts struct {
	mu    sync.Mutex
	pools []previous.WhereaboutsPool
	err   error
	edits int
}

func (f *fakeWhereabouts) edit(_ context.Context, plan func([]previous.WhereaboutsPool) ([]previous.WhereaboutsEdit, addr.Set, error)) (addr.Set, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err != nil {
		return addr.Set{}, f.err
	}
	edits, taken, err := plan(f.pools)
	if err != nil || !taken.IsEmpty() {
		return taken, err
	}
	for _, e := range edits {
		for i := range f.pools {
			if f.pools[i].Name != e.Pool {
				continue
			}
			if f.pools[i].Allocations == nil {
				f.pools[i].Allocations = map[string]previous.WhereaboutsAllocation{}
			}
			maps.Copy(f.pools[i].Allocations, e.Add)
			for _, off := range e.Remove {
				delete(f.pools[i].Allocations, off)
			}
		}
		f.edits++
	}
	return addr.Set{}, nil
}

// While the configuration names host-local as "previous", every address an ADD hands out has
// ipwarden's reservation file in host-local's directory when the ADD is answered (so host-local,
// even with an ADD that takes its lock late, never picks it); ipwarden's own files are not read
// as host-local's; the file goes once the DEL's journal write landed. An ADD without "previous"
// writes nothing.
func TestServiceAddReservesInHostLocal(t *testing.T) {
	h := newSvc(t, 100*time.Millisecond, testV4)
	h.hold(map[string]string{"v4": "10.1.0.10-10.1.0.13"})
	data := t.TempDir()
	dir := filepath.Join(data, "net")
	prev, _ := json.Marshal(map[string]any{"type": "host-local", "dataDir": data})
	add := func(cid string) string {
		req := addReq(cid)
		req.Previous = prev
		return addrOfResp(t, h.do(req))
	}
	file := func(ip string) string {
		b, err := os.ReadFile(filepath.Join(dir, ip))
		if errors.Is(err, os.ErrNotExist) {
			return ""
		}
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	a1, a2 := add("c1"), add("c2")
	if a1 != "10.1.0.10" || a2 != "10.1.0.11" {
		t.Fatalf("ADDs got %s and %s: ipwarden's own files must not keep their addresses out of use", a1, a2)
	}
	if file(a1) != "c1\r\neth0\r\n" || file(a2) != "c2\r\neth0\r\n" {
		t.Fatalf("reservation files %q %q", file(a1), file(a2))
	}
	if p := h.svc.status().Pools[0]; p.PreviousReserved != 0 {
		t.Fatalf("pool status %+v: ipwarden's own files are not host-local's reservations", p)
	}
	// A repeated ADD writes nothing new, and keeps the file.
	if got := add("c1"); got != a1 || file(a1) == "" {
		t.Fatalf("repeated ADD got %s, file %q", got, file(a1))
	}
	if resp := h.do(delReq("c1")); resp.Error != nil {
		t.Fatal(resp.Error)
	}
	if f := file(a1); f != "" {
		t.Fatalf("the DEL's journal write landed and the file is still there: %q", f)
	}
	// Without "previous", nothing is written.
	if got := addrOfResp(t, h.do(addReq("c3"))); file(got) != "" {
		t.Fatalf("an ADD without previous wrote %s's file", got)
	}
	h.j.neverTwice(t)
}

// The previous IPAM reserved an address itself after ipwarden's reading (Whereabouts' IPPool
// updated between the list and ipwarden's update): the reservation is refused, nothing is handed
// out, and the ADD picks another address. A reservation that cannot be written fails the ADD
// with code 11, nothing handed out.
func TestServiceAddPicksAgainWhenThePreviousIPAMTookTheAddress(t *testing.T) {
	h := newSvc(t, 100*time.Millisecond, testV4)
	h.hold(map[string]string{"v4": "10.1.0.10-10.1.0.13"})
	// The reading (the list) is from before Whereabouts allocated .10; the IPPool now has it.
	h.svc.SetWhereaboutsLister(func(context.Context) ([]previous.WhereaboutsPool, error) {
		return []previous.WhereaboutsPool{{Name: "kube-system/p", Range: "10.1.0.0/16"}}, nil
	})
	wb := &fakeWhereabouts{pools: []previous.WhereaboutsPool{{Name: "kube-system/p", Range: "10.1.0.0/16",
		Allocations: map[string]previous.WhereaboutsAllocation{"10": {ID: "wb-sandbox", PodRef: "ns/old"}}}}}
	h.svc.SetWhereaboutsEditor(wb.edit)
	req := addReq("c1")
	req.Previous = json.RawMessage(`{"type": "whereabouts"}`)
	if got := addrOfResp(t, h.do(req)); got != "10.1.0.11" {
		t.Fatalf("ADD got %s, want 10.1.0.11: Whereabouts took .10 after the reading", got)
	}
	if a := wb.pools[0].Allocations["11"]; a.ID != "ipwarden:c1" || wb.pools[0].Allocations["10"].ID != "wb-sandbox" {
		t.Fatalf("IPPool allocations %+v", wb.pools[0].Allocations)
	}
	wb.err = errors.New("the API server is not reachable")
	req = addReq("c2")
	req.Previous = json.RawMessage(`{"type": "whereabouts"}`)
	resp := h.do(req)
	if resp.Error == nil || resp.Error.Code != cniproto.CodeTryAgainLater || !strings.Contains(resp.Error.Msg, "cannot make the address unavailable") {
		t.Fatalf("ADD with the IPPool not writable: %+v %+v", resp.IPs, resp.Error)
	}
	h.svc.locked(func(st *ipam.State) {
		if _, ok := st.Attachment(ipam.Key{ContainerID: "c2", IfName: "eth0"}); ok {
			t.Error("a failed reservation left an attachment")
		}
	})
	// The DEL of c1 removes ipwarden's allocation once journaled.
	wb.err = nil
	if resp := h.do(delReq("c1")); resp.Error != nil {
		t.Fatal(resp.Error)
	}
	if _, ok := wb.pools[0].Allocations["11"]; ok {
		t.Fatalf("ipwarden's allocation outlived its DEL: %+v", wb.pools[0].Allocations)
	}
	h.j.neverTwice(t)
}

// The order around the journal, on the Service with host-local as "previous": the reservation
// file exists before the ADD's journal write (held here) and the ADD answers after both; a DEL
// is answered at once but its file stays until the DEL's journal write landed; a journal that
// refuses the ADD's write leaves no file and the ADD fails with nothing handed out.
func TestServiceReservationOrderAroundTheJournal(t *testing.T) {
	h := newSvc(t, 100*time.Millisecond, testV4)
	h.hold(map[string]string{"v4": "10.1.0.10-10.1.0.13"})
	data := t.TempDir()
	dir := filepath.Join(data, "net")
	prev, _ := json.Marshal(map[string]any{"type": "host-local", "dataDir": data})
	exists := func(ip string) bool {
		_, err := os.Stat(filepath.Join(dir, ip))
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			t.Fatal(err)
		}
		return err == nil
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
			time.Sleep(time.Millisecond) // polling a condition, not a synchronization
		}
	}

	gate := make(chan struct{})
	h.j.setBlock(gate)
	req := addReq("c1")
	req.Previous = prev
	answered := make(chan *cniproto.Response, 1)
	go func() { answered <- h.svc.Handle(context.Background(), req) }()
	waitFor("the reservation file", func() bool { return exists("10.1.0.10") })
	select {
	case r := <-answered:
		t.Fatalf("the ADD answered %+v before its journal write landed", r)
	default:
	}
	if n := len(h.j.snapshot().Attachments); n != 0 {
		t.Fatalf("the journal has %d attachments while its write is held", n)
	}
	h.j.setBlock(nil)
	close(gate)
	if got := addrOfResp(t, <-answered); got != "10.1.0.10" {
		t.Fatalf("ADD got %s", got)
	}

	gate = make(chan struct{})
	h.j.setBlock(gate)
	if resp := h.svc.Handle(context.Background(), delReq("c1")); resp.Error != nil {
		t.Fatal(resp.Error)
	}
	if !exists("10.1.0.10") {
		t.Fatal("the DEL's journal write has not landed and the file is gone")
	}
	h.j.setBlock(nil)
	close(gate)
	waitFor("the file's removal after the DEL's journal write", func() bool { return !exists("10.1.0.10") })

	h.j.setFail(errors.New("write journal: no space left on device"))
	req = addReq("c2")
	req.Previous = prev
	resp := h.do(req)
	if resp.Error == nil || resp.Error.Code != cniproto.CodeTryAgainLater {
		t.Fatalf("ADD with the journal refusing: %+v %+v", resp.IPs, resp.Error)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.Name() != "lock" {
			t.Fatalf("a refused ADD left %s in host-local's directory", e.Name())
		}
	}
	h.j.setFail(nil)
	h.j.neverTwice(t)
}

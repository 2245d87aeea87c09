package agent

import (
	"github.com/ipwarden/ipwarden/internal/agent/ipam"

	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

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
	req := addReq("c1")
	req.Previous = json.RawMessage(`{"type": "whereabouts", "range": "10.1.0.0/16"}`)
	if got := addrOfResp(t, h.do(req)); got != "10.1.0.12" {
		t.Fatalf("ADD got %s, want 10.1.0.12: 10.1.0.10 and .11 are Whereabouts'", got)
	}
	// Whereabouts' reservations are the cluster's, not the node's: nothing is claimed.
	var spec []ipam.PoolRequest
	h.svc.locked(func(st *ipam.State) { spec = st.Spec() })
	if len(spec) != 1 || !spec[0].Claimed.IsEmpty() {
		t.Fatalf("spec %+v: Whereabouts' reservations are not claimed", spec)
	}
}

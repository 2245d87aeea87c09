package agent

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
)

func TestListRefusedOnlyWhileWaiting(t *testing.T) {
	g := &gate{node: "n1", leaseNS: "ns", enforce: true}
	if g.refuseList() == nil {
		t.Fatal("LIST served while the agent waits for the API server with an empty journal")
	}
	g.setLease(false, "other", time.Time{})
	if r := g.refuseList(); r != nil {
		t.Fatalf("LIST refused while another agent holds the Lease: %+v", r.Error)
	}
	if r := g.refuseAdd(); r == nil || !strings.Contains(r.Error.Msg, "other") {
		t.Fatalf("ADD while another agent holds the Lease: %+v", r)
	}
	g.setLease(true, "", time.Now().Add(time.Minute))
	g.setSynced()
	if g.refuseList() != nil || g.refuseAdd() != nil {
		t.Fatal("refused after taking the Lease and reconciling")
	}
}

func TestAddRefusal(t *testing.T) {
	for _, tc := range []struct {
		name                         string
		offline, known, held, synced bool
		holder, apiErr               string
		serves                       bool
		msg                          string
	}{
		{"fresh journal, API away", false, false, false, false, "", "dial tcp: connection refused", false, "waiting for the API server"},
		{"fresh journal, API error named", false, false, false, false, "", "dial tcp: connection refused", false, "connection refused"},
		{"journal with holdings, API away", true, false, false, false, "", "x", true, ""},
		{"lease held, not reconciled, empty journal", false, true, true, false, "", "", false, "waiting for the API server"},
		{"lease held, not reconciled, journal with holdings", true, true, true, false, "", "", true, ""},
		{"lease held and reconciled", false, true, true, true, "", "", true, ""},
		{"another holder, journal with holdings", true, true, false, false, "agent-b-1", "", false, "holder agent-b-1"},
		{"another holder after reconciling", true, true, false, true, "agent-b-1", "", false, "holder agent-b-1"},
	} {
		r := addRefusal("n1", "ipwarden-system", tc.offline, tc.known, tc.held, tc.holder, tc.synced, waitingForAPI(tc.apiErr))
		if (r == nil) != tc.serves {
			t.Errorf("%s: refusal %+v, want serving %v", tc.name, r, tc.serves)
			continue
		}
		if r != nil && (r.Error.Code != 11 || !strings.Contains(r.Error.Msg, tc.msg)) {
			t.Errorf("%s: %+v, want code 11 and %q", tc.name, r.Error, tc.msg)
		}
	}
}

func TestPermitExpired(t *testing.T) {
	now := time.Date(2026, 11, 25, 8, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name   string
		held   bool
		permit time.Time
		want   bool
	}{
		{"held, renewed recently", true, now.Add(30 * time.Second), false},
		{"held, permit ends now", true, now, false},
		{"held, paused past its Lease", true, now.Add(-time.Second), true},
		{"held, never renewed (serving from the journal before the API server answered)", true, time.Time{}, false},
		{"not held: refused anyway", false, now.Add(-time.Minute), false},
	} {
		if got := PermitExpired(tc.held, tc.permit, now); got != tc.want {
			t.Errorf("%s: PermitExpired = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// An agent paused past its Lease (permit expired) re-checks it before it plans an ADD, and refuses
// when another agent took it meanwhile; within its permit it asks nothing. The machine asks for
// the re-check (Ready.Recheck); the Service runs the Lease keeper's round and feeds it back.
func TestAddPastThePermitRechecksTheLease(t *testing.T) {
	var mu sync.Mutex
	now := time.Date(2026, 11, 25, 8, 0, 0, 0, time.UTC)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	svc := NewService(ipam.New("n1"), &memJournal{}, ServiceOptions{Node: "n1", LeaseNamespace: "ns", Gated: true, AddressWait: time.Second,
		Now: clock, Log: logr.Discard()})
	if err := svc.SetPools([]ipam.Pool{testV4}, []string{"v4"}); err != nil {
		t.Fatal(err)
	}
	if err := svc.SetHoldings(map[string]addr.Set{"v4": addr.MustParseSetString("10.1.0.8/29")}, RecordOf{}); err != nil {
		t.Fatal(err)
	}
	svc.SetReady(true)
	svc.setLease(true, "", now.Add(time.Minute))
	svc.setSynced()
	var rechecks atomic.Int32
	svc.setLeaseRecheck(func(context.Context) {
		rechecks.Add(1)
		svc.setLease(false, "twin-agent", time.Time{}) // what the Lease shows now
	})
	if r := svc.Handle(context.Background(), addReq("c1")); r.Error != nil || rechecks.Load() != 0 {
		t.Fatalf("within the permit: %+v after %d re-checks", r.Error, rechecks.Load())
	}
	mu.Lock()
	now = now.Add(2 * time.Minute) // paused past its Lease
	mu.Unlock()
	r := svc.Handle(context.Background(), addReq("c2"))
	if rechecks.Load() != 1 || r.Error == nil || r.Error.Code != cniproto.CodeTryAgainLater || !strings.Contains(r.Error.Msg, "twin-agent") {
		t.Fatalf("past the permit: %+v after %d re-checks; want one re-check and a refusal naming twin-agent", r.Error, rechecks.Load())
	}
}

package agent

import (
	"strings"
	"testing"
)

func TestListRefusedOnlyWhileWaiting(t *testing.T) {
	g := &gate{node: "n1", leaseNS: "ns", enforce: true}
	if g.refuseList() == nil {
		t.Fatal("LIST served while the agent waits for the API server with an empty journal")
	}
	g.setLease(false, "other")
	if r := g.refuseList(); r != nil {
		t.Fatalf("LIST refused while another agent holds the Lease: %+v", r.Error)
	}
	if r := g.refuseAdd(); r == nil || !strings.Contains(r.Error.Msg, "other") {
		t.Fatalf("ADD while another agent holds the Lease: %+v", r)
	}
	g.setLease(true, "")
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

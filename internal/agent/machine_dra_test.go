package agent

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/previous"
)

// The tests of the machine's DRA rules (machine_dra.go), one table each.

// claimOf is the claim of pod-<cid> (uid-<cid>) for device dev of pool v4, on interface ifname.
func reserveReq(cid, dev, ifname string) ipam.ReserveRequest {
	return ipam.ReserveRequest{
		Claim: ipam.ClaimDevice{Namespace: "ns", Name: "claim-" + cid, UID: "claim-uid-" + cid, Request: "addr", Device: dev, Interface: ifname},
		Pod:   ipam.PodRef{Namespace: "ns", Name: "pod-" + cid, UID: "uid-" + cid},
		Pool:  "v4",
	}
}

// prepare reserves for reserveReq(cid, dev, "eth0"), journaled, and returns the address.
func (h *machineHarness) prepare(cid, dev string) string {
	h.t.Helper()
	id := h.m.Prepare(reserveReq(cid, dev, "eth0"), h.now)
	a := mustAnswer(h.t, h.settle(), id)
	if a.Err != nil || a.Att == nil {
		h.t.Fatalf("prepare %s: %s", cid, describeAnswer(a))
	}
	return fmtAddresses(a.Att.Addresses)
}

func resKey(cid, dev string) ipam.Key { return ipam.ReservationKey("claim-uid-"+cid, "addr", dev) }

// A Prepare is answered only after the journal write of its reservation landed; a refused write
// reserves nothing (the address goes to the next); a repeated Prepare gets the same address
// without a write.
func TestMachinePrepareAnsweredOnlyAfterItsWrite(t *testing.T) {
	for _, tc := range []struct {
		name    string
		outcome error
		// then: a Prepare of the same device (same) or of another claim (other), after the
		// first's answer; wantThen its address, thenWrites its writes.
		same       bool
		wantThen   string
		thenWrites int
	}{
		{name: "landed: a repeated Prepare is the same reservation, no write", same: true, wantThen: "v4=10.1.0.8", thenWrites: 0},
		{name: "landed: another claim gets another address", wantThen: "v4=10.1.0.9", thenWrites: 1},
		{name: "refused: nothing reserved, the retry writes again", outcome: errRefused, same: true, wantThen: "v4=10.1.0.8", thenWrites: 1},
		{name: "refused: the address goes to another claim", outcome: errRefused, wantThen: "v4=10.1.0.8", thenWrites: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Minute}, testV4)
			h.hold(map[string]string{"v4": "10.1.0.8/29"})
			id := h.m.Prepare(reserveReq("c1", "s0", "eth0"), h.now)
			rd := h.ready()
			noAnswer(t, rd, id, "the Prepare")
			if len(rd.Writes) != 1 || len(rd.Writes[0].Change.PutAttachments) != 1 || rd.Writes[0].Change.PutAttachments[0].Key != resKey("c1", "s0") {
				t.Fatalf("writes %+v, want the reservation's", rd.Writes)
			}
			if c := rd.Writes[0].Change.PutAttachments[0].DRA; c == nil || c.UID != "claim-uid-c1" || c.Interface != "eth0" {
				t.Fatalf("the reservation's record names claim %+v", c)
			}
			h.m.Written(rd.Writes[0].ID, tc.outcome, h.now)
			a := mustAnswer(t, h.ready(), id)
			if (a.Err == nil) != (tc.outcome == nil) || (a.Att != nil) != (tc.outcome == nil) {
				t.Fatalf("Prepare answered %s after write outcome %v", describeAnswer(a), tc.outcome)
			}
			if _, ok := h.m.st.Attachment(resKey("c1", "s0")); ok != (tc.outcome == nil) {
				t.Fatalf("reservation in the state: %v", ok)
			}
			cid := "c2"
			if tc.same {
				cid = "c1"
			}
			dev := "s1"
			if tc.same {
				dev = "s0"
			}
			id = h.m.Prepare(reserveReq(cid, dev, "eth0"), h.now)
			rd = h.settle()
			a = mustAnswer(t, rd, id)
			if a.Att == nil || fmtAddresses(a.Att.Addresses) != tc.wantThen {
				t.Fatalf("then: %s, want %s", describeAnswer(a), tc.wantThen)
			}
			n := 0
			for _, w := range rd.Writes {
				if slices.ContainsFunc(w.Change.PutAttachments, func(at ipam.Attachment) bool { return at.Key == a.Att.Key }) {
					n++
				}
			}
			if n != tc.thenWrites {
				t.Fatalf("then: %d writes of its reservation, want %d (%+v)", n, tc.thenWrites, rd.Writes)
			}
		})
	}
}

// A Prepare is refused, with nothing reserved, while the gate refuses ADD, for a device of a pool
// that does not serve the node, and when the pool has no address now; the refusal says why.
func TestMachinePrepareRefusals(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(h *machineHarness)
		req   ipam.ReserveRequest
		want  string
	}{
		{name: "not serving", setup: func(h *machineHarness) { h.m.SetReady(false, h.now) }, req: reserveReq("c1", "s0", "eth0"), want: "starting"},
		{name: "pool not serving the node", req: func() ipam.ReserveRequest { r := reserveReq("c1", "s0", "eth0"); r.Pool = "v6"; return r }(),
			want: "does not serve node node-a"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Minute}, testV4)
			h.hold(map[string]string{"v4": "10.1.0.8"})
			if tc.setup != nil {
				tc.setup(h)
			}
			id := h.m.Prepare(tc.req, h.now)
			rd := h.settle()
			a := mustAnswer(t, rd, id)
			if a.Err == nil || !strings.Contains(a.Err.Error(), tc.want) || a.Att != nil {
				t.Fatalf("Prepare answered %s, want a refusal containing %q", describeAnswer(a), tc.want)
			}
			if len(writesOfKey(rd, ipam.ReservationKey(tc.req.Claim.UID, "addr", tc.req.Claim.Device))) != 0 {
				t.Fatalf("a refused Prepare wrote: %+v", rd.Writes)
			}
		})
	}
}

func writesOfKey(rd Ready, k ipam.Key) []Write {
	var out []Write
	for _, w := range rd.Writes {
		if slices.ContainsFunc(w.Change.PutAttachments, func(a ipam.Attachment) bool { return a.Key == k }) ||
			slices.Contains(w.Change.DeleteAttachments, k) {
			out = append(out, w)
		}
	}
	return out
}

// A Prepare short of addresses waits, counted as demand, and is tried again after every change
// until --address-wait passes: an address the controller grants meanwhile is reserved; past the
// deadline it is refused, nothing reserved, and the demand is gone.
func TestMachinePrepareShortOfAddressesWaits(t *testing.T) {
	for _, tc := range []struct {
		name    string
		granted bool // the controller grants another address before the deadline
		want    string
	}{
		{name: "granted: reserved", granted: true, want: "v4=10.1.0.9"},
		{name: "deadline: refused", want: "no free address"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: 10 * time.Second}, testV4)
			h.hold(map[string]string{"v4": "10.1.0.8"})
			h.prepare("c0", "s0")
			id := h.m.Prepare(reserveReq("c1", "s1", "eth0"), h.now)
			rd := h.settle()
			noAnswer(t, rd, id, "the short Prepare")
			if !rd.KickNow || rd.Wake != h.now.Add(10*time.Second) {
				t.Fatalf("short Prepare: KickNow %v Wake %v, want a round at once and a wake at the deadline", rd.KickNow, rd.Wake)
			}
			if d := h.m.st.Demand("v4"); d != 2 {
				t.Fatalf("demand %d while it waits, want 2", d)
			}
			h.now = h.now.Add(5 * time.Second)
			if tc.granted {
				h.holdings(map[string]string{"v4": "10.1.0.8-10.1.0.9"}, RecordOf{})
			} else {
				h.now = h.now.Add(5 * time.Second)
				h.m.Tick(h.now)
			}
			rd = h.settle()
			a := mustAnswer(t, rd, id)
			got := ""
			if a.Att != nil {
				got = fmtAddresses(a.Att.Addresses)
			} else if a.Err != nil {
				got = a.Err.Error()
			}
			if !strings.Contains(got, tc.want) {
				t.Fatalf("Prepare answered %q, want %q", got, tc.want)
			}
			if d := h.m.st.Demand("v4"); d != map[bool]int{true: 2, false: 1}[tc.granted] {
				t.Fatalf("demand %d after the answer", d)
			}
		})
	}
}

// The ADD of a pod with a prepared reservation on the reservation's interface gets exactly its
// address; another pod's ADD, or the pod's ADD on another interface, never does. The DEL of the
// attachment frees nothing of it: it stays the reservation's.
func TestMachineAddOfAClaimedPod(t *testing.T) {
	for _, tc := range []struct {
		name   string
		ifname string // the reservation's interface
		add    cniproto.Request
		want   string // the ADD's addresses
	}{
		{name: "the claim's pod on its interface: the reserved address", ifname: "eth0", add: addReq("c1"), want: "10.1.0.8/16"},
		{name: "another pod: another address", ifname: "eth0", add: addReq("c2"), want: "10.1.0.9/16"},
		{name: "the claim's pod on another interface: another address", ifname: "net1", add: addReq("c1"), want: "10.1.0.9/16"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Minute}, testV4)
			h.hold(map[string]string{"v4": "10.1.0.8/29"})
			id := h.m.Prepare(reserveReq("c1", "s0", tc.ifname), h.now)
			if a := mustAnswer(t, h.settle(), id); a.Err != nil {
				t.Fatal(a.Err)
			}
			if got := ips(h.add(tc.add)); got != tc.want {
				t.Fatalf("ADD got %s, want %s", got, tc.want)
			}
			h.m.Request(delReq(tc.add.ContainerID), h.now)
			h.settle()
			res, ok := h.m.st.Attachment(resKey("c1", "s0"))
			if !ok || fmtAddresses(res.Addresses) != "v4=10.1.0.8" {
				t.Fatalf("after the DEL the reservation is %+v (%v), want it to hold 10.1.0.8", res, ok)
			}
			// The reserved address is never handed to another ADD, the DEL's freed one is.
			if got := ips(h.add(addReq("c3"))); got == "10.1.0.8/16" {
				t.Fatalf("another pod's ADD got the reserved address")
			}
		})
	}
}

// Unprepare frees the reservation through the cooldown once its write landed; it is refused
// while an attachment uses the address; it succeeds, with nothing to free, for an unknown one.
func TestMachineUnprepare(t *testing.T) {
	for _, tc := range []struct {
		name     string
		prepared bool
		attached bool
		outcome  error
		busy     bool // refused: attached
		freed    bool // answered with the reservation, its address cooling
	}{
		{name: "unknown: nothing to free", prepared: false},
		{name: "detached: freed, cooling", prepared: true, freed: true},
		{name: "attached: refused, kept", prepared: true, attached: true, busy: true},
		{name: "refused write: kept", prepared: true, outcome: errRefused},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Minute}, testV4)
			h.hold(map[string]string{"v4": "10.1.0.8/29"})
			if tc.prepared {
				h.prepare("c1", "s0")
			}
			if tc.attached {
				h.add(addReq("c1"))
			}
			id := h.m.Unprepare("claim-uid-c1", "addr", "s0", h.now)
			rd := h.ready()
			for _, w := range rd.Writes {
				if slices.ContainsFunc(w.Change.PutCooling, func(c ipam.Cooling) bool { return c.Addr.String() == "10.1.0.8" }) != tc.freed && tc.outcome == nil {
					t.Fatalf("the write %+v cools 10.1.0.8: want %v", w.Change, tc.freed)
				}
				h.m.Written(w.ID, tc.outcome, h.now)
			}
			later := h.settle()
			rd.Answers = append(rd.Answers, later.Answers...)
			a := mustAnswer(t, rd, id)
			var busy *ipam.ReservationBusyError
			if errors.As(a.Err, &busy) != tc.busy || (a.Att != nil) != tc.freed || (tc.outcome != nil) != (a.Err != nil && !tc.busy) {
				t.Fatalf("Unprepare answered %s", describeAnswer(a))
			}
			_, kept := h.m.st.Attachment(resKey("c1", "s0"))
			if kept != (tc.prepared && !tc.freed) {
				t.Fatalf("reservation kept: %v", kept)
			}
		})
	}
}

// ReconcileClaims unprepares a reservation whose claim is not allocated to the node any more,
// once no attachment uses its address; a claim still allocated keeps it.
func TestMachineReconcileClaims(t *testing.T) {
	for _, tc := range []struct {
		name      string
		allocated bool
		attached  bool
		released  bool
	}{
		{name: "allocated: kept", allocated: true},
		{name: "gone, detached: released", released: true},
		{name: "gone, attached: kept until the DEL", attached: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Minute}, testV4)
			h.hold(map[string]string{"v4": "10.1.0.8/29"})
			h.prepare("c1", "s0")
			if tc.attached {
				h.add(addReq("c1"))
			}
			ids := h.m.ReconcileClaims(func(c ipam.ClaimDevice) bool { return tc.allocated && c.UID == "claim-uid-c1" }, h.now)
			h.settle()
			if (len(ids) == 1) != tc.released {
				t.Fatalf("unprepares queued: %v", ids)
			}
			if _, ok := h.m.st.Attachment(resKey("c1", "s0")); ok == tc.released {
				t.Fatalf("reservation still there: %v, want released %v", ok, tc.released)
			}
			if tc.attached {
				h.m.Request(delReq("c1"), h.now)
				h.settle()
				h.m.ReconcileClaims(func(ipam.ClaimDevice) bool { return false }, h.now)
				h.settle()
				if _, ok := h.m.st.Attachment(resKey("c1", "s0")); ok {
					t.Fatal("reservation kept after its attachment's DEL")
				}
			}
		})
	}
}

// An ADD of a claimed pod whose reserved address the previous IPAM reserves (a Prepare writes
// nothing into its store, so host-local may hand the address to a pod of its own after it) fails
// with code 11, nothing handed out: the pod may run with no other address than its claim's
// status names, and picking the reserved address again would be refused again, without end
// (TestSim seed 15025917343579145828: one write after another, never answered).
func TestMachineAddOfAClaimedPodWhoseAddressThePreviousIPAMReserves(t *testing.T) {
	hostLocal := `{"type": "host-local", "dataDir": "/var/lib/cni/networks"}`
	taken := &previous.TakenError{Kind: previous.HostLocal, Addrs: addr.MustParseSetString("10.1.0.8")}
	for _, tc := range []struct {
		name    string
		reading string // what the previous IPAM reserves at the ADD's reading
		outcome error  // of the ADD's first write
		writes  int    // the ADD's writes
		wantIP  string // or
		wantErr uint
	}{
		{name: "another address reserved there: the reserved one", reading: "10.1.0.9", writes: 1, wantIP: "10.1.0.8/16"},
		{name: "reserved there at the reading: code 11, no write", reading: "10.1.0.8", wantErr: cniproto.CodeTryAgainLater},
		{name: "taken there since the reading: code 11 after that write", outcome: taken, writes: 1, wantErr: cniproto.CodeTryAgainLater},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Minute}, testV4)
			h.hold(map[string]string{"v4": "10.1.0.8/29"})
			h.prepare("c1", "s0")
			req := addReq("c1")
			req.Previous = []byte(hostLocal)
			if tc.reading != "" {
				h.m.st.SetPrevious(req.Network, addr.MustParseSetString(tc.reading), true)
			}
			id := h.m.Request(req, h.now)
			var a Answer
			writes := 0
			for {
				rd := h.ready()
				if ans, ok := answerOf(rd, id); ok {
					a = ans
					break
				}
				ws := writesOf(rd, "c1")
				if len(ws) != 1 || writes > 3 {
					t.Fatalf("after %d writes the ADD's writes are %+v, want one more", writes, rd.Writes)
				}
				var out error
				if writes == 0 {
					out = tc.outcome
				}
				writes++
				h.m.Written(ws[0].ID, out, h.now)
			}
			if writes != tc.writes {
				t.Fatalf("the ADD made %d writes, want %d", writes, tc.writes)
			}
			if tc.wantErr != 0 {
				if code(a) != tc.wantErr || a.Att != nil || h.attached("c1") {
					t.Fatalf("ADD answered %s, want code %d and nothing handed out", describeAnswer(a), tc.wantErr)
				}
			} else if ips(a.Resp) != tc.wantIP {
				t.Fatalf("ADD answered %s, want %s", describeAnswer(a), tc.wantIP)
			}
			if res, ok := h.m.st.Attachment(resKey("c1", "s0")); !ok || fmtAddresses(res.Addresses) != "v4=10.1.0.8" {
				t.Fatalf("the reservation is %+v (%v), want it kept with 10.1.0.8", res, ok)
			}
		})
	}
}

// recoveryOf is the evidence of claim-<cid>'s reservation of addr on eth0 (device s0 of pool v4).
func recoveryOf(cid, addr string) ipam.ReservationEvidence {
	r := reserveReq(cid, "s0", "eth0")
	return ipam.ReservationEvidence{Claim: r.Claim, Pod: r.Pod, Pool: r.Pool, Addr: netip.MustParseAddr(addr)}
}

// After a lost journal the reservations the claims' status entries name are re-created as a fact:
// answered only once journaled (a refused write recovers nothing, and the claim's pod's ADD then
// gets an ordinary address); a claim whose address another attachment holds is not recovered
// and is reported (an event, the metric), with no write; a claim of a pod that is done needs
// nothing and is no conflict.
func TestMachineRecoverReservations(t *testing.T) {
	for _, tc := range []struct {
		name    string
		other   bool   // pod c2's ADD holds 10.1.0.8 first
		done    bool   // pod c1 finished
		claim   string // the address c1's claim names
		outcome error  // of the recovery's write
		// want: the recovery's reason (unless refused), its writes, the event; then c1's ADD on
		// eth0 gets wantAdd.
		want    string
		writes  int
		event   bool
		wantAdd string
	}{
		{name: "journaled, then answered: the pod's ADD gets the claim's address", claim: "10.1.0.10", want: ipam.RecoveryRecovered, writes: 1,
			wantAdd: "10.1.0.10/16"},
		{name: "refused: nothing recovered, the ADD gets an ordinary address", claim: "10.1.0.10", outcome: errRefused, want: ipam.RecoveryRecovered,
			writes: 1, wantAdd: "10.1.0.8/16"},
		{name: "another pod's attachment holds it: kept, reported, no write", other: true, claim: "10.1.0.8", want: ipam.RecoveryInUse,
			event: true, wantAdd: "10.1.0.9/16"},
		{name: "the pod is done: nothing to recover, no conflict", done: true, claim: "10.1.0.10", want: ipam.RecoveryPodNotRunning},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Minute}, testV4)
			metrics := h.m.metrics
			h.hold(map[string]string{"v4": "10.1.0.8/29"})
			if tc.other {
				h.add(addReq("c2"))
			}
			h.m.SetPods([]ipam.Pod{{Ref: reserveReq("c1", "s0", "eth0").Pod, Finished: tc.done}}, h.now)
			id := h.m.RecoverReservations([]ipam.ReservationEvidence{recoveryOf("c1", tc.claim)}, h.now)
			rd := h.ready()
			if len(rd.Writes) != tc.writes {
				t.Fatalf("writes %+v, want %d", rd.Writes, tc.writes)
			}
			if tc.writes > 0 {
				noAnswer(t, rd, id, "the recovery")
				h.m.Written(rd.Writes[0].ID, tc.outcome, h.now)
				rd = h.ready()
			}
			a := mustAnswer(t, rd, id)
			switch {
			case tc.outcome != nil:
				if a.Err == nil || len(a.Recovery) != 0 {
					t.Fatalf("answered %s, recovery %v; want the refusal, nothing decided", describeAnswer(a), a.Recovery)
				}
			case a.Err != nil || len(a.Recovery) != 1 || a.Recovery[0].Reason != tc.want:
				t.Fatalf("answered %s, recovery %v; want %s", describeAnswer(a), a.Recovery, tc.want)
			}
			_, reserved := h.m.st.Attachment(resKey("c1", "s0"))
			if reserved != (tc.want == ipam.RecoveryRecovered && tc.outcome == nil) || (a.N == 1) != reserved {
				t.Fatalf("reservation in the state: %v, N %d", reserved, a.N)
			}
			if got := slices.ContainsFunc(rd.Events, func(e NodeEvent) bool { return e.Reason == ReasonDRAReservationNotRecovered }); got != tc.event {
				t.Fatalf("events %+v, want the warning: %v", rd.Events, tc.event)
			}
			if tc.outcome == nil {
				if got := testutil.ToFloat64(metrics.DRARecovered.WithLabelValues(tc.want)); got != 1 {
					t.Fatalf("dra_reservations_recovered_total{reason=%s} = %v", tc.want, got)
				}
			} else if got := testutil.ToFloat64(metrics.JournalRefused.WithLabelValues("recover")); got != 1 {
				t.Fatalf("journal_refused_total{change=recover} = %v", got)
			}
			if tc.wantAdd == "" {
				return
			}
			resp := h.add(addReq("c1"))
			if got := resp.IPs[0].Address; len(resp.IPs) != 1 || got != tc.wantAdd {
				t.Fatalf("c1's ADD got %s, want %s", got, tc.wantAdd)
			}
		})
	}
}

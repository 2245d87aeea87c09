package agent

import (
	"strings"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// The tests of the machine's ADD gate (machine_gate.go), in the style of machine_test.go: the
// machine alone, driven by hand.

// newGatedMachine returns a gated machine of node-a serving testV4 whose gate is open: it holds
// the node's Lease until permit and has reconciled.
func newGatedMachine(t *testing.T, cfg MachineConfig, permit time.Time) *machineHarness {
	t.Helper()
	cfg.Gated, cfg.LeaseNamespace = true, "ipwarden-system"
	h := newMachine(t, cfg, testV4)
	h.m.SetLease(true, "", permit, h.now)
	h.m.SetSynced()
	h.ready()
	return h
}

// The gate is asked every time the machine would plan an ADD: when its turn comes (before its
// pod is read), after its pod was read, and at every attempt while it waits for addresses. An
// ADD the gate refuses is answered with the gate's refusal and never planned, even when the
// addresses it waited for come after. Another holder of the node's Lease, the agent no longer
// serving and the handback mark refuse it; a renewal of the Lease does not.
func TestMachineAddGateAtEveryAttempt(t *testing.T) {
	lost := func(h *machineHarness) { h.m.SetLease(false, "agent-b-7", time.Time{}, h.now) }
	renewed := func(h *machineHarness) { h.m.SetLease(true, "", h.now.Add(time.Hour), h.now) }
	stopped := func(h *machineHarness) { h.m.SetReady(false, h.now) }
	handedBack := func(h *machineHarness) {
		h.m.SetHandback(&ipam.HandbackMark{At: h.now, To: "host-local", Network: "net", Dir: "/var/lib/cni/networks/net"}, h.now)
	}
	const (
		before  = iota // the fact comes before the ADD
		reading        // while the ADD's pod is read
		waiting        // while the ADD waits for addresses
	)
	const (
		heldByOther  = "another ipwarden agent holds node node-a's Lease ipwarden-system/ipwarden-agent-node-a (holder agent-b-7)"
		starting     = "the ipwarden agent on node node-a is starting and not serving yet"
		isHandedBack = "this node was handed back to host-local"
	)
	for _, tc := range []struct {
		name string
		when int
		fact func(h *machineHarness)
		// The ADD is refused with wantCode and a message containing wantMsg, and never planned;
		// wantCode 0: it is planned once the node holds an address for it.
		wantCode uint
		wantMsg  string
	}{
		{name: "another holder of the Lease: refused, its pod not read", when: before, fact: lost,
			wantCode: cniproto.CodeTryAgainLater, wantMsg: heldByOther},
		{name: "another holder seen while its pod is read: refused after the read", when: reading, fact: lost,
			wantCode: cniproto.CodeTryAgainLater, wantMsg: heldByOther},
		{name: "an ADD already waiting when the Lease is lost is refused, never planned", when: waiting, fact: lost,
			wantCode: cniproto.CodeTryAgainLater, wantMsg: heldByOther},
		{name: "not serving: refused, its pod not read", when: before, fact: stopped,
			wantCode: cniproto.CodeTryAgainLater, wantMsg: starting},
		{name: "an ADD waiting when the agent stops serving is refused", when: waiting, fact: stopped,
			wantCode: cniproto.CodeTryAgainLater, wantMsg: starting},
		{name: "handed back: refused, its pod not read", when: before, fact: handedBack,
			wantCode: cniproto.CodeHandedBack, wantMsg: isHandedBack},
		{name: "handed back while its pod is read: refused after the read", when: reading, fact: handedBack,
			wantCode: cniproto.CodeHandedBack, wantMsg: isHandedBack},
		{name: "an ADD waiting when the node is handed back is refused, never planned", when: waiting, fact: handedBack,
			wantCode: cniproto.CodeHandedBack, wantMsg: isHandedBack},
		{name: "the Lease renewed while it waits: it waits on, then is planned", when: waiting, fact: renewed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newGatedMachine(t, MachineConfig{AddressWait: time.Minute, ReadsPods: true}, mt0.Add(time.Hour))
			h.hold(map[string]string{"v4": "10.1.0.8"})
			h.add(addReq("c0")) // the node's one address is used: c1 waits
			var all []Write
			if tc.when == before {
				tc.fact(h)
				all = append(all, h.settle().Writes...)
			}
			id := h.m.Request(addReq("c1"), h.now)
			rd := h.ready()
			all = append(all, rd.Writes...)
			switch tc.when {
			case before:
				if len(rd.Reads) != 0 {
					t.Fatalf("a refused ADD read its pod: %+v", rd.Reads)
				}
			case reading:
				if len(rd.Reads) != 1 {
					t.Fatalf("reads %+v, want the ADD's pod's", rd.Reads)
				}
				tc.fact(h)
				all = append(all, h.settle().Writes...)
				h.m.PodRead(id, ipam.PodMeta{}, nil, h.now)
				rd = h.settle()
				all = append(all, rd.Writes...)
			case waiting:
				h.m.PodRead(id, ipam.PodMeta{}, nil, h.now)
				rd = h.ready()
				noAnswer(t, rd, id, "the ADD short of addresses")
				h.now = h.now.Add(time.Second)
				tc.fact(h)
				rd = h.settle()
				all = append(all, rd.Writes...)
			}
			if tc.wantCode != 0 {
				a := mustAnswer(t, rd, id)
				if code(a) != tc.wantCode || !strings.Contains(a.Resp.Error.Msg, tc.wantMsg) {
					t.Fatalf("ADD answered %s, want code %d and %q", describeAnswer(a), tc.wantCode, tc.wantMsg)
				}
				if got := h.m.st.Demand("v4"); got != 1 {
					t.Fatalf("demand of v4 %d after the ADD was refused, want 1 (c0)", got)
				}
			} else {
				noAnswer(t, rd, id, "the ADD short of addresses")
			}

			// The address it waited for comes.
			h.now = h.now.Add(time.Second)
			h.holdings(map[string]string{"v4": "10.1.0.8-10.1.0.9"}, RecordOf{})
			rd = h.settle()
			all = append(all, rd.Writes...)
			planned := writesOf(Ready{Writes: all}, "c1")
			if tc.wantCode != 0 {
				if len(planned) != 0 || h.attached("c1") {
					t.Fatalf("the refused ADD was planned: %+v", planned)
				}
				if _, ok := answerOf(rd, id); ok {
					t.Fatal("the refused ADD was answered twice")
				}
				return
			}
			if a := mustAnswer(t, rd, id); ips(a.Resp) != "10.1.0.9/16" || len(planned) != 1 {
				t.Fatalf("ADD answered %s, writes %+v, want 10.1.0.9 after one write", describeAnswer(a), planned)
			}
		})
	}
}

// Past its permit (the last renewal's start plus the Lease's duration) the agent may have lost
// the node's Lease without seeing it: an ADD is not planned before a re-check of the Lease ends
// (Ready.Recheck; one at a time, whoever asks). What the re-check found decides; a re-check that
// found nothing (the API server is away) lets the ADDs go on from what the node holds, and the
// next re-check is asked for no sooner than recheckEvery after it. An ADD whose caller goes
// during the re-check fails, nothing handed out.
func TestMachineAddPastThePermitWaitsForARecheck(t *testing.T) {
	permit := mt0.Add(time.Minute)
	past := permit.Add(time.Minute)
	for _, tc := range []struct {
		name string
		// during happens while c1 and c2 wait for the re-check; then the re-check ends.
		during func(h *machineHarness, c1 uint64)
		// The outcome of c1 and c2: 0 written, or the code they fail with (wantMsg in it).
		want1, want2 uint
		wantMsg      string
		// c3 comes c3After the re-check ended: whether it asks for another re-check (it then
		// waits), else it is planned (want3 0) or refused.
		c3After     time.Duration
		wantRecheck bool
		want3       uint
	}{
		{name: "the re-check renews the Lease: planned",
			during:  func(h *machineHarness, _ uint64) { h.m.SetLease(true, "", h.now.Add(time.Minute), h.now) },
			c3After: 30 * time.Second},
		{name: "the re-check finds another holder: refused naming it, never planned",
			during: func(h *machineHarness, _ uint64) { h.m.SetLease(false, "agent-b-7", time.Time{}, h.now) },
			want1:  cniproto.CodeTryAgainLater, want2: cniproto.CodeTryAgainLater, wantMsg: "holder agent-b-7",
			c3After: time.Hour, want3: cniproto.CodeTryAgainLater},
		{name: "the re-check reads nothing (API server away): planned from what the node holds",
			during:  func(*machineHarness, uint64) {},
			c3After: recheckEvery - time.Millisecond},
		{name: "API server away: the next ADD re-checks again after recheckEvery",
			during:  func(*machineHarness, uint64) {},
			c3After: recheckEvery, wantRecheck: true},
		{name: "its caller goes during the re-check: it fails, the other is planned",
			during: func(h *machineHarness, c1 uint64) {
				h.m.Cancel(c1, h.now)
				h.m.SetLease(true, "", h.now.Add(time.Minute), h.now)
			},
			want1: cniproto.CodeTryAgainLater, wantMsg: "re-checked its Lease",
			c3After: time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newGatedMachine(t, MachineConfig{AddressWait: time.Minute}, permit)
			h.hold(map[string]string{"v4": "10.1.0.8/29"})
			h.now = past
			c1 := h.m.Request(addReq("c1"), h.now)
			rd := h.ready()
			if !rd.Recheck || len(rd.Writes) != 0 || len(rd.Answers) != 0 {
				t.Fatalf("an ADD past the permit: Recheck %v, writes %+v, answers %+v; want a re-check asked and nothing else",
					rd.Recheck, rd.Writes, rd.Answers)
			}
			c2 := h.m.Request(addReq("c2"), h.now)
			if rd := h.ready(); rd.Recheck || len(rd.Writes) != 0 || len(rd.Answers) != 0 {
				t.Fatalf("a second ADD during the re-check: Recheck %v, writes %+v, answers %+v; want it to wait for the same re-check",
					rd.Recheck, rd.Writes, rd.Answers)
			}
			if w := h.m.Ready().Wake; !w.IsZero() {
				t.Fatalf("Wake %v while ADDs wait for a re-check, want none (the driver bounds it)", w)
			}
			h.now = h.now.Add(100 * time.Millisecond)
			tc.during(h, c1)
			h.m.LeaseChecked(h.now)
			rd = h.settle()
			for _, c := range []struct {
				cid  string
				id   uint64
				want uint
			}{{"c1", c1, tc.want1}, {"c2", c2, tc.want2}} {
				a := mustAnswer(t, rd, c.id)
				planned := len(writesOf(rd, c.cid)) == 1
				switch {
				case c.want == 0 && (a.Resp.Error != nil || !planned):
					t.Fatalf("%s: %s, planned %v; want it planned and answered", c.cid, describeAnswer(a), planned)
				case c.want != 0 && (code(a) != c.want || !strings.Contains(a.Resp.Error.Msg, tc.wantMsg) || planned):
					t.Fatalf("%s: %s, planned %v; want code %d with %q, never planned", c.cid, describeAnswer(a), planned, c.want, tc.wantMsg)
				}
			}

			h.now = h.now.Add(tc.c3After)
			c3 := h.m.Request(addReq("c3"), h.now)
			rd = h.ready()
			if rd.Recheck != tc.wantRecheck {
				t.Fatalf("c3, %v after the re-check: Recheck %v, want %v", tc.c3After, rd.Recheck, tc.wantRecheck)
			}
			if tc.wantRecheck {
				noAnswer(t, rd, c3, "c3 waiting for the re-check")
				return
			}
			if tc.want3 != 0 {
				if a := mustAnswer(t, rd, c3); code(a) != tc.want3 {
					t.Fatalf("c3: %s, want code %d", describeAnswer(a), tc.want3)
				}
				return
			}
			if len(writesOf(rd, "c3")) != 1 {
				t.Fatalf("c3: writes %+v, want it planned", rd.Writes)
			}
		})
	}
}

// DEL and CHECK ask nothing of the Lease or the handback mark (a node keeps freeing and checking
// what it holds whoever else holds the Lease); while the agent is not serving they are refused
// with code 11 (not 3: the plugin must not ask the previous IPAM), answered at once.
func TestMachineDelCheckOnlyWaitForServing(t *testing.T) {
	for _, tc := range []struct {
		name     string
		fact     func(h *machineHarness)
		wantCode uint // of DEL and CHECK; 0: served
	}{
		{name: "another holder of the Lease: served",
			fact: func(h *machineHarness) { h.m.SetLease(false, "agent-b-7", time.Time{}, h.now) }},
		{name: "handed back: served",
			fact: func(h *machineHarness) {
				h.m.SetHandback(&ipam.HandbackMark{At: h.now, To: "host-local", Network: "net"}, h.now)
			}},
		{name: "not serving: refused", fact: func(h *machineHarness) { h.m.SetReady(false, h.now) },
			wantCode: cniproto.CodeTryAgainLater},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newGatedMachine(t, MachineConfig{}, mt0.Add(time.Hour))
			h.hold(map[string]string{"v4": "10.1.0.8/29"})
			h.add(addReq("c1"))
			tc.fact(h)
			h.settle()
			chk := h.m.Request(checkReq("c1"), h.now)
			del := h.m.Request(delReq("c1"), h.now)
			rd := h.settle()
			for _, id := range []uint64{chk, del} {
				if a := mustAnswer(t, rd, id); code(a) != tc.wantCode {
					t.Fatalf("answered %s, want code %d", describeAnswer(a), tc.wantCode)
				}
			}
			if got := h.attached("c1"); got != (tc.wantCode != 0) {
				t.Fatalf("c1 attached %v after the DEL", got)
			}
		})
	}
}

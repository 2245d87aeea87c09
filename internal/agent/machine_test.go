package agent

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/podinfo"
	"github.com/ipwarden/ipwarden/internal/previous"
)

// The tests of the Machine's ordering rules (see its doc comment). They drive the machine as a
// driver does, but by hand: an input at an explicit time, then Ready (what it wants done) and
// Advance, then the outcomes fed back. No Service, goroutine, journal or clock.

// mt0 is the machine tests' clock at the start.
var mt0 = time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)

// errRefused is a journal's refusal of a write.
var errRefused = errors.New("write journal: no space left on device")

// machineHarness drives a Machine by hand.
type machineHarness struct {
	t   *testing.T
	m   *Machine
	now time.Time
}

// newMachine returns a machine of node-a serving pools, their settings journaled.
func newMachine(t *testing.T, cfg MachineConfig, pools ...ipam.Pool) *machineHarness {
	t.Helper()
	cfg.Node, cfg.Log, cfg.Metrics = "node-a", logr.Discard(), NewMetrics(nil)
	h := &machineHarness{t: t, m: NewMachine(ipam.New("node-a"), cfg), now: mt0}
	names := make([]string, len(pools))
	for i, p := range pools {
		names[i] = p.Name
	}
	id := h.m.Fact("pools", func(m *Machine) ipam.Plan { return m.st.PlanPools(pools, names) }, nil, h.now)
	if a := mustAnswer(t, h.settle(), id); a.Err != nil {
		t.Fatalf("pools: %v", a.Err)
	}
	return h
}

// ready returns what the machine wants done and acknowledges it.
func (h *machineHarness) ready() Ready {
	rd := h.m.Ready()
	h.m.Advance()
	return rd
}

// settle carries out what the machine wants done until it wants nothing more: every write
// lands, every pod read answers with no annotations. It returns all of it as one Ready (Wake
// and Marker: the last).
func (h *machineHarness) settle() Ready {
	h.t.Helper()
	var all Ready
	for range 100 {
		rd := h.ready()
		all.Writes = append(all.Writes, rd.Writes...)
		all.Answers = append(all.Answers, rd.Answers...)
		all.Reads = append(all.Reads, rd.Reads...)
		all.Events = append(all.Events, rd.Events...)
		all.Kick, all.KickNow, all.Changed = all.Kick || rd.Kick, all.KickNow || rd.KickNow, all.Changed || rd.Changed
		all.Wake = rd.Wake
		if rd.Marker != nil {
			all.Marker = rd.Marker
		}
		if len(rd.Writes) == 0 && len(rd.Reads) == 0 {
			return all
		}
		for _, w := range rd.Writes {
			h.m.Written(w.ID, nil, h.now)
		}
		for _, r := range rd.Reads {
			h.m.PodRead(r.ID, ipam.PodMeta{}, nil, h.now)
		}
	}
	h.t.Fatal("the machine never settled")
	return all
}

// holdings queues the fact of what the node holds (as Service.SetHoldings does).
func (h *machineHarness) holdings(held map[string]string, rec RecordOf) uint64 {
	sets := map[string]addr.Set{}
	for p, s := range held {
		sets[p] = addr.MustParseSetString(s)
	}
	return h.m.Fact("holdings", func(m *Machine) ipam.Plan { return m.planHoldings(sets, rec) },
		func(m *Machine, p ipam.Plan, _ *Answer) { m.holdingsApplied(rec, p) }, h.now)
}

// hold sets what the node holds, journaled.
func (h *machineHarness) hold(held map[string]string) {
	h.t.Helper()
	id := h.holdings(held, RecordOf{})
	if a := mustAnswer(h.t, h.settle(), id); a.Err != nil {
		h.t.Fatalf("holdings: %v", a.Err)
	}
}

// add makes the attachment of req, journaled, and returns its answer.
func (h *machineHarness) add(req cniproto.Request) *cniproto.Response {
	h.t.Helper()
	id := h.m.Request(req, h.now)
	a := mustAnswer(h.t, h.settle(), id)
	if a.Resp == nil || a.Resp.Error != nil {
		h.t.Fatalf("ADD %s: %+v", req.ContainerID, a.Resp)
	}
	return a.Resp
}

// attached reports whether the state has the attachment cid/eth0.
func (h *machineHarness) attached(cid string) bool {
	_, ok := h.m.st.Attachment(ipam.Key{ContainerID: cid, IfName: "eth0"})
	return ok
}

func delReq(cid string) cniproto.Request {
	return cniproto.Request{Op: cniproto.OpDel, ContainerID: cid, IfName: "eth0"}
}

func checkReq(cid string) cniproto.Request {
	return cniproto.Request{Op: cniproto.OpCheck, ContainerID: cid, IfName: "eth0"}
}

// answerOf returns the answer to id in rd.
func answerOf(rd Ready, id uint64) (Answer, bool) {
	i := slices.IndexFunc(rd.Answers, func(a Answer) bool { return a.ID == id })
	if i < 0 {
		return Answer{}, false
	}
	return rd.Answers[i], true
}

func mustAnswer(t *testing.T, rd Ready, id uint64) Answer {
	t.Helper()
	a, ok := answerOf(rd, id)
	if !ok {
		t.Fatalf("input %d not answered; answers %+v", id, rd.Answers)
	}
	return a
}

// noAnswer fails t if rd answers id.
func noAnswer(t *testing.T, rd Ready, id uint64, what string) {
	t.Helper()
	if a, ok := answerOf(rd, id); ok {
		t.Fatalf("%s answered early: %+v", what, describeAnswer(a))
	}
}

// writesOf returns the writes of rd that put or delete the attachment cid/eth0.
func writesOf(rd Ready, cid string) []Write {
	k := ipam.Key{ContainerID: cid, IfName: "eth0"}
	var out []Write
	for _, w := range rd.Writes {
		if slices.ContainsFunc(w.Change.PutAttachments, func(a ipam.Attachment) bool { return a.Key == k }) ||
			slices.Contains(w.Change.DeleteAttachments, k) {
			out = append(out, w)
		}
	}
	return out
}

// putAddresses is what the attachment cid/eth0 holds in write w ("" when w does not put it).
func putAddresses(w Write, cid string) string {
	for _, a := range w.Change.PutAttachments {
		if a.Key.ContainerID == cid {
			return fmtAddresses(a.Addresses)
		}
	}
	return ""
}

// ips is a CNI answer's addresses, or its error.
func ips(resp *cniproto.Response) string {
	if resp == nil {
		return "<none>"
	}
	if resp.Error != nil {
		return fmt.Sprintf("error %d: %s", resp.Error.Code, resp.Error.Msg)
	}
	var out []string
	for _, ip := range resp.IPs {
		out = append(out, ip.Address)
	}
	return strings.Join(out, ",")
}

func describeAnswer(a Answer) string {
	return fmt.Sprintf("{ID:%d Resp:%s Att:%v Err:%v}", a.ID, ips(a.Resp), a.Att != nil, a.Err)
}

// code is the CNI error code of an answer (0: success).
func code(a Answer) uint {
	if a.Resp == nil || a.Resp.Error == nil {
		return 0
	}
	return a.Resp.Error.Code
}

// An ADD is answered only after the journal write of its attachment landed; a refused write
// aborts its plan: the ADD fails (try again later) and nothing was handed out, so the address
// goes to the next ADD. A repeated ADD of a known attachment is answered without a write.
func TestMachineAddAnsweredOnlyAfterItsWrite(t *testing.T) {
	for _, tc := range []struct {
		name    string
		outcome error // of the ADD's write
		// wantIP is the ADD's address, wantCode its error code (one of them).
		wantIP   string
		wantCode uint
		// next is an ADD that comes after the first is answered; it gets the node's one
		// address at once (nextIP, in its write), waits for one (nextIP ""), or is answered
		// without a write (nextAnswer).
		next       cniproto.Request
		nextIP     string
		nextAnswer string
	}{
		{name: "landed: a repeated ADD is answered without a write", wantIP: "10.1.0.8/16",
			next: addReq("c1"), nextAnswer: "10.1.0.8/16"},
		{name: "landed: the address is taken", wantIP: "10.1.0.8/16", next: addReq("c2")},
		{name: "refused: the address goes to the next ADD", outcome: errRefused, wantCode: cniproto.CodeTryAgainLater,
			next: addReq("c2"), nextIP: "v4=10.1.0.8"},
		{name: "refused: a retried ADD is a new one", outcome: errRefused, wantCode: cniproto.CodeTryAgainLater,
			next: addReq("c1"), nextIP: "v4=10.1.0.8"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Minute}, testV4)
			h.hold(map[string]string{"v4": "10.1.0.8"})
			id := h.m.Request(addReq("c1"), h.now)
			rd := h.ready()
			noAnswer(t, rd, id, "the ADD")
			ws := writesOf(rd, "c1")
			if len(rd.Writes) != 1 || len(ws) != 1 || !ws[0].Add || ws[0].Lazy {
				t.Fatalf("writes %+v, want the ADD's alone, not lazy", rd.Writes)
			}
			if got := putAddresses(ws[0], "c1"); got != "v4=10.1.0.8" {
				t.Fatalf("the ADD's write records %q", got)
			}
			// Nothing else answers it: the clock, a barrier.
			h.now = h.now.Add(time.Second)
			h.m.Tick(h.now)
			h.m.Barrier(h.now)
			noAnswer(t, h.ready(), id, "the ADD")

			h.m.Written(ws[0].ID, tc.outcome, h.now)
			rd = h.ready()
			a := mustAnswer(t, rd, id)
			if tc.wantIP != "" {
				if ips(a.Resp) != tc.wantIP || a.Att == nil {
					t.Fatalf("ADD answered %s, want %s and the attachment", describeAnswer(a), tc.wantIP)
				}
			} else if code(a) != tc.wantCode || len(a.Resp.IPs) != 0 || a.Att != nil {
				t.Fatalf("ADD answered %s, want code %d and nothing handed out", describeAnswer(a), tc.wantCode)
			}
			if h.attached("c1") != (tc.outcome == nil) {
				t.Fatalf("attachment c1 in the state: %v, want %v", h.attached("c1"), tc.outcome == nil)
			}
			if h.m.st.Pending(ipam.Key{ContainerID: "c1", IfName: "eth0"}) {
				t.Fatal("c1 still in flight after its write's outcome")
			}
			if got := testutil.ToFloat64(h.m.metrics.JournalRefused.WithLabelValues("add")); (got == 1) != (tc.outcome != nil) {
				t.Fatalf("journal_refused_total{change=add} = %v", got)
			}

			next := h.m.Request(tc.next, h.now)
			rd = h.ready()
			switch {
			case tc.nextAnswer != "":
				if a := mustAnswer(t, rd, next); ips(a.Resp) != tc.nextAnswer || len(rd.Writes) != 0 {
					t.Fatalf("repeated ADD: answer %s writes %+v, want %s without a write", describeAnswer(a), rd.Writes, tc.nextAnswer)
				}
			case tc.nextIP != "":
				ws := writesOf(rd, tc.next.ContainerID)
				if len(ws) != 1 || putAddresses(ws[0], tc.next.ContainerID) != tc.nextIP {
					t.Fatalf("next ADD's writes %+v, want one with %s", rd.Writes, tc.nextIP)
				}
				noAnswer(t, rd, next, "the next ADD")
			default:
				if len(rd.Writes) != 0 || !rd.KickNow {
					t.Fatalf("next ADD: writes %+v KickNow %v, want it to wait for an address", rd.Writes, rd.KickNow)
				}
				noAnswer(t, rd, next, "the next ADD")
			}
		})
	}
}

// minput is an input of a test: a CNI request, or a conditional free.
type minput struct {
	req    cniproto.Request
	freeIf string // a conditional free of this container's attachment, accepting it
}

func (in minput) feed(h *machineHarness) uint64 {
	if in.freeIf != "" {
		return h.m.FreeIf(ipam.Key{ContainerID: in.freeIf, IfName: "eth0"}, func(ipam.Attachment) bool { return true }, h.now)
	}
	return h.m.Request(in.req, h.now)
}

func (in minput) String() string {
	if in.freeIf != "" {
		return "free " + in.freeIf
	}
	return string(in.req.Op) + " " + in.req.ContainerID
}

// Requests for one attachment run one at a time, in the order they came: the second starts
// once the first is finished, its journal write included. Requests for different attachments
// do not wait for each other.
func TestMachineRequestsOfOneAttachmentRunInOrder(t *testing.T) {
	for _, tc := range []struct {
		name  string
		known []string // attachments made before
		first minput   // its write stays in flight until the test lands it
		// second comes while the first's write is in flight; held: it starts only once that
		// write landed.
		second minput
		held   bool
		// What the second does when it starts: its writes, and whether it is answered then
		// (and with the first's addresses: sameIPs).
		writes   int
		answered bool
		sameIPs  bool
		code     uint // of the second's answer
	}{
		{"ADD then DEL", nil, minput{req: addReq("c1")}, minput{req: delReq("c1")}, true, 1, true, false, 0},
		{"ADD then CHECK", nil, minput{req: addReq("c1")}, minput{req: checkReq("c1")}, true, 0, true, false, 0},
		{"ADD then ADD", nil, minput{req: addReq("c1")}, minput{req: addReq("c1")}, true, 0, true, true, 0},
		{"ADD then conditional free", nil, minput{req: addReq("c1")}, minput{freeIf: "c1"}, true, 1, false, false, 0},
		{"DEL then ADD", []string{"c1"}, minput{req: delReq("c1")}, minput{req: addReq("c1")}, true, 1, false, false, 0},
		{"DEL then DEL", []string{"c1"}, minput{req: delReq("c1")}, minput{req: delReq("c1")}, true, 0, true, false, 0},
		// Run early, the CHECK would find the attachment the DEL frees.
		{"DEL then CHECK", []string{"c1"}, minput{req: delReq("c1")}, minput{req: checkReq("c1")}, true, 0, true, false, cniproto.CodeUnknownContainer},
		{"ADD, then DEL of another attachment", []string{"c2"}, minput{req: addReq("c1")}, minput{req: delReq("c2")}, false, 1, true, false, 0},
		{"ADD, then ADD of another attachment", nil, minput{req: addReq("c1")}, minput{req: addReq("c2")}, false, 1, false, false, 0},
		{"DEL, then ADD of another attachment", []string{"c1"}, minput{req: delReq("c1")}, minput{req: addReq("c2")}, false, 1, false, false, 0},
		{"DEL, then CHECK of another attachment", []string{"c1", "c2"}, minput{req: delReq("c1")}, minput{req: checkReq("c2")}, false, 0, true, false, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Minute}, testV4)
			h.hold(map[string]string{"v4": "10.1.0.8/29"})
			for _, c := range tc.known {
				h.add(addReq(c))
			}
			h.now = h.now.Add(time.Second)
			first := tc.first.feed(h)
			second := tc.second.feed(h)
			rd := h.ready()
			if len(rd.Writes) == 0 {
				t.Fatalf("%s: no write", tc.first)
			}
			firstWrite := rd.Writes[0]
			secondStarted := func(rd Ready, writes int) {
				t.Helper()
				if len(rd.Writes) != writes {
					t.Fatalf("%s started with writes %+v, want %d", tc.second, rd.Writes, writes)
				}
				a, ok := answerOf(rd, second)
				if ok != tc.answered {
					t.Fatalf("%s answered when it started: %v, want %v (%+v)", tc.second, ok, tc.answered, rd.Answers)
				}
				if ok && code(a) != tc.code {
					t.Fatalf("%s answered %s, want code %d", tc.second, describeAnswer(a), tc.code)
				}
			}
			if !tc.held {
				secondStarted(rd, 1+tc.writes)
				return
			}
			if len(rd.Writes) != 1 {
				t.Fatalf("%s ran while %s's write was in flight: writes %+v", tc.second, tc.first, rd.Writes)
			}
			noAnswer(t, rd, second, tc.second.String())
			// Nothing but the first's write lets it start.
			h.now = h.now.Add(time.Second)
			h.m.Tick(h.now)
			if rd := h.ready(); len(rd.Writes) != 0 {
				t.Fatalf("%s ran on a tick: writes %+v", tc.second, rd.Writes)
			} else {
				noAnswer(t, rd, second, tc.second.String())
			}

			h.m.Written(firstWrite.ID, nil, h.now)
			rd = h.ready()
			secondStarted(rd, tc.writes)
			if tc.first.req.Op == cniproto.OpAdd {
				fa := mustAnswer(t, rd, first)
				if i, j := slices.IndexFunc(rd.Answers, func(a Answer) bool { return a.ID == first }),
					slices.IndexFunc(rd.Answers, func(a Answer) bool { return a.ID == second }); j >= 0 && j < i {
					t.Fatalf("%s answered before %s: %+v", tc.second, tc.first, rd.Answers)
				}
				if sa, _ := answerOf(rd, second); tc.sameIPs && ips(sa.Resp) != ips(fa.Resp) {
					t.Fatalf("%s answered %s, the first %s", tc.second, describeAnswer(sa), describeAnswer(fa))
				}
			}
			if tc.first.req.Op == cniproto.OpDel && tc.second.req.Op == cniproto.OpAdd {
				// A new attachment, not the one the DEL freed.
				if ws := writesOf(rd, "c1"); len(ws) != 1 || putAddresses(ws[0], "c1") == "" {
					t.Fatalf("ADD after DEL: writes %+v, want a new attachment", rd.Writes)
				}
			}
		})
	}
}

// A DEL is answered at once, in the same Ready as its write; its address stays in use, and its
// attachment busy, until the write lands. A refused write keeps the attachment.
func TestMachineDelAnsweredAtOnceAddressKeptUntilWritten(t *testing.T) {
	quick := testV4
	quick.Cooldown = 0 // a freed address is reusable at once: only the write holds it
	for _, tc := range []struct {
		name    string
		outcome error // of the DEL's write
		// reused: the waiting ADD of another attachment gets the DEL's address once the
		// write's outcome is in; kept: the attachment stays.
		reused, kept bool
		// againWrites: the writes of a repeated DEL that waited for the first.
		againWrites int
	}{
		{"write landed", nil, true, false, 0},
		{"write refused", errRefused, false, true, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Minute}, quick)
			h.hold(map[string]string{"v4": "10.1.0.8"})
			h.add(addReq("c1"))
			h.now = h.now.Add(time.Second)
			del := h.m.Request(delReq("c1"), h.now)
			rd := h.ready()
			if a := mustAnswer(t, rd, del); a.Resp == nil || a.Resp.Error != nil {
				t.Fatalf("DEL answered %s", describeAnswer(a))
			}
			ws := writesOf(rd, "c1")
			if len(rd.Writes) != 1 || len(ws) != 1 || !ws[0].Lazy || ws[0].Add {
				t.Fatalf("DEL's writes %+v, want one lazy write", rd.Writes)
			}
			if !h.attached("c1") {
				t.Fatal("the DEL's attachment left the state before its write landed")
			}
			// Its address is not handed out meanwhile, however often asked.
			other := h.m.Request(addReq("c2"), h.now)
			again := h.m.Request(delReq("c1"), h.now)
			for range 3 {
				h.now = h.now.Add(time.Second)
				h.m.Tick(h.now)
				rd = h.ready()
				if len(rd.Writes) != 0 {
					t.Fatalf("writes while the DEL's write was in flight: %+v", rd.Writes)
				}
				noAnswer(t, rd, other, "the ADD of c2")
				noAnswer(t, rd, again, "the repeated DEL")
			}

			h.m.Written(ws[0].ID, tc.outcome, h.now)
			rd = h.ready()
			if h.attached("c1") != tc.kept {
				t.Fatalf("attachment c1 kept: %v, want %v", h.attached("c1"), tc.kept)
			}
			if ws := writesOf(rd, "c2"); tc.reused != (len(ws) == 1 && putAddresses(ws[0], "c2") == "v4=10.1.0.8") {
				t.Fatalf("the ADD of c2 after the DEL's write: writes %+v, want the DEL's address: %v", rd.Writes, tc.reused)
			}
			if a := mustAnswer(t, rd, again); code(a) != 0 || len(writesOf(rd, "c1")) != tc.againWrites {
				t.Fatalf("repeated DEL: %s, writes %+v, want %d of c1", describeAnswer(a), rd.Writes, tc.againWrites)
			}
		})
	}
}

// A barrier is answered once every DEL answered before it has its journal write's outcome; a
// DEL that comes after it, or one not yet answered (behind another request), does not hold it.
func TestMachineBarrierWaitsForEarlierDels(t *testing.T) {
	type landing struct {
		cid     string
		outcome error
	}
	for _, tc := range []struct {
		name   string
		busy   []string // ADDs in flight, made before
		before []string // DELs before the barrier
		after  []string // DELs after it
		land   []landing
		// answeredAt: the barrier is answered after this many landings (0: at once).
		answeredAt int
	}{
		{name: "no DEL in flight", answeredAt: 0},
		{name: "one DEL", before: []string{"c1"}, land: []landing{{"c1", nil}}, answeredAt: 1},
		{name: "one DEL, refused", before: []string{"c1"}, land: []landing{{"c1", errRefused}}, answeredAt: 1},
		{name: "two DELs", before: []string{"c1", "c2"}, land: []landing{{"c2", nil}, {"c1", nil}}, answeredAt: 2},
		{name: "a DEL after the barrier", before: []string{"c1"}, after: []string{"c2"},
			land: []landing{{"c1", nil}, {"c2", nil}}, answeredAt: 1},
		{name: "only DELs after the barrier", after: []string{"c1", "c2"}, land: []landing{{"c1", nil}}, answeredAt: 0},
		{name: "a DEL behind an ADD, not answered yet", busy: []string{"c9"}, before: []string{"c9"}, answeredAt: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Minute}, testV4)
			h.hold(map[string]string{"v4": "10.1.0.8/29"})
			h.add(addReq("c1"))
			h.add(addReq("c2"))
			h.now = h.now.Add(time.Second)
			writes := map[string]uint64{}
			del := func(cid string) {
				h.m.Request(delReq(cid), h.now)
			}
			for _, c := range tc.busy {
				h.m.Request(addReq(c), h.now)
			}
			for _, c := range tc.before {
				del(c)
			}
			b := h.m.Barrier(h.now)
			for _, c := range tc.after {
				del(c)
			}
			rd := h.ready()
			for _, w := range rd.Writes {
				for _, k := range w.Change.DeleteAttachments {
					writes[k.ContainerID] = w.ID
				}
			}
			_, answered := answerOf(rd, b)
			if answered != (tc.answeredAt == 0) {
				t.Fatalf("barrier answered at once: %v, want %v", answered, tc.answeredAt == 0)
			}
			for i, l := range tc.land {
				w, ok := writes[l.cid]
				if !ok {
					t.Fatalf("no DEL write of %s: %+v", l.cid, rd.Writes)
				}
				h.m.Written(w, l.outcome, h.now)
				_, ok = answerOf(h.ready(), b)
				if want := i+1 == tc.answeredAt; ok != want {
					t.Fatalf("barrier answered after %d landings: %v, want %v", i+1, ok, want)
				}
			}
			if tc.answeredAt > len(tc.land) {
				t.Fatal("bad test case")
			}
		})
	}
}

// An ADD of an attachment the node does not know, of a named pod, first reads the pod's
// annotations: nothing is written before the read's outcome. A failed read fails it (try again
// later), unless the node served the pod's earlier sandbox; so does a read while the agent
// starts with the API server away, except that it serves the ADD without annotations (never
// for a claim named in args.cni); a read with annotations decides the pools.
func TestMachineAddReadsAnUnknownPod(t *testing.T) {
	podErr := errors.New("the API server did not answer")
	for _, tc := range []struct {
		name      string
		readsPods bool
		// earlier: the pod's earlier sandbox (c0) has an attachment; known: c1 itself has one.
		earlier, known bool
		pod            cniproto.Pod // the ADD's pod ("": the default ns/pod-c1)
		claimArg       string       // the configuration's args.cni ipam-claim-reference
		// The read's outcome.
		meta    ipam.PodMeta
		readErr error
		// wantRead: the ADD reads its pod; then it writes wantAddrs (or is answered without a
		// write when the attachment is known), or fails with wantCode.
		wantRead  bool
		wantAddrs string
		wantCode  uint
	}{
		{name: "read, then written with the pod's pools", readsPods: true, meta: ipam.PodMeta{Pools: "v6"},
			wantRead: true, wantAddrs: "v6=fd01::8"},
		{name: "read, then written with the node's pools", readsPods: true,
			wantRead: true, wantAddrs: "v4=10.1.0.8,v6=fd01::8"},
		{name: "read fails", readsPods: true, readErr: podErr, wantRead: true, wantCode: cniproto.CodeTryAgainLater},
		{name: "read fails, earlier sandbox served", readsPods: true, earlier: true, readErr: podErr,
			wantRead: true, wantAddrs: "v4=10.1.0.9,v6=fd01::9"},
		{name: "API server away at start: served without annotations", readsPods: true, readErr: ErrPodReaderAway,
			wantRead: true, wantAddrs: "v4=10.1.0.8,v6=fd01::8"},
		{name: "API server away at start, earlier sandbox served", readsPods: true, earlier: true, readErr: ErrPodReaderAway,
			wantRead: true, wantAddrs: "v4=10.1.0.9,v6=fd01::9"},
		{name: "API server away at start, a claim in args.cni", readsPods: true, claimArg: "vm", readErr: ErrPodReaderAway,
			wantRead: true, wantCode: cniproto.CodeTryAgainLater},
		{name: "known attachment: no read", readsPods: true, known: true},
		{name: "no pod name: no read", readsPods: true, pod: cniproto.Pod{UID: "uid-c1"}, wantAddrs: "v4=10.1.0.8,v6=fd01::8"},
		{name: "reads off: no read", wantAddrs: "v4=10.1.0.8,v6=fd01::8"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Minute, ReadsPods: tc.readsPods}, testV4, testV6)
			h.hold(map[string]string{"v4": "10.1.0.8/29", "v6": "fd01::8/125"})
			req := addReq("c1")
			if tc.pod != (cniproto.Pod{}) {
				req.Pod = tc.pod
			}
			req.IPAMClaimReference = tc.claimArg
			if tc.earlier {
				r := addReq("c0")
				r.Pod = req.Pod
				h.add(r)
			}
			var first *cniproto.Response
			if tc.known {
				first = h.add(req)
			}
			h.now = h.now.Add(time.Second)
			id := h.m.Request(req, h.now)
			rd := h.ready()
			wantReads := []PodRead(nil)
			if tc.wantRead {
				wantReads = []PodRead{{ID: id, Namespace: "ns", Name: "pod-c1", UID: "uid-c1", IfName: "eth0", Network: "net", ClaimArg: tc.claimArg}}
			}
			if !slices.Equal(rd.Reads, wantReads) {
				t.Fatalf("reads %+v, want %+v", rd.Reads, wantReads)
			}
			if tc.wantRead {
				if len(rd.Writes) != 0 {
					t.Fatalf("written before its pod was read: %+v", rd.Writes)
				}
				noAnswer(t, rd, id, "the ADD")
				unknown := testutil.ToFloat64(h.m.metrics.PodUnknown)
				h.m.PodRead(id, tc.meta, tc.readErr, h.now)
				rd = h.ready()
				if got := testutil.ToFloat64(h.m.metrics.PodUnknown) - unknown; got != map[bool]float64{true: 1}[tc.wantCode != 0] {
					t.Fatalf("add_pod_unreadable_total rose by %v", got)
				}
			}
			switch {
			case tc.wantCode != 0:
				if a := mustAnswer(t, rd, id); code(a) != tc.wantCode || len(rd.Writes) != 0 {
					t.Fatalf("ADD: %s, writes %+v, want code %d and no write", describeAnswer(a), rd.Writes, tc.wantCode)
				}
				if h.attached("c1") {
					t.Fatal("an attachment was made for a refused ADD")
				}
			case tc.known:
				if a := mustAnswer(t, rd, id); ips(a.Resp) != ips(first) || len(rd.Writes) != 0 {
					t.Fatalf("repeated ADD: %s, writes %+v, want %s and no write", describeAnswer(a), rd.Writes, ips(first))
				}
			default:
				ws := writesOf(rd, "c1")
				if len(rd.Writes) != 1 || len(ws) != 1 || putAddresses(ws[0], "c1") != tc.wantAddrs {
					t.Fatalf("writes %+v, want one of c1 with %s", rd.Writes, tc.wantAddrs)
				}
				noAnswer(t, rd, id, "the ADD")
			}
		})
	}
}

// An ADD short of addresses waits (and asks the pool monitor for a round at once) until a
// change gives it one, oldest first; it fails at its deadline (start + --address-wait), or at
// once when its caller goes.
func TestMachineAddShortOfAddressesWaits(t *testing.T) {
	const wait = 10 * time.Second
	deadline := mt0.Add(time.Second).Add(wait)
	// more is the fact that the node holds one address more, its write landed.
	more := func(h *machineHarness, refuse error) Ready {
		h.t.Helper()
		id := h.holdings(map[string]string{"v4": "10.1.0.8-10.1.0.9"}, RecordOf{})
		rd := h.ready()
		if len(rd.Writes) != 1 || len(writesOf(rd, "c1")) != 0 {
			h.t.Fatalf("the holdings' writes %+v: the ADD went before them", rd.Writes)
		}
		h.m.Written(rd.Writes[0].ID, refuse, h.now)
		rd = h.ready()
		if a := mustAnswer(h.t, rd, id); !errors.Is(a.Err, refuse) {
			h.t.Fatalf("holdings answered %v", a.Err)
		}
		return rd
	}
	for _, tc := range []struct {
		name string
		// act happens at at, while the ADD of c1 (made at mt0+1s) waits.
		at  time.Time
		act func(h *machineHarness, id uint64) Ready
		// The ADD then writes wantAddrs, fails with wantCode, or goes on waiting until wantWake.
		wantAddrs string
		wantCode  uint
		wantWake  time.Time
	}{
		{name: "holdings give it an address", at: mt0.Add(2 * time.Second),
			act:       func(h *machineHarness, _ uint64) Ready { return more(h, nil) },
			wantAddrs: "v4=10.1.0.9"},
		{name: "holdings refused: it waits", at: mt0.Add(2 * time.Second),
			act:      func(h *machineHarness, _ uint64) Ready { return more(h, errRefused) },
			wantWake: deadline},
		{name: "oldest first", at: mt0.Add(2 * time.Second),
			act: func(h *machineHarness, _ uint64) Ready {
				c2 := h.m.Request(addReq("c2"), h.now)
				if rd := h.ready(); len(rd.Writes) != 0 {
					h.t.Fatalf("c2 did not wait: %+v", rd.Writes)
				}
				rd := more(h, nil)
				if ws := writesOf(rd, "c2"); len(ws) != 0 {
					h.t.Fatalf("the newer ADD got the address: %+v", rd.Writes)
				}
				noAnswer(h.t, rd, c2, "the newer ADD")
				return rd
			},
			wantAddrs: "v4=10.1.0.9"},
		{name: "tick before the deadline: it waits", at: deadline.Add(-time.Millisecond),
			act:      func(h *machineHarness, _ uint64) Ready { h.m.Tick(h.now); return h.ready() },
			wantWake: deadline},
		{name: "tick at the deadline: it fails", at: deadline,
			act:      func(h *machineHarness, _ uint64) Ready { h.m.Tick(h.now); return h.ready() },
			wantCode: cniproto.CodeTryAgainLater},
		{name: "tick past the deadline: it fails", at: deadline.Add(time.Minute),
			act:      func(h *machineHarness, _ uint64) Ready { h.m.Tick(h.now); return h.ready() },
			wantCode: cniproto.CodeTryAgainLater},
		{name: "its caller goes: it fails at once", at: mt0.Add(2 * time.Second),
			act:      func(h *machineHarness, id uint64) Ready { h.m.Cancel(id, h.now); return h.ready() },
			wantCode: cniproto.CodeTryAgainLater},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: wait}, testV4)
			h.hold(map[string]string{"v4": "10.1.0.8"})
			h.add(addReq("c0"))
			h.now = mt0.Add(time.Second)
			id := h.m.Request(addReq("c1"), h.now)
			rd := h.ready()
			noAnswer(t, rd, id, "the ADD short of addresses")
			if len(rd.Writes) != 0 || !rd.KickNow || !rd.Wake.Equal(deadline) {
				t.Fatalf("short ADD: writes %+v KickNow %v Wake %v, want none, true, %v", rd.Writes, rd.KickNow, rd.Wake, deadline)
			}
			if got := h.m.st.Demand("v4"); got < 2 {
				t.Fatalf("demand of v4 %d, want the waiting ADD counted", got)
			}

			h.now = tc.at
			rd = tc.act(h, id)
			switch {
			case tc.wantAddrs != "":
				ws := writesOf(rd, "c1")
				if len(ws) != 1 || putAddresses(ws[0], "c1") != tc.wantAddrs {
					t.Fatalf("writes %+v, want c1's with %s", rd.Writes, tc.wantAddrs)
				}
				noAnswer(t, rd, id, "the ADD")
				h.m.Written(ws[0].ID, nil, h.now)
				if a := mustAnswer(t, h.ready(), id); ips(a.Resp) != "10.1.0.9/16" {
					t.Fatalf("ADD answered %s", describeAnswer(a))
				}
			case tc.wantCode != 0:
				a := mustAnswer(t, rd, id)
				if code(a) != tc.wantCode || !strings.Contains(a.Resp.Error.Msg, "no free address") || len(rd.Writes) != 0 {
					t.Fatalf("ADD answered %s, writes %+v, want code %d", describeAnswer(a), rd.Writes, tc.wantCode)
				}
				if !rd.Wake.IsZero() {
					t.Fatalf("Wake %v after the only waiting ADD failed", rd.Wake)
				}
				if got := h.m.st.Demand("v4"); got != 1 {
					t.Fatalf("demand of v4 %d after the ADD failed, want 1 (c0)", got)
				}
			default:
				noAnswer(t, rd, id, "the ADD")
				if len(writesOf(rd, "c1")) != 0 || !rd.Wake.Equal(tc.wantWake) {
					t.Fatalf("writes %+v Wake %v, want it to go on waiting until %v", rd.Writes, rd.Wake, tc.wantWake)
				}
			}
		})
	}
}

// Facts are planned one at a time, each against the state the one before left: the next is
// planned once the previous one's write has its outcome. A refused fact is answered with the
// refusal and leaves the state as it was.
func TestMachineFactsPlannedOneAtATime(t *testing.T) {
	initial := addr.MustParseSetString("10.1.0.8")
	for _, tc := range []struct {
		name string
		// The first fact: holdings 10.1.0.0/29 from record u1/2 (the mark moves), or a fact
		// with nothing to write (empty), whose write's outcome is outcome.
		empty   bool
		outcome error
		// secondSees is the v4 holding the second fact's plan sees.
		secondSees addr.Set
	}{
		{name: "first lands", secondSees: addr.MustParseSetString("10.1.0.0/29")},
		{name: "first refused", outcome: errRefused, secondSees: initial},
		{name: "first has nothing to write", empty: true, secondSees: initial},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Minute}, testV4)
			h.hold(map[string]string{"v4": initial.String()})
			mark := h.m.st.Mark()
			var plans1, plans2 int
			var seen addr.Set
			firstHeld := map[string]addr.Set{"v4": addr.MustParseSetString("10.1.0.0/29")}
			first := h.m.Fact("holdings", func(m *Machine) ipam.Plan {
				plans1++
				if tc.empty {
					return nil
				}
				return m.planHoldings(firstHeld, RecordOf{UID: "u1", Generation: 2})
			}, nil, h.now)
			second := h.m.Fact("holdings", func(m *Machine) ipam.Plan {
				plans2++
				seen, _ = m.st.Holding("v4")
				return m.planHoldings(map[string]addr.Set{"v4": addr.MustParseSetString("10.1.0.0/28")}, RecordOf{UID: "u1", Generation: 3})
			}, nil, h.now)
			rd := h.ready()
			if plans1 != 1 {
				t.Fatalf("first fact planned %d times", plans1)
			}
			if tc.empty {
				if a := mustAnswer(t, rd, first); a.Err != nil {
					t.Fatalf("empty fact answered %v", a.Err)
				}
				if plans2 != 1 || len(rd.Writes) != 1 {
					t.Fatalf("after an empty fact: second planned %d times, writes %+v, want 1 and its write", plans2, rd.Writes)
				}
			} else {
				if plans2 != 0 {
					t.Fatal("the second fact was planned while the first's write was in flight")
				}
				if len(rd.Writes) != 1 {
					t.Fatalf("writes %+v, want the first fact's alone", rd.Writes)
				}
				noAnswer(t, rd, first, "the first fact")
				h.now = h.now.Add(time.Second)
				h.m.Tick(h.now)
				if h.ready(); plans2 != 0 {
					t.Fatal("the second fact was planned on a tick")
				}
				refused := testutil.ToFloat64(h.m.metrics.JournalRefused.WithLabelValues("holdings"))
				h.m.Written(rd.Writes[0].ID, tc.outcome, h.now)
				rd = h.ready()
				if a := mustAnswer(t, rd, first); !errors.Is(a.Err, tc.outcome) || (a.Err == nil) != (tc.outcome == nil) {
					t.Fatalf("first fact answered %v, want %v", a.Err, tc.outcome)
				}
				if got := testutil.ToFloat64(h.m.metrics.JournalRefused.WithLabelValues("holdings")) - refused; got != map[bool]float64{true: 1}[tc.outcome != nil] {
					t.Fatalf("journal_refused_total{change=holdings} rose by %v", got)
				}
				if tc.outcome != nil {
					if held, _ := h.m.st.Holding("v4"); held.String() != initial.String() || h.m.st.Mark() != mark {
						t.Fatalf("after the refusal: holding %v mark %+v, want %v and %+v", held, h.m.st.Mark(), initial, mark)
					}
				}
				if plans2 != 1 || len(rd.Writes) != 1 {
					t.Fatalf("after the first's outcome: second planned %d times, writes %+v", plans2, rd.Writes)
				}
			}
			if seen.String() != tc.secondSees.String() {
				t.Fatalf("the second fact was planned against holding %v, want %v", seen, tc.secondSees)
			}
			h.m.Written(rd.Writes[0].ID, nil, h.now)
			if a := mustAnswer(t, h.ready(), second); a.Err != nil {
				t.Fatal(a.Err)
			}
			if held, _ := h.m.st.Holding("v4"); held.String() != "10.1.0.0/28" || h.m.st.Mark() != (ipam.RecordMark{UID: "u1", Generation: 3}) {
				t.Fatalf("after both: holding %v mark %+v", held, h.m.st.Mark())
			}
		})
	}
}

// The hold's marker: written (Ready.Marker, until) when the hold starts, removed (zero) when it
// ends, untouched meanwhile; never without HoldMarker.
func TestMachineHoldMarker(t *testing.T) {
	until := mt0.Add(5 * time.Minute)
	web := ipam.Pod{Ref: ipam.PodRef{Namespace: "ns", Name: "web", UID: "uid-web"}}
	for _, tc := range []struct {
		name   string
		marker bool
		// used: the held address is in use when the hold starts (nothing is unattributed).
		used bool
		// at is when end runs; it ends the hold (wantEnd) or not.
		at      time.Time
		end     func(h *machineHarness)
		wantEnd bool
		// wantEvent: the hold ran out with a pod unreported (a Warning).
		wantEvent bool
	}{
		{name: "the pods report", marker: true, at: mt0.Add(time.Minute), end: func(h *machineHarness) {
			// As the Service does on a pod event: set the pods, record what they report (the
			// rebuild, journaled), then evaluate the hold.
			reported := web
			reported.IPs = []netip.Addr{netip.MustParseAddr("10.1.0.9")}
			h.m.st.SetPods([]ipam.Pod{reported})
			h.m.Rebuild([]ipam.Pod{reported}, 0, h.now)
			h.settle()
			h.m.EvaluateHold(h.now)
		}, wantEnd: true},
		{name: "the pod's ADD", marker: true, at: mt0.Add(time.Minute), end: func(h *machineHarness) {
			r := addReq("web")
			r.Pod = cniproto.Pod{Namespace: "ns", Name: "web", UID: "uid-web"}
			h.m.Request(r, h.now)
		}, wantEnd: true},
		{name: "the deadline", marker: true, at: until, end: func(h *machineHarness) { h.m.Tick(h.now) },
			wantEnd: true, wantEvent: true},
		{name: "before the deadline, unreported", marker: true, at: until.Add(-time.Second),
			end: func(h *machineHarness) { h.m.Tick(h.now); h.m.EvaluateHold(h.now) }},
		{name: "nothing unattributed: no hold", marker: true, used: true},
		{name: "no marker kept", marker: false, at: until, end: func(h *machineHarness) { h.m.Tick(h.now) },
			wantEnd: true, wantEvent: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Minute, HoldMarker: tc.marker}, testV4)
			if tc.used {
				h.hold(map[string]string{"v4": "10.1.0.8"})
				h.add(addReq("c1"))
			} else {
				h.hold(map[string]string{"v4": "10.1.0.8/29"})
			}
			h.m.st.SetPods([]ipam.Pod{web})
			h.m.StartHold(until, h.now)
			rd := h.ready()
			if on, _ := h.m.st.Hold(); on == tc.used {
				t.Fatalf("hold on: %v", on)
			}
			switch {
			case !tc.marker:
				if rd.Marker != nil {
					t.Fatalf("marker %v without HoldMarker", *rd.Marker)
				}
			case tc.used:
				if rd.Marker == nil || !rd.Marker.IsZero() {
					t.Fatalf("marker %v, want it removed: no hold", rd.Marker)
				}
				return
			default:
				if rd.Marker == nil || !rd.Marker.Equal(until) {
					t.Fatalf("marker %v, want %v", rd.Marker, until)
				}
				if !rd.Wake.Equal(until) {
					t.Fatalf("Wake %v, want the hold's end %v", rd.Wake, until)
				}
			}
			h.now = tc.at
			tc.end(h)
			rd = h.ready()
			if on, _ := h.m.st.Hold(); on == tc.wantEnd {
				t.Fatalf("hold on after: %v", on)
			}
			switch {
			case !tc.marker:
				if rd.Marker != nil {
					t.Fatalf("marker %v without HoldMarker", *rd.Marker)
				}
			case tc.wantEnd:
				if rd.Marker == nil || !rd.Marker.IsZero() {
					t.Fatalf("marker %v, want it removed", rd.Marker)
				}
			default:
				if rd.Marker != nil {
					t.Fatalf("marker %v rewritten while the hold goes on", *rd.Marker)
				}
			}
			gotEvent := slices.ContainsFunc(rd.Events, func(e NodeEvent) bool { return e.Reason == ReasonHoldExpired })
			if gotEvent != tc.wantEvent {
				t.Fatalf("events %+v, want the hold-expired warning: %v", rd.Events, tc.wantEvent)
			}
		})
	}
}

// An ADD of a pod whose addresses a rebuild is recording waits for the rebuild's write, without
// a deadline, then adopts them; when the journal refuses the rebuild, the ADD goes on as if there
// had been none.
func TestMachineAddWaitsForARebuildInFlight(t *testing.T) {
	const wait = 10 * time.Second
	for _, tc := range []struct {
		name    string
		cancel  bool  // the ADD's caller goes while it waits
		outcome error // of the rebuild's write
		// The ADD then writes wantAddrs, or fails with wantCode.
		wantAddrs string
		wantCode  uint
	}{
		{name: "rebuild lands: the ADD adopts its address", wantAddrs: "v4=10.1.0.9"},
		{name: "rebuild refused: the ADD picks afresh", outcome: errRefused, wantAddrs: "v4=10.1.0.8"},
		{name: "its caller goes: it fails at once", cancel: true, wantCode: cniproto.CodeTryAgainLater},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: wait}, testV4)
			h.hold(map[string]string{"v4": "10.1.0.8/29"})
			web := cniproto.Pod{Namespace: "ns", Name: "web", UID: "uid-web"}
			pods := []ipam.Pod{{Ref: ipam.PodRef{Namespace: web.Namespace, Name: web.Name, UID: web.UID},
				IPs: []netip.Addr{netip.MustParseAddr("10.1.0.9")}}}
			rebuild := h.m.Fact("rebuild", func(m *Machine) ipam.Plan { return m.planRebuild(pods, 0) }, rebuildApplied, h.now)
			rd := h.ready()
			if len(rd.Writes) != 1 {
				t.Fatalf("rebuild's writes %+v", rd.Writes)
			}
			rebuildWrite := rd.Writes[0].ID
			req := addReq("web")
			req.Pod = web
			id := h.m.Request(req, h.now)
			rd = h.ready()
			noAnswer(t, rd, id, "the ADD")
			if len(rd.Writes) != 0 || !rd.Wake.IsZero() {
				t.Fatalf("ADD during the rebuild's write: writes %+v Wake %v, want none and no deadline", rd.Writes, rd.Wake)
			}
			h.now = h.now.Add(10 * wait)
			h.m.Tick(h.now)
			if rd := h.ready(); len(rd.Writes) != 0 {
				t.Fatalf("writes on a tick: %+v", rd.Writes)
			} else {
				noAnswer(t, rd, id, "the ADD waiting for the rebuild, past --address-wait,")
			}
			if tc.cancel {
				h.m.Cancel(id, h.now)
				if a := mustAnswer(t, h.ready(), id); code(a) != tc.wantCode {
					t.Fatalf("canceled ADD answered %s", describeAnswer(a))
				}
				return
			}
			h.m.Written(rebuildWrite, tc.outcome, h.now)
			rd = h.ready()
			if a := mustAnswer(t, rd, rebuild); !errors.Is(a.Err, tc.outcome) || (a.Err == nil) != (tc.outcome == nil) {
				t.Fatalf("rebuild answered %v", a.Err)
			}
			noAnswer(t, rd, id, "the ADD")
			ws := writesOf(rd, "web")
			if len(ws) != 1 || putAddresses(ws[0], "web") != tc.wantAddrs {
				t.Fatalf("ADD's writes %+v, want one with %s", rd.Writes, tc.wantAddrs)
			}
			h.m.Written(ws[0].ID, nil, h.now)
			if a := mustAnswer(t, h.ready(), id); "v4="+strings.TrimSuffix(ips(a.Resp), "/16") != tc.wantAddrs {
				t.Fatalf("ADD answered %s, want %s", describeAnswer(a), tc.wantAddrs)
			}
		})
	}
}

// A waiting ADD asks the pool monitor for a round at once each time a change leaves it short (a
// node that got part of its request asks for the rest without a quiet time), and a fact that
// changes nothing (an empty rebuild on a pod event, a round that marks nothing) tries no waiting
// ADD again: it neither asks for a round nor reports a change.
func TestMachineWaitingAddKicksOnEveryChangeOnly(t *testing.T) {
	h := newMachine(t, MachineConfig{AddressWait: time.Minute}, testV4)
	h.hold(map[string]string{"v4": "10.1.0.8/32"})
	h.add(addReq("c1"))
	id := h.m.Request(addReq("c2"), h.now)
	if rd := h.settle(); !rd.KickNow || len(rd.Answers) != 0 {
		t.Fatalf("short ADD: KickNow %v answers %+v, want it waiting and a round at once", rd.KickNow, rd.Answers)
	}

	// Nothing to journal: no retry, no kick, no change.
	h.m.Rebuild(nil, 1, h.now)
	h.m.ReleaseRound(h.now, false)
	if rd := h.settle(); rd.KickNow || rd.Changed || len(rd.Writes) != 0 {
		t.Fatalf("facts that change nothing: KickNow %v Changed %v writes %d, want none", rd.KickNow, rd.Changed, len(rd.Writes))
	}

	// A holding that changes, still without a free address for c2: it asks again at once.
	h.holdings(map[string]string{"v4": "10.1.0.8/32, 10.1.0.0/32"}, RecordOf{})
	rd := h.settle()
	if !rd.Changed || !rd.KickNow {
		t.Fatalf("a change that leaves the ADD short: Changed %v KickNow %v, want both", rd.Changed, rd.KickNow)
	}
	for _, a := range rd.Answers {
		if a.ID == id {
			t.Fatalf("c2 answered %+v with no usable address", a.Resp)
		}
	}
}

// A DEL's write names its attachment for host-local's files only while the node is handed back
// (the driver removes them once the write landed, before the machine hears of it).
func TestMachineDelWriteCarriesTheHandbackRelease(t *testing.T) {
	for _, handedBack := range []bool{false, true} {
		h := newMachine(t, MachineConfig{}, testV4)
		h.hold(map[string]string{"v4": "10.1.0.8/29"})
		h.add(addReq("c1"))
		if handedBack {
			mark := &ipam.HandbackMark{At: h.now, To: "host-local", Network: "net", Dir: "/var/lib/cni/networks/net"}
			id := h.m.SetHandback(mark, h.now)
			if a := mustAnswer(t, h.settle(), id); a.Err != nil {
				t.Fatal(a.Err)
			}
		}
		h.m.Request(cniproto.Request{Op: cniproto.OpDel, ContainerID: "c1", IfName: "eth0"}, h.now)
		rd := h.ready()
		if len(rd.Writes) != 1 {
			t.Fatalf("handed back %v: writes %+v, want the DEL's", handedBack, rd.Writes)
		}
		switch rel := rd.Writes[0].Release; {
		case handedBack && (rel == nil || rel.Key.ContainerID != "c1"):
			t.Fatalf("handed back: the DEL's write releases %+v, want c1's attachment", rel)
		case !handedBack && rel != nil:
			t.Fatalf("not handed back: the DEL's write releases %+v, want nothing", rel)
		}
	}
}

// Rule: after a lost journal the hold is per network. The pod network's pool leaves it once the
// runtime shows every pod's sandbox (or, with no runtime to ask, every pod reports
// status.podIPs); a secondary network's pool only once network-status names that network for
// every pod (or it has an ADD here on it). What a pod uses is attached, never freed.
func TestMachineHoldPerNetwork(t *testing.T) {
	storage := ipam.Pool{Name: "s4", Network: "storage", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.99.0.0/24")},
		Scaling: testV4.Scaling, Cooldown: time.Hour}
	webRef := ipam.PodRef{Namespace: "ns", Name: "web", UID: "uid-web"}
	status := func(p ipam.Pod) ipam.Pod { p.IPs = []netip.Addr{netip.MustParseAddr("10.1.0.8")}; return p }
	net1 := func(p ipam.Pod) ipam.Pod {
		p.Networks = []podinfo.NetworkStatus{{Name: "default/storage", Interface: "net1", IPs: []netip.Addr{netip.MustParseAddr("10.99.0.8")}}}
		return p
	}
	shown := ipam.NodeSandboxes{Known: true, Sandboxes: []ipam.RuntimeSandbox{{ID: "sb1", Pod: webRef, Ready: true,
		IPs: []netip.Addr{netip.MustParseAddr("10.1.0.8")}}}}
	for _, tc := range []struct {
		name string
		pod  ipam.Pod
		ev   ipam.NodeSandboxes
		// what stays unattributed per pool, and whether the hold is still on
		v4, s4 string
		holdOn bool
		attach []string
	}{
		{name: "no runtime, status.podIPs only: the secondary pool stays held",
			pod: status(ipam.Pod{Ref: webRef}), v4: "", s4: "10.99.0.8/30", holdOn: true, attach: []string{"v4=10.1.0.8"}},
		{name: "the runtime shows the sandbox, no status yet: eth0 attached from it",
			pod: ipam.Pod{Ref: webRef}, ev: shown, v4: "", s4: "10.99.0.8/30", holdOn: true, attach: []string{"v4=10.1.0.8"}},
		{name: "the runtime does not show the pod: the pod network stays held, whatever the status says",
			pod: status(ipam.Pod{Ref: webRef}), ev: ipam.NodeSandboxes{Known: true}, v4: "10.1.0.9-10.1.0.11", s4: "10.99.0.8/30", holdOn: true,
			attach: []string{"v4=10.1.0.8"}},
		{name: "network-status names storage: both attached, the hold ends",
			pod: net1(status(ipam.Pod{Ref: webRef})), ev: shown, v4: "", s4: "", holdOn: false, attach: []string{"s4=10.99.0.8", "v4=10.1.0.8"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Minute}, testV4, storage)
			h.hold(map[string]string{"v4": "10.1.0.8/30", "s4": "10.99.0.8/30"})
			// The journal was lost: nothing attaches, and the pod has not reported yet.
			h.m.SetPods([]ipam.Pod{{Ref: webRef}}, h.now)
			h.m.StartHold(mt0.Add(5*time.Minute), h.now)
			h.settle()
			// A reading and a pod event, as the Service carries them: the reading, the pods, the
			// rebuild (journaled), the hold.
			h.m.SetSandboxes(tc.ev, h.now)
			h.m.SetPods([]ipam.Pod{tc.pod}, h.now)
			h.m.Rebuild([]ipam.Pod{tc.pod}, 0, h.now)
			h.settle()
			h.m.EvaluateHold(h.now)
			h.settle()
			for pool, want := range map[string]string{"v4": tc.v4, "s4": tc.s4} {
				if got := h.m.st.Unattributed(pool); !got.Equal(addr.MustParseSetString(want)) {
					t.Errorf("%s unattributed %v, want %q", pool, got, want)
				}
			}
			if on, _ := h.m.st.Hold(); on != tc.holdOn {
				t.Errorf("hold on %v, want %v", on, tc.holdOn)
			}
			var got []string
			for _, k := range h.m.st.PodAttachments(webRef.UID) {
				a, _ := h.m.st.Attachment(k)
				for _, ad := range a.Addresses {
					got = append(got, ad.Pool+"="+ad.Addr.String())
				}
			}
			slices.Sort(got)
			if !slices.Equal(got, tc.attach) {
				t.Errorf("attached %v, want %v", got, tc.attach)
			}
		})
	}
}

// An ADD whose configuration names a previous IPAM whose store ipwarden writes (host-local,
// Whereabouts) carries, with its journal write, the reservation of its addresses in that store
// (Write.Reserve, which the driver makes first); it is answered only after both. When the
// previous IPAM reserved the address itself since the reading (a TakenError), nothing is handed
// out and the ADD picks again with that address out of use; any other failure of the
// reservation fails the ADD with code 11, nothing handed out. The attachment records the store,
// and its free carries the removal (Write.Unreserve) with the free's journal write.
func TestMachinePreviousReservedWithTheAddsWrite(t *testing.T) {
	hostLocal := `{"type": "host-local", "dataDir": "/var/lib/cni/networks"}`
	for _, tc := range []struct {
		name string
		prev string // the ADD's "previous"
		// outcomes of the ADD's writes, in turn (a missing one lands)
		outcomes []error
		// writes: the address each of the ADD's writes records; reserve: whether they carry
		// a reservation, and of which store
		writes  []string
		store   *ipam.PreviousStore
		wantIP  string
		wantErr uint
	}{
		{name: "no previous: the journal write alone", writes: []string{"v4=10.1.0.8"}, wantIP: "10.1.0.8/16"},
		{name: "an IPAM ipwarden does not write: the journal write alone", prev: `{"type": "calico-ipam"}`,
			writes: []string{"v4=10.1.0.8"}, wantIP: "10.1.0.8/16"},
		{name: "host-local: its directory is reserved in first", prev: hostLocal, writes: []string{"v4=10.1.0.8"},
			store: &ipam.PreviousStore{Kind: "host-local", Dir: "/var/lib/cni/networks/net"}, wantIP: "10.1.0.8/16"},
		{name: "Whereabouts: its IPPools", prev: `{"type": "whereabouts"}`, writes: []string{"v4=10.1.0.8"},
			store: &ipam.PreviousStore{Kind: "whereabouts"}, wantIP: "10.1.0.8/16"},
		{name: "taken by host-local since the reading: the ADD picks another", prev: hostLocal,
			outcomes: []error{&previous.TakenError{Kind: previous.HostLocal, Addrs: addr.MustParseSetString("10.1.0.8")}},
			writes:   []string{"v4=10.1.0.8", "v4=10.1.0.9"}, store: &ipam.PreviousStore{Kind: "host-local", Dir: "/var/lib/cni/networks/net"},
			wantIP: "10.1.0.9/16"},
		{name: "taken twice: the ADD picks a third", prev: `{"type": "whereabouts"}`,
			outcomes: []error{&previous.TakenError{Kind: previous.Whereabouts, Addrs: addr.MustParseSetString("10.1.0.8")},
				&previous.TakenError{Kind: previous.Whereabouts, Addrs: addr.MustParseSetString("10.1.0.9")}},
			writes: []string{"v4=10.1.0.8", "v4=10.1.0.9", "v4=10.1.0.10"}, store: &ipam.PreviousStore{Kind: "whereabouts"}, wantIP: "10.1.0.10/16"},
		{name: "the reservation fails: code 11, nothing handed out", prev: hostLocal,
			outcomes: []error{&ReserveError{Kind: "host-local", Err: errors.New("host-local's lock was not released in time")}},
			writes:   []string{"v4=10.1.0.8"}, store: &ipam.PreviousStore{Kind: "host-local", Dir: "/var/lib/cni/networks/net"},
			wantErr: cniproto.CodeTryAgainLater},
		{name: "the journal refuses after the reservation: code 11, nothing handed out", prev: hostLocal, outcomes: []error{errRefused},
			writes: []string{"v4=10.1.0.8"}, store: &ipam.PreviousStore{Kind: "host-local", Dir: "/var/lib/cni/networks/net"},
			wantErr: cniproto.CodeTryAgainLater},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Minute}, testV4)
			h.hold(map[string]string{"v4": "10.1.0.8-10.1.0.10"})
			req := addReq("c1")
			if tc.prev != "" {
				req.Previous = []byte(tc.prev)
			}
			id := h.m.Request(req, h.now)
			var got []string
			var a Answer
			for i := 0; ; i++ {
				rd := h.ready()
				if ans, ok := answerOf(rd, id); ok {
					a = ans
					break
				}
				ws := writesOf(rd, "c1")
				if len(ws) != 1 {
					t.Fatalf("ADD's writes %+v, want one", rd.Writes)
				}
				w := ws[0]
				got = append(got, putAddresses(w, "c1"))
				switch {
				case tc.store == nil && w.Reserve != nil:
					t.Fatalf("write %d reserves %+v, want no reservation", i, w.Reserve)
				case tc.store != nil && (w.Reserve == nil || w.Reserve.Store != *tc.store || len(w.Reserve.Reservations) != 1 ||
					"v4="+w.Reserve.Reservations[0].Addr.String() != got[i] || w.Reserve.Reservations[0].Pod != "ns/pod-c1" ||
					w.Reserve.Reservations[0].ContainerID != "c1" || w.Reserve.Reservations[0].IfName != "eth0"):
					t.Fatalf("write %d reserves %+v, want %+v for %s", i, w.Reserve, tc.store, got[i])
				}
				var out error
				if i < len(tc.outcomes) {
					out = tc.outcomes[i]
				}
				h.m.Written(w.ID, out, h.now)
			}
			if !slices.Equal(got, tc.writes) {
				t.Fatalf("the ADD's writes recorded %v, want %v", got, tc.writes)
			}
			journalRefused := slices.ContainsFunc(tc.outcomes, func(e error) bool { return e != nil && !isReserveError(e) })
			if n := testutil.ToFloat64(h.m.metrics.JournalRefused.WithLabelValues("add")); (n > 0) != journalRefused {
				t.Fatalf("journal_refused_total{change=add} = %v: only the journal's refusals count", n)
			}
			if tc.wantErr != 0 {
				if code(a) != tc.wantErr || a.Att != nil || h.attached("c1") {
					t.Fatalf("ADD answered %s, want code %d and nothing handed out", describeAnswer(a), tc.wantErr)
				}
				return
			}
			if ips(a.Resp) != tc.wantIP || a.Att == nil {
				t.Fatalf("ADD answered %s, want %s", describeAnswer(a), tc.wantIP)
			}
			att, _ := h.m.st.Attachment(ipam.Key{ContainerID: "c1", IfName: "eth0"})
			if (att.Previous == nil) != (tc.store == nil) || (tc.store != nil && *att.Previous != *tc.store) {
				t.Fatalf("the attachment records store %+v, want %+v", att.Previous, tc.store)
			}
			// The free: its journal write carries the removal from the same store.
			del := h.m.Request(delReq("c1"), h.now)
			rd := h.ready()
			mustAnswer(t, rd, del)
			ws := writesOf(rd, "c1")
			if len(ws) != 1 || ws[0].Reserve != nil {
				t.Fatalf("DEL's writes %+v", rd.Writes)
			}
			if u := ws[0].Unreserve; (u == nil) != (tc.store == nil) ||
				(u != nil && (u.Store != *tc.store || len(u.Reservations) != 1 || "v4="+u.Reservations[0].Addr.String() != tc.writes[len(tc.writes)-1])) {
				t.Fatalf("DEL's write removes %+v, want store %+v", u, tc.store)
			}
		})
	}
}

// An ADD that adopts its pod's address (rebuilt from its status: a pod that started through the
// previous IPAM) reserves it as adopted: the previous IPAM's own reservation of it is no conflict.
func TestMachinePreviousReservationOfAnAdoptedAddress(t *testing.T) {
	h := newMachine(t, MachineConfig{AddressWait: time.Minute}, testV4)
	h.hold(map[string]string{"v4": "10.1.0.8-10.1.0.10"})
	pod := ipam.Pod{Ref: ipam.PodRef{Namespace: "ns", Name: "pod-c1", UID: "uid-c1"}, IPs: []netip.Addr{netip.MustParseAddr("10.1.0.9")}}
	id := h.m.Rebuild([]ipam.Pod{pod}, 0, h.now)
	if a := mustAnswer(t, h.settle(), id); a.Err != nil || a.N != 1 {
		t.Fatalf("rebuild: %+v", a)
	}
	req := addReq("c1")
	req.Previous = []byte(`{"type": "host-local"}`)
	id = h.m.Request(req, h.now)
	rd := h.ready()
	ws := writesOf(rd, "c1")
	if len(ws) != 1 || ws[0].Reserve == nil || len(ws[0].Reserve.Reservations) != 1 {
		t.Fatalf("writes %+v", rd.Writes)
	}
	if r := ws[0].Reserve.Reservations[0]; r.Addr != netip.MustParseAddr("10.1.0.9") || !r.Adopted {
		t.Fatalf("reservation %+v, want the pod's 10.1.0.9, adopted", r)
	}
	h.m.Written(ws[0].ID, nil, h.now)
	if a := mustAnswer(t, h.ready(), id); ips(a.Resp) != "10.1.0.9/16" {
		t.Fatalf("ADD answered %s", describeAnswer(a))
	}
}

// Rule: the leak collector's conditional free of an attachment rebuilt from a pod's reports is
// refused while the runtime's reading shows a sandbox of that pod, or one with its address: a
// deleted pod is not a stopped sandbox (the simulation found the collector freeing one after its
// grace while the runtime still ran it: seed 9456292697644351092).
func TestMachineCollectorKeepsWhatTheRuntimeShows(t *testing.T) {
	webRef := ipam.PodRef{Namespace: "ns", Name: "web", UID: "uid-web"}
	addr9 := netip.MustParseAddr("10.1.0.9")
	for _, tc := range []struct {
		name  string
		ev    ipam.NodeSandboxes
		freed bool
	}{
		{"the runtime shows the pod's sandbox", ipam.NodeSandboxes{Known: true, Sandboxes: []ipam.RuntimeSandbox{{ID: "sb1", Pod: webRef, Ready: false}}}, false},
		{"the runtime shows another sandbox with the address", ipam.NodeSandboxes{Known: true, Sandboxes: []ipam.RuntimeSandbox{{ID: "sb2",
			Pod: ipam.PodRef{Namespace: "ns", Name: "other", UID: "uid-other"}, IPs: []netip.Addr{addr9}}}}, false},
		{"the runtime shows neither", ipam.NodeSandboxes{Known: true}, true},
		{"no runtime to ask", ipam.NodeSandboxes{}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Minute}, testV4)
			h.hold(map[string]string{"v4": "10.1.0.8/30"})
			pod := ipam.Pod{Ref: webRef, IPs: []netip.Addr{addr9}}
			id := h.m.Rebuild([]ipam.Pod{pod}, 0, h.now)
			if a := mustAnswer(t, h.settle(), id); a.Err != nil || a.N != 1 {
				t.Fatalf("rebuild: %+v", a)
			}
			h.m.SetSandboxes(tc.ev, h.now)
			h.settle()
			k := ipam.RebuiltKey(webRef.UID)
			id = h.m.FreeIf(k, func(ipam.Attachment) bool { return true }, h.now)
			mustAnswer(t, h.settle(), id)
			if _, kept := h.m.st.Attachment(k); kept == tc.freed {
				t.Fatalf("attachment kept %v, want freed %v", kept, tc.freed)
			}
		})
	}
}

package ipam

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// Tests of the addresses reserved ahead (ahead.go).

// aheadStart plans the ADD of cid without journaling it: the pending state an early ADD is
// answered in.
func aheadStart(h *harness, cid string, pools ...string) (Attachment, Change, error) {
	h.t.Helper()
	return h.s.Add(AddRequest{Key: key(cid), Network: "net", Pod: PodRef{"ns", cid, "uid-" + cid}, Pools: pools}, h.now)
}

// aheadConfirm journals a planned ADD and confirms it.
func aheadConfirm(h *harness, cid string, ch Change) {
	h.commit(ch)
	h.s.ConfirmAdd(key(cid))
}

// aheadStrs lists the addresses of as.
func aheadStrs(as []Address) []string {
	var out []string
	for _, a := range as {
		out = append(out, a.Addr.String())
	}
	return out
}

// aheadJournaled is the set of addresses of pool with a record reserved ahead in the journal
// model.
func aheadJournaled(h *harness, pool string) addr.Set {
	var as []netip.Addr
	for _, a := range h.snap.Ahead {
		if a.Pool == pool {
			as = append(as, a.Addr)
		}
	}
	return addr.SetOfAddrs(as...)
}

// aheadInUse is the set of addresses of pool that attachments use.
func aheadInUse(s *State, pool string) addr.Set {
	var as []netip.Addr
	for _, a := range s.Attachments() {
		for _, ad := range a.Addresses {
			if ad.Pool == pool {
				as = append(as, ad.Addr)
			}
		}
	}
	return addr.SetOfAddrs(as...)
}

// aheadSet is set, empty without items.
func aheadSet(t testing.TB, items []string) addr.Set {
	if len(items) == 0 {
		return addr.Set{}
	}
	return set(t, items...)
}

// aheadFree is the Free count of pool in the stats.
func aheadFree(h *harness, pool string) int {
	for _, st := range h.s.Stats(h.now) {
		if st.Pool == pool {
			return st.Free
		}
	}
	h.t.Fatalf("no stats for pool %s", pool)
	return 0
}

// The first ADD of a pool reserves AheadPerPool addresses ahead in its own change and is not
// early; each next ADD is answered from them (the one next would prefer: the lowest of the
// largest run), deletes the record of the address it uses and tops the reservation up.
func TestAheadAddsUseReservedAddresses(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.2/31", "10.0.0.16/30") // runs of 2 and 4
	steps := []struct {
		cid        string
		want       string
		early      bool
		deleteAhd  []string
		putAhead   []string
		aheadAfter []string // Ahead("v4") once confirmed
	}{
		{"a", "10.0.0.16", false, nil, []string{"10.0.0.17", "10.0.0.18"}, []string{"10.0.0.17-10.0.0.18"}},
		{"b", "10.0.0.17", true, []string{"10.0.0.17"}, []string{"10.0.0.19"}, []string{"10.0.0.18-10.0.0.19"}},
		{"c", "10.0.0.18", true, []string{"10.0.0.18"}, []string{"10.0.0.2"}, []string{"10.0.0.2", "10.0.0.19"}},
		// .2 is lower, but .19 is in the larger run: next would prefer it.
		{"d", "10.0.0.19", true, []string{"10.0.0.19"}, []string{"10.0.0.3"}, []string{"10.0.0.2/31"}},
		{"e", "10.0.0.2", true, []string{"10.0.0.2"}, nil, []string{"10.0.0.3"}}, // nothing left to reserve
		{"f", "10.0.0.3", true, []string{"10.0.0.3"}, nil, nil},
	}
	for _, st := range steps {
		a, ch, err := aheadStart(h, st.cid)
		if err != nil {
			t.Fatalf("ADD %s: %v", st.cid, err)
		}
		if got := aheadStrs(a.Addresses); !slices.Equal(got, []string{st.want}) {
			t.Fatalf("ADD %s got %v, want %s", st.cid, got, st.want)
		}
		if h.s.Early(key(st.cid)) != st.early {
			t.Fatalf("ADD %s: Early = %v, want %v", st.cid, !st.early, st.early)
		}
		if got := aheadStrs(ch.DeleteAhead); !slices.Equal(got, st.deleteAhd) {
			t.Fatalf("ADD %s: DeleteAhead %v, want %v", st.cid, got, st.deleteAhd)
		}
		if got := aheadStrs(ch.PutAhead); !slices.Equal(got, st.putAhead) {
			t.Fatalf("ADD %s: PutAhead %v, want %v", st.cid, got, st.putAhead)
		}
		if len(ch.PutAttachments) != 1 || ch.PutAttachments[0].Key != key(st.cid) ||
			!slices.Equal(aheadStrs(ch.PutAttachments[0].Addresses), []string{st.want}) {
			t.Fatalf("ADD %s: the change does not journal the attachment: %+v", st.cid, ch.PutAttachments)
		}
		// Reserved in the change being journaled: not usable before it is.
		for _, ad := range ch.PutAhead {
			if h.s.Ahead("v4").Contains(ad.Addr) {
				t.Fatalf("ADD %s: %s usable ahead before its record is journaled", st.cid, ad.Addr)
			}
		}
		aheadConfirm(h, st.cid, ch)
		if h.s.Early(key(st.cid)) {
			t.Fatalf("ADD %s: still early once confirmed", st.cid)
		}
		if want := aheadSet(t, st.aheadAfter); !h.s.Ahead("v4").Equal(want) {
			t.Fatalf("after ADD %s: Ahead = %v, want %v", st.cid, h.s.Ahead("v4"), want)
		}
		if !aheadJournaled(h, "v4").Equal(h.s.Ahead("v4")) {
			t.Fatalf("after ADD %s: journal records %v, Ahead %v", st.cid, aheadJournaled(h, "v4"), h.s.Ahead("v4"))
		}
	}
	var short *ShortError
	if _, err := h.add("g"); !errors.As(err, &short) {
		t.Fatalf("ADD with every address in use: %v, want a ShortError", err)
	}
}

// An ADD planned while the change reserving addresses ahead is still in flight is not answered
// from them: they are not on disk yet.
func TestAheadNotUsableBeforeJournaled(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/29")
	_, cha, err := aheadStart(h, "a")
	if err != nil || len(cha.PutAhead) != 2 {
		t.Fatalf("ADD a: %+v, %v", cha, err)
	}
	b, chb, err := aheadStart(h, "b")
	if err != nil {
		t.Fatal(err)
	}
	if h.s.Early(key("b")) {
		t.Fatal("ADD b is early while a's reservations are in flight")
	}
	for _, ad := range cha.PutAhead {
		if slices.Contains(b.Addresses, ad) {
			t.Fatalf("ADD b got %s, reserved ahead by a's change in flight", ad.Addr)
		}
	}
	if len(chb.PutAhead) != 0 || len(chb.DeleteAhead) != 0 {
		t.Fatalf("ADD b reserves %v and deletes %v; a's change already reserves %d", chb.PutAhead, chb.DeleteAhead, AheadPerPool)
	}
	// a's write is refused: its reservations are free again, b's address stays b's.
	h.s.AbortAdd(key("a"))
	aheadConfirm(h, "b", chb)
	if !h.s.Ahead("v4").IsEmpty() || len(h.snap.Ahead) != 0 {
		t.Fatalf("aborted reservations: Ahead %v, journal %v", h.s.Ahead("v4"), h.snap.Ahead)
	}
	if got := aheadFree(h, "v4"); got != 7 {
		t.Fatalf("Free = %d after a's abort, want 7 (8 held, b's in use)", got)
	}
}

// An early ADD whose journal write is refused was answered: its address is lost, out of use
// while the hold is on, adopted when its pod reports it, and its record is forgotten once the
// hold ends.
func TestAheadAbortedEarlyAddIsLost(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/29")
	h.mustAdd("a") // .8; .9 and .10 reserved ahead
	x, _, err := aheadStart(h, "x")
	if err != nil || !h.s.Early(key("x")) {
		t.Fatalf("ADD x: %v, %v; want early", x, err)
	}
	lost := x.Addresses[0].Addr
	if lost != ip("10.0.0.9") {
		t.Fatalf("ADD x got %s, want 10.0.0.9", lost)
	}
	h.s.AbortAdd(key("x")) // answered, journal refused
	if !h.s.AheadLost("v4").Equal(setOf(lost)) || h.s.LostAhead() != 1 {
		t.Fatalf("AheadLost = %v, LostAhead = %d; want %s, 1", h.s.AheadLost("v4"), h.s.LostAhead(), lost)
	}
	if h.s.Ahead("v4").Contains(lost) {
		t.Fatalf("lost %s is still usable ahead", lost)
	}
	if !aheadJournaled(h, "v4").Contains(lost) {
		t.Fatalf("the journal lost the record of %s", lost)
	}
	until := h.now.Add(time.Hour)
	if !h.s.StartLostHold(until) {
		t.Fatal("StartLostHold: no hold")
	}
	podA := Pod{Ref: PodRef{"ns", "a", "uid-a"}, IPs: []netip.Addr{ip("10.0.0.8")}}
	podX := Pod{Ref: PodRef{"ns", "x", "uid-x"}}
	h.s.SetPods([]Pod{podA, podX})
	if d := h.s.EvaluateHold(h.now); d.Release || !reflect.DeepEqual(d.Waiting, []PodRef{podX.Ref}) {
		t.Fatalf("EvaluateHold = %+v, want waiting for x", d)
	}
	if plan := h.s.PlanForgetAhead(); !plan.Change.IsEmpty() {
		t.Fatalf("PlanForgetAhead during the hold: %+v", plan.Change)
	}
	// Every other held address goes; the lost one never does.
	for i := 0; ; i++ {
		a, err := h.add(fmt.Sprint("n", i))
		if err != nil {
			var short *ShortError
			if !errors.As(err, &short) {
				t.Fatalf("ADD n%d: %v", i, err)
			}
			if i != 6 {
				t.Fatalf("%d ADDs during the hold, want 6 (8 held, a's and the lost one)", i)
			}
			break
		}
		if a.Addresses[0].Addr == lost {
			t.Fatalf("ADD n%d got the lost address %s during the hold", i, lost)
		}
	}
	// x reports its address: adopted, and the hold ends.
	podX.IPs = []netip.Addr{lost}
	pods := []Pod{podA, podX}
	h.s.SetPods(pods)
	ch, problems := h.s.Rebuild(pods, h.now)
	if len(problems) > 0 {
		t.Fatalf("rebuild problems: %v", problems)
	}
	h.commit(ch)
	if att, ok := h.s.Attachment(RebuiltKey("uid-x")); !ok || !slices.Equal(att.Addresses, []Address{{Pool: "v4", Addr: lost}}) {
		t.Fatalf("x's reported address not adopted: %+v, %v (change %+v)", att, ok, ch)
	}
	if d := h.s.EvaluateHold(h.now); !d.Release {
		t.Fatalf("EvaluateHold after x reported = %+v, want release", d)
	}
	plan := h.s.PlanForgetAhead()
	if got := aheadStrs(plan.Change.DeleteAhead); !slices.Equal(got, []string{lost.String()}) {
		t.Fatalf("PlanForgetAhead deletes %v, want [%s]", got, lost)
	}
	h.commit(plan.Change)
	h.s.Apply(plan)
	if !h.s.AheadLost("v4").IsEmpty() || h.s.LostAhead() != 0 {
		t.Fatalf("after forgetting: AheadLost %v, LostAhead %d", h.s.AheadLost("v4"), h.s.LostAhead())
	}
	if aheadJournaled(h, "v4").Contains(lost) {
		t.Fatalf("the journal still records %s reserved ahead: %v", lost, h.snap.Ahead)
	}
	if att, _ := h.s.Attachment(RebuiltKey("uid-x")); !slices.Equal(att.Addresses, []Address{{Pool: "v4", Addr: lost}}) {
		t.Fatalf("forgetting the record dropped x's address: %+v", att)
	}
	// Still x's after a restart from the journal.
	h.crash()
	if h.s.LostAhead() != 0 {
		t.Fatalf("LostAhead %d after restart", h.s.LostAhead())
	}
	if att, ok := h.s.Attachment(RebuiltKey("uid-x")); !ok || att.Addresses[0].Addr != lost {
		t.Fatalf("x's adopted address after restart: %+v, %v", att, ok)
	}
}

// After a crash every record is lost: held out of use while a pod on the node has not reported
// its addresses, then forgotten and free.
func TestAheadCrashHoldsRecordedAddresses(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/29")
	h.mustAdd("a") // .8
	h.mustAdd("b") // .9, early; .10 and .11 reserved ahead
	recorded := aheadJournaled(h, "v4")
	if !recorded.Equal(set(t, "10.0.0.10-10.0.0.11")) {
		t.Fatalf("journal records %v ahead, want 10.0.0.10-10.0.0.11", recorded)
	}
	h.crash()
	if !h.s.AheadLost("v4").Equal(recorded) || !h.s.Ahead("v4").IsEmpty() || h.s.LostAhead() != 2 {
		t.Fatalf("after the crash: AheadLost %v, Ahead %v, LostAhead %d; want every record lost",
			h.s.AheadLost("v4"), h.s.Ahead("v4"), h.s.LostAhead())
	}
	if !h.s.StartLostHold(h.now.Add(time.Hour)) {
		t.Fatal("StartLostHold: no hold")
	}
	podA := Pod{Ref: PodRef{"ns", "a", "uid-a"}, IPs: []netip.Addr{ip("10.0.0.8")}}
	podB := Pod{Ref: PodRef{"ns", "b", "uid-b"}} // has its attachment: settled
	sleepy := Pod{Ref: PodRef{"ns", "sleepy", "uid-sleepy"}}
	h.s.SetPods([]Pod{podA, podB, sleepy})
	if d := h.s.EvaluateHold(h.now); d.Release || !reflect.DeepEqual(d.Waiting, []PodRef{sleepy.Ref}) {
		t.Fatalf("EvaluateHold = %+v, want waiting for sleepy", d)
	}
	if st := h.s.Stats(h.now)[0]; st.Free != 4 || st.Unattributed != 2 {
		t.Fatalf("stats during the hold: %+v, want Free 4, Unattributed 2", st)
	}
	var got []string
	for i := 0; ; i++ {
		a, err := h.add(fmt.Sprint("n", i))
		if err != nil {
			break
		}
		if recorded.Contains(a.Addresses[0].Addr) {
			t.Fatalf("ADD n%d got %s, lost after the crash, during the hold", i, a.Addresses[0].Addr)
		}
		got = append(got, aheadStrs(a.Addresses)...)
	}
	if len(got) != 4 {
		t.Fatalf("ADDs during the hold got %v, want the 4 free addresses", got)
	}
	// sleepy is gone: the hold ends, the records go, the addresses are free.
	h.s.SetPods([]Pod{podA, podB})
	if d := h.s.EvaluateHold(h.now); !d.Release {
		t.Fatalf("EvaluateHold without sleepy = %+v, want release", d)
	}
	plan := h.s.PlanForgetAhead()
	if got := aheadStrs(plan.Change.DeleteAhead); !slices.Equal(got, []string{"10.0.0.10", "10.0.0.11"}) {
		t.Fatalf("PlanForgetAhead deletes %v", got)
	}
	h.commit(plan.Change)
	h.s.Apply(plan)
	if h.s.LostAhead() != 0 || !h.s.AheadLost("v4").IsEmpty() || !aheadJournaled(h, "v4").IsEmpty() {
		t.Fatalf("after forgetting: LostAhead %d, AheadLost %v, journal %v", h.s.LostAhead(), h.s.AheadLost("v4"), h.snap.Ahead)
	}
	if got := aheadFree(h, "v4"); got != 2 {
		t.Fatalf("Free = %d after forgetting, want 2", got)
	}
	var later []string
	for _, cid := range []string{"y", "z"} {
		later = append(later, h.mustAdd(cid)...)
	}
	slices.Sort(later)
	if !slices.Equal(later, []string{"10.0.0.10", "10.0.0.11"}) {
		t.Fatalf("ADDs after the hold got %v, want the forgotten 10.0.0.10 and 10.0.0.11", later)
	}
}

// A clean stop deletes every record: the restarted agent has nothing lost to hold, and the same
// addresses free.
func TestAheadCleanStopForgetsRecords(t *testing.T) {
	h := newHarness(t, poolV4, poolV6)
	h.hold("v4", "10.0.0.8/29")
	h.hold("v6", "fd00::10/125")
	h.mustAdd("a")
	h.mustAdd("b")
	h.del("a")
	if len(h.snap.Ahead) != 4 {
		t.Fatalf("journal records %v ahead, want 2 per pool", h.snap.Ahead)
	}
	before := h.s.Stats(h.now)
	atts := h.s.Attachments()
	h.restart()
	if len(h.snap.Ahead) != 0 {
		t.Fatalf("after a clean stop the journal records %v ahead", h.snap.Ahead)
	}
	if h.s.LostAhead() != 0 || !h.s.AheadLost("v4").IsEmpty() || !h.s.AheadLost("v6").IsEmpty() {
		t.Fatalf("after a clean stop: LostAhead %d, AheadLost %v %v", h.s.LostAhead(), h.s.AheadLost("v4"), h.s.AheadLost("v6"))
	}
	if h.s.StartLostHold(h.now.Add(time.Hour)) {
		t.Fatal("a hold after a clean stop")
	}
	after := h.s.Stats(h.now)
	for i := range before {
		if before[i].Free != after[i].Free || before[i].InUse != after[i].InUse || before[i].Cooling != after[i].Cooling {
			t.Fatalf("pool %s: stats before the stop %+v, after %+v", before[i].Pool, before[i], after[i])
		}
	}
	if !reflect.DeepEqual(atts, h.s.Attachments()) {
		t.Fatalf("attachments changed across the clean stop")
	}
	// Nothing reserved: the first ADD is not early and reserves again.
	_, ch, err := aheadStart(h, "c")
	if err != nil || h.s.Early(key("c")) || len(ch.PutAhead) != 4 {
		t.Fatalf("first ADD after the restart: early %v, PutAhead %v, %v", h.s.Early(key("c")), ch.PutAhead, err)
	}
}

// SetReserveAhead(0) (or less) turns reserving ahead off.
func TestAheadOff(t *testing.T) {
	for _, n := range []int{0, -1} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			h := newHarness(t, poolV4)
			h.s.SetReserveAhead(n)
			h.hold("v4", "10.0.0.8/29")
			for i := range 5 {
				cid := fmt.Sprint("p", i)
				_, ch, err := aheadStart(h, cid)
				if err != nil {
					t.Fatal(err)
				}
				if h.s.Early(key(cid)) || len(ch.PutAhead) != 0 || len(ch.DeleteAhead) != 0 {
					t.Fatalf("ADD %s: early %v, PutAhead %v, DeleteAhead %v", cid, h.s.Early(key(cid)), ch.PutAhead, ch.DeleteAhead)
				}
				aheadConfirm(h, cid, ch)
				if i == 2 {
					h.del("p1")
				}
			}
			if !h.s.Ahead("v4").IsEmpty() || len(h.snap.Ahead) != 0 {
				t.Fatalf("Ahead %v, journal %v", h.s.Ahead("v4"), h.snap.Ahead)
			}
		})
	}
}

// A static address that is reserved ahead goes to the pod that names it, and leaves the
// reservation: no later ADD is answered with it. While a pod bound to the node asks for it, no
// other ADD gets it either.
func TestAheadStaticTakesReservedAddress(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/29")
	h.mustAdd("a") // .8; .9 and .10 reserved ahead
	if !h.s.Ahead("v4").Equal(set(t, "10.0.0.9-10.0.0.10")) {
		t.Fatalf("Ahead = %v", h.s.Ahead("v4"))
	}
	// The static pod is bound to the node before its ADD: an ordinary ADD skips its address.
	// Another static pod wants 10.0.0.11, still free: b's change does not reserve it ahead.
	h.s.SetPods([]Pod{{Ref: PodRef{"ns", "s", "uid-s"}, IPAddresses: "10.0.0.9"}, {Ref: PodRef{"ns", "s2", "uid-s2"}, IPAddresses: "10.0.0.11"}})
	b, chb, err := aheadStart(h, "b")
	if err != nil {
		t.Fatal(err)
	}
	if b.Addresses[0].Addr != ip("10.0.0.10") || !h.s.Early(key("b")) {
		t.Fatalf("ADD b got %v (early %v), want 10.0.0.10 early: 10.0.0.9 is wanted", b.Addresses, h.s.Early(key("b")))
	}
	if got := aheadStrs(chb.PutAhead); !slices.Equal(got, []string{"10.0.0.12"}) {
		t.Fatalf("ADD b reserves %v ahead, want [10.0.0.12]: 10.0.0.9 and 10.0.0.11 are wanted", got)
	}
	aheadConfirm(h, "b", chb)
	if !h.s.Ahead("v4").Contains(ip("10.0.0.9")) {
		t.Fatalf("Ahead = %v, want 10.0.0.9 still reserved", h.s.Ahead("v4"))
	}
	s, chs, err := h.s.Add(AddRequest{Key: key("s"), Network: "net", Pod: PodRef{"ns", "s", "uid-s"},
		Meta: PodMeta{IPAddresses: "10.0.0.9", NamespaceKnown: true}}, h.now)
	if err != nil || s.Addresses[0].Addr != ip("10.0.0.9") {
		t.Fatalf("static ADD: %v, %v", s.Addresses, err)
	}
	if h.s.Ahead("v4").Contains(ip("10.0.0.9")) {
		t.Fatalf("the static address is still reserved ahead while its ADD is pending: %v", h.s.Ahead("v4"))
	}
	aheadConfirm(h, "s", chs)
	if h.s.Ahead("v4").Contains(ip("10.0.0.9")) {
		t.Fatalf("the static address is still reserved ahead: %v", h.s.Ahead("v4"))
	}
	h.s.SetPods(nil)
	for i := 0; ; i++ {
		a, err := h.add(fmt.Sprint("n", i))
		if err != nil {
			break
		}
		if a.Addresses[0].Addr == ip("10.0.0.9") {
			t.Fatalf("ADD n%d got 10.0.0.9, the static pod's", i)
		}
	}
	// A crash with the stale record: the address is the static pod's, not lost.
	h.crash()
	if h.s.LostAhead() != 0 {
		t.Fatalf("LostAhead = %d after the crash; AheadLost %v", h.s.LostAhead(), h.s.AheadLost("v4"))
	}
}

// The journal model stays consistent with the state through random ADDs, DELs and refused
// writes: an address usable ahead is recorded on disk and in no attachment; an early ADD's
// addresses are recorded on disk before its own write; after a crash every record is lost and
// nothing is usable ahead.
func TestAheadJournalConsistency(t *testing.T) {
	for seed := range 20 {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(seed), 7))
			h := newHarness(t, poolV4, poolV6)
			h.hold("v4", "10.0.0.8/29", "10.0.0.32/30")
			h.hold("v6", "fd00::10/125")
			var live []string
			check := func(step int) {
				t.Helper()
				for _, pool := range []string{"v4", "v6"} {
					ahead, used, rec := h.s.Ahead(pool), aheadInUse(h.s, pool), aheadJournaled(h, pool)
					if ahead.Overlaps(used) {
						t.Fatalf("step %d: pool %s: ahead %v overlaps in use %v", step, pool, ahead, used)
					}
					if !rec.ContainsSet(ahead) {
						t.Fatalf("step %d: pool %s: ahead %v not all recorded on disk %v", step, pool, ahead, rec)
					}
					if ahead.Overlaps(h.s.AheadLost(pool)) {
						t.Fatalf("step %d: pool %s: ahead %v overlaps lost %v", step, pool, ahead, h.s.AheadLost(pool))
					}
				}
			}
			for step := range 120 {
				h.now = h.now.Add(time.Duration(rng.IntN(20)) * time.Second)
				switch r := rng.IntN(10); {
				case r < 6 || len(live) == 0:
					cid := fmt.Sprint("c", step)
					a, ch, err := aheadStart(h, cid)
					if err != nil {
						break
					}
					if h.s.Early(key(cid)) {
						for _, ad := range a.Addresses {
							if !aheadJournaled(h, ad.Pool).Contains(ad.Addr) {
								t.Fatalf("step %d: early ADD %s answered with %v, not recorded on disk %v", step, cid, ad, h.snap.Ahead)
							}
						}
					}
					if !h.s.Early(key(cid)) && rng.IntN(8) == 0 {
						h.s.AbortAdd(key(cid))
						break
					}
					aheadConfirm(h, cid, ch)
					live = append(live, cid)
				case r < 9:
					i := rng.IntN(len(live))
					h.del(live[i])
					live = slices.Delete(live, i, i+1)
				default:
					// Cooled addresses back into the free set for a while.
					h.now = h.now.Add(time.Minute)
				}
				check(step)
			}
			h.crash()
			for _, pool := range []string{"v4", "v6"} {
				if !h.s.Ahead(pool).IsEmpty() {
					t.Fatalf("pool %s: Ahead %v after a crash", pool, h.s.Ahead(pool))
				}
				if rec := aheadJournaled(h, pool); !h.s.AheadLost(pool).Equal(rec) {
					t.Fatalf("pool %s: AheadLost %v after a crash, journal records %v", pool, h.s.AheadLost(pool), rec)
				}
				used := aheadInUse(h.s, pool)
				free := h.s.AheadLost(pool).Subtract(used)
				if count(free) > AheadPerPool {
					t.Fatalf("pool %s: %v lost and unused, more than %d", pool, free, AheadPerPool)
				}
			}
			// Nothing lost is handed out before it is forgotten.
			lost := map[string]addr.Set{"v4": h.s.AheadLost("v4").Subtract(aheadInUse(h.s, "v4")), "v6": h.s.AheadLost("v6").Subtract(aheadInUse(h.s, "v6"))}
			h.s.StartLostHold(h.now.Add(time.Hour))
			for i := 0; i < 30; i++ {
				a, err := h.add(fmt.Sprint("after", i))
				if err != nil {
					break
				}
				for _, ad := range a.Addresses {
					if lost[ad.Pool].Contains(ad.Addr) {
						t.Fatalf("ADD after the crash got %v, lost", ad)
					}
				}
			}
		})
	}
}

// A clean stop whose journal write is refused (Abort) leaves the state as it was: addresses lost
// before the stop (an early ADD answered, its write refused) stay out of use.
func TestAheadStopAbortKeepsLost(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/29")
	h.mustAdd("a") // .8; .9 and .10 reserved ahead
	if _, _, err := aheadStart(h, "x"); err != nil || !h.s.Early(key("x")) {
		t.Fatalf("ADD x: %v, early %v", err, h.s.Early(key("x")))
	}
	h.s.AbortAdd(key("x")) // .9 answered, lost
	lostBefore, aheadBefore := h.s.AheadLost("v4"), h.s.Ahead("v4")
	if !lostBefore.Equal(set(t, "10.0.0.9")) {
		t.Fatalf("AheadLost = %v", lostBefore)
	}
	plan := h.s.PlanStopAhead()
	h.s.Abort(plan) // the journal refused the deletion: every record is still on disk
	if !h.s.Ahead("v4").Equal(aheadBefore) {
		t.Errorf("Ahead = %v after the aborted stop, want %v as before", h.s.Ahead("v4"), aheadBefore)
	}
	if !h.s.AheadLost("v4").Equal(lostBefore) {
		t.Errorf("AheadLost = %v after the aborted stop, want %v as before", h.s.AheadLost("v4"), lostBefore)
	}
	for i := 0; ; i++ {
		a, err := h.add(fmt.Sprint("n", i))
		if err != nil {
			break
		}
		if a.Addresses[0].Addr == ip("10.0.0.9") {
			t.Fatalf("ADD n%d got 10.0.0.9, which x's sandbox may use", i)
		}
	}
}

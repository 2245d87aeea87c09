package ipam

import (
	"errors"
	"net/netip"
	"testing"
)

// olderJournal gives h's journal model an older agent's records of addresses reserved ahead and
// restarts from it, as after that agent crashed with them on disk.
func olderJournal(h *harness, items ...string) {
	h.t.Helper()
	var ch Change
	for _, a := range set(h.t, items...).Addrs(64) {
		ch.PutAhead = append(ch.PutAhead, Address{Pool: "v4", Addr: a})
	}
	h.commit(ch)
	h.crash()
}

// TestLostReservationsStayOutOfUse: an address an older agent recorded as reserved ahead may be
// a running sandbox's with no record of which, so no ADD, static pick, give-back or restart of
// this agent hands it out; it counts as demand and as unattributed.
func TestLostReservationsStayOutOfUse(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/29")
	olderJournal(h, "10.0.0.8", "10.0.0.9")
	if got := h.s.LostAhead(); got != 2 {
		t.Fatalf("LostAhead = %d, want 2", got)
	}
	st := h.s.Stats(h.now)[0]
	if st.Unattributed != 2 || st.Free != 6 {
		t.Fatalf("stats %+v: want unattributed 2, free 6", st)
	}
	if d := h.s.Demand("v4"); d != 2 {
		t.Fatalf("demand %d, want 2 (the lost addresses count as in use)", d)
	}
	// A static pick of a lost address is refused, not waited for.
	_, _, err := h.s.Add(AddRequest{Key: key("s"), Network: "net", Pod: PodRef{"ns", "s", "uid-s"},
		Meta: PodMeta{IPAddresses: "10.0.0.9", NamespaceKnown: true}}, h.now)
	var su *StaticUnavailableError
	if !errors.As(err, &su) {
		t.Fatalf("static ADD of a lost address: %v, want StaticUnavailableError", err)
	}
	// Every free address goes, never a lost one.
	for _, c := range []string{"a", "b", "c", "d", "e", "f"} {
		for _, got := range h.mustAdd(c) {
			if got == "10.0.0.8" || got == "10.0.0.9" {
				t.Fatalf("ADD %s got lost address %s", c, got)
			}
		}
	}
	if _, err := h.add("g"); err == nil {
		t.Fatal("ADD g succeeded: only lost addresses are left")
	}
	// Nothing in use: the node gives back free addresses, never lost ones.
	for _, c := range []string{"a", "b", "c", "d", "e", "f"} {
		h.del(c)
	}
	h.now = h.now.Add(poolV4.Cooldown * 10)
	plan := h.s.Release(h.now)
	if rel := plan.Marked["v4"]; rel.Contains(ip("10.0.0.8")) || rel.Contains(ip("10.0.0.9")) {
		t.Fatalf("released %v: lost addresses must stay", rel)
	}
	h.s.UnmarkReleasing(plan)
	// A clean stop and a restart keep them lost: their records stay on disk.
	h.restart()
	if got := h.s.LostAhead(); got != 2 {
		t.Fatalf("after a restart LostAhead = %d, want 2", got)
	}
}

// TestLostReservationAdoptedThenFreedStaysOut: a pod's status.podIPs naming a lost address is a
// hint: the rebuild records it for that pod, and when that attachment is freed the address
// is still not handed out, because the record of unknown owner remains.
func TestLostReservationAdoptedThenFreedStaysOut(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/30")
	olderJournal(h, "10.0.0.9")
	pods := []Pod{{Ref: PodRef{"ns", "p", "uid-p"}, IPs: []netip.Addr{ip("10.0.0.9")}}}
	h.s.SetPods(pods)
	ch, _ := h.s.Rebuild(pods, h.now)
	h.commit(ch)
	if _, ok := h.s.Attachment(RebuiltKey("uid-p")); !ok {
		t.Fatal("the report was not recorded")
	}
	plan, err := h.s.PlanDel(RebuiltKey("uid-p"), h.now)
	if err != nil || !plan.Found {
		t.Fatalf("free the rebuilt attachment: %v %v", plan.Found, err)
	}
	h.commit(plan.Changes())
	h.s.Apply(plan)
	h.now = h.now.Add(poolV4.Cooldown * 10)
	for _, c := range []string{"a", "b", "c"} {
		if got := h.mustAdd(c); got[0] == "10.0.0.9" {
			t.Fatalf("ADD %s got the lost address", c)
		}
	}
	if _, err := h.add("d"); err == nil {
		t.Fatal("ADD d succeeded: only the lost address is left")
	}
}

// A rebuild planned while a DEL of an attachment is in flight (answered, its write not landed)
// leaves that attachment alone, even when a pod gone from the list reports its address with the
// sandbox gone: otherwise the DEL's write, landing after the rebuild's, would record the address
// as cooling while the rebuilt attachment holds it (found by TestModelNoAddressAnsweredTwice).
func TestRebuildLeavesAnAttachmentWithADelInFlight(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/30")
	// .8 for pod uid-a (not in the pod list below: gone, or not delivered yet), whose sandbox's
	// network namespace is gone.
	_, ch, err := h.s.Add(AddRequest{Key: key("a"), Network: "net", Netns: "/run/netns/cni-a", Pod: PodRef{"ns", "a", "uid-a"}}, h.now)
	if err != nil {
		t.Fatal(err)
	}
	h.commit(ch)
	h.s.Apply(AddPlan{Key: key("a"), Change: ch})
	del, err := h.s.PlanDel(key("a"), h.now)
	if err != nil {
		t.Fatal(err)
	}
	pods := []Pod{{Ref: PodRef{"ns", "q", "uid-q"}, IPs: []netip.Addr{ip("10.0.0.8")}}}
	rb := h.s.PlanRebuild(pods, h.now, func(string) Sandbox { return SandboxGone })
	if !rb.Change.IsEmpty() {
		t.Fatalf("a rebuild during the DEL changed %+v", rb.Change)
	}
	h.s.Apply(rb)
	h.commit(del.Changes())
	h.s.Apply(del)
	// Once the DEL landed, the next rebuild may judge the report.
	if h.s.Pending(key("a")) {
		t.Fatal("the attachment is still in flight after its DEL was applied")
	}
	h.crash()
}

// A lost address the node's status no longer holds (its record rewound, say) is claimed, like an
// attachment's address, so the controller hands it to no other node.
func TestLostReservationIsClaimed(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/30")
	olderJournal(h, "10.0.0.9")
	h.hold("v4", "10.0.0.10/31")
	spec := h.s.Spec()
	if len(spec) != 1 || !spec[0].Claimed.Contains(ip("10.0.0.9")) {
		t.Fatalf("spec %+v: want 10.0.0.9 claimed", spec)
	}
}

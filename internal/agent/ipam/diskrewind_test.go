package ipam

import (
	"net/netip"
	"strings"
	"testing"
)

func TestReportWins(t *testing.T) {
	x, y := ip("10.0.0.5"), ip("10.0.0.6")
	tests := []struct {
		name       string
		owner      Pod
		ownerBound bool
		sb         Sandbox
		want       bool
	}{
		{"owner gone, its sandbox gone", Pod{}, false, SandboxGone, true},
		{"owner gone, its sandbox still exists (force delete)", Pod{}, false, SandboxExists, false},
		{"owner gone, sandbox cannot be looked at (the list may lag a new pod)", Pod{}, false, SandboxUnknown, false},
		{"owner finished, sandbox gone", Pod{IPs: []netip.Addr{x}, Finished: true}, true, SandboxGone, true},
		{"owner finished, sandbox cannot be looked at", Pod{IPs: []netip.Addr{x}, Finished: true}, true, SandboxUnknown, true},
		{"owner reports another address, old sandbox gone", Pod{IPs: []netip.Addr{y}}, true, SandboxGone, true},
		{"owner reports another address, old sandbox still there", Pod{IPs: []netip.Addr{y}}, true, SandboxExists, false},
		{"owner reports another address, sandbox cannot be looked at", Pod{IPs: []netip.Addr{y}}, true, SandboxUnknown, false},
		{"owner reports the address too", Pod{IPs: []netip.Addr{x}}, true, SandboxGone, false},
		{"owner reports it among others", Pod{IPs: []netip.Addr{y, x}}, true, SandboxGone, false},
		{"owner reports nothing yet", Pod{}, true, SandboxGone, false},
		{"owner deleting, still reporting it", Pod{IPs: []netip.Addr{x}, Deleting: true}, true, SandboxGone, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := ReportWins(x, tt.owner, tt.ownerBound, tt.sb); got != tt.want {
				t.Fatalf("ReportWins = %v, want %v", got, tt.want)
			}
		})
	}
}

// The node's disk is restored from an older snapshot: the journal attaches 10.0.0.2 to a pod
// that ended since and shows 10.0.0.4 cooling, while running pods report both. Rebuild moves
// them to the pods that report them (journaled: a restart keeps them), and no ADD gets them.
func TestRebuildAfterTheJournalRewound(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.0/28")
	a, ch0, err := h.s.Add(AddRequest{Key: key("old"), Network: "net", Netns: "/run/netns/cni-old", Pod: PodRef{"ns", "old", "uid-old"}}, h.now)
	if err != nil || a.Addresses[0].Addr != ip("10.0.0.2") {
		t.Fatalf("first ADD got %+v, %v", a, err)
	}
	h.commit(ch0)
	h.s.ConfirmAdd(key("old"))
	h.mustAdd("kept") // 10.0.0.3, its pod still runs and reports it
	h.mustAdd("cool") // 10.0.0.4, freed before the snapshot
	h.del("cool")
	h.restart() // the snapshot's journal, restored

	pods := []Pod{
		{Ref: PodRef{"ns", "new", "uid-new"}, IPs: []netip.Addr{ip("10.0.0.2")}},
		{Ref: PodRef{"ns", "kept", "uid-kept"}, IPs: []netip.Addr{ip("10.0.0.3")}},
		{Ref: PodRef{"ns", "new2", "uid-new2"}, IPs: []netip.Addr{ip("10.0.0.4")}},
		// Shows the kept pod's address too: the kept pod still reports it, so it stays.
		{Ref: PodRef{"ns", "squat", "uid-squat"}, IPs: []netip.Addr{ip("10.0.0.3")}},
	}
	gone := func(string) Sandbox { return SandboxGone } // the ended pods' namespaces are gone
	ch, problems := h.rebuildSeeing(pods, gone)
	h.commit(ch)
	if len(ch.DeleteAttachments) != 1 || ch.DeleteAttachments[0] != key("old") {
		t.Fatalf("the ended pod's attachment was not dropped: %+v", ch)
	}
	if len(ch.DeleteCooling) != 1 || ch.DeleteCooling[0].Addr != ip("10.0.0.4") {
		t.Fatalf("the cooling address was not taken out of cooling: %+v", ch)
	}
	joined := strings.Join(problems, "\n")
	if !strings.Contains(joined, "moves to ns/new") || !strings.Contains(joined, "pod ns/squat shows address 10.0.0.3") {
		t.Fatalf("problems: %v", problems)
	}
	h.restart()
	owner := map[netip.Addr]string{}
	for _, a := range h.s.Attachments() {
		for _, ad := range a.Addresses {
			owner[ad.Addr] = a.Pod.UID
		}
	}
	for a, uid := range map[string]string{"10.0.0.2": "uid-new", "10.0.0.3": "uid-kept", "10.0.0.4": "uid-new2"} {
		if owner[ip(a)] != uid {
			t.Fatalf("%s is attached to %q, want %s (%v)", a, owner[ip(a)], uid, owner)
		}
	}
	for i := range 10 {
		got := h.mustAdd("x" + string(rune('a'+i)))[0]
		if got == "10.0.0.2" || got == "10.0.0.3" || got == "10.0.0.4" {
			t.Fatalf("handed out a running pod's address: %s", got)
		}
	}
}

// A force-deleted pod whose sandbox the runtime has not stopped yet keeps its address, even when
// another pod's status shows it (a stale status from before the address came to it).
func TestRebuildNeverTakesFromALiveSandbox(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.0/28")
	_, ch, err := h.s.Add(AddRequest{Key: key("forced"), Network: "net", Netns: "/run/netns/cni-forced",
		Pod: PodRef{"ns", "forced", "uid-forced"}}, h.now)
	if err != nil {
		t.Fatal(err)
	}
	h.commit(ch)
	h.s.ConfirmAdd(key("forced"))
	pods := []Pod{{Ref: PodRef{"ns", "stale", "uid-stale"}, IPs: []netip.Addr{ip("10.0.0.2")}}}
	exists := func(netns string) Sandbox {
		if netns == "/run/netns/cni-forced" {
			return SandboxExists
		}
		return SandboxGone
	}
	ch, problems := h.rebuildSeeing(pods, exists)
	if !ch.IsEmpty() || len(problems) != 1 || !strings.Contains(problems[0], "pod ns/stale shows address 10.0.0.2") {
		t.Fatalf("rebuild = %+v, %v", ch, problems)
	}
	// Once the sandbox is gone, the report wins.
	ch, _ = h.rebuildSeeing(pods, func(string) Sandbox { return SandboxGone })
	if len(ch.DeleteAttachments) != 1 || len(ch.PutAttachments) != 1 || ch.PutAttachments[0].Pod.UID != "uid-stale" {
		t.Fatalf("rebuild after the sandbox went = %+v", ch)
	}
}

// rebuildSeeing plans a rebuild with sandbox readings and applies it.
func (h *harness) rebuildSeeing(pods []Pod, sandbox func(string) Sandbox) (Change, []string) {
	plan := h.s.PlanRebuild(pods, h.now, sandbox)
	h.s.Apply(plan)
	return plan.Change, plan.Problems
}

package ipam

import (
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"testing"
	"time"
)

func TestDecideHold(t *testing.T) {
	until := t0.Add(5 * time.Minute)
	web := PodRef{"ns", "web", "u-web"}
	db := PodRef{"ns", "db", "u-db"}
	reported := Pod{Ref: web, IPs: []netip.Addr{ip("10.0.0.13")}}
	unreported := Pod{Ref: db}
	withADD := map[string]bool{"u-db": true}
	tests := []struct {
		name    string
		pods    []Pod
		adds    map[string]bool
		now     time.Time
		release bool
		reason  string
		waiting []PodRef
	}{
		{"no pods", nil, nil, t0, true, HoldReasonAllReported, nil},
		{"every pod reported", []Pod{reported}, nil, t0, true, HoldReasonAllReported, nil},
		{"a pod has not reported", []Pod{reported, unreported}, nil, t0, false, "", []PodRef{db}},
		{"the unreported pod has an ADD here", []Pod{reported, unreported}, withADD, t0, true, HoldReasonAllReported, nil},
		{"host network pod", []Pod{{Ref: db, HostNetwork: true}}, nil, t0, true, HoldReasonAllReported, nil},
		{"finished pod", []Pod{{Ref: db, Finished: true}}, nil, t0, true, HoldReasonAllReported, nil},
		{"deleting but may still run", []Pod{{Ref: db, Deleting: true}}, nil, t0, false, "", []PodRef{db}},
		{"pod without UID cannot have an ADD", []Pod{{Ref: PodRef{"ns", "x", ""}}}, map[string]bool{"": true}, t0, false, "",
			[]PodRef{{"ns", "x", ""}}},
		{"deadline", []Pod{unreported}, nil, until, true, HoldReasonDeadline, []PodRef{db}},
		{"just before the deadline", []Pod{unreported}, nil, until.Add(-time.Nanosecond), false, "", []PodRef{db}},
		{"waiting sorted", []Pod{{Ref: db}, {Ref: PodRef{"a", "z", "u1"}}}, nil, t0, false, "", []PodRef{{"a", "z", "u1"}, db}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := DecideHold(tc.pods, func(uid string) bool { return tc.adds[uid] }, tc.now, until)
			if d.Release != tc.release || d.Reason != tc.reason || !reflect.DeepEqual(d.Waiting, tc.waiting) {
				t.Fatalf("DecideHold = %+v, want release %v reason %q waiting %v", d, tc.release, tc.reason, tc.waiting)
			}
		})
	}
}

// The lost-journal case: pod web's ADD was answered (10.0.0.8), the journal is lost before its
// status.podIPs is written. After the rebuild nothing records 10.0.0.8; the hold keeps every
// unattributed address out of use, counts it as demand (so the node asks for more), never
// releases it, serves new pods from addresses granted later, attributes web's address once web
// reports it, and frees the rest only then.
func TestHoldAfterLostJournal(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/30")
	web := PodRef{"ns", "web", "u-web"}
	// The journal is lost: a new state knows the pool and the holding, not the attachment.
	h.s = New("node-a")
	h.s.SetPools([]Pool{poolV4}, []string{"v4"})
	h.s.SetHolding("v4", set(t, "10.0.0.8/30"))
	pods := []Pod{{Ref: web}}
	h.s.SetPods(pods)
	if ch, _ := h.s.Rebuild(pods, h.now); !ch.IsEmpty() {
		t.Fatalf("rebuilt %+v from a pod without addresses", ch)
	}
	if n := h.s.StartHold(h.now.Add(5 * time.Minute)); n != 4 {
		t.Fatalf("StartHold held %d addresses, want 4", n)
	}
	if d := h.s.EvaluateHold(h.now); d.Release || !reflect.DeepEqual(d.Waiting, []PodRef{web}) {
		t.Fatalf("EvaluateHold = %+v", d)
	}
	var short *ShortError
	if _, err := h.add("other"); !errors.As(err, &short) {
		t.Fatalf("ADD during the hold: %v, want a ShortError", err)
	}
	st := h.s.Stats(h.now)[0]
	if st.Free != 0 || st.Unattributed != 4 || st.Demand < 5 {
		t.Fatalf("stats during the hold: %+v", st)
	}
	if plan := h.s.Release(h.now); len(plan.Marked) != 0 {
		t.Fatalf("released unattributed addresses: %+v", plan.Marked)
	}
	// The controller grants more: those are free at once.
	h.s.SetHolding("v4", set(t, "10.0.0.8/29"))
	if got := h.mustAdd("other"); got[0] != "10.0.0.12" {
		t.Fatalf("ADD from a new grant got %v", got)
	}
	// web reports its address: attributed, and the hold ends.
	pods = []Pod{{Ref: web, IPs: []netip.Addr{ip("10.0.0.8")}}, {Ref: PodRef{"ns", "other", "uid-other"}}}
	h.s.SetPods(pods)
	if ch, _ := h.s.Rebuild(pods, h.now); len(ch.PutAttachments) != 1 {
		t.Fatalf("rebuild after web reported: %+v", ch)
	}
	if d := h.s.EvaluateHold(h.now); !d.Release || d.Reason != HoldReasonAllReported {
		t.Fatalf("EvaluateHold = %+v", d)
	}
	if on, _ := h.s.Hold(); on {
		t.Fatal("hold still on")
	}
	for i := range 6 {
		a, err := h.add(fmt.Sprint("n", i))
		if err != nil {
			break
		}
		if a.Addresses[0].Addr == ip("10.0.0.8") {
			t.Fatal("handed out web's address")
		}
	}
}

func TestHoldEndsAtDeadlineAndNotWithoutAddresses(t *testing.T) {
	h := newHarness(t, poolV4)
	h.s.SetPods([]Pod{{Ref: PodRef{"ns", "web", "u-web"}}})
	if n := h.s.StartHold(h.now.Add(time.Minute)); n != 0 {
		t.Fatalf("held %d addresses before any holding", n)
	}
	if on, _ := h.s.Hold(); on {
		t.Fatal("a hold over nothing")
	}
	h.hold("v4", "10.0.0.8/30")
	h.s.StartHold(h.now.Add(time.Minute))
	if d := h.s.EvaluateHold(h.now.Add(59 * time.Second)); d.Release {
		t.Fatalf("released early: %+v", d)
	}
	if d := h.s.EvaluateHold(h.now.Add(time.Minute)); !d.Release || d.Reason != HoldReasonDeadline {
		t.Fatalf("at the deadline: %+v", d)
	}
	if got := h.mustAdd("a"); got[0] != "10.0.0.8" {
		t.Fatalf("after the hold got %v", got)
	}
}

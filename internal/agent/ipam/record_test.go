package ipam

import (
	"strings"
	"testing"

	"github.com/ipwarden/ipwarden/internal/addr"
)

func TestIsRewound(t *testing.T) {
	mark := RecordMark{UID: "u1", Generation: 7}
	cases := []struct {
		name string
		mark RecordMark
		uid  string
		gen  int64
		want bool
	}{
		{"no mark: new node or lost journal", RecordMark{}, "u1", 1, false},
		{"same object, same write", mark, "u1", 7, false},
		{"same object, newer write", mark, "u1", 9, false},
		{"same object, older generation: etcd restored", mark, "u1", 5, true},
		{"another object: deleted and re-created", mark, "u2", 9, true},
		{"no object identity", mark, "", 0, false},
	}
	for _, tc := range cases {
		if got := IsRewound(tc.mark, tc.uid, tc.gen); got != tc.want {
			t.Errorf("%s: IsRewound = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestSuspectAddresses(t *testing.T) {
	s := func(items ...string) addr.Set { return set(t, items...) }
	cases := []struct {
		name                                    string
		status, trusted, inUse, releasing, want addr.Set
		known                                   bool
	}{
		{"status shows what the node gave back", s("10.0.0.2-10.0.0.9"), s("10.0.0.2-10.0.0.5"), s("10.0.0.2"), s(), s("10.0.0.6-10.0.0.9"), true},
		{"status shows less: nothing suspect (claims cover it)", s("10.0.0.2"), s("10.0.0.2-10.0.0.5"), s("10.0.0.3"), s(), s(), true},
		{"in use is never suspect", s("10.0.0.2-10.0.0.3"), s(), s("10.0.0.3"), s(), s("10.0.0.2"), true},
		{"already releasing", s("10.0.0.2-10.0.0.3"), s(), s(), s("10.0.0.2"), s("10.0.0.3"), true},
		{"no trusted holding: every free address", s("10.0.0.2-10.0.0.3"), s(), s("10.0.0.2"), s(), s("10.0.0.3"), false},
	}
	for _, tc := range cases {
		if got := SuspectAddresses(tc.status, tc.trusted, tc.known, tc.inUse, tc.releasing); !got.Equal(tc.want) {
			t.Errorf("%s: got %v, want %v", tc.name, got, tc.want)
		}
	}
}

// The record rewinds: the node held .2-.9 and gave back .6-.9 (taken by the controller), then
// etcd is restored to when the status showed .2-.9 but not .10, which a pod uses. The agent
// never hands out .6-.9 again, releases them, and claims .10.
func TestDistrustAndClaimsAfterARewind(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.2-10.0.0.5", "10.0.0.10")
	mark := h.s.PlanMark(RecordMark{UID: "u1", Generation: 4})
	h.commit(mark.Changes())
	h.s.Apply(mark)
	h.mustAdd("c1") // .2
	h.s.SetHolding("v4", set(t, "10.0.0.2-10.0.0.5", "10.0.0.10"))
	// A pod takes .10 (the lowest free after .2 is .3: force .10 by taking .3-.5 first).
	h.mustAdd("c2")
	h.mustAdd("c3")
	h.mustAdd("c4")
	if got := h.mustAdd("c5"); got[0] != "10.0.0.10" {
		t.Fatalf("c5 got %v", got)
	}
	h.restart()
	rewound := set(t, "10.0.0.2-10.0.0.9")
	if !h.s.Rewound("u1", 3) {
		t.Fatal("an older generation was not seen as a rewind")
	}
	plan := h.s.PlanHoldings(map[string]addr.Set{"v4": rewound}, true, h.now)
	h.commit(plan.Changes())
	h.s.Apply(plan)
	marked := plan.Distrusted
	if !marked["v4"].Equal(set(t, "10.0.0.6-10.0.0.9")) {
		t.Fatalf("distrusted %v, want 10.0.0.6-10.0.0.9", marked["v4"])
	}
	spec := h.s.Spec()
	if len(spec) != 1 || !spec[0].Claimed.Equal(set(t, "10.0.0.10")) || !spec[0].Releasing.Equal(set(t, "10.0.0.6-10.0.0.9")) {
		t.Fatalf("spec %+v: want claimed .10, releasing .6-.9", spec)
	}
	if _, err := h.add("c6"); err == nil {
		t.Fatal("an ADD was served from the distrusted addresses")
	}
	// The journal keeps the distrust across a restart.
	h.restart()
	h.hold("v4", "10.0.0.2-10.0.0.9")
	if _, err := h.add("c7"); err == nil {
		t.Fatal("after a restart an ADD was served from the distrusted addresses")
	}
}

func TestRecordMissingHandsNothingOut(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.2-10.0.0.5")
	h.s.SetRecordMissing(true)
	if _, err := h.add("c1"); err == nil {
		t.Fatal("an ADD was served while the NodeIPAllocation is missing")
	}
	if r := h.s.Reason("v4", h.now); r == "" || !strings.Contains(r, "missing") {
		t.Fatalf("reason %q does not say the record is missing", r)
	}
	h.s.SetRecordMissing(false)
	h.mustAdd("c1")
}

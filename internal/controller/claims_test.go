package controller

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
)

func claimSpec(pool string, requested int, claimed ...string) ipwardenv1.NodeIPAllocationSpec {
	sp := spec(pool, requested)
	for _, c := range claimed {
		sp.Pools[0].Claimed = append(sp.Pools[0].Claimed, ipwardenv1.AddressBlock(c))
	}
	return sp
}

// After a rewind the node's pods use addresses its status lost: every case of who else has
// them decides whether the claim is granted, withheld, or a conflict.
func TestClaims(t *testing.T) {
	cases := []struct {
		name     string
		allocs   []ipwardenv1.NodeIPAllocation
		cooling  []string // released by some node, cooling in the record
		claim    []string // node a's claims
		request  int
		wantAdd  string // what a is granted (claims and fill)
		conflict string // addresses a claims that another node holds
	}{
		{name: "free claim granted", claim: []string{"10.0.0.5"}, request: 1, wantAdd: "10.0.0.5"},
		{name: "claim counts toward the request", claim: []string{"10.0.0.5-10.0.0.6"}, request: 2, wantAdd: "10.0.0.5-10.0.0.6"},
		{name: "cooling claim granted: a pod uses it", cooling: []string{"10.0.0.5"}, claim: []string{"10.0.0.5"}, request: 1, wantAdd: "10.0.0.5"},
		{name: "held by another node: conflict, never taken",
			allocs: []ipwardenv1.NodeIPAllocation{allocWith("b", "p", "10.0.0.5")}, claim: []string{"10.0.0.5"}, request: 0,
			wantAdd: "", conflict: "10.0.0.5"},
		{name: "already held: nothing to grant",
			allocs: []ipwardenv1.NodeIPAllocation{allocWith("a", "p", "10.0.0.5")}, claim: []string{"10.0.0.5"}, request: 1, wantAdd: ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := NewState(DefaultExhaustionMarks)
			s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/28", time.Minute)}, tc.allocs, t0)
			if len(tc.cooling) > 0 {
				b := s.PlanFill("z", claimSpec("p", 0, tc.cooling...), t0)
				s.Commit(b, t0)
				f := s.PlanFill("z", spec("p", 0, tc.cooling...), t0)
				s.Commit(f, t0)
				s.SetClaims("z", ipwardenv1.NodeIPAllocationSpec{})
			}
			f := s.PlanFill("a", claimSpec("p", tc.request, tc.claim...), t0)
			if got := f.Pools["p"].Added; !got.Equal(set(t, splitOrNone(tc.wantAdd)...)) {
				t.Fatalf("a was given %v, want %s", got, tc.wantAdd)
			}
			var conflicts addr.Set
			for _, c := range f.Conflicts {
				if c.Claimant != "a" || c.Holder != "b" {
					t.Fatalf("conflict %v names the wrong nodes", c)
				}
				conflicts = conflicts.Union(c.Addrs)
			}
			if !conflicts.Equal(set(t, splitOrNone(tc.conflict)...)) {
				t.Fatalf("conflicts %v, want %s", conflicts, tc.conflict)
			}
			s.Commit(f, t0)
			if tc.conflict != "" {
				// The holder's own sync sees the conflict too, and keeps the address.
				g := s.PlanFill("b", spec("p", 1), t0)
				if len(g.Conflicts) != 1 || !g.Pools["p"].Held.ContainsSet(set(t, tc.conflict)) {
					t.Fatalf("holder's fill: conflicts %v, held %v", g.Conflicts, g.Pools["p"].Held)
				}
				st := NodeStatus(ipwardenv1.NodeIPAllocationStatus{}, spec("p", 1), 1, g)
				if !hasCondition(st, ipwardenv1.ConditionAddressConflict) {
					t.Fatalf("holder's status lacks the AddressConflict condition: %+v", st.Conditions)
				}
				if n := len(s.Conflicts()); n != 1 {
					t.Fatalf("State.Conflicts() = %d, want 1", n)
				}
			}
		})
	}
}

func splitOrNone(s string) []string {
	if s == "" {
		return nil
	}
	return []string{s}
}

func hasCondition(st ipwardenv1.NodeIPAllocationStatus, typ string) bool {
	for _, c := range st.Conditions {
		if c.Type == typ && c.Status == "True" {
			return true
		}
	}
	return false
}

// No fill ever hands out an address another node claims, and while the controller settles
// after it started leading it fills nobody from the free pool but still grants claims.
func TestClaimedAddressesNeverFillOthersAndSettleServesClaimsFirst(t *testing.T) {
	s := NewState(DefaultExhaustionMarks)
	s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/29", time.Minute)}, []ipwardenv1.NodeIPAllocation{
		{ObjectMeta: allocWith("a", "p").ObjectMeta, Spec: claimSpec("p", 0, "10.0.0.1-10.0.0.3")},
	}, t0)
	s.SettleUntil(t0.Add(10 * time.Second))
	// b asks for everything during the settle: nothing.
	f := s.PlanFill("b", spec("p", 6), t0)
	if !f.Pools["p"].Added.IsEmpty() || f.Pools["p"].Reason == "" {
		t.Fatalf("b was filled while settling: %v (reason %q)", f.Pools["p"].Added, f.Pools["p"].Reason)
	}
	s.Abort(f, true)
	// After the settle b gets what is free, never a's claims (a has not synced yet).
	f = s.PlanFill("b", spec("p", 6), t0.Add(11*time.Second))
	if got := f.Pools["p"].Added; got.Overlaps(set(t, "10.0.0.1-10.0.0.3")) || count(got) != 3 {
		t.Fatalf("b got %v: want the 3 unclaimed addresses", got)
	}
	s.Commit(f, t0.Add(11*time.Second))
	// a's claims are granted even during a settle.
	s.SettleUntil(t0.Add(time.Hour))
	g := s.PlanFill("a", claimSpec("p", 3, "10.0.0.1-10.0.0.3"), t0.Add(12*time.Second))
	if !g.Pools["p"].Granted.Equal(set(t, "10.0.0.1-10.0.0.3")) {
		t.Fatalf("a's claims granted %v", g.Pools["p"].Granted)
	}
}

func TestNeedServesClaimsFirst(t *testing.T) {
	if !MoreUrgent(Need{Claims: 1}, Need{Deficit: 100, Surplus: 100}) {
		t.Fatal("a claim must come before any deficit")
	}
	s := NewState(DefaultExhaustionMarks)
	s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/28", time.Minute)}, nil, t0)
	if n := s.NeedOfNode("a", claimSpec("p", 0, "10.0.0.4/30")); n.Claims != 4 {
		t.Fatalf("need %+v, want 4 claims", n)
	}
}

func wantSpec(pool string, requested int, wanted ...string) ipwardenv1.NodeIPAllocationSpec {
	sp := spec(pool, requested)
	for _, w := range wanted {
		sp.Pools[0].Wanted = append(sp.Pools[0].Wanted, ipwardenv1.AddressBlock(w))
	}
	return sp
}

// A static address a node's pod wants is moved to the node when free, and refused with a stable
// reason when another node holds or claims it or the pool does not hand it out; it is never
// taken from another node, and no other node is filled with it.
func TestWanted(t *testing.T) {
	for _, tc := range []struct {
		name    string
		allocs  []ipwardenv1.NodeIPAllocation
		claimB  []string
		want    string
		wantAdd string
		refused string // the reason of the refusal, "" for none
	}{
		{name: "free: moved", want: "10.0.0.9", wantAdd: "10.0.0.9"},
		{name: "held by another node: refused, never taken", allocs: []ipwardenv1.NodeIPAllocation{allocWith("b", "p", "10.0.0.9")},
			want: "10.0.0.9", refused: "held by node b"},
		{name: "claimed by another node: refused", claimB: []string{"10.0.0.9"}, want: "10.0.0.9", refused: "used by a pod on node b"},
		{name: "network address: refused", want: "10.0.0.0", refused: "does not hand it out"},
		{name: "outside the pool: refused", want: "10.0.1.9", refused: "does not hand it out"},
		{name: "already held: nothing", allocs: []ipwardenv1.NodeIPAllocation{allocWith("a", "p", "10.0.0.9")}, want: "10.0.0.9"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewState(DefaultExhaustionMarks)
			s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/28", time.Minute)}, tc.allocs, t0)
			if len(tc.claimB) > 0 {
				s.SetClaims("b", claimSpec("p", 0, tc.claimB...))
			}
			f := s.PlanFill("a", wantSpec("p", 0, tc.want), t0)
			pf := f.Pools["p"]
			if !pf.Added.Equal(set(t, splitOrNone(tc.wantAdd)...)) {
				t.Fatalf("a was given %v, want %s", pf.Added, tc.wantAdd)
			}
			switch {
			case tc.refused == "" && len(pf.Refused) > 0:
				t.Fatalf("refused %v", pf.Refused)
			case tc.refused != "" && (len(pf.Refused) != 1 || !strings.Contains(pf.Refused[0].Reason, tc.refused)):
				t.Fatalf("refused %v, want %q", pf.Refused, tc.refused)
			}
			st := NodeStatus(ipwardenv1.NodeIPAllocationStatus{}, wantSpec("p", 0, tc.want), 1, f)
			if tc.refused != "" && (len(st.Pools) != 1 || len(st.Pools[0].Refused) != 1 || string(st.Pools[0].Refused[0].Address) != tc.want) {
				t.Fatalf("status %+v does not show the refusal", st.Pools)
			}
			s.Abort(f, true)
		})
	}

	// The holder's status asks it to give the address back; the refusal names the holder.
	{
		s := NewState(DefaultExhaustionMarks)
		s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/28", time.Minute)}, []ipwardenv1.NodeIPAllocation{allocWith("b", "p", "10.0.0.8-10.0.0.9")}, t0)
		f := s.PlanFill("a", wantSpec("p", 0, "10.0.0.9"), t0)
		if r := f.Pools["p"].Refused; len(r) != 1 || r[0].Holder != "b" {
			t.Fatalf("refused %+v, want one naming holder b", r)
		}
		s.Abort(f, true)
		fb := s.PlanFill("b", spec("p", 2), t0)
		st := NodeStatus(ipwardenv1.NodeIPAllocationStatus{}, spec("p", 2), 1, fb)
		if !fb.Pools["p"].WantedElsewhere.Equal(set(t, "10.0.0.9")) || len(st.Pools) != 1 || len(st.Pools[0].WantedElsewhere) != 1 {
			t.Fatalf("b's fill %+v, status %+v: want 10.0.0.9 wanted elsewhere", fb.Pools["p"], st.Pools)
		}
		s.Abort(fb, true)
	}

	// Another node asking for addresses is never filled with the one a wants.
	s := NewState(DefaultExhaustionMarks)
	s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/28", time.Minute)}, nil, t0)
	s.SetWanted("a", wantSpec("p", 0, "10.0.0.1"))
	f := s.PlanFill("b", spec("p", 14), t0)
	if f.Pools["p"].Added.Contains(netip.MustParseAddr("10.0.0.1")) {
		t.Fatalf("b was filled with the address a wants: %v", f.Pools["p"].Added)
	}
}

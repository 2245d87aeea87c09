package controller

import (
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
)

func TestPoolGrows(t *testing.T) {
	s := NewState(DefaultExhaustionMarks)
	known := testPool("p", "10.0.0.0/28", time.Minute)
	s.Rebuild([]ipwardenv1.IPPool{known}, nil, t0)
	excluded := testPool("p", "10.0.0.0/28", time.Minute)
	excluded.Spec.Exclude = []ipwardenv1.IPOrCIDR{"10.0.0.8/29"}
	bad := testPool("q", "not-a-cidr", time.Minute)
	for _, tc := range []struct {
		name string
		pool ipwardenv1.IPPool
		want bool
	}{
		{"unknown pool", testPool("q", "10.1.0.0/28", time.Minute), true},
		{"same addresses", known, false},
		{"more CIDRs", testPool("p", "10.0.0.0/27", time.Minute), true},
		{"fewer addresses", excluded, false},
		{"unparsable", bad, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := s.PoolGrows(&tc.pool); got != tc.want {
				t.Fatalf("PoolGrows = %v, want %v", got, tc.want)
			}
		})
	}
	// An exclusion lifted later gives addresses back: that grows the pool again.
	s.SetPool(&excluded)
	if !s.PoolGrows(&known) {
		t.Fatal("lifting an exclusion does not count as growth")
	}
}

// A pool that appears while the controller leads hands out none of its free addresses while it
// settles: a node's claims (its pods' addresses, from a previous IPAM say) are granted, nothing
// else; the settle's end, or its bound, lets fills through.
func TestPoolSettleServesClaimsOnly(t *testing.T) {
	for _, tc := range []struct {
		name    string
		at      time.Time
		end     bool
		wantAdd int // addresses a is given, the claimed 10.0.0.5 among them
		reason  string
	}{
		{name: "settling: the claim only", at: t0, wantAdd: 1, reason: "is new or grew"},
		{name: "every node reported", at: t0, end: true, wantAdd: 4},
		{name: "bound passed", at: t0.Add(time.Minute), wantAdd: 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewState(DefaultExhaustionMarks)
			s.Rebuild(nil, nil, t0)
			p := testPool("p", "10.0.0.0/28", time.Minute)
			p.UID, p.Generation = "uid-p", 1
			if !s.PoolGrows(&p) {
				t.Fatal("a new pool does not grow")
			}
			s.SetPool(&p)
			s.StartPoolSettle("p", "uid-p", 1, t0.Add(time.Minute))
			if tc.end {
				s.EndPoolSettle("p")
			}
			if got := s.PoolsSettling(); (len(got) == 1) == tc.end {
				t.Fatalf("PoolsSettling = %+v", got)
			}
			f := s.PlanFill("a", claimSpec("p", 4, "10.0.0.5"), tc.at)
			if got := f.Pools["p"].Added; count(got) != tc.wantAdd || !got.ContainsSet(set(t, "10.0.0.5")) {
				t.Fatalf("a was given %v, want %d addresses with the claimed 10.0.0.5", got, tc.wantAdd)
			}
			if r := f.Pools["p"].Reason; !strings.Contains(r, tc.reason) || (tc.reason == "" && r != "") {
				t.Fatalf("reason %q, want one naming %q", r, tc.reason)
			}
		})
	}
}

func TestPoolUnobserved(t *testing.T) {
	obs := func(name string, pools ...ipwardenv1.ObservedPool) ipwardenv1.NodeIPAllocation {
		return ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: ipwardenv1.NodeIPAllocationSpec{ObservedPools: pools}}
	}
	now := metav1.Now()
	deleting := obs("d", ipwardenv1.ObservedPool{Pool: "p", UID: "u", Generation: 2})
	deleting.DeletionTimestamp = &now
	for _, tc := range []struct {
		name   string
		allocs []ipwardenv1.NodeIPAllocation
		nodes  map[string]bool
		want   string
	}{
		{"observed at the generation", []ipwardenv1.NodeIPAllocation{obs("a", ipwardenv1.ObservedPool{Pool: "p", UID: "u", Generation: 2})}, map[string]bool{"a": true}, ""},
		{"observed later generation", []ipwardenv1.NodeIPAllocation{obs("a", ipwardenv1.ObservedPool{Pool: "p", UID: "u", Generation: 3})}, map[string]bool{"a": true}, ""},
		{"older generation", []ipwardenv1.NodeIPAllocation{obs("a", ipwardenv1.ObservedPool{Pool: "p", UID: "u", Generation: 1})}, map[string]bool{"a": true}, "a"},
		{"a pool of the same name before", []ipwardenv1.NodeIPAllocation{obs("a", ipwardenv1.ObservedPool{Pool: "p", UID: "old", Generation: 5})}, map[string]bool{"a": true}, "a"},
		{"nothing observed (an old agent)", []ipwardenv1.NodeIPAllocation{obs("a")}, map[string]bool{"a": true}, "a"},
		{"selected node without its object", nil, map[string]bool{"b": true}, "b"},
		{"object being deleted", []ipwardenv1.NodeIPAllocation{deleting}, map[string]bool{"d": true}, "d"},
		{"node gone: its object waits for deletion, not for an agent", []ipwardenv1.NodeIPAllocation{obs("gone")}, map[string]bool{}, ""},
		{"node no pool selects, no object: no agent to wait for", nil, map[string]bool{"c": false}, ""},
		{"sorted", []ipwardenv1.NodeIPAllocation{obs("z"), obs("a")}, map[string]bool{"a": true, "z": true}, "a,z"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := strings.Join(PoolUnobserved(tc.allocs, tc.nodes, "p", "u", 2), ","); got != tc.want {
				t.Fatalf("PoolUnobserved = %q, want %q", got, tc.want)
			}
		})
	}
}

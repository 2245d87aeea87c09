package controller

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/sticky"
)

func TestStickyCondition(t *testing.T) {
	for _, tc := range []struct {
		n      int
		status metav1.ConditionStatus
		reason string
	}{
		{0, metav1.ConditionFalse, "Room"},
		{3685, metav1.ConditionFalse, "Room"},
		{3686, metav1.ConditionTrue, "NearlyFull"},
		{4095, metav1.ConditionTrue, "NearlyFull"},
		{4096, metav1.ConditionTrue, "Full"},
	} {
		c := StickyCondition(tc.n, 3)
		if c.Type != ipwardenv1.ConditionStickyFull || c.Status != tc.status || c.Reason != tc.reason || c.ObservedGeneration != 3 {
			t.Errorf("StickyCondition(%d) = %+v, want %s %s", tc.n, c, tc.status, tc.reason)
		}
	}
}

// TestStickyRecordStopsAtTheLimit: a pool whose record holds MaxStickyReservations takes no
// more (its status could not carry them), keeps every one it has, and says so in StickyFull.
func TestStickyRecordStopsAtTheLimit(t *testing.T) {
	pool := testPool("p", "10.0.0.0/16", time.Minute)
	for i := range ipwardenv1.MaxStickyReservations {
		pool.Status.Sticky = append(pool.Status.Sticky, ipwardenv1.StickyAddress{
			Address:   ipwardenv1.IPAddress(netip.AddrFrom4([4]byte{10, 0, byte(128 + i/256), byte(i % 256)}).String()),
			Namespace: "ns", StatefulSet: "db", Ordinal: int32(i)})
	}
	s := NewState(DefaultExhaustionMarks)
	s.Rebuild([]ipwardenv1.IPPool{pool}, []ipwardenv1.NodeIPAllocation{allocWith("a", "p", "10.0.0.0/24")}, t0)
	sp := spec("p", 256)
	sp.Pools[0].Sticky = []ipwardenv1.StickyAddress{{Address: "10.0.0.7", Namespace: "ns", StatefulSet: "web", Ordinal: 0}}
	f := s.PlanFill("a", sp, t0)
	s.Abort(f, true)
	if n := len(s.pools["p"].sticky); n != ipwardenv1.MaxStickyReservations {
		t.Fatalf("the record holds %d reservations, want %d", n, ipwardenv1.MaxStickyReservations)
	}
	st, _ := s.PoolStatus("p", pool.Status, 1, t0)
	if len(st.Sticky) != ipwardenv1.MaxStickyReservations {
		t.Fatalf("%d reservations in the status, want %d", len(st.Sticky), ipwardenv1.MaxStickyReservations)
	}
	for _, e := range st.Sticky {
		if e.StatefulSet == "web" {
			t.Fatalf("a reservation beyond the limit was recorded: %+v", e)
		}
	}
	var full *metav1.Condition
	for i := range st.Conditions {
		if st.Conditions[i].Type == ipwardenv1.ConditionStickyFull {
			full = &st.Conditions[i]
		}
	}
	if full == nil || full.Status != metav1.ConditionTrue || full.Reason != "Full" {
		t.Fatalf("StickyFull condition %+v, want True/Full", full)
	}

	// Below the limit the same report is recorded.
	s.ReturnSticky("ns", "db", sticky.StatefulSet{Exists: false, WhenDeleted: appsv1.DeletePersistentVolumeClaimRetentionPolicyType})
	f = s.PlanFill("a", sp, t0)
	s.Abort(f, true)
	st, _ = s.PoolStatus("p", pool.Status, 1, t0)
	if len(st.Sticky) != 1 || st.Sticky[0].StatefulSet != "web" {
		t.Fatalf("after the StatefulSet db was deleted, status.sticky = %v, want only web-0", fmt.Sprint(st.Sticky))
	}
}

// stickyReport is node spec reporting that its pod web-0 (namespace ns, StatefulSet web) uses
// address a of pool p.
func stickyReport(a string) ipwardenv1.NodeIPAllocationSpec {
	sp := spec("p", 4)
	sp.Pools[0].Sticky = []ipwardenv1.StickyAddress{{Address: ipwardenv1.IPAddress(a), Namespace: "ns", StatefulSet: "web", Ordinal: 0}}
	return sp
}

// A node reports its sticky pod's address until the pod's attachment is gone, which outlives
// the StatefulSet's scale-down or deletion: the report must not re-record a reservation that
// sticky.Keep returns, or it stays forever (the real-node suite found this: after the
// StatefulSet was deleted, web-0's address stayed reserved and the node, at its maxPerNode,
// refused a Deployment pod).
func TestRecordStickyFollowsTheStatefulSetsLastView(t *testing.T) {
	del := appsv1.DeletePersistentVolumeClaimRetentionPolicyType
	cases := []struct {
		name   string
		views  []sticky.StatefulSet // ReturnSticky calls before the report, in order
		record bool
	}{
		{"StatefulSet not seen yet", nil, true},
		{"runs the ordinal", []sticky.StatefulSet{{Exists: true, Replicas: 2}}, true},
		{"scaled to zero, whenScaled Delete", []sticky.StatefulSet{{Exists: true, Replicas: 0, WhenScaled: del}}, false},
		{"scaled to zero, whenScaled Retain", []sticky.StatefulSet{{Exists: true, Replicas: 0}}, true},
		{"deleted, whenDeleted Delete", []sticky.StatefulSet{{Exists: true, Replicas: 1, WhenDeleted: del}, {Exists: false, Replicas: 1, WhenDeleted: del}}, false},
		{"deleted, whenDeleted Retain", []sticky.StatefulSet{{Exists: false, Replicas: 1}}, true},
		{"deleted, then created again", []sticky.StatefulSet{{Exists: false, Replicas: 1, WhenDeleted: del}, {Exists: true, Replicas: 1}}, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := NewState(DefaultExhaustionMarks)
			s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/28", 0)}, []ipwardenv1.NodeIPAllocation{allocWith("a", "p", "10.0.0.1-10.0.0.4")}, t0)
			for _, v := range c.views {
				s.ReturnSticky("ns", "web", v)
			}
			s.recordSticky("a", stickyReport("10.0.0.2"))
			got, recorded := s.pools["p"].sticky[sticky.Identity{Namespace: "ns", StatefulSet: "web", Ordinal: 0}]
			if recorded != c.record || (recorded && got.String() != "10.0.0.2") {
				t.Fatalf("record %v (%v), want recorded %v", got, recorded, c.record)
			}
		})
	}
}

// The sequence the real node ran: recorded, the StatefulSet deleted (whenDeleted: Delete) and
// the reservation returned, then the node, whose pod is still being torn down, reports it
// again: it stays returned, and the pool's status lists nothing.
func TestReturnedStickyStaysReturned(t *testing.T) {
	del := appsv1.DeletePersistentVolumeClaimRetentionPolicyType
	s := NewState(DefaultExhaustionMarks)
	s.Rebuild([]ipwardenv1.IPPool{testPool("p", "10.0.0.0/28", 0)}, []ipwardenv1.NodeIPAllocation{allocWith("a", "p", "10.0.0.1-10.0.0.4")}, t0)
	s.ReturnSticky("ns", "web", sticky.StatefulSet{Exists: true, Replicas: 1, WhenDeleted: del})
	s.recordSticky("a", stickyReport("10.0.0.2"))
	if len(s.pools["p"].sticky) != 1 {
		t.Fatalf("not recorded: %v", s.pools["p"].sticky)
	}
	if !s.ReturnSticky("ns", "web", sticky.StatefulSet{Exists: false, Replicas: 1, WhenDeleted: del}) {
		t.Fatal("deleting the StatefulSet returned nothing")
	}
	s.recordSticky("a", stickyReport("10.0.0.2"))
	if st := s.pools["p"].stickyStatus(); len(st) != 0 {
		t.Fatalf("the late report re-recorded %v", st)
	}
}

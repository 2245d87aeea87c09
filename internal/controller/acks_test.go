package controller

import (
	"slices"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
)

func TestUnacknowledged(t *testing.T) {
	now := metav1.Now()
	alloc := func(name, acked string, deleting bool) ipwardenv1.NodeIPAllocation {
		a := ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: ipwardenv1.NodeIPAllocationSpec{AcknowledgedLeader: acked}}
		if deleting {
			a.DeletionTimestamp = &now
		}
		return a
	}
	// Existing nodes, and whether a serving pool selects them.
	nodes := map[string]bool{"a": true, "b": true, "c": true, "d": true, "unselected": false}
	all := func(acked string) []ipwardenv1.NodeIPAllocation {
		return []ipwardenv1.NodeIPAllocation{alloc("a", acked, false), alloc("b", acked, false), alloc("c", acked, false), alloc("d", acked, false)}
	}
	for _, tc := range []struct {
		name   string
		allocs []ipwardenv1.NodeIPAllocation
		leader string
		want   []string
	}{
		{"all acknowledged", all("me"), "me", nil},
		{"previous leader's acknowledgement does not count",
			append(all("me")[2:], alloc("b", "old", false), alloc("a", "", false)), "me", []string{"a", "b"}},
		{"node gone: waits for deletion, not for an agent", append(all("me"), alloc("gone", "", false)), "me", nil},
		{"selected node without a record: deleted by hand, its pods may use addresses", all("me")[1:], "me", []string{"a"}},
		{"none at all", nil, "me", []string{"a", "b", "c", "d"}},
		{"record being deleted", append(all("me")[:3], alloc("d", "me", true)), "me", []string{"d"}},
		{"an unselected node with a record counts", append(all("me"), alloc("unselected", "", false)), "me", []string{"unselected"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Unacknowledged(tc.allocs, nodes, tc.leader); !slices.Equal(got, tc.want) {
				t.Fatalf("Unacknowledged = %v, want %v", got, tc.want)
			}
		})
	}
}

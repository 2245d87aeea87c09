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
	nodes := map[string]bool{"a": true, "b": true, "c": true, "d": true}
	exists := func(n string) bool { return nodes[n] }
	for _, tc := range []struct {
		name   string
		allocs []ipwardenv1.NodeIPAllocation
		leader string
		want   []string
	}{
		{"none", nil, "me", nil},
		{"all acknowledged", []ipwardenv1.NodeIPAllocation{alloc("a", "me", false), alloc("b", "me", false)}, "me", nil},
		{"previous leader's acknowledgement does not count",
			[]ipwardenv1.NodeIPAllocation{alloc("b", "old", false), alloc("a", "", false), alloc("c", "me", false)}, "me", []string{"a", "b"}},
		{"node gone: waits for deletion, not for an agent", []ipwardenv1.NodeIPAllocation{alloc("gone", "", false)}, "me", nil},
		{"being deleted", []ipwardenv1.NodeIPAllocation{alloc("d", "", true)}, "me", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Unacknowledged(tc.allocs, exists, tc.leader); !slices.Equal(got, tc.want) {
				t.Fatalf("Unacknowledged = %v, want %v", got, tc.want)
			}
		})
	}
}

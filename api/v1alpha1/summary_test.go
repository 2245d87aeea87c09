package v1alpha1

import "testing"

func TestSummarize(t *testing.T) {
	for _, tc := range []struct {
		name   string
		spec   NodeIPAllocationSpec
		status NodeIPAllocationStatus
		want   string
	}{
		{"empty", NodeIPAllocationSpec{}, NodeIPAllocationStatus{}, ""},
		{"requested, nothing held yet",
			NodeIPAllocationSpec{Pools: []NodePoolRequest{{Pool: "pods-v4", Requested: 32}}},
			NodeIPAllocationStatus{}, "pods-v4 0/32"},
		{"dual-stack sorted by pool",
			NodeIPAllocationSpec{Pools: []NodePoolRequest{{Pool: "pods-v6", Requested: 16}, {Pool: "pods-v4", Requested: 32}}},
			NodeIPAllocationStatus{Pools: []NodePoolStatus{{Pool: "pods-v4", Held: 32}, {Pool: "pods-v6", Held: 8}}},
			"pods-v4 32/32, pods-v6 8/16"},
		{"held from a pool no longer requested",
			NodeIPAllocationSpec{},
			NodeIPAllocationStatus{Pools: []NodePoolStatus{{Pool: "old", Held: 4}}}, "old 4/0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Summarize(tc.spec, tc.status); got != tc.want {
				t.Fatalf("Summarize = %q, want %q", got, tc.want)
			}
		})
	}
}

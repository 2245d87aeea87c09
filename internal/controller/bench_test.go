package controller

import (
	"fmt"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
)

// fleet builds the state of a 5,000-node cluster holding 150,000 addresses of one /12 pool, as
// the controller has it after a rebuild.
func fleet(b *testing.B, nodes, perNode int) (*State, map[string]ipwardenv1.NodeIPAllocationSpec) {
	b.Helper()
	pool := ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: "pods"}, Spec: ipwardenv1.IPPoolSpec{
		CIDRs:         []ipwardenv1.CIDR{"10.0.0.0/12"},
		Scaling:       ipwardenv1.Scaling{BatchSize: 16, BufferPercent: 50, MaxPerNode: 250},
		ReuseCooldown: metav1.Duration{Duration: 30 * time.Second},
	}}
	s := NewState(DefaultExhaustionMarks)
	s.Rebuild([]ipwardenv1.IPPool{pool}, nil, t0)
	specs := map[string]ipwardenv1.NodeIPAllocationSpec{}
	for i := range nodes {
		name := fmt.Sprintf("node-%05d", i)
		spec := ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "pods", Requested: int32(perNode)}}}
		f := s.PlanFill(name, spec, t0)
		s.Commit(f, t0)
		specs[name] = spec
	}
	return s, specs
}

func syncOne(s *State, name string, spec ipwardenv1.NodeIPAllocationSpec, now time.Time) {
	f := s.PlanFill(name, spec, now)
	_ = NodeStatus(ipwardenv1.NodeIPAllocationStatus{}, spec, 1, f)
	if f.Changed() {
		s.Commit(f, now)
	} else {
		s.Abort(f, true)
	}
}

// BenchmarkSyncDirtyNode is the controller's work for one dirty node at 5,000 nodes: the node
// grows by a batch, then releases it. Compare with BenchmarkSyncFullPass.
func BenchmarkSyncDirtyNode(b *testing.B) {
	s, specs := fleet(b, 5000, 30)
	name := "node-02500"
	grow := ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "pods", Requested: 46}}}
	now := t0
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		now = now.Add(time.Second)
		if i%2 == 0 {
			syncOne(s, name, grow, now)
		} else {
			h := s.HeldBy(name)["pods"]
			rel := addr.Set{}
			for _, r := range h.Ranges() {
				rel = rel.Union(addr.NewSet(r))
			}
			rel = h.Subtract(h.First(30))
			spec := specs[name]
			spec.Pools = []ipwardenv1.NodePoolRequest{{Pool: "pods", Requested: 30, Releasing: toBlocks(rel)}}
			syncOne(s, name, spec, now)
		}
	}
}

// BenchmarkSyncFullPass is one full pass over 5,000 nodes with nothing to change: the periodic
// backstop, and what a controller that scans everything on every event would pay per event.
func BenchmarkSyncFullPass(b *testing.B) {
	s, specs := fleet(b, 5000, 30)
	b.ResetTimer()
	for b.Loop() {
		for name, spec := range specs {
			syncOne(s, name, spec, t0)
		}
	}
}

func toBlocks(s addr.Set) []ipwardenv1.AddressBlock {
	var out []ipwardenv1.AddressBlock
	for _, str := range s.Strings() {
		out = append(out, ipwardenv1.AddressBlock(str))
	}
	return out
}

// BenchmarkAuditFullPass is the controller's leak-collection backstop at 5,000 nodes: compare
// every NodeIPAllocation status with the record. Event-driven work touches one node
// (BenchmarkSyncDirtyNode); this slow pass runs every --audit-period.
func BenchmarkAuditFullPass(b *testing.B) {
	s, specs := fleet(b, 5000, 30)
	allocs := make([]ipwardenv1.NodeIPAllocation, 0, len(specs))
	for name := range specs {
		a := ipwardenv1.NodeIPAllocation{}
		a.Name = name
		for pool, set := range s.HeldBy(name) {
			a.Status.Pools = append(a.Status.Pools, ipwardenv1.NodePoolStatus{Pool: pool, Addresses: set.Strings()})
		}
		allocs = append(allocs, a)
	}
	b.ResetTimer()
	for b.Loop() {
		if r := s.Audit(allocs); r.Candidates() != 0 {
			b.Fatalf("clean fleet audit found %d candidates", r.Candidates())
		}
	}
}

package sim

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// The address economy goals of docs/design.md ("Targets"), measured on the real decision code.
// Each run is short in simulated time and small in nodes so the package stays fast; the
// figures at scale are in docs/simulate.md.

// TestEconomySteadyChurn: 50 nodes, 30 pods each, one pod start per node per minute, for an
// hour: at most 1/batch API writes per pod start counting the give-back, no pod waits, a node
// at rest (no release delay running) holds at most demand + batch*(buffer+1), and node holdings
// stay in few runs (routes): a mean of at most 2 and a p99 of at most 4.
func TestEconomySteadyChurn(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Nodes = 50
	cfg.Duration = time.Hour
	res := mustRun(t, cfg)
	s := res.Summary
	if goal := 1 / float64(cfg.Scaling.BatchSize); s.APIWrites.PerPodStart > goal {
		t.Errorf("%.3f writes per pod start (agent %d, node status %d for %d starts), goal <= 1/batch = %.4f",
			s.APIWrites.PerPodStart, s.APIWrites.AgentSpec, s.APIWrites.NodeStatus, s.Pods.Started, goal)
	}
	if s.APIWrites.AgentReleases == 0 {
		t.Errorf("no give-back in an hour of churn: the test would not count its writes")
	}
	if bound := float64(cfg.Scaling.BatchSize) * 1.5; s.PerNode.SpareAtRest.Max > bound || float64(s.PerNode.SpareBound) != bound {
		t.Errorf("spare at rest %+v (bound %d), want at most batch*(buffer+1) = %v", s.PerNode.SpareAtRest, s.PerNode.SpareBound, bound)
	}
	if s.Pods.Waited != 0 || s.Pods.Failed != 0 {
		t.Errorf("pods %+v: want none waiting", s.Pods)
	}
	if s.PerNode.Runs.Mean > 2 || s.PerNode.Runs.P99 > 4 {
		t.Errorf("runs per node %+v: want a mean of at most 2 and a p99 of at most 4", s.PerNode.Runs)
	}
}

// flagClears counts the samples at which the pool's exhausted flag went from set to clear.
func flagClears(res *Result) int {
	n := 0
	for i := 1; i < len(res.Series); i++ {
		if res.Series[i-1].Exhausted && !res.Series[i].Exhausted {
			n++
		}
	}
	return n
}

// equalTrace binds perNode pods to each of nodes nodes at time 0, all running to the end.
func equalTrace(t testing.TB, nodes, perNode int) *Trace {
	var b strings.Builder
	for n := range nodes {
		for i := range perNode {
			fmt.Fprintf(&b, "0,n%02d,p%d,start\n", n, i)
		}
	}
	return mustTrace(t, b.String())
}

// TestEconomyEqualPool: 1,000 pods on 10 nodes, all bound at once, and a pool of exactly 1,000
// addresses: every pod starts. The pool runs out while nodes still hold batches beyond their
// pods; the exhausted flag makes each node hold just its demand, spares go back cooled (no
// cooldown in the pool), and the controller hands them to the nodes with waiting pods.
func TestEconomyEqualPool(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Trace = equalTrace(t, 10, 100)
	cfg.PoolSize = 1000
	cfg.Duration = 3 * time.Minute
	res := mustRun(t, cfg)
	s := res.Summary
	last := res.Series[len(res.Series)-1]
	if s.Pods.Started != 1000 || s.Pods.NeverStarted != 0 || last.Running != 1000 {
		t.Fatalf("pods %+v, %d running at the end: want all 1,000 started", s.Pods, last.Running)
	}
	if !last.Exhausted || last.Held != 1000 {
		t.Errorf("end state %+v: want the whole pool held by pods and the pool marked exhausted", last)
	}
}

// TestEconomyHeadroom: the same with 10 % headroom (1,100 addresses): no ADD waits past the
// address wait, and the exhausted flag, once set, does not flip back and forth: clearing it
// would make every node ask for its batches again (120 more than the pool has free).
func TestEconomyHeadroom(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Trace = equalTrace(t, 10, 100)
	cfg.PoolSize = 1100
	cfg.Duration = 5 * time.Minute
	res := mustRun(t, cfg)
	s := res.Summary
	if s.Pods.Failed != 0 || s.Pods.NeverStarted != 0 || s.Pods.Started != 1000 {
		t.Fatalf("pods %+v: want all 1,000 started, none past the address wait", s.Pods)
	}
	if c := flagClears(res); c > 0 {
		t.Errorf("the exhausted flag cleared %d times; want it set once and steady", c)
	}
}

// TestEconomyExhaustedFlagSteadyUnderChurn: a pool a little smaller than the nodes' batch
// targets, with churn (the simulator's old 1-2 % band against the 30 s cooldown): the flag is
// set once and stays set, and writes stay bounded.
func TestEconomyExhaustedFlagSteadyUnderChurn(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Nodes = 50
	cfg.PoolSize = 2390 // 50 nodes hold ~2,400 unconstrained
	cfg.Duration = 20 * time.Minute
	res := mustRun(t, cfg)
	flips := flagClears(res)
	s := res.Summary
	if flips > 0 {
		t.Errorf("the exhausted flag cleared %d times in 20 minutes; want it set once at most", flips)
	}
	if s.Pods.Failed != 0 || s.Pods.NeverStarted != 0 {
		t.Errorf("pods %+v: want none failed", s.Pods)
	}
	t.Logf("%.3f writes per pod start, exhausted for %.0fs, flag changes %d", s.APIWrites.PerPodStart, s.Exhaustion.ExhaustedSeconds, flips)
}

package sim

import (
	"bytes"
	"encoding/csv"
	"encoding/xml"
	"errors"
	"fmt"
	"github.com/go-logr/logr"
	"github.com/ipwarden/ipwarden/internal/controller"
	"io"
	"reflect"
	"strings"
	"testing"
	"time"
)

func mustTrace(t testing.TB, csv string) *Trace {
	t.Helper()
	tr, err := ParseTrace(strings.NewReader(csv))
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

func mustRun(t testing.TB, cfg Config) *Result {
	t.Helper()
	res, err := Run(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// steadyTrace starts n pods on node n1 at time 0 and never stops them.
func steadyTrace(t testing.TB, n int) *Trace {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "0,n1,pod-%d,start\n", i)
	}
	return mustTrace(t, b.String())
}

// TestSteadyNodeHolds48 is the worked example of the scaling formula run through the whole
// loop: batch 16, buffer 50 %, 25 pods on a node: the node holds 48 and no pod waits.
func TestSteadyNodeHolds48(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Trace = steadyTrace(t, 25)
	cfg.Duration = 2 * time.Minute
	cfg.PoolSize = 256
	res := mustRun(t, cfg)
	last := res.Series[len(res.Series)-1]
	if last.Held != 48 || last.InUse != 25 || last.Running != 25 || last.Allocated != 48 {
		t.Fatalf("end state held %d, in use %d, running %d, pool allocated %d; want 48, 25, 25, 48", last.Held, last.InUse, last.Running, last.Allocated)
	}
	s := res.Summary
	if s.Pods.Started != 25 || s.Pods.Waited != 0 || s.Pods.Failed != 0 {
		t.Errorf("pods %+v: want 25 started, none waited (their ADD comes 1s after binding, the fill ~60ms)", s.Pods)
	}
	// Binding 25 pods crosses the batch boundaries at demand 9 (32) and 25 (48): two spec
	// writes, 20 ms apart. Both reach the controller within the minimum interval after its
	// first pass over the nodes as it started leading (at 0): its next sync answers both, one
	// status write.
	if s.APIWrites.AgentSpec != 2 || s.APIWrites.NodeStatus != 1 {
		t.Errorf("writes %+v: want 2 agent spec writes and 1 node status write", s.APIWrites)
	}
	if s.PerNode.Held.Max != 48 || s.PerNode.Runs.Max != 1 {
		t.Errorf("per node %+v: want at most 48 held in one run", s.PerNode)
	}
}

// TestBurstMeetsDesignTarget: 110 pods on one node (kubelet's maximum) with batch 16: every ADD
// succeeds and the IP wait p99 stays under a second, even with no time between binding and ADD.
func TestBurstMeetsDesignTarget(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Nodes, cfg.PodsPerNode, cfg.Churn = 1, 0, 0
	cfg.Burst, cfg.BurstAt = 110, 10*time.Second
	cfg.AddDelay = 0
	cfg.Duration = time.Minute
	res := mustRun(t, cfg)
	s := res.Summary
	if s.Pods.Started != 110 || s.Pods.Failed != 0 || s.Pods.StillWaiting != 0 {
		t.Fatalf("pods %+v: want 110 started, none failed or waiting", s.Pods)
	}
	if s.Pods.WaitAll.P99 >= 1 {
		t.Errorf("IP wait p99 %gs, want < 1s", s.Pods.WaitAll.P99)
	}
	if last := res.Series[len(res.Series)-1]; last.Held != 128 {
		t.Errorf("node holds %d after the burst, want Target(110) = 128", last.Held)
	}
}

// TestTinyPoolExhausts: two nodes share a 64-address pool; a burst of 70 pods at one minute
// needs more than the pool has. The pool is marked exhausted right then, pods fail after the
// address wait, some never get an address, and the summary says when.
func TestTinyPoolExhausts(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Trace = mustTrace(t, "0,n1,a,start\n0,n2,b,start\n")
	cfg.PoolSize = 64
	cfg.Burst, cfg.BurstAt = 70, time.Minute
	cfg.Duration = 3 * time.Minute
	res := mustRun(t, cfg)
	e := res.Summary.Exhaustion
	if e.ExhaustedAt == nil || *e.ExhaustedAt < 60 || *e.ExhaustedAt > 62 {
		t.Fatalf("exhausted at %v, want just after the burst at 60s", e.ExhaustedAt)
	}
	if e.FirstStarvedFill == nil || *e.FirstStarvedFill < 60 || *e.FirstStarvedFill > *e.ExhaustedAt {
		t.Errorf("first short fill at %v, want between the burst and the exhausted mark", e.FirstStarvedFill)
	}
	if e.FirstFailedPod == nil || *e.FirstFailedPod < 70 || *e.FirstFailedPod > 72 {
		t.Errorf("first failed pod at %v, want 10s (the address wait) after the burst's ADDs", e.FirstFailedPod)
	}
	p := res.Summary.Pods
	if p.Failed == 0 || p.StillWaiting == 0 || p.Failed > p.Started {
		t.Errorf("pods %+v: want failures and pods still waiting at the end", p)
	}
	last := res.Series[len(res.Series)-1]
	if !last.Exhausted || last.Allocated != 64 || last.Held != 64 {
		t.Errorf("end state %+v: want the whole pool held and the pool marked exhausted", last)
	}
}

func TestDeterministic(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Nodes, cfg.Duration = 20, 5*time.Minute
	a, b := mustRun(t, cfg), mustRun(t, cfg)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("two runs with the same seed differ")
	}
	cfg.Seed++
	if c := mustRun(t, cfg); reflect.DeepEqual(a.Summary.Pods, c.Summary.Pods) {
		t.Fatal("runs with different seeds are identical")
	}
}

// TestColdStartQueues: 200 empty nodes ask at once; 4 workers at 20ms per write fill them
// in about a second, most urgent first, and the fill latency shows the queue.
func TestColdStartQueues(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Nodes, cfg.Start, cfg.Duration = 200, StartCold, 2*time.Minute
	cfg.ControllerResync = 0
	res := mustRun(t, cfg)
	c := res.Summary.Controller
	if c.MaxQueue < 190 {
		t.Errorf("max queue %d, want about 200 (every node asks at once)", c.MaxQueue)
	}
	// 200+ fills / 4 workers * 20 ms = ~1 s, plus the watch delays.
	if c.FillLatency.Max < 0.9 || c.FillLatency.Max > 5 {
		t.Errorf("fill latency %+v, want the slowest around 1-2s", c.FillLatency)
	}
	if res.Summary.Pods.Started < 200*25 {
		t.Errorf("started %d pods, want the initial ~30 per node", res.Summary.Pods.Started)
	}
}

func TestTraceStopsFreeAddresses(t *testing.T) {
	cfg := DefaultConfig()
	var b strings.Builder
	for i := range 40 {
		fmt.Fprintf(&b, "%d,n1,p%d,start\n", i, i)
	}
	for i := range 40 {
		fmt.Fprintf(&b, "%d,n1,p%d,stop\n", 100+i, i)
	}
	cfg.Trace = mustTrace(t, b.String())
	cfg.Duration = 7 * time.Minute
	res := mustRun(t, cfg)
	if got := res.Summary.Pods.Started; got != 40 {
		t.Fatalf("started %d, want 40", got)
	}
	// The last pod stops at 2m19s and its address cools until 2m49s; from then on the node
	// holds 48 for no demand, beyond Keep(0) = 24, and gives back only after the release
	// delay (3m): at 5m it still holds 48.
	for _, smp := range res.Series {
		if smp.At == 5*time.Minute && (smp.Held != 48 || smp.Running != 0) {
			t.Fatalf("at 5m %+v: want 48 held (the release delay runs), no pods", smp)
		}
	}
	last := res.Series[len(res.Series)-1]
	// After the delay the node is back to Target(0) = 16 in one run, nothing cooling in the
	// pool: the addresses it gave back had cooled on the node (releasingCooled).
	if last.Running != 0 || last.Held != 16 || last.Cooling != 0 || last.Allocated != 16 {
		t.Fatalf("end state %+v: want no pods, 16 held and allocated, nothing cooling", last)
	}
}

func TestWriters(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Trace = mustTrace(t, "0,n1,a,start\n0,n2,b,start\n")
	cfg.PoolSize, cfg.Burst, cfg.BurstAt, cfg.Duration = 64, 70, 30*time.Second, 2*time.Minute
	res := mustRun(t, cfg)

	var svg bytes.Buffer
	if err := WriteSVG(&svg, res.Summary, res.Series); err != nil {
		t.Fatal(err)
	}
	checkXML(t, svg.Bytes())
	if !strings.Contains(svg.String(), colExhausted) {
		t.Error("the chart does not shade the exhausted period")
	}
	var empty bytes.Buffer
	if err := WriteSVG(&empty, Summary{}, nil); err != nil {
		t.Fatal(err)
	}
	checkXML(t, empty.Bytes())

	var out bytes.Buffer
	if err := WriteCSV(&out, res.Series); err != nil {
		t.Fatal(err)
	}
	rows, err := csv.NewReader(&out).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != len(res.Series)+1 || !reflect.DeepEqual(rows[0], SeriesHeader) || len(rows[1]) != len(SeriesHeader) {
		t.Errorf("series.csv: %d rows, header %v", len(rows), rows[0])
	}
	if want := 14; len(rows) != want {
		t.Errorf("series.csv has %d rows, want a header and samples at 0, 10, ..., 120s", len(rows))
	}

	var text bytes.Buffer
	if err := WriteText(&text, res.Summary); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"addresses per node", "held", "failed (waited over 10s", "API writes", "pool marked exhausted at 31"} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("text summary lacks %q:\n%s", want, text.String())
		}
	}
}

// checkXML fails unless b is one well-formed XML document with an svg root.
func checkXML(t *testing.T, b []byte) {
	t.Helper()
	d := xml.NewDecoder(bytes.NewReader(b))
	depth, root := 0, ""
	for {
		tok, err := d.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("chart is not well-formed XML: %v", err)
		}
		switch el := tok.(type) {
		case xml.StartElement:
			if depth == 0 {
				if root != "" {
					t.Fatal("chart has two root elements")
				}
				root = el.Name.Local
			}
			depth++
		case xml.EndElement:
			depth--
		}
	}
	if root != "svg" || depth != 0 {
		t.Fatalf("root %q, depth %d at the end: want one svg element", root, depth)
	}
}

// BenchmarkRun times whole simulations; the 5000-node hour is the one docs/design.md quotes.
// go test -run '^$' -bench BenchmarkRun -benchtime 1x ./internal/sim/
func BenchmarkRun(b *testing.B) {
	for _, bc := range []struct {
		name  string
		nodes int
		dur   time.Duration
	}{
		{"500nodes-10m", 500, 10 * time.Minute},
		{"5000nodes-1h", 5000, time.Hour},
	} {
		b.Run(bc.name, func(b *testing.B) {
			cfg := DefaultConfig()
			cfg.Nodes, cfg.Duration, cfg.PoolSize = bc.nodes, bc.dur, 1<<20
			var events int
			for b.Loop() {
				res := mustRun(b, cfg)
				events = res.Summary.Pods.Started
			}
			b.ReportMetric(bc.dur.Seconds()*float64(b.N)/b.Elapsed().Seconds(), "sim-s/s")
			b.ReportMetric(float64(events), "pod-starts")
		})
	}
}

// The simulator is a driver of the controller's machine and decides nothing itself: a fresh
// machine fed the inputs the simulator gave (informer events, the clock, the outcomes of the
// writes) asks for exactly the writes the simulator performed. internal/controller checks the
// same of Controller.run, the machine's driver on the API server.
func TestSimulateDrivesTheControllersMachine(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Nodes, cfg.Duration, cfg.PoolSize = 30, 5*time.Minute, 30*40 // near exhaustion: take-backs, cooling, the flag
	var m *controller.Machine
	cfg.onMachine = func(x *controller.Machine) { m = x; m.Record() }
	res := mustRun(t, cfg)
	issued := m.Issued()
	kinds := map[controller.OpKind]int{}
	for _, op := range issued {
		kinds[op.Kind]++
	}
	if kinds[controller.OpNodeStatus] == 0 || kinds[controller.OpPoolStatus] == 0 || res.Summary.APIWrites.NodeStatus == 0 {
		t.Fatalf("the run wrote %v (summary %+v): want node and pool statuses", kinds, res.Summary.APIWrites)
	}
	replayed, err := controller.Replay(controller.NewMachine(m.Options(), controller.NewMetrics(nil), logr.Discard()), m.Script())
	if err != nil {
		t.Fatal(err)
	}
	if err := controller.SameOps(issued, replayed); err != nil {
		t.Fatalf("the simulator's writes and the machine's differ: %v", err)
	}
}

package sim

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// WriteText prints a short human summary of a run.
func WriteText(w io.Writer, s Summary) error {
	var b strings.Builder
	sc := s.Scenario
	nodes := "nodes"
	if sc.Nodes == 1 {
		nodes = "node"
	}
	fmt.Fprintf(&b, "ipwarden simulate: %d %s, %s simulated, %s start\n", sc.Nodes, nodes, fmtSecs(sc.DurationSeconds), sc.Start)
	if sc.TraceEvents > 0 {
		fmt.Fprintf(&b, "  workload   trace of %d events", sc.TraceEvents)
	} else {
		fmt.Fprintf(&b, "  workload   %g pods per node, %g pod starts per node per minute", sc.PodsPerNode, sc.ChurnPerNodePerMinute)
	}
	if sc.Burst > 0 {
		fmt.Fprintf(&b, ", burst of %d pods on one node at %s", sc.Burst, fmtSecs(sc.BurstAtSeconds))
	}
	b.WriteString("\n")
	pool := strings.Join(sc.PoolCIDRs, ",")
	if len(sc.PoolExclude) > 0 {
		pool += " minus " + strings.Join(sc.PoolExclude, ",")
	}
	fmt.Fprintf(&b, "  pool       %d addresses (%s), batch %d, buffer %d%%, maxPerNode %d, reuse cooldown %s\n",
		s.Pool.Capacity, pool, sc.BatchSize, sc.BufferPercent, sc.MaxPerNode, fmtSecs(sc.ReuseCooldownSeconds))
	fmt.Fprintf(&b, "             give back beyond demand + %d (release slack %d%%) after %s\n",
		s.PerNode.SpareBound, sc.ReleaseSlackPercent, fmtSecs(sc.ReleaseDelaySeconds))
	qps := "no write limit"
	if sc.KubeAPIQPS > 0 {
		qps = fmt.Sprintf("%g writes/s (burst %d)", sc.KubeAPIQPS, sc.KubeAPIBurst)
	}
	fmt.Fprintf(&b, "  API        controller: %d workers, %s per status write, %s; agent: %s per spec write; %s watch delay\n\n",
		sc.ControllerWorkers, fmtSecs(sc.ControllerLatencySeconds), qps, fmtSecs(sc.AgentLatencySeconds), fmtSecs(sc.WatchDelaySeconds))

	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "addresses per node\tmean\tp50\tp99\tmax\t")
	row := func(name string, st Stats) {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t\n", name, num(st.Mean), num(st.P50), num(st.P99), num(st.Max))
	}
	row("held", s.PerNode.Held)
	row("used by pods", s.PerNode.Used)
	row("idle (held - used)", s.PerNode.Idle)
	row(fmt.Sprintf("spare (held - demand; bound %d)", s.PerNode.SpareBound), s.PerNode.Spare)
	row("spare at rest (no release delay running)", s.PerNode.SpareAtRest)
	row("address runs (routes)", s.PerNode.Runs)
	if err := tw.Flush(); err != nil {
		return err
	}
	b.WriteString("\n")

	fmt.Fprintf(&b, "pool          allocated mean %s (%s%%), peak %s%%; in use %s%% of the pool, %s%% of what nodes hold\n",
		num(s.Pool.Allocated.Mean), num(s.Pool.AllocatedPercent), num(s.Pool.PeakAllocatedPercent),
		num(s.Pool.InUsePercent), num(s.Pool.UsedOfHeldPercent))
	fmt.Fprintf(&b, "pods          %d started, %d waited for an address (%s%%)", s.Pods.Started, s.Pods.Waited, num(s.Pods.WaitedPercent))
	if s.Pods.Waited > 0 {
		fmt.Fprintf(&b, ": wait p50 %s, p99 %s, max %s", fmtSecs(s.Pods.Wait.P50), fmtSecs(s.Pods.Wait.P99), fmtSecs(s.Pods.Wait.Max))
	}
	b.WriteString("\n")
	fmt.Fprintf(&b, "              %d failed (waited over %s: CNI error 11)", s.Pods.Failed, fmtSecs(sc.AddressWaitSeconds))
	fmt.Fprintf(&b, "; %d never started", s.Pods.NeverStarted)
	if s.Pods.StillWaiting > 0 {
		fmt.Fprintf(&b, " (%d still waiting at the end)", s.Pods.StillWaiting)
	}
	b.WriteString("\n")
	wr := s.APIWrites
	fmt.Fprintf(&b, "API writes    %s/s: agent spec %s/s, node status %s/s, pool status %s/s\n",
		num(wr.PerSecond), num(wr.AgentPerSecond), num(wr.NodeStatusPerSecond), num(wr.PoolStatusPerSecond))
	fmt.Fprintf(&b, "              per pod start, give-back included: %s agent and node status (target <= 1/batch = %s), %s with pool status\n",
		num(wr.PerPodStart), num(round3(1/float64(max(sc.BatchSize, 1)))), num(wr.PerPodStartAll))
	fmt.Fprintf(&b, "              agent writes: %d raise the request, %d release addresses, %d lower it or clear released ones\n",
		wr.AgentRaises, wr.AgentReleases, wr.AgentSpec-wr.AgentRaises-wr.AgentReleases)
	c := s.Controller
	fmt.Fprintf(&b, "controller    request to fill p50 %s, p99 %s, max %s; %d fills, queue max %d\n",
		fmtSecs(c.FillLatency.P50), fmtSecs(c.FillLatency.P99), fmtSecs(c.FillLatency.Max), c.Fills, c.MaxQueue)
	e := s.Exhaustion
	if e.ExhaustedAt == nil && e.FirstStarvedFill == nil {
		b.WriteString("exhaustion    never\n")
	} else {
		b.WriteString("exhaustion    ")
		var parts []string
		if e.ExhaustedAt != nil {
			parts = append(parts, fmt.Sprintf("pool marked exhausted at %s (for %s in all)", fmtSecs(*e.ExhaustedAt), fmtSecs(e.ExhaustedSeconds)))
		}
		if e.FirstStarvedFill != nil {
			parts = append(parts, "first short fill at "+fmtSecs(*e.FirstStarvedFill))
		}
		if e.FirstFailedPod != nil {
			parts = append(parts, "first failed pod at "+fmtSecs(*e.FirstFailedPod))
		}
		b.WriteString(strings.Join(parts, "; ") + "\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// num prints a number without needless decimals.
func num(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }

// fmtSecs prints seconds as a short duration: 850ms, 12.5s, 3m20s.
func fmtSecs(v float64) string {
	d := time.Duration(v * float64(time.Second))
	switch {
	case d == 0:
		return "0s"
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return d.Round(10 * time.Millisecond).String()
	default:
		return d.Round(time.Second).String()
	}
}

// WriteJSON prints the summary as indented JSON.
func WriteJSON(w io.Writer, s Summary) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(s)
}

// SeriesHeader is the header row of series.csv.
var SeriesHeader = []string{
	"time_seconds", "pool_capacity", "pool_allocated", "nodes_held", "in_use", "pool_cooling",
	"pods_running", "pods_waiting", "pods_failed_total", "pool_exhausted", "controller_queue",
	"agent_spec_writes_total", "node_status_writes_total", "pool_status_writes_total",
}

// WriteCSV writes the time series, one row per sample (see SeriesHeader).
func WriteCSV(w io.Writer, series []Sample) error {
	cw := csv.NewWriter(w)
	if err := cw.Write(SeriesHeader); err != nil {
		return err
	}
	i := func(v int64) string { return strconv.FormatInt(v, 10) }
	for _, s := range series {
		ex := "0"
		if s.Exhausted {
			ex = "1"
		}
		if err := cw.Write([]string{
			num(round3(s.At.Seconds())), i(s.Capacity), i(s.Allocated), i(s.Held), i(s.InUse), i(s.Cooling),
			i(int64(s.Running)), i(int64(s.Waiting)), i(int64(s.FailedTotal)), ex, i(int64(s.Queue)),
			i(s.AgentWrites), i(s.NodeStatusWrites), i(s.PoolStatusWrites),
		}); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

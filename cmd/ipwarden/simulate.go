package main

import (
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/ipwarden/ipwarden/internal/sim"
)

// simulateFlags are the raw flag values of ipwarden simulate.
type simulateFlags struct {
	cfg       sim.Config
	poolCIDRs []string
	start     string
	trace     string
	outputDir string
	output    string
}

func newSimulateCommand() *cobra.Command {
	f := &simulateFlags{cfg: sim.DefaultConfig()}
	f.start = string(f.cfg.Start)
	cmd := &cobra.Command{
		Use:   "simulate",
		Short: "Capacity planner: simulate a cluster's pods, agents and controller to choose batch and buffer",
		Long: `simulate runs ipwarden's real decision code (the agent's allocation state machine and
scaling, the controller's fill, take-back, scheduling and exhaustion logic, the address
allocator with reuse cooldown) under a virtual clock, with no API server and no waiting: an hour
of a 5,000-node cluster takes seconds. Use it to choose an IPPool's batchSize, bufferPercent and
maxPerNode, and the pool's size, for your node count and pod churn.

It reports addresses held against used per node, the pool's utilization, pods that waited for
an address and for how long, pods that failed (waited over --address-wait: CNI error 11), API
writes per second and per pod start, the controller's request-to-fill latency, and when the pool
ran out. --output-dir also writes series.csv, summary.json and chart.svg (open it in a browser).

Workload: Poisson pod starts per node (--churn per minute) with exponential lifetimes that
keep about --pods-per-node pods running, plus an optional --burst; or a --trace file:
  ` + strings.ReplaceAll(sim.TraceFormat, "\n", "\n  ") + `

See docs/simulate.md for worked examples.`,
		Example: `  # the default pool settings on a 5,000-node cluster with a /14 pool
  ipwarden simulate --nodes 5000 --pods-per-node 30 --churn 1 --pool-cidr 10.0.0.0/14

  # compare batch sizes; write a chart
  ipwarden simulate --nodes 5000 --batch-size 32 --output-dir /tmp/b32

  # 110 pods landing on one node at once (kubelet's maximum)
  ipwarden simulate --nodes 1 --churn 0 --pods-per-node 0 --burst 110 --add-delay 0s --duration 1m

  # replay a recorded workload
  ipwarden simulate --trace pods.csv --pool-cidr 10.0.0.0/16`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := f.config(cmd)
			if err != nil {
				return err
			}
			if f.output != "text" && f.output != "json" {
				return fmt.Errorf("-o %q: use text or json", f.output)
			}
			began := time.Now()
			res, err := sim.Run(cfg)
			if err != nil {
				return err
			}
			took := time.Since(began)
			out := cmd.OutOrStdout()
			notes := out
			if f.output == "json" {
				if err := sim.WriteJSON(out, res.Summary); err != nil {
					return err
				}
				notes = cmd.ErrOrStderr()
			} else {
				if err := sim.WriteText(out, res.Summary); err != nil {
					return err
				}
				fmt.Fprintf(out, "\nsimulated %s in %s\n", cfg.Duration, took.Round(10*time.Millisecond))
			}
			if f.outputDir != "" {
				files, err := writeSimulation(f.outputDir, res)
				if err != nil {
					return err
				}
				fmt.Fprintf(notes, "wrote %s\n", strings.Join(files, ", "))
			}
			return nil
		},
	}
	fl := cmd.Flags()
	c := &f.cfg
	fl.IntVar(&c.Nodes, "nodes", c.Nodes, "number of nodes")
	fl.Float64Var(&c.PodsPerNode, "pods-per-node", c.PodsPerNode, "mean number of pods running on a node in steady state")
	fl.Float64Var(&c.Churn, "churn", c.Churn, "pod starts per node per minute (pods live pods-per-node/churn minutes on average)")
	fl.StringSliceVar(&f.poolCIDRs, "pool-cidr", nil, "the pool's CIDRs, comma-separated or repeated (instead of --pool-size)")
	fl.IntVar(&c.PoolSize, "pool-size", c.PoolSize, "the pool's size in addresses, carved from 10.0.0.0/8 (instead of --pool-cidr)")
	fl.IntVar(&c.Scaling.BatchSize, "batch-size", c.Scaling.BatchSize, "IPPool spec.scaling.batchSize: a node's holding grows and shrinks in steps of this size")
	fl.IntVar(&c.Scaling.BufferPercent, "buffer-percent", c.Scaling.BufferPercent, "IPPool spec.scaling.bufferPercent: share of a batch kept spare beyond demand")
	fl.IntVar(&c.Scaling.MaxPerNode, "max-per-node", c.Scaling.MaxPerNode, "IPPool spec.scaling.maxPerNode: most addresses one node holds")
	fl.IntVar(&c.Scaling.ReleaseSlackPercent, "release-slack-percent", c.Scaling.ReleaseSlackPercent, "IPPool spec.scaling.releaseSlackPercent: give back only beyond demand + batch*(buffer+slack)")
	fl.DurationVar(&c.Scaling.ReleaseDelay, "release-delay", c.Scaling.ReleaseDelay, "IPPool spec.scaling.releaseDelay: how long a node holds more than that before it gives back")
	fl.DurationVar(&c.ReuseCooldown, "reuse-cooldown", c.ReuseCooldown, "IPPool spec.reuseCooldown: how long a freed address rests before reuse")
	fl.IntVar(&c.ControllerWorkers, "controller-workers", c.ControllerWorkers, "the controller's --workers: node syncs in parallel")
	fl.DurationVar(&c.ControllerLatency, "controller-latency", c.ControllerLatency, "how long one status write of the controller takes (its worker is busy meanwhile)")
	fl.Float64Var(&c.KubeAPIQPS, "kube-api-qps", c.KubeAPIQPS, "the controller's --kube-api-qps: its writes per second to the API server (0: no limit)")
	fl.IntVar(&c.KubeAPIBurst, "kube-api-burst", c.KubeAPIBurst, "the controller's --kube-api-burst")
	fl.DurationVar(&c.WatchDelay, "watch-delay", c.WatchDelay, "time from a write until the other side's informer sees it")
	fl.DurationVar(&c.MinSyncInterval, "min-sync-interval", c.MinSyncInterval, "the controller's --min-sync-interval")
	fl.DurationVar(&c.ControllerResync, "controller-resync", c.ControllerResync, "the controller's --resync-period (0 disables the full pass)")
	fl.DurationVar(&c.PoolStatusInterval, "pool-status-interval", c.PoolStatusInterval, "the controller's --pool-status-interval")
	fl.DurationVar(&c.AgentLatency, "agent-latency", c.AgentLatency, "how long an agent's spec write takes (changes meanwhile coalesce into its next write)")
	fl.DurationVar(&c.AgentResync, "agent-resync", c.AgentResync, "longest time between two recomputations of a node's request by its agent")
	fl.DurationVar(&c.AddDelay, "add-delay", c.AddDelay, "time from a pod's binding to its CNI ADD (the agent counts the pod as demand from its binding)")
	fl.DurationVar(&c.AddressWait, "address-wait", c.AddressWait, "the agent's --address-wait: an ADD waiting longer fails with CNI error 11 (the pod counts as failed)")
	fl.DurationVar(&c.Duration, "duration", c.Duration, "simulated time (with --trace: the trace's last event plus 1m unless given)")
	fl.DurationVar(&c.SampleInterval, "sample-interval", c.SampleInterval, "time between two rows of series.csv and points of chart.svg")
	fl.Uint64Var(&c.Seed, "seed", c.Seed, "random seed: the same flags and seed give the same run")
	fl.StringVar(&f.start, "start", f.start, "warm: nodes already run their pods and hold their addresses; cold: nothing is held and every initial pod starts at time 0")
	fl.IntVar(&c.Burst, "burst", 0, "number of pods bound to one node at --burst-at, running to the end")
	fl.DurationVar(&c.BurstAt, "burst-at", 0, "when the --burst lands")
	fl.StringVar(&f.trace, "trace", "", "CSV of pod starts and stops (time_seconds,node,pod,event) replacing the synthetic workload")
	fl.StringVar(&f.outputDir, "output-dir", "", "directory to write series.csv, summary.json and chart.svg into (created if missing)")
	fl.StringVarP(&f.output, "output", "o", "text", "summary format on stdout: text or json")
	return cmd
}

// config turns the flags into a simulation, rejecting combinations that make no sense.
func (f *simulateFlags) config(cmd *cobra.Command) (sim.Config, error) {
	cfg := f.cfg
	set := cmd.Flags().Changed
	cfg.Start = sim.Start(f.start)
	if len(f.poolCIDRs) > 0 {
		if set("pool-size") {
			return cfg, errors.New("give --pool-cidr or --pool-size, not both")
		}
		for _, s := range f.poolCIDRs {
			p, err := netip.ParsePrefix(strings.TrimSpace(s))
			if err != nil {
				return cfg, fmt.Errorf("--pool-cidr %q: not a CIDR such as 10.0.0.0/16 or fd00::/64", s)
			}
			cfg.PoolCIDRs = append(cfg.PoolCIDRs, p)
		}
	}
	if f.trace != "" {
		for _, name := range []string{"nodes", "pods-per-node", "churn"} {
			if set(name) {
				return cfg, fmt.Errorf("--%s does not go with --trace: the trace file is the workload (its nodes and pods)", name)
			}
		}
		if cfg.Start == sim.StartCold {
			return cfg, errors.New("--start cold does not go with --trace: a trace starts with empty nodes; put its initial pods at time 0")
		}
		file, err := os.Open(f.trace)
		if err != nil {
			return cfg, fmt.Errorf("--trace: %w", err)
		}
		defer file.Close()
		tr, err := sim.ParseTrace(file)
		if err != nil {
			return cfg, fmt.Errorf("--trace %s: %w\nthe format is %s", f.trace, err, sim.TraceFormat)
		}
		cfg.Trace = tr
		if !set("duration") {
			cfg.Duration = tr.End().Truncate(time.Second) + time.Minute
		}
	}
	return cfg, cfg.Validate()
}

// writeSimulation writes series.csv, summary.json and chart.svg into dir.
func writeSimulation(dir string, res *sim.Result) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("--output-dir: %w", err)
	}
	var files []string
	for _, w := range []struct {
		name  string
		write func(io.Writer) error
	}{
		{"series.csv", func(out io.Writer) error { return sim.WriteCSV(out, res.Series) }},
		{"summary.json", func(out io.Writer) error { return sim.WriteJSON(out, res.Summary) }},
		{"chart.svg", func(out io.Writer) error { return sim.WriteSVG(out, res.Summary, res.Series) }},
	} {
		path := filepath.Join(dir, w.name)
		file, err := os.Create(path)
		if err != nil {
			return files, fmt.Errorf("--output-dir: %w", err)
		}
		err = w.write(file)
		if cerr := file.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return files, fmt.Errorf("write %s: %w", path, err)
		}
		files = append(files, path)
	}
	return files, nil
}

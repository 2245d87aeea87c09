// Command bench measures ipwarden against its targets (docs/design.md "Targets") on this machine, with
// the reference measured in the same run where one exists, and prints each figure next to its
// goal. `make bench` runs it all.
//
//	go run ./hack/bench [all|cni|burst|churn|equal|controller|scale] [flags]
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

type figure struct {
	name, value, goal string
	ok                bool
}

// benchEnv is one fresh local cluster: control plane, a controller, clients.
type benchEnv struct {
	root        string
	bins        localcluster.Binaries
	cp          *controlplane.ControlPlane
	c           client.Client
	controller  *localcluster.Process
	ctrlMetrics string
}

// keepDirs leaves each bench's scratch directory (control plane, controller and agent logs) in
// place; traceChanges prints the equal bench's pool and NodeIPAllocation changes as they happen.
var keepDirs, traceChanges bool

func newEnv(ctx context.Context, root string, bins localcluster.Binaries, withController bool) (*benchEnv, error) {
	cp, err := controlplane.Start(ctx, controlplane.Options{Root: root, Keep: keepDirs})
	if err == nil && keepDirs {
		fmt.Println("  logs and data in", cp.Dir)
	}
	if err != nil {
		return nil, err
	}
	scheme := k8sruntime.NewScheme()
	_ = clientgoscheme.AddToScheme(scheme)
	_ = ipwardenv1.AddToScheme(scheme)
	c, err := client.New(cp.Config, client.Options{Scheme: scheme})
	if err != nil {
		cp.Stop()
		return nil, err
	}
	env := &benchEnv{root: root, bins: bins, cp: cp, c: c}
	if withController {
		env.ctrlMetrics = freeAddr()
		env.controller, err = localcluster.Start("controller", bins.Ipwarden, filepath.Join(cp.Dir, "controller.log"),
			"controller", "--kubeconfig", cp.Kubeconfig, "--leader-elect=false", "--claim-settle=100ms", "--pool-settle=-1s",
			"--metrics-bind-address", env.ctrlMetrics, "--health-probe-bind-address=0")
		if err != nil {
			cp.Stop()
			return nil, err
		}
	}
	return env, nil
}

func (e *benchEnv) close() {
	if e.controller != nil {
		e.controller.Stop()
	}
	_ = e.cp.Stop()
}

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	what := "all"
	if len(args) > 0 && args[0] != "" && args[0][0] != '-' {
		what, args = args[0], args[1:]
	}
	fs := flag.NewFlagSet(what, flag.ContinueOnError)
	nodes := fs.Int("nodes", 5000, "controller bench: nodes (hollow agents)")
	perNode := fs.Int("per-node", 30, "controller bench: addresses each node requests")
	parallel := fs.Int("parallel", 32, "controller bench: concurrent hollow-agent writers")
	pairs := fs.Int("pairs", 1000, "cni bench: sequential ADD+DEL pairs per plugin in each run, for the latency quantiles")
	cniRunCount := fs.Int("cni-runs", cniRuns, "cni bench: runs of the paired measurement; the goals are judged on the median of the runs' ratios")
	window := fs.Duration("window", 5*time.Second, "cni bench: duration of each throughput measurement")
	pods := fs.Int("pods", 110, "burst bench: pods started at once")
	var scale scaleOptions
	fs.IntVar(&scale.nodes, "scale-nodes", 1000, "scale bench: nodes, each served by the real agent code in this process")
	fs.IntVar(&scale.pods, "scale-pods", 30, "scale bench: pods bound to every node at once in the burst")
	fs.DurationVar(&scale.rest, "scale-rest", time.Minute, "scale bench: the quiet window over which writes at rest are counted")
	fs.IntVar(&scale.workers, "scale-workers", 64, "scale bench: DEL+ADD pairs the runtime stand-in sends at once in the apiserver scenario")
	fs.IntVar(&scale.burstNodes, "scale-burst-nodes", 10, "scale bench: nodes bursting at once (each binds its scale-pods pods at the same moment and sends their ADDs at once; the next node starts as one ends)")
	scenarios := fs.String("scale-scenarios", "restart,failover,apiserver,newpool", "scale bench: what follows the burst, in order: restart (every agent, 10% at a time), failover (the leading controller killed), apiserver (kube-apiserver restarted), newpool (a pool created and grown with 1% of the agents down); \"\" for none")
	var churn churnOptions
	fs.IntVar(&churn.nodes, "churn-nodes", 3, "churn bench: real agents (nodes) on the pool")
	fs.IntVar(&churn.pods, "churn-pods", 30, "churn bench: pods bound to each node")
	fs.DurationVar(&churn.interval, "churn-interval", 2*time.Second, "churn bench: one pod stopped and a new one started per node this often")
	fs.DurationVar(&churn.duration, "churn-duration", 3*time.Minute, "churn bench: how long the churn lasts (then the nodes come to rest)")
	fs.DurationVar(&churn.releaseDelay, "churn-release-delay", 20*time.Second, "churn bench: the pool's releaseDelay")
	fs.DurationVar(&churn.cooldown, "churn-cooldown", 30*time.Second, "churn bench: the pool's reuseCooldown")
	equalLimit := fs.Duration("equal-deadline", 3*time.Minute, "equal bench: how long a pod's ADD is retried on CNI error 11")
	fs.BoolVar(&keepDirs, "keep", false, "keep each bench's scratch directory (logs of the control plane, controller and agents)")
	outDir := fs.String("output-dir", "", "where to write report.txt and the pictures (SVG) beside it; default _out/bench under the repository")
	fs.BoolVar(&traceChanges, "trace", false, "equal bench: print every change of the pool status and the nodes' requests and holdings")
	if err := fs.Parse(args); err != nil {
		return err
	}
	scale.scenarios = strings.Split(*scenarios, ",")
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	root, err := controlplane.RepoRoot()
	if err != nil {
		return err
	}
	fmt.Println("building ipwarden, ipwarden-cni, bridge and host-local")
	bins, err := localcluster.Build(root, filepath.Join(controlplane.BinDir(root), "bench"), os.Stdout)
	if err != nil {
		return err
	}
	if *outDir == "" {
		*outDir = filepath.Join(root, "_out", "bench")
	}
	rep := &report{}
	sections := []struct {
		name  string
		run   func() ([]figure, error)
		alone bool // not part of "all" (make bench-scale)
	}{
		{"scale", func() ([]figure, error) {
			env, err := newEnv(ctx, root, bins, false)
			if err != nil {
				return nil, err
			}
			defer env.close()
			return scaleBench(ctx, env, scale)
		}, true},
		{"cni", func() ([]figure, error) {
			env, err := newEnv(ctx, root, bins, true)
			if err != nil {
				return nil, err
			}
			defer env.close()
			return cniBench(ctx, env, *cniRunCount, *pairs, *window, rep)
		}, false},
		{"burst", func() ([]figure, error) {
			env, err := newEnv(ctx, root, bins, true)
			if err != nil {
				return nil, err
			}
			defer env.close()
			return burstBench(ctx, env, *pods, rep)
		}, false},
		{"churn", func() ([]figure, error) {
			env, err := newEnv(ctx, root, bins, true)
			if err != nil {
				return nil, err
			}
			defer env.close()
			return churnBench(ctx, env, churn)
		}, false},
		{"equal", func() ([]figure, error) {
			env, err := newEnv(ctx, root, bins, true)
			if err != nil {
				return nil, err
			}
			defer env.close()
			return equalBench(ctx, env, *equalLimit)
		}, false},
		{"controller", func() ([]figure, error) {
			env, err := newEnv(ctx, root, bins, false)
			if err != nil {
				return nil, err
			}
			defer env.close()
			b := &controllerBench{nodes: *nodes, perNode: *perNode, parallel: *parallel, cidr: "10.64.0.0/12",
				bin: bins.Ipwarden, cp: env.cp, c: env.c, log: func(f string, a ...any) { fmt.Printf("  "+f+"\n", a...) }}
			return b.run(ctx)
		}, false},
	}
	ran := false
	for _, s := range sections {
		if (what != "all" || s.alone) && what != s.name {
			continue
		}
		ran = true
		fmt.Printf("== %s\n", s.name)
		t0 := time.Now()
		figs, err := s.run()
		if err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
		fmt.Printf("   (%s)\n", time.Since(t0).Round(time.Second))
		rep.figures = append(rep.figures, figs...)
	}
	if !ran {
		return fmt.Errorf("unknown bench %q: use all, cni, burst, churn, equal, controller or scale", what)
	}
	rep.date = time.Now()
	fmt.Print("\n" + rep.text())
	if err := rep.write(*outDir); err != nil {
		return err
	}
	if failed := rep.failed(); failed > 0 {
		return fmt.Errorf("%d figures miss their goal", failed)
	}
	return nil
}

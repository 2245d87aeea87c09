// Command bench measures ipwarden against its targets (DESIGN.md "Targets") on this machine, with
// the reference measured in the same run where one exists, and prints each figure next to its goal.
//
//	go run ./hack/bench controller [--nodes 5000 --per-node 30]
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"
	"text/tabwriter"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/controlplane"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	if len(args) < 1 || args[0] != "controller" {
		return fmt.Errorf("usage: bench controller [flags]")
	}
	fs := flag.NewFlagSet("controller", flag.ContinueOnError)
	nodes := fs.Int("nodes", 5000, "nodes (hollow agents)")
	perNode := fs.Int("per-node", 30, "addresses each node requests")
	cidr := fs.String("cidr", "10.64.0.0/12", "pool CIDR")
	parallel := fs.Int("parallel", 32, "concurrent hollow-agent writers")
	if err := fs.Parse(args[1:]); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	root, err := controlplane.RepoRoot()
	if err != nil {
		return err
	}
	bin := filepath.Join(controlplane.BinDir(root), "ipwarden")
	if out, err := exec.Command("go", "build", "-o", bin, "./cmd/ipwarden").CombinedOutput(); err != nil {
		return fmt.Errorf("build ipwarden: %v\n%s", err, out)
	}
	logf := func(f string, a ...any) { fmt.Printf("  "+f+"\n", a...) }
	logf("starting a local control plane")
	cp, err := controlplane.Start(ctx, controlplane.Options{Root: root})
	if err != nil {
		return err
	}
	defer cp.Stop()
	scheme := runtime.NewScheme()
	_ = clientgoscheme.AddToScheme(scheme)
	_ = ipwardenv1.AddToScheme(scheme)
	c, err := client.New(cp.Config, client.Options{Scheme: scheme})
	if err != nil {
		return err
	}
	b := &controllerBench{nodes: *nodes, perNode: *perNode, parallel: *parallel, cidr: *cidr, bin: bin, cp: cp, c: c, log: logf}
	start := time.Now()
	figs, err := b.run(ctx)
	if err != nil {
		return err
	}
	fmt.Printf("\ncontroller at scale (%d nodes, %d addresses, real kube-apiserver on loopback, %s)\n", *nodes, *nodes**perNode, time.Since(start).Round(time.Second))
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "FIGURE\tVALUE\tGOAL\tMET")
	for _, f := range figs {
		met := "yes"
		if !f.ok {
			met = "NO"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", f.name, f.value, f.goal, met)
	}
	return tw.Flush()
}

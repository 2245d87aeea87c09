// Command controlplane builds and runs ipwarden's local test control plane (etcd and
// kube-apiserver on loopback, CRDs installed).
//
//	go run ./hack/controlplane ensure   build the binaries into _bin/ if they are missing or stale
//	go run ./hack/controlplane ensure kubectl|node|helm|promcheck|all
//	                                    also kubectl, or the real-node suite's kubelet,
//	                                    kube-controller-manager and kube-scheduler, or all of them
//	go run ./hack/controlplane up       start a control plane, print its kubeconfig, run until Ctrl-C
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/ipwarden/ipwarden/internal/controlplane"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "controlplane:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	if len(args) < 1 || len(args) > 2 || (len(args) == 2 && args[0] != "ensure") {
		return fmt.Errorf("usage: controlplane ensure [kubectl|node|helm|promcheck|all] | up")
	}
	root, err := controlplane.RepoRoot()
	if err != nil {
		return err
	}
	switch args[0] {
	case "ensure":
		return ensure(root, args[1:])
	case "up":
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		cp, err := controlplane.Start(ctx, controlplane.Options{Root: root, Log: os.Stderr})
		if err != nil {
			return err
		}
		defer cp.Stop()
		fmt.Printf("control plane running; try:\n  export KUBECONFIG=%s\n  kubectl get ippools,nodeipallocations\nCtrl-C stops it and removes %s\n", cp.Kubeconfig, cp.Dir)
		<-ctx.Done()
		return nil
	default:
		return fmt.Errorf("unknown command %q: use ensure or up", args[0])
	}
}

// ensure builds the named tool sets (the control plane when none is named) and prints their paths.
func ensure(root string, sets []string) error {
	set := "controlplane"
	if len(sets) == 1 {
		set = sets[0]
	}
	bin := controlplane.BinDir(root)
	var paths []string
	if set == "controlplane" || set == "all" {
		bins, err := controlplane.EnsureBinaries(root, bin, os.Stderr)
		if err != nil {
			return err
		}
		paths = append(paths, bins.KubeAPIServer, bins.Etcd)
	}
	if set == "kubectl" || set == "all" {
		p, err := controlplane.EnsureKubectl(root, bin, os.Stderr)
		if err != nil {
			return err
		}
		paths = append(paths, p)
	}
	if set == "node" || set == "all" {
		n, err := controlplane.EnsureNodeBinaries(root, bin, os.Stderr)
		if err != nil {
			return err
		}
		paths = append(paths, n.Kubelet, n.KubeControllerManager, n.KubeScheduler)
	}
	if set == "helm" || set == "all" {
		p, err := controlplane.EnsureHelm(root, bin, os.Stderr)
		if err != nil {
			return err
		}
		paths = append(paths, p)
	}
	if set == "promcheck" || set == "all" {
		p, err := controlplane.EnsurePromcheck(root, bin, os.Stderr)
		if err != nil {
			return err
		}
		paths = append(paths, p)
	}
	if len(paths) == 0 {
		return fmt.Errorf("unknown tool set %q: use kubectl, node, helm, promcheck or all", set)
	}
	for _, p := range paths {
		fmt.Println(p)
	}
	return nil
}

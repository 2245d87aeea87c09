// Command controlplane builds and runs ipwarden's local test control plane (etcd and
// kube-apiserver on loopback, CRDs installed).
//
//	go run ./hack/controlplane ensure   build the binaries into _bin/ if they are missing or stale
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
	if len(args) != 1 {
		return fmt.Errorf("usage: controlplane ensure|up")
	}
	root, err := controlplane.RepoRoot()
	if err != nil {
		return err
	}
	switch args[0] {
	case "ensure":
		bins, err := controlplane.EnsureBinaries(root, controlplane.BinDir(root), os.Stderr)
		if err != nil {
			return err
		}
		fmt.Println(bins.KubeAPIServer)
		fmt.Println(bins.Etcd)
		return nil
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

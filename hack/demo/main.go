// Command demo is ipwarden's local demonstration: a real kube-apiserver and etcd on loopback,
// ipwarden's CRDs, the example pools, and the API rejecting bad pools with clear messages.
//
// The full demo (controller, node agents, pods through the real CNI plugin) arrives with the
// controller and agent; this one shows what the foundation does today.
//
//	go run ./hack/demo [--keep]
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"text/tabwriter"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/controlplane"
)

func main() {
	keep := flag.Bool("keep", false, "leave the control plane running until Ctrl-C, to look around with kubectl")
	flag.Parse()
	if err := run(*keep); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

func run(keep bool) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	root, err := controlplane.RepoRoot()
	if err != nil {
		return err
	}
	fmt.Println("== starting a local control plane (etcd + kube-apiserver on 127.0.0.1)")
	start := time.Now()
	cp, err := controlplane.Start(ctx, controlplane.Options{Root: root, Log: os.Stdout})
	if err != nil {
		return err
	}
	defer func() {
		fmt.Println("== stopping the control plane")
		_ = cp.Stop()
	}()
	fmt.Printf("   ready in %s; CRDs ippools.ipwarden.io and nodeipallocations.ipwarden.io installed\n", time.Since(start).Round(100*time.Millisecond))

	scheme := runtime.NewScheme()
	if err := ipwardenv1.AddToScheme(scheme); err != nil {
		return err
	}
	c, err := client.New(cp.Config, client.Options{Scheme: scheme})
	if err != nil {
		return err
	}

	examples := filepath.Join(root, "deploy", "examples", "ippools.yaml")
	fmt.Printf("\n== applying %s\n", examples)
	if err := applyFile(ctx, c, examples); err != nil {
		return err
	}
	if err := printPools(ctx, c); err != nil {
		return err
	}

	fmt.Println("\n== the API server rejects bad pools before any controller sees them:")
	for _, bad := range []struct{ what, spec string }{
		{"a CIDR with host bits", `{"cidrs": ["10.0.0.1/24"]}`},
		{"mixed families", `{"cidrs": ["10.0.0.0/24", "fd00::/64"]}`},
		{"an exclusion outside the pool", `{"cidrs": ["10.0.0.0/24"], "exclude": ["192.168.0.1"]}`},
		{"maxPerNode below batchSize", `{"cidrs": ["10.0.0.0/24"], "scaling": {"batchSize": 32, "maxPerNode": 16}}`},
		{"a negative cooldown", `{"cidrs": ["10.0.0.0/24"], "reuseCooldown": "-5s"}`},
	} {
		obj := fmt.Sprintf(`{"apiVersion": "ipwarden.io/v1alpha1", "kind": "IPPool", "metadata": {"name": "bad"}, "spec": %s}`, bad.spec)
		u := &unstructured.Unstructured{}
		if err := u.UnmarshalJSON([]byte(obj)); err != nil {
			return err
		}
		err := c.Create(ctx, u)
		if err == nil {
			return fmt.Errorf("the API server accepted %s", bad.what)
		}
		fmt.Printf("   %-32s -> %v\n", bad.what, err)
	}

	fmt.Println("\nThe controller and node agents are not part of ipwarden yet, so nodes get no addresses")
	fmt.Println("in this demo; it grows with them.")
	if keep {
		fmt.Printf("\n== left running. In another shell:\n   export KUBECONFIG=%s\n   kubectl get ippools,nodeipallocations\nCtrl-C stops everything.\n", cp.Kubeconfig)
		<-ctx.Done()
	}
	return nil
}

func applyFile(ctx context.Context, c client.Client, path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096)
	for {
		u := &unstructured.Unstructured{}
		if err := dec.Decode(&u.Object); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return fmt.Errorf("%s: %w", path, err)
		}
		if len(u.Object) == 0 {
			continue
		}
		if err := c.Create(ctx, u); err != nil {
			return fmt.Errorf("create %s %s: %w", u.GetKind(), u.GetName(), err)
		}
		fmt.Printf("   created %s %s\n", u.GetKind(), u.GetName())
	}
}

func printPools(ctx context.Context, c client.Client) error {
	var pools ipwardenv1.IPPoolList
	if err := c.List(ctx, &pools); err != nil {
		return err
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "   NAME\tCIDRS\tBATCH\tBUFFER\tMAX/NODE\tCOOLDOWN")
	for _, p := range pools.Items {
		s := p.Spec.Scaling
		fmt.Fprintf(tw, "   %s\t%v\t%d\t%d%%\t%d\t%s\n", p.Name, p.Spec.CIDRs, s.BatchSize, s.BufferPercent, s.MaxPerNode, p.Spec.ReuseCooldown.Duration)
	}
	return tw.Flush()
}

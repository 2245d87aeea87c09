// Package e2e runs ipwarden end to end on this machine: a real kube-apiserver and etcd on
// loopback, real `ipwarden controller` and `ipwarden agent` processes, and the real `bridge` CNI
// plugin delegating IPAM to ipwarden-cni, driven by libcni in network namespaces the tests
// create. It needs root (network namespaces, veths, a bridge) and iproute2 and ping; it fails,
// never skips, without them: CI runs it as root.
//
// Traffic stays inside the namespaces and bridges the tests create; every namespace is named
// ipw-e2e-* and every bridge ipwe2e*, and both are removed after each test, also on failure,
// and swept at start in case an earlier run was killed.
package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/localcluster"

	"testing"
)

var (
	controlPlane *controlplane.ControlPlane
	k8s          client.Client
	// cniDir is CNI_PATH: bridge and ipwarden (the ipwarden-cni binary under its type name).
	cniDir string
	// ipwardenBin is the ipwarden binary (controller, agent).
	ipwardenBin string
	scheme      = runtime.NewScheme()
)

func TestMain(m *testing.M) {
	localcluster.QuickRaceExit() // libcni runs the plugin with this process's environment
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "e2e: FAIL: these tests need root (network namespaces, veths, a bridge); run them as root, as CI does")
		return 1
	}
	for tool, pkg := range map[string]string{"ip": "iproute2", "ping": "iputils-ping"} {
		if _, err := exec.LookPath(tool); err != nil {
			fmt.Fprintf(os.Stderr, "e2e: FAIL: %s is missing: apt-get install -y %s\n", tool, pkg)
			return 1
		}
	}
	sweep()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		panic(err)
	}
	if err := ipwardenv1.AddToScheme(scheme); err != nil {
		panic(err)
	}
	root, err := controlplane.RepoRoot()
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	if err := buildBinaries(root); err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	cp, err := controlplane.Start(ctx, controlplane.Options{Log: os.Stderr})
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e: cannot start the test control plane:", err)
		return 1
	}
	defer func() {
		if err := cp.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "e2e: stop control plane:", err)
		}
	}()
	controlPlane = cp
	if k8s, err = client.New(cp.Config, client.Options{Scheme: scheme}); err != nil {
		fmt.Fprintln(os.Stderr, "e2e: client:", err)
		return 1
	}
	code := m.Run()
	sweep()
	return code
}

// buildBinaries builds ipwarden and ipwarden-cni from this tree and installs the pinned bridge
// plugin into the e2e CNI_PATH when it is missing.
func buildBinaries(root string) error {
	bins, err := localcluster.Build(root, filepath.Join(controlplane.BinDir(root), "e2e"), os.Stderr)
	if err != nil {
		return err
	}
	cniDir, ipwardenBin = bins.CNIDir, bins.Ipwarden
	return nil
}

// sweep removes namespaces and bridges an earlier, killed run may have left. Only names with
// this package's prefixes are touched.
func sweep() {
	out, _ := exec.Command("ip", "netns", "list").Output()
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) > 0 && strings.HasPrefix(f[0], nsPrefix) {
			_ = exec.Command("ip", "netns", "del", f[0]).Run()
		}
	}
	out, _ = exec.Command("ip", "-o", "link", "show", "type", "bridge").Output()
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 {
			name := strings.TrimSuffix(strings.SplitN(f[1], "@", 2)[0], ":")
			if strings.HasPrefix(name, bridgePrefix) {
				_ = exec.Command("ip", "link", "del", name).Run()
			}
		}
	}
}

// Package integration runs ipwarden against a real kube-apiserver and etcd started on loopback
// for this test binary (see internal/controlplane).
package integration

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

var (
	// netnsDir stands for the host's /var/run/netns: agents look for pods' network namespaces
	// there (--netns-dirs) and the plugin passes CNI_NETNS=<netnsDir>/none, a namespace that is
	// gone, unless a test passes a real one (see cniIn).
	netnsDir string
	// controlPlane is the package's etcd + kube-apiserver; kubeconfigPath its admin kubeconfig.
	controlPlane   *controlplane.ControlPlane
	kubeconfigPath string
	restConfig     *rest.Config
	k8s            client.Client
	scheme         = runtime.NewScheme()
)

func TestMain(m *testing.M) {
	localcluster.QuickRaceExit()
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		panic(err)
	}
	if err := ipwardenv1.AddToScheme(scheme); err != nil {
		panic(err)
	}
	dir, err := os.MkdirTemp("", "ipw-netns-")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	netnsDir = dir
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	cp, err := controlplane.Start(ctx, controlplane.Options{Log: os.Stderr})
	if err != nil {
		fmt.Fprintln(os.Stderr, "integration: cannot start the test control plane:", err)
		return 1
	}
	defer func() {
		if err := cp.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "integration: stop control plane:", err)
		}
	}()
	controlPlane, kubeconfigPath, restConfig = cp, cp.Kubeconfig, cp.Config
	if k8s, err = client.New(restConfig, client.Options{Scheme: scheme}); err != nil {
		fmt.Fprintln(os.Stderr, "integration: client:", err)
		return 1
	}
	return m.Run()
}

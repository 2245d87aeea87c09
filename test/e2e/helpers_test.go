package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

const (
	nsPrefix     = "ipw-e2e-"
	bridgePrefix = "ipwe2e"
)

// startProcess runs ipwarden with args as a child of the test (internal/localcluster), killed at
// the end of the test; its log is printed when the test failed or IPWARDEN_TEST_LOGS is set.
func startProcess(t *testing.T, name string, args ...string) *localcluster.Process {
	t.Helper()
	p, err := localcluster.Start(name, ipwardenBin, filepath.Join(t.TempDir(), "process.log"), args...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.Kill()
		if race := p.DataRace(); race != "" {
			t.Errorf("%s reported a data race:\n%s", name, race)
		}
		if t.Failed() || os.Getenv("IPWARDEN_TEST_LOGS") != "" {
			t.Logf("%s log (tail):\n%s", name, p.LogTail(12000))
		}
	})
	return p
}

func startController(t *testing.T) *localcluster.Process {
	return startProcess(t, "controller", "controller", "--kubeconfig", controlPlane.Kubeconfig, "--leader-elect=false", "--claim-settle=100ms", "--pool-settle=-1s",
		"--metrics-bind-address=0", "--health-probe-bind-address=0", "--min-sync-interval=20ms", "--pool-status-interval=200ms")
}

// agent is a running `ipwarden agent`.
type agent struct {
	*localcluster.Process
	node    string
	socket  string
	metrics string
}

func startAgent(t *testing.T, node string, args ...string) *agent {
	t.Helper()
	runDir, err := os.MkdirTemp("", "ipw-e2e-run-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(runDir) })
	a := &agent{node: node, socket: filepath.Join(runDir, "s", "agent.sock"), metrics: freePort(t)}
	base := []string{"agent", "--kubeconfig", controlPlane.Kubeconfig, "--node-name", node, "--socket", a.socket,
		"--state-dir", t.TempDir(), "--metrics-bind-address", a.metrics, "--health-probe-bind-address=0"}
	a.Process = startProcess(t, "agent "+node, append(base, args...)...)
	eventually(t, 60*time.Second, "agent "+node+" to serve", func() error {
		if !a.Running() {
			t.Fatalf("agent %s exited", node)
		}
		_, err := a.list()
		return err
	})
	return a
}

func (a *agent) list() (*cniproto.Response, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cniproto.Call(ctx, a.socket, cniproto.Request{Op: cniproto.OpList})
	if err != nil {
		return nil, err
	}
	return resp, resp.AsError()
}

// freePort is a free loopback host:port (localcluster.FreeAddr).
func freePort(t *testing.T) string {
	t.Helper()
	a, err := localcluster.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// eventually polls cond until it returns nil or the deadline passes.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() error) {
	t.Helper()
	if err := localcluster.WaitFor(context.Background(), timeout, 50*time.Millisecond, cond); err != nil {
		t.Fatalf("waiting for %s: %v", what, err)
	}
}

func createPool(t *testing.T, name, label string, spec ipwardenv1.IPPoolSpec) {
	t.Helper()
	spec.NodeSelector = &metav1.LabelSelector{MatchLabels: map[string]string{"ipwarden.test/e2e": label}}
	p := &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: spec}
	if err := k8s.Create(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), p) })
}

func createNode(t *testing.T, name, label string) {
	t.Helper()
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"ipwarden.test/e2e": label}}}
	if err := k8s.Create(context.Background(), n); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = k8s.Delete(context.Background(), n)
		_ = k8s.Delete(context.Background(), &ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: name}})
	})
}

func held(t *testing.T, node, pool string) addr.Set {
	t.Helper()
	a := &ipwardenv1.NodeIPAllocation{}
	if err := k8s.Get(context.Background(), client.ObjectKey{Name: node}, a); err != nil {
		t.Fatal(err)
	}
	for _, p := range a.Status.Pools {
		if p.Pool == pool {
			s, err := addr.ParseSet(p.Addresses)
			if err != nil {
				t.Fatal(err)
			}
			return s
		}
	}
	return addr.Set{}
}

// netns creates a network namespace named ipw-e2e-<suffix> and removes it at the end of the test.
func netns(t *testing.T, suffix string) string {
	t.Helper()
	name := nsPrefix + suffix
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add %s: %v: %s", name, err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	return name
}

// bridgeName returns a fresh bridge name and removes the bridge at the end of the test.
func bridgeName(t *testing.T) string {
	t.Helper()
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	name := bridgePrefix + hex.EncodeToString(b) // 12 characters, under IFNAMSIZ
	t.Cleanup(func() { _ = exec.Command("ip", "link", "del", name).Run() })
	return name
}

// network is a CNI network: the bridge plugin with ipwarden as IPAM.
type network struct {
	cni  *libcni.CNIConfig
	list *libcni.NetworkConfigList
}

func newNetwork(t *testing.T, bridge, socket string, pools ...string) *network {
	t.Helper()
	ipamConf := map[string]any{"type": "ipwarden", "socket": socket}
	if len(pools) > 0 {
		ipamConf["pools"] = pools
	}
	conf := map[string]any{
		"cniVersion": "1.1.0",
		"name":       "ipwarden-e2e",
		"plugins": []any{map[string]any{
			"type": "bridge", "bridge": bridge, "isGateway": true, "ipMasq": false, "ipam": ipamConf,
		}},
	}
	b, _ := json.Marshal(conf)
	list, err := libcni.NetworkConfFromBytes(b)
	if err != nil {
		t.Fatal(err)
	}
	return &network{cni: libcni.NewCNIConfigWithCacheDir([]string{cniDir}, t.TempDir(), pluginExec()), list: list}
}

func runtimeConf(ns, containerID, pod string) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{
		ContainerID: containerID,
		NetNS:       "/var/run/netns/" + ns,
		IfName:      "eth0",
		Args: [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", "default"}, {"K8S_POD_NAME", pod},
			{"K8S_POD_UID", "uid-" + pod}},
	}
}

func (n *network) add(ctx context.Context, rt *libcni.RuntimeConf) (*current.Result, error) {
	r, err := n.cni.AddNetworkList(ctx, n.list, rt)
	if err != nil {
		return nil, err
	}
	return current.NewResultFromResult(r)
}

// ping sends one echo request from inside namespace ns to ip.
func ping(ns, ip string) error {
	out, err := exec.Command("ip", "netns", "exec", ns, "ping", "-c", "1", "-W", "2", ip).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ping %s from %s: %v: %s", ip, ns, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// pluginExec is libcni's default plugin executor, given explicitly: with nil, libcni creates it
// lazily inside each call, which races when calls run concurrently (a burst).
func pluginExec() invoke.Exec {
	return &invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: os.Stderr}, PluginDecoder: version.PluginDecoder{}}
}

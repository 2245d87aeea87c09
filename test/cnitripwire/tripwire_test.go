// Package cnitripwire is make test's coarse tripwire on the ADD path: a short CNI bench through
// the real plugin binaries, ipwarden-cni (to a real agent with its durable journal, pods bound to
// its node as for a runtime) against host-local, interleaved in the same run, that fails when
// ipwarden's ADD+DEL p50 is over 3x host-local's; and over 5x for pods the agent's watch does not
// know (its metadata reads from the API server: the path that once queued on a rate limiter and
// measured 44.9x; 1.6x on a quiet machine, so the looser bound). The bounds are loose for a
// loaded CI machine; the figures to quote are `go run ./hack/bench cni`'s (BENCHMARKS.md). It runs
// without -race (the Makefile's NORACE_PKGS): a race-built agent would measure the race detector.
package cnitripwire

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/version"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

const (
	pairs        = 100 // ADD+DEL pairs per plugin, measured
	maxRatio     = 3.0 // ipwarden's p50 over host-local's
	maxMissRatio = 5.0 // the same for pods the agent's watch does not know
)

func TestCNIAddDelWithin3xOfHostLocal(t *testing.T) {
	if localcluster.Race {
		t.Fatal("run this package without -race (Makefile NORACE_PKGS): a race-built agent measures the race detector")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	bins, err := localcluster.Build(root, filepath.Join(controlplane.BinDir(root), "tripwire"), os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	cp, err := controlplane.Start(ctx, controlplane.Options{Root: root, Log: os.Stderr})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cp.Stop() })
	scheme := k8sruntime.NewScheme()
	_ = clientgoscheme.AddToScheme(scheme)
	_ = ipwardenv1.AddToScheme(scheme)
	c, err := client.New(cp.Config, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	const node = "tripwire"
	labels := map[string]string{"ipwarden.test/tripwire": "yes"}
	if err := c.Create(ctx, &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: "tripwire"}, Spec: ipwardenv1.IPPoolSpec{
		CIDRs: []ipwardenv1.CIDR{"10.252.0.0/16"}, NodeSelector: &metav1.LabelSelector{MatchLabels: labels},
		Scaling: ipwardenv1.Scaling{BatchSize: 16, BufferPercent: 50, MaxPerNode: 250}}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node, Labels: labels}}); err != nil {
		t.Fatal(err)
	}
	ctrl, err := localcluster.Start("controller", bins.Ipwarden, filepath.Join(cp.Dir, "controller.log"),
		"controller", "--kubeconfig", cp.Kubeconfig, "--leader-elect=false", "--claim-settle=100ms", "--pool-settle=-1s",
		"--metrics-bind-address=0", "--health-probe-bind-address=0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ctrl.Stop)
	dir := t.TempDir()
	socket := filepath.Join(dir, "run", "agent.sock")
	if err := os.MkdirAll(filepath.Dir(socket), 0o700); err != nil {
		t.Fatal(err)
	}
	metrics, err := localcluster.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	agent, err := localcluster.Start("agent", bins.Ipwarden, filepath.Join(cp.Dir, "agent.log"),
		"agent", "--node-name", node, "--kubeconfig", cp.Kubeconfig, "--socket", socket, "--state-dir", filepath.Join(dir, "state"),
		"--metrics-bind-address", metrics, "--health-probe-bind-address=0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(agent.Stop)
	if err := localcluster.WaitFor(ctx, 60*time.Second, 50*time.Millisecond, func() error {
		resp, err := cniproto.Call(ctx, socket, cniproto.Request{Op: cniproto.OpList})
		if err != nil {
			return err
		}
		return resp.AsError()
	}); err != nil {
		t.Fatalf("agent not serving: %v\n%s", err, agent.LogTail(2000))
	}
	// Pods bound to the node, as for a runtime: the agent's watch knows them at ADD.
	var pods [][2]string
	for i := range 16 {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: fmt.Sprintf("tripwire-%d", i)},
			Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "c", Image: "none"}}}}
		if err := c.Create(ctx, p); err != nil {
			t.Fatal(err)
		}
		pods = append(pods, [2]string{p.Name, string(p.UID)})
	}
	if err := localcluster.WaitFor(ctx, 30*time.Second, 50*time.Millisecond, func() error {
		if got := localcluster.ScrapeSum("http://"+metrics+"/metrics", "ipwarden_agent_pool_requested_addresses"); got < float64(len(pods)) {
			return fmt.Errorf("the agent requests %v addresses for %d bound pods", got, len(pods))
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}

	localcluster.IPAMOnly()
	cache := filepath.Join(dir, "cni-cache")
	cni := libcni.NewCNIConfigWithCacheDir([]string{bins.CNIDir}, cache,
		&invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: os.Stderr}, PluginDecoder: version.PluginDecoder{}})
	ipw := ipamNet(t, map[string]any{"type": "ipwarden", "socket": socket})
	hl := ipamNet(t, map[string]any{"type": "host-local",
		"ranges": [][]map[string]any{{{"subnet": "10.253.0.0/16"}}}, "dataDir": filepath.Join(dir, "host-local")})
	seq := 0
	pair := func(net *libcni.NetworkConfigList, known bool) time.Duration {
		t.Helper()
		seq++
		p := pods[seq%len(pods)]
		if !known {
			p = [2]string{fmt.Sprintf("unknown-%d", seq), fmt.Sprintf("uid-unknown-%d", seq)}
		}
		rt := &libcni.RuntimeConf{ContainerID: fmt.Sprintf("tripwire%08d", seq), NetNS: "/proc/self/ns/net", IfName: "eth0",
			Args: [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", "default"}, {"K8S_POD_NAME", p[0]}, {"K8S_POD_UID", p[1]}}}
		t0 := time.Now()
		if _, err := cni.AddNetworkList(ctx, net, rt); err != nil {
			t.Fatalf("%s ADD: %v", net.Name, err)
		}
		if err := cni.DelNetworkList(ctx, net, rt); err != nil {
			t.Fatalf("%s DEL: %v", net.Name, err)
		}
		return time.Since(t0)
	}
	for range 20 { // warm up: the node's first batch, page cache, binaries
		pair(ipw, true)
		pair(hl, true)
	}
	var a, miss, b []time.Duration
	for i := range pairs { // interleaved: all share whatever else the machine does
		a = append(a, pair(ipw, true))
		b = append(b, pair(hl, true))
		if i%2 == 0 {
			miss = append(miss, pair(ipw, false))
		}
	}
	pa, pm, pb := p50(a), p50(miss), p50(b)
	ratio, missRatio := float64(pa)/float64(pb), float64(pm)/float64(pb)
	t.Logf("CNI ADD+DEL p50: ipwarden %s (%d pairs), its pods unknown to the agent's watch %s (%d pairs), host-local %s: %.2fx and %.2fx (tripwires at %.0fx and %.0fx)",
		pa, len(a), pm, len(miss), pb, ratio, missRatio, maxRatio, maxMissRatio)
	if ratio > maxRatio {
		t.Errorf("ipwarden's CNI ADD+DEL p50 is %.2fx host-local's (%s vs %s), over the %.0fx tripwire: something slow is on the ADD path (go run ./hack/bench cni says where)",
			ratio, pa, pb, maxRatio)
	}
	if missRatio > maxMissRatio {
		t.Errorf("ipwarden's CNI ADD+DEL p50 for pods its watch does not know is %.2fx host-local's (%s vs %s), over the %.0fx tripwire: is the metadata read rate-limited or slow?",
			missRatio, pm, pb, maxMissRatio)
	}
}

// ipamNet is an IPAM-only network configuration: the plugin called as a main plugin would
// delegate to it.
func ipamNet(t *testing.T, plugin map[string]any) *libcni.NetworkConfigList {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": "tripwire-" + plugin["type"].(string),
		"plugins": []any{map[string]any{"type": plugin["type"], "ipam": plugin}}})
	list, err := libcni.NetworkConfFromBytes(b)
	if err != nil {
		t.Fatal(err)
	}
	return list
}

func p50(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

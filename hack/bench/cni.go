package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/version"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// node is one benchmark node: a real agent process on its own socket and state directory.
type node struct {
	name, socket, metrics string
	agent                 *localcluster.Process
}

// startNode creates a Node labeled for one bench pool and runs its agent.
func startNode(ctx context.Context, env *benchEnv, name, pool string, extra ...string) (*node, error) {
	cp, bins := env.cp, env.bins
	if err := createNode(ctx, env.c, name, map[string]string{"ipwarden.io/bench-pool": pool}); err != nil {
		return nil, err
	}
	dir := filepath.Join(cp.Dir, name)
	if err := os.MkdirAll(filepath.Join(dir, "run"), 0o700); err != nil {
		return nil, err
	}
	n := &node{name: name, socket: filepath.Join(dir, "run", "agent.sock"), metrics: freeAddr()}
	args := append([]string{"agent", "--node-name", name, "--kubeconfig", cp.Kubeconfig, "--socket", n.socket,
		"--state-dir", filepath.Join(dir, "state"), "--metrics-bind-address", n.metrics, "--health-probe-bind-address=0"}, extra...)
	var err error
	if n.agent, err = localcluster.Start("agent "+name, bins.Ipwarden, filepath.Join(cp.Dir, name+".log"), args...); err != nil {
		return nil, err
	}
	return n, waitSocket(ctx, n)
}

// cniBench compares ADD+DEL through the real plugin binaries: ipwarden-cni (talking to a real
// agent with a durable journal) against host-local, the containernetworking reference IPAM
// plugin, driven the same way (libcni, IPAM-only network config) in the same run: runs
// repetitions of pairs pairs per plugin each, judged on the median of the runs' ratios
// (cnirepeat.go).
func cniBench(ctx context.Context, env *benchEnv, runs, pairs int, window time.Duration, rep *report) ([]figure, error) {
	if runs < 1 || pairs < 1 {
		return nil, fmt.Errorf("-cni-runs %d and -pairs %d: both must be at least 1", runs, pairs)
	}
	if err := createPool(ctx, env.c, "bench-cni", "10.252.0.0/16", ipwardenv1.Scaling{BatchSize: 16, BufferPercent: 50, MaxPerNode: 250}, 0); err != nil {
		return nil, err
	}
	n, err := startNode(ctx, env, "bench-cni-node", "bench-cni")
	if err != nil {
		return nil, err
	}
	defer n.agent.Stop()
	cache := filepath.Join(env.cp.Dir, "cni-cache")
	ipw, err := ipamNetwork(env.bins.CNIDir, cache, map[string]any{"type": "ipwarden", "socket": n.socket})
	if err != nil {
		return nil, err
	}
	hl, err := ipamNetwork(env.bins.CNIDir, cache, map[string]any{"type": "host-local",
		"ranges": [][]map[string]any{{{"subnet": "10.253.0.0/16"}}}, "dataDir": filepath.Join(env.cp.Dir, "host-local")})
	if err != nil {
		return nil, err
	}
	// The pods exist and are bound to the node, as for a real runtime: the kubelet starts a
	// sandbox after the binding, so the agent's pod watch knows the pod at its ADD. Each pair is
	// a new sandbox of one of these pods.
	known, err := benchPods(ctx, env.c, n.name, 64)
	if err != nil {
		return nil, err
	}
	if err := waitAgentKnows(ctx, n, known); err != nil {
		return nil, err
	}
	ipw.pods, hl.pods = known, known
	plugins := []struct {
		name string
		net  *ipamNet
	}{{"ipwarden", ipw}, {"host-local", hl}}

	// Warm up both (the node's first batch, page cache, binaries) at the highest concurrency.
	for _, p := range plugins {
		if _, err := p.net.throughput(ctx, 32, 2*time.Second); err != nil {
			return nil, fmt.Errorf("%s warm-up: %w", p.name, err)
		}
	}
	// The paired measurement, repeated runs times: in each run both plugins' pairs in
	// alternating blocks (cniSchedule), so the two share the machine's drift; the goal is judged
	// on the median of the runs' ratios (cniVerdict).
	var figs []figure
	lat := map[string][]time.Duration{}
	var results []cniRun
	for r := range runs {
		run := map[string][]time.Duration{}
		for _, st := range cniSchedule(r, pairs, cniBlock) {
			p := plugins[st.plugin]
			d, err := p.net.latencies(ctx, st.pairs)
			if err != nil {
				return nil, fmt.Errorf("%s, run %d: %w", p.name, r+1, err)
			}
			run[p.name] = append(run[p.name], d...)
		}
		var res cniRun
		for q, f := range []float64{0.5, 0.99} {
			res.ipw[q], res.hl[q] = quantile(run["ipwarden"], f), quantile(run["host-local"], f)
		}
		results = append(results, res)
		fmt.Printf("  run %d of %d: p50 %s vs %s = %.2fx, p99 %s vs %s = %.2fx\n", r+1, runs,
			res.ipw[0].Round(10*time.Microsecond), res.hl[0].Round(10*time.Microsecond), res.ratio(0),
			res.ipw[1].Round(10*time.Microsecond), res.hl[1].Round(10*time.Microsecond), res.ratio(1))
		for name, d := range run {
			lat[name] = append(lat[name], d...)
		}
	}
	figs = append(figs, cniVerdict(results, 0, cniP50Goal, pairs), cniVerdict(results, 1, cniP99Goal, pairs), cniPooled(lat))
	rep.cni = lat
	// Where ipwarden's time goes: the agent's own handling (journal included) per ADD and DEL.
	for _, op := range []string{"ADD", "DEL"} {
		sum := localcluster.ScrapeSum("http://"+n.metrics+"/metrics", `ipwarden_agent_cni_request_duration_seconds_sum{op="`+op+`"}`)
		cnt := localcluster.ScrapeSum("http://"+n.metrics+"/metrics", `ipwarden_agent_cni_request_duration_seconds_count{op="`+op+`"}`)
		if cnt > 0 {
			figs = append(figs, figure{name: "agent's own " + op + " handling, mean (journal included)",
				value: (time.Duration(sum / cnt * float64(time.Second))).Round(time.Microsecond).String(), goal: "(informational)", ok: true})
		}
	}
	jsum := localcluster.ScrapeSum("http://"+n.metrics+"/metrics", "ipwarden_agent_journal_write_seconds_sum")
	jcnt := localcluster.ScrapeSum("http://"+n.metrics+"/metrics", "ipwarden_agent_journal_write_seconds_count")
	if jcnt > 0 {
		figs = append(figs, figure{name: "durable journal commit, mean", value: (time.Duration(jsum / jcnt * float64(time.Second))).Round(time.Microsecond).String(), goal: "(informational)", ok: true})
	}
	// With the API server paused (SIGSTOP), the ADDs of pods the agent's watch knows make no API
	// call, so they run at the same speed: measured against the same number of pairs just
	// before the pause.
	n4 := max(pairs/4, 50)
	up, err := ipw.latencies(ctx, n4)
	if err != nil {
		return nil, fmt.Errorf("ipwarden, before pausing the API server: %w", err)
	}
	resume, err := env.cp.PauseAPIServer()
	if err != nil {
		return nil, err
	}
	down, err := ipw.latencies(ctx, n4)
	if rerr := resume(); rerr != nil {
		return nil, rerr
	}
	if err != nil {
		return nil, fmt.Errorf("ipwarden, API server paused: %w", err)
	}
	a, b := quantile(down, 0.5), quantile(up, 0.5)
	figs = append(figs, figure{
		name:  fmt.Sprintf("CNI ADD+DEL p50 of known pods with the API server paused (SIGSTOP), vs running (%d pairs each)", n4),
		value: fmt.Sprintf("%s vs %s = %.2fx", a.Round(10*time.Microsecond), b.Round(10*time.Microsecond), float64(a)/float64(b)),
		goal:  "<= 1.1x (the same speed)", ok: float64(a) <= 1.1*float64(b),
	})
	// An ADD whose pod the agent's watch does not know (here: no such pod): one metadata GET of
	// the pod and one of its namespace, on a client without client-side rate limit.
	ipw.pods = nil
	miss, err := ipw.latencies(ctx, max(pairs/4, 20))
	if err != nil {
		return nil, fmt.Errorf("ipwarden, pods unknown to the watch: %w", err)
	}
	a, b = quantile(miss, 0.5), quantile(lat["host-local"], 0.5)
	figs = append(figs, figure{
		name:  fmt.Sprintf("CNI ADD+DEL p50 of pods the agent's watch does not know (%d pairs; a pod GET and a namespace metadata GET), vs host-local", len(miss)),
		value: fmt.Sprintf("%s vs %s = %.2fx", a.Round(10*time.Microsecond), b.Round(10*time.Microsecond), float64(a)/float64(b)),
		goal:  "(informational)", ok: true,
	})
	ipw.pods = known
	for _, conc := range []int{1, 8, 32} {
		a, err := ipw.throughput(ctx, conc, window)
		if err != nil {
			return nil, err
		}
		b, err := hl.throughput(ctx, conc, window)
		if err != nil {
			return nil, err
		}
		figs = append(figs, figure{
			name:  fmt.Sprintf("CNI ADD+DEL throughput at concurrency %d", conc),
			value: fmt.Sprintf("%.0f/s vs %.0f/s = %.2fx", a, b, a/b),
			goal:  "(ratio; higher is better)", ok: true,
		})
	}
	return figs, nil
}

// ipamNet invokes one IPAM plugin alone, as a main plugin would delegate to it.
type ipamNet struct {
	cni  *libcni.CNIConfig
	list *libcni.NetworkConfigList
	seq  atomic.Int64
	// pods, when set, are the pods (in namespace default) whose new sandboxes the pairs are,
	// round robin.
	pods []benchPod
}

// benchPods binds count pods to node (createPod).
func benchPods(ctx context.Context, c client.Client, node string, count int) ([]benchPod, error) {
	out := make([]benchPod, 0, count)
	for i := range count {
		p, err := createPod(ctx, c, node, fmt.Sprintf("%s-pod-%d", node, i))
		if err != nil {
			return nil, fmt.Errorf("create bench pod: %w", err)
		}
		out = append(out, p)
	}
	return out, nil
}

// waitAgentKnows waits until the agent counts the pods as demand: its pod watch has them.
func waitAgentKnows(ctx context.Context, n *node, pods []benchPod) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		got := localcluster.ScrapeSum("http://"+n.metrics+"/metrics", "ipwarden_agent_pool_requested_addresses")
		if got >= float64(len(pods)) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the agent requests %v addresses for %d bound pods after 30s", got, len(pods))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func ipamNetwork(cniDir, cache string, plugin map[string]any) (*ipamNet, error) {
	localcluster.IPAMOnly()
	// An IPAM plugin called directly reads its settings from the "ipam" section, as when a main
	// plugin delegates to it.
	conf := map[string]any{"type": plugin["type"], "ipam": plugin}
	b, _ := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": "bench-" + plugin["type"].(string), "plugins": []any{conf}})
	list, err := libcni.NetworkConfFromBytes(b)
	if err != nil {
		return nil, err
	}
	return &ipamNet{cni: libcni.NewCNIConfigWithCacheDir([]string{cniDir}, cache, pluginExec()), list: list}, nil
}

func (n *ipamNet) pair(ctx context.Context) error {
	id := n.seq.Add(1)
	rt := podRuntime(fmt.Sprintf("bench%012d", id), "bench", fmt.Sprintf("p%d", id), fmt.Sprintf("uid-%d", id))
	if len(n.pods) > 0 {
		p := n.pods[int(id)%len(n.pods)]
		rt = podRuntime(fmt.Sprintf("bench%012d", id), "default", p.name, p.uid)
	}
	if _, err := n.cni.AddNetworkList(ctx, n.list, rt); err != nil {
		return fmt.Errorf("ADD: %w", err)
	}
	if err := n.cni.DelNetworkList(ctx, n.list, rt); err != nil {
		return fmt.Errorf("DEL: %w", err)
	}
	return nil
}

func (n *ipamNet) latencies(ctx context.Context, count int) ([]time.Duration, error) {
	out := make([]time.Duration, 0, count)
	for range count {
		t0 := time.Now()
		if err := n.pair(ctx); err != nil {
			return nil, err
		}
		out = append(out, time.Since(t0))
	}
	return out, nil
}

func (n *ipamNet) throughput(ctx context.Context, workers int, window time.Duration) (float64, error) {
	var done atomic.Int64
	var firstErr atomic.Value
	deadline := time.Now().Add(window)
	var wg sync.WaitGroup
	start := time.Now()
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) {
				if err := n.pair(ctx); err != nil {
					firstErr.CompareAndSwap(nil, err)
					return
				}
				done.Add(1)
			}
		}()
	}
	wg.Wait()
	if err, _ := firstErr.Load().(error); err != nil {
		return 0, err
	}
	return float64(done.Load()) / time.Since(start).Seconds(), nil
}

func podRuntime(cid, ns, name, uid string) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{ContainerID: cid, NetNS: "/proc/self/ns/net", IfName: "eth0",
		Args: [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", ns}, {"K8S_POD_NAME", name}, {"K8S_POD_UID", uid}}}
}

func quantile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[int(q*float64(len(s)-1))]
}

func createPool(ctx context.Context, c client.Client, name, cidr string, sc ipwardenv1.Scaling, cooldown time.Duration) error {
	return c.Create(ctx, &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: ipwardenv1.IPPoolSpec{
		CIDRs: []ipwardenv1.CIDR{ipwardenv1.CIDR(cidr)}, Scaling: sc, ReuseCooldown: metav1.Duration{Duration: cooldown},
		NodeSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"ipwarden.io/bench-pool": name}},
	}})
}

// pluginExec is libcni's default plugin executor, given explicitly: with nil, libcni creates it
// lazily inside each call, which races when calls run concurrently (a burst).
func pluginExec() invoke.Exec {
	return &invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: os.Stderr}, PluginDecoder: version.PluginDecoder{}}
}

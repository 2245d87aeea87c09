package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/agent"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/controlplane"
)

// scaleOptions are the scale bench's knobs (make bench-scale).
type scaleOptions struct {
	nodes   int
	pods    int           // burst: pods per node
	rest    time.Duration // the quiet window writes at rest are counted over
	workers int           // the runtime stand-in's concurrent ADDs
	// scenarios run after the burst, in order: restart (every agent, 10 % at a time), failover
	// (the leading controller killed), apiserver (kube-apiserver restarted), newpool (a pool
	// created and grown with 1 % of the agents down).
	scenarios []string
}

// scaleBench runs N nodes, each served by the real agent code (agent.Run: the service, journal,
// Kube watches and node Lease a DaemonSet pod runs; many in this process, each with its own
// connection to the API server, state directory and socket), against a real kube-apiserver and
// etcd and the real controller process with leader election and the fence policy. A runtime
// stand-in sends ADD over each agent's socket as the plugin does. It measures the API server's
// load at rest and in a burst, the watches per node, the burst's ADD latency and the controller's
// CPU and memory.
func scaleBench(ctx context.Context, env *benchEnv, o scaleOptions) ([]figure, error) {
	log := func(f string, a ...any) { fmt.Printf("  "+f+"\n", a...) }
	ctrllog.SetLogger(logr.Discard())
	c := env.c
	baseWatches, err := apiWatches(ctx, env.cp.Config)
	if err != nil {
		return nil, err
	}
	labels := map[string]string{"ipwarden.io/bench-pool": "bench-scale"}
	if err := createPool(ctx, c, "bench-scale", "10.64.0.0/12", ipwardenv1.Scaling{BatchSize: 16, BufferPercent: 50, MaxPerNode: 250}, 30*time.Second); err != nil {
		return nil, err
	}
	t0 := time.Now()
	if err := forEach(ctx, o.nodes, 32, func(i int) error {
		return c.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: scaleNode(i), Labels: labels}})
	}); err != nil {
		return nil, fmt.Errorf("create nodes: %w", err)
	}
	log("%d Node objects in %s", o.nodes, time.Since(t0).Round(time.Millisecond))

	// The controller: leader-elected and fenced, as deployed.
	ctrl, _, err := startScaleController(env, "controller")
	if err != nil {
		return nil, err
	}
	var sc *scaleRun
	defer func() {
		ctrl.Stop()
		if sc != nil {
			sc.ctrl.Stop()
			if sc.standby != nil {
				sc.standby.Stop()
			}
		}
	}()

	// The agents, in this process.
	dir, err := os.MkdirTemp("", "ipw-scale-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	scheme := k8sruntime.NewScheme()
	_ = clientgoscheme.AddToScheme(scheme)
	_ = ipwardenv1.AddToScheme(scheme)
	agents := &scaleAgents{parent: ctx}
	defer agents.stopAll()
	sockets := make([]string, o.nodes)
	t0 = time.Now()
	for i := range o.nodes {
		sockets[i] = filepath.Join(dir, strconv.Itoa(i), "a.sock")
		cfg := agent.Config{Node: scaleNode(i), RestConfig: ownConnection(env.cp.Config), Scheme: scheme, Socket: sockets[i],
			StateDir: filepath.Join(dir, strconv.Itoa(i), "state"), AddressWait: 60 * time.Second, MetricsAddr: "0", ProbeAddr: "0",
			Resync: time.Minute, RequestCoalesce: 100 * time.Millisecond, LeaseNamespace: controlplane.ControllerNamespace,
			ControllerLease: controlplane.ControllerLease, ReserveAhead: ipam.AheadPerPool, Log: logr.Discard()}
		if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
			return nil, err
		}
		agents.add(cfg)
	}
	agents.sockets = sockets
	if err := waitAllServe(ctx, sockets, 10*time.Minute); err != nil {
		return nil, err
	}
	startup := time.Since(t0)
	log("%d agents serving ADD in %s", o.nodes, startup.Round(time.Second))

	// Rest: let the start settle, then count the API server's requests over a quiet window.
	if err := settle(ctx, env.cp.Config, 20*time.Second, 3*time.Minute); err != nil {
		return nil, err
	}
	before, err := apiRequests(ctx, env.cp.Config)
	if err != nil {
		return nil, err
	}
	cpu0 := procCPU(ctrl.Pid())
	time.Sleep(o.rest) // the measured window: nothing happens but what ipwarden does by itself
	after, err := apiRequests(ctx, env.cp.Config)
	if err != nil {
		return nil, err
	}
	restCPU := procCPU(ctrl.Pid()) - cpu0
	writes := after.sub(before).writes().ipwardens()
	allWatches, err := apiWatches(ctx, env.cp.Config)
	if err != nil {
		return nil, err
	}
	watches := allWatches.sub(baseWatches)

	// Burst: pods bound to every node at once, then the runtime stand-in's ADDs.
	burst0, err := apiRequests(ctx, env.cp.Config)
	if err != nil {
		return nil, err
	}
	t0 = time.Now()
	sc = &scaleRun{env: env, o: o, agents: agents, ctrl: ctrl, log: log}
	all := make([]int, o.nodes)
	for i := range all {
		all[i] = i
	}
	pods, err := sc.createPods(ctx, all, o.pods, "scale")
	if err != nil {
		return nil, fmt.Errorf("create pods: %w", err)
	}
	sc.burst = pods
	log("%d pods bound in %s", len(pods), time.Since(t0).Round(time.Second))
	t0 = time.Now()
	lat, failed := sc.addAll(ctx, pods)
	burstTime := time.Since(t0)
	if err := settle(ctx, env.cp.Config, 5*time.Second, 3*time.Minute); err != nil {
		return nil, err
	}
	burst1, err := apiRequests(ctx, env.cp.Config)
	if err != nil {
		return nil, err
	}
	burstWrites := burst1.sub(burst0).writes().ipwardens()
	delete(burstWrites, [2]string{"PUT", "leases"}) // renewals are the cost at rest, counted above
	rss := procRSS(ctrl.Pid())

	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	q := func(f float64) time.Duration { return lat[int(f*float64(len(lat)-1))].Round(time.Millisecond) }
	n := float64(o.nodes)
	figs := []figure{
		{name: fmt.Sprintf("scale %d nodes: agents serving ADD after start", o.nodes), value: startup.Round(time.Second).String(), goal: "(informational)", ok: true},
		{name: fmt.Sprintf("scale %d nodes: API writes at rest per node (over %s)", o.nodes, o.rest),
			value: fmt.Sprintf("%.3f/s (%s)", writes.total()/o.rest.Seconds()/n, writes.perSecond(o.rest, n)), goal: "<= 0.1/s", ok: writes.total()/o.rest.Seconds()/n <= 0.1},
		{name: fmt.Sprintf("scale %d nodes: watches per node by resource", o.nodes), value: watches.perNode(n), goal: "<= 1 per kind", ok: watches.maxPerNode(n) <= 1.05},
		{name: fmt.Sprintf("scale %d nodes: burst of %d pods per node, ADDs that failed", o.nodes, o.pods), value: fmt.Sprintf("%d of %d in %s", failed, len(pods), burstTime.Round(time.Second)), goal: "0", ok: failed == 0},
		{name: fmt.Sprintf("scale %d nodes: burst ADD p50 / p99 (agent's own time incl. IP wait; no plugin exec)", o.nodes), value: fmt.Sprintf("%s / %s", q(0.5), q(0.99)), goal: "p99 <= 1s", ok: q(0.99) <= time.Second},
		{name: fmt.Sprintf("scale %d nodes: burst API writes per node, agents' spec / controller's status (per pod)", o.nodes),
			value: fmt.Sprintf("%.2f / %.2f (%.3f per pod; %s)", burstWrites.of("PATCH", "nodeipallocations")/n, burstWrites.of("PUT", "nodeipallocations/status")/n,
				burstWrites.total()/float64(len(pods)), burstWrites.summary()),
			goal: "controller <= 2 per node", ok: burstWrites.of("PUT", "nodeipallocations/status")/n <= 2},
		{name: fmt.Sprintf("scale %d nodes: controller CPU at rest, RSS after the burst", o.nodes), value: fmt.Sprintf("%.1f%% of a core, %d MiB", 100*restCPU/o.rest.Seconds(), rss>>20), goal: "RSS < 300 MiB", ok: rss < 300<<20},
	}
	for _, name := range o.scenarios {
		var more []figure
		var err error
		switch name {
		case "restart":
			more, err = sc.rollingRestart(ctx)
		case "failover":
			more, err = sc.failover(ctx)
		case "apiserver":
			more, err = sc.apiserverRestart(ctx)
		case "newpool":
			more, err = sc.newPool(ctx)
		case "":
		default:
			err = fmt.Errorf("unknown scale scenario %q: use restart, failover, apiserver, newpool", name)
		}
		if err != nil {
			return figs, fmt.Errorf("scenario %s: %w", name, err)
		}
		figs = append(figs, more...)
	}
	return figs, nil
}

func scaleNode(i int) string { return fmt.Sprintf("scale-%05d", i) }

// ownConnection is cfg for one agent with its own connection to the API server, as each node's
// agent has (client-go shares one transport between configs that look alike; a Dial function
// makes it build one per config).
func ownConnection(cfg *rest.Config) *rest.Config {
	c := rest.CopyConfig(cfg)
	c.QPS, c.Burst = 5, 10 // the agent's defaults in a cluster
	d := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}
	c.Dial = d.DialContext
	return c
}

// forEach runs f(0..n-1) on at most par goroutines and returns the first error.
func forEach(ctx context.Context, n, par int, f func(i int) error) error {
	var next atomic.Int64
	var first atomic.Value
	var wg sync.WaitGroup
	for range min(par, n) {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= n || ctx.Err() != nil || first.Load() != nil {
					return
				}
				if err := f(i); err != nil {
					first.CompareAndSwap(nil, err)
				}
			}
		})
	}
	wg.Wait()
	if err, _ := first.Load().(error); err != nil {
		return err
	}
	return ctx.Err()
}

// waitAllServe waits until every agent's STATUS says it serves ADD.
func waitAllServe(ctx context.Context, sockets []string, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	pending := append([]string(nil), sockets...)
	for len(pending) > 0 {
		var still []string
		for _, s := range pending {
			c, cancel := context.WithTimeout(ctx, 2*time.Second)
			resp, err := cniproto.Call(c, s, cniproto.Request{Op: cniproto.OpStatus})
			cancel()
			if err != nil || resp.Error != nil {
				still = append(still, s)
			}
		}
		pending = still
		if len(pending) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d agents not serving ADD after %s", len(pending), len(sockets), limit)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
	return nil
}

// requestCounts is apiserver_request_total summed by (verb, resource).
type requestCounts map[[2]string]float64

func apiMetrics(ctx context.Context, cfg *rest.Config) (string, error) {
	rc, err := rest.RESTClientFor(restForMetrics(cfg))
	if err != nil {
		return "", err
	}
	b, err := rc.Get().AbsPath("/metrics").DoRaw(ctx)
	return string(b), err
}

func restForMetrics(cfg *rest.Config) *rest.Config {
	c := rest.CopyConfig(cfg)
	c.GroupVersion = &corev1.SchemeGroupVersion
	c.APIPath = "/api"
	c.NegotiatedSerializer = clientgoscheme.Codecs.WithoutConversion()
	c.QPS = -1
	return c
}

func apiRequests(ctx context.Context, cfg *rest.Config) (requestCounts, error) {
	body, err := apiMetrics(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("read the API server's metrics: %w", err)
	}
	return parseRequests(body), nil
}

// parseRequests sums apiserver_request_total by verb and resource (subresource appended as
// resource/subresource).
func parseRequests(body string) requestCounts {
	out := requestCounts{}
	for _, line := range strings.Split(body, "\n") {
		if !strings.HasPrefix(line, "apiserver_request_total{") {
			continue
		}
		labels, v, ok := splitSample(line)
		if !ok {
			continue
		}
		res := labels["resource"]
		if sub := labels["subresource"]; sub != "" {
			res += "/" + sub
		}
		out[[2]string{labels["verb"], res}] += v
	}
	return out
}

// splitSample parses `name{k="v",...} value`.
func splitSample(line string) (map[string]string, float64, bool) {
	open, close := strings.IndexByte(line, '{'), strings.LastIndexByte(line, '}')
	if open < 0 || close < open {
		return nil, 0, false
	}
	v, err := strconv.ParseFloat(strings.TrimSpace(line[close+1:]), 64)
	if err != nil {
		return nil, 0, false
	}
	labels := map[string]string{}
	for _, kv := range strings.Split(line[open+1:close], ",") {
		k, val, ok := strings.Cut(kv, "=")
		if ok {
			labels[k] = strings.Trim(val, `"`)
		}
	}
	return labels, v, true
}

func (a requestCounts) sub(b requestCounts) requestCounts {
	out := requestCounts{}
	for k, v := range a {
		if d := v - b[k]; d > 0 {
			out[k] = d
		}
	}
	return out
}

// writes keeps the write verbs.
func (a requestCounts) writes() requestCounts {
	out := requestCounts{}
	for k, v := range a {
		switch k[0] {
		case "POST", "PUT", "PATCH", "DELETE", "APPLY", "CREATE", "UPDATE", "DELETECOLLECTION":
			out[k] = v
		}
	}
	return out
}

func (a requestCounts) of(verb, resource string) float64 { return a[[2]string{verb, resource}] }

func (a requestCounts) total() float64 {
	var t float64
	for _, v := range a {
		t += v
	}
	return t
}

// ipwardens keeps the requests ipwarden makes: its own objects, Leases, events and Node
// status (not the bench's pods nor the API server's own endpoints).
func (a requestCounts) ipwardens() requestCounts {
	out := requestCounts{}
	for k, v := range a {
		switch res, _, _ := strings.Cut(k[1], "/"); res {
		case "nodeipallocations", "ippools", "leases", "events", "nodes":
			out[k] = v
		}
	}
	return out
}

func (a requestCounts) perSecond(window time.Duration, nodes float64) string {
	var parts []string
	for _, k := range a.keys() {
		parts = append(parts, fmt.Sprintf("%s %s %.3f", k[0], k[1], a[k]/window.Seconds()/nodes))
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

func (a requestCounts) summary() string {
	var parts []string
	for _, k := range a.keys() {
		parts = append(parts, fmt.Sprintf("%s %s %.0f", k[0], k[1], a[k]))
	}
	return strings.Join(parts, ", ")
}

func (a requestCounts) keys() [][2]string {
	keys := make([][2]string, 0, len(a))
	for k := range a {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i][1]+keys[i][0] < keys[j][1]+keys[j][0] })
	return keys
}

// watchCounts is apiserver_longrunning_requests{verb="WATCH"} by resource.
type watchCounts map[string]float64

func apiWatches(ctx context.Context, cfg *rest.Config) (watchCounts, error) {
	body, err := apiMetrics(ctx, cfg)
	if err != nil {
		return nil, err
	}
	return parseWatches(body), nil
}

func parseWatches(body string) watchCounts {
	out := watchCounts{}
	for _, line := range strings.Split(body, "\n") {
		if !strings.HasPrefix(line, "apiserver_longrunning_requests{") {
			continue
		}
		labels, v, ok := splitSample(line)
		if !ok || labels["verb"] != "WATCH" {
			continue
		}
		out[labels["resource"]] += v
	}
	return out
}

func (w watchCounts) sub(b watchCounts) watchCounts {
	out := watchCounts{}
	for k, v := range w {
		if d := v - b[k]; d > 0 {
			out[k] = d
		}
	}
	return out
}

func (w watchCounts) perNode(nodes float64) string {
	keys := make([]string, 0, len(w))
	for k := range w {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %.2f", k, w[k]/nodes))
	}
	return strings.Join(parts, ", ")
}

func (w watchCounts) maxPerNode(nodes float64) float64 {
	var m float64
	for _, v := range w {
		m = max(m, v/nodes)
	}
	return m
}

// settle waits until the API server's write count stops rising for quiet (at most limit).
func settle(ctx context.Context, cfg *rest.Config, quiet, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	last, err := apiRequests(ctx, cfg)
	if err != nil {
		return err
	}
	stillSince := time.Now()
	for time.Since(stillSince) < quiet {
		if time.Now().After(deadline) {
			return nil // busy still: measure anyway, the figures will show it
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
		now, err := apiRequests(ctx, cfg)
		if err != nil {
			return err
		}
		// Lease renewals are the steady state, not the settling: count the rest.
		d := now.sub(last).writes().ipwardens()
		delete(d, [2]string{"PUT", "leases"})
		if d.total() > 0 {
			stillSince = time.Now()
		}
		last = now
	}
	return nil
}

// procCPU is a process's user+system CPU seconds (/proc/PID/stat).
func procCPU(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseFloat(f[11], 64)
	k, _ := strconv.ParseFloat(f[12], 64)
	return (u + k) / 100 // USER_HZ
}

// procRSS is a process's resident memory in bytes (/proc/PID/status VmRSS).
func procRSS(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return kb << 10
		}
	}
	return 0
}

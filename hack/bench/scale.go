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
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/controlplane"
)

// scaleOptions are the scale bench's knobs (make bench-scale).
type scaleOptions struct {
	nodes   int
	pods    int           // burst: pods per node
	rest    time.Duration // the quiet window writes at rest are counted over
	workers int           // the runtime stand-in's concurrent DEL+ADD pairs (API server scenario)
	// burstNodes is how many nodes burst at once: each binds its pods at the same moment and
	// sends their ADDs at once; the next node starts as one ends.
	burstNodes int
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
// load at rest and in a burst (each node's pods bound at once and their ADDs concurrent on that
// node, scale_burst.go), the watches per node, the burst's ADD latency and IP wait and the
// controller's CPU and memory.
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
	// Each agent serves its metrics on loopback until the burst is measured (its IP wait); the
	// restarts after it serve none. Each has a loopback address of its own (agentMetricsAddr): a
	// free port picked now and bound later could be taken meanwhile by one of the thousands of
	// connections the agents open (it was, at 1,000 nodes).
	metricsAddrs := make([]string, o.nodes)
	t0 = time.Now()
	for i := range o.nodes {
		sockets[i] = filepath.Join(dir, strconv.Itoa(i), "a.sock")
		metricsAddrs[i] = agentMetricsAddr(i)
		cfg := agent.Config{Node: scaleNode(i), RestConfig: ownConnection(env.cp.Config), Scheme: scheme, Socket: sockets[i],
			StateDir: filepath.Join(dir, strconv.Itoa(i), "state"), AddressWait: 60 * time.Second, MetricsAddr: metricsAddrs[i], ProbeAddr: "0",
			Resync: time.Minute, RequestCoalesce: 100 * time.Millisecond, LeaseNamespace: controlplane.ControllerNamespace,
			ControllerLease: controlplane.ControllerLease, Log: logr.Discard()}
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

	// Burst: every node's pods bound at the same moment and their ADDs sent at once to its
	// agent, burstNodes nodes at a time (scale_burst.go).
	sc = &scaleRun{env: env, o: o, agents: agents, ctrl: ctrl, log: log}
	agents0 := scrapeAgents(ctx, metricsAddrs)
	burst0, err := apiRequests(ctx, env.cp.Config)
	if err != nil {
		return nil, err
	}
	cpuBurst0 := procCPU(ctrl.Pid())
	t0 = time.Now()
	br, err := sc.burstAll(ctx, o.burstNodes, "scale")
	burstTime := time.Since(t0)
	cpuBurst := procCPU(ctrl.Pid()) - cpuBurst0
	if err != nil {
		return nil, fmt.Errorf("burst: %w", err)
	}
	sc.burst = br.pods
	log("%d nodes burst, %d at a time: %d pods bound and ADDed in %s, %d ADDs failed; controller CPU %.1f s", o.nodes, o.burstNodes, len(br.pods),
		burstTime.Round(time.Second), br.failed, cpuBurst)
	for _, e := range br.errs {
		log("  a failed ADD: %s", e)
	}
	if err := settle(ctx, env.cp.Config, 5*time.Second, 3*time.Minute); err != nil {
		return nil, err
	}
	cpuSettled := procCPU(ctrl.Pid()) - cpuBurst0
	burst1, err := apiRequests(ctx, env.cp.Config)
	if err != nil {
		return nil, err
	}
	ah := scrapeAgents(ctx, metricsAddrs).plus(agents0, -1)
	wait := ah.ipWait
	for i := range agents.cfgs {
		agents.cfgs[i].MetricsAddr = "0" // a restarted agent could not bind its address again at once
	}
	burstWrites := burst1.sub(burst0).writes().ipwardens()
	delete(burstWrites, [2]string{"PUT", "leases"}) // renewals are the cost at rest, counted above
	rss := procRSS(ctrl.Pid())

	lat := br.lat
	q := func(ds []time.Duration, f float64) time.Duration { return quantileOf(ds, f) }
	n := float64(o.nodes)
	burstName := fmt.Sprintf("scale %d nodes: burst (%d pods bound to a node at once, their ADDs at once; %d nodes at a time)", o.nodes, o.pods, o.burstNodes)
	figs := []figure{
		{name: fmt.Sprintf("scale %d nodes: agents serving ADD after start", o.nodes), value: startup.Round(time.Second).String(), goal: "(informational)", ok: true},
		{name: fmt.Sprintf("scale %d nodes: API writes at rest per node (over %s)", o.nodes, o.rest),
			value: fmt.Sprintf("%.3f/s (%s)", writes.total()/o.rest.Seconds()/n, writes.perSecond(o.rest, n)), goal: "<= 0.1/s", ok: writes.total()/o.rest.Seconds()/n <= 0.1},
		{name: fmt.Sprintf("scale %d nodes: watches per node by resource", o.nodes), value: watches.perNode(n), goal: "<= 1 per kind", ok: watches.maxPerNode(n) <= 1.05},
		{name: burstName + ", ADDs that failed", value: fmt.Sprintf("%d of %d in %s", br.failed, len(br.pods), burstTime.Round(time.Second)), goal: "0", ok: br.failed == 0},
		{name: fmt.Sprintf("scale %d nodes: burst ADD p50 / p99 / max (agent's answer incl. IP wait; no plugin exec)", o.nodes),
			value: fmt.Sprintf("%s / %s / %s", q(lat, 0.5), q(lat, 0.99), q(lat, 1)), goal: "p99 <= 1s", ok: len(lat) > 0 && q(lat, 0.99) <= time.Second},
		{name: fmt.Sprintf("scale %d nodes: burst IP wait (agents' ip_wait_seconds): ADDs that waited over 1 ms; p50 / p99 / max bucket; mean", o.nodes),
			value: fmt.Sprintf("%.0f of %.0f; %s / %s / %s; %s", wait.over(0.001), wait.count, fmtBound(wait, wait.quantile(0.5)), fmtBound(wait, wait.quantile(0.99)),
				fmtBound(wait, wait.quantile(1)), meanSeconds(wait)),
			goal: "p99 < 1s", ok: wait.count > 0 && wait.quantile(0.99) <= 1},
		{name: fmt.Sprintf("scale %d nodes: burst, the agents' own ADD handling p50 / p99 bucket (cni_request_duration_seconds); journal commits: count for the ADDs, p50 / p99 bucket, mean", o.nodes),
			value: fmt.Sprintf("%s / %s; %.0f for %.0f, %s / %s, %s", fmtBound(ah.add, ah.add.quantile(0.5)), fmtBound(ah.add, ah.add.quantile(0.99)),
				ah.journal.count, ah.add.count, fmtBound(ah.journal, ah.journal.quantile(0.5)), fmtBound(ah.journal, ah.journal.quantile(0.99)), meanSeconds(ah.journal)),
			goal: "(informational)", ok: true},
		{name: fmt.Sprintf("scale %d nodes: burst, one node: its pods bound / bound to last ADD answered, p50 / max", o.nodes),
			value: fmt.Sprintf("%s / %s; %s / %s", q(br.bound, 0.5), q(br.bound, 1), q(br.took, 0.5), q(br.took, 1)), goal: "(informational)", ok: true},
		{name: fmt.Sprintf("scale %d nodes: burst API writes per node, agents' spec / controller's status (per pod)", o.nodes),
			value: fmt.Sprintf("%.2f / %.2f (%.3f per pod; %s)", burstWrites.of("PATCH", "nodeipallocations")/n, burstWrites.of("PUT", "nodeipallocations/status")/n,
				burstWrites.total()/float64(len(br.pods)), burstWrites.summary()),
			goal: "controller <= 2 per node", ok: burstWrites.of("PUT", "nodeipallocations/status")/n <= 2},
		{name: fmt.Sprintf("scale %d nodes: controller CPU during the burst; until its writes settled", o.nodes),
			value: fmt.Sprintf("%.0f%% of a core (%.2f s over %s); %.2f s (%.2f ms per pod)", 100*cpuBurst/burstTime.Seconds(), cpuBurst, burstTime.Round(time.Second),
				cpuSettled, 1000*cpuSettled/float64(max(len(br.pods), 1))),
			goal: "(informational)", ok: true},
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

// agentHistograms are the histograms the burst reports, each added up over the agents.
type agentHistograms struct{ ipWait, add, journal histogram }

// scrapeAgents adds up the agents' histograms (an agent that does not answer adds nothing).
func scrapeAgents(ctx context.Context, addrs []string) agentHistograms {
	each := make([]agentHistograms, len(addrs))
	_ = forEach(ctx, len(addrs), 32, func(i int) error {
		m := scrape("http://" + addrs[i] + "/metrics")
		each[i] = agentHistograms{
			ipWait:  histogramOf(m, "ipwarden_agent_ip_wait_seconds", ""),
			add:     histogramOf(m, "ipwarden_agent_cni_request_duration_seconds", `op="ADD"`),
			journal: histogramOf(m, "ipwarden_agent_journal_write_seconds", ""),
		}
		return nil
	})
	var sum agentHistograms
	for _, h := range each {
		sum = sum.plus(h, 1)
	}
	return sum
}

func (a agentHistograms) plus(o agentHistograms, sign float64) agentHistograms {
	add := func(h, o histogram) histogram {
		if len(o.bounds) == 0 {
			return h
		}
		return h.plus(o, sign)
	}
	return agentHistograms{ipWait: add(a.ipWait, o.ipWait), add: add(a.add, o.add), journal: add(a.journal, o.journal)}
}

// meanSeconds is a histogram's mean observation as a duration.
func meanSeconds(h histogram) string {
	if h.count <= 0 {
		return "none"
	}
	return time.Duration(h.sum / h.count * float64(time.Second)).Round(100 * time.Microsecond).String()
}

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

// agentMetricsAddr is agent i's metrics address: a loopback address of its own in 127.42.0.0/16
// (Linux routes all of 127.0.0.0/8 to lo) on a fixed port, which no client connection of the
// bench (all from 127.0.0.1) can take.
func agentMetricsAddr(i int) string {
	return fmt.Sprintf("127.42.%d.%d:10372", i/250, i%250+1)
}

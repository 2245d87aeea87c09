package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	cnitypes "github.com/containernetworking/cni/pkg/types"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// benchPod is one pod the bench plays kubelet and runtime for: a Pod object bound to a node
// through the API, its sandbox's ADD and DEL through the real ipwarden-cni plugin.
type benchPod struct {
	name, uid string
	sandbox   int // the runtime's attempt: a failed ADD is torn down and retried in a new sandbox
}

func (p benchPod) cid() string { return fmt.Sprintf("%s-s%d", p.name, p.sandbox) }

// createPod binds a pod to node as the scheduler would.
func createPod(ctx context.Context, c client.Client, node, name string) (benchPod, error) {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "c", Image: "bench"}}}}
	if err := c.Create(ctx, p); err != nil {
		return benchPod{}, err
	}
	return benchPod{name: name, uid: string(p.UID)}, nil
}

// addRetry runs the pod's ADD as a runtime does: a sandbox whose ADD fails with CNI error 11
// (try again later) is torn down (DEL) and the pod retried in a new one, until deadline. It
// returns how many ADDs failed with error 11; any other error ends the pod's tries.
func (n *ipamNet) addRetry(ctx context.Context, p *benchPod, deadline time.Time) (int, error) {
	failed := 0
	for {
		_, err := n.cni.AddNetworkList(ctx, n.list, podRuntime(p.cid(), "default", p.name, p.uid))
		if err == nil {
			return failed, nil
		}
		var ce *cnitypes.Error
		if !errors.As(err, &ce) || ce.Code != cnitypes.ErrTryAgainLater {
			return failed, err
		}
		failed++
		if traceChanges {
			fmt.Printf("  trace %s ADD of %s failed: %v\n", time.Now().UTC().Format("15:04:05.000"), p.name, ce.Msg)
		}
		if derr := n.cni.DelNetworkList(ctx, n.list, podRuntime(p.cid(), "default", p.name, p.uid)); derr != nil {
			return failed, fmt.Errorf("DEL of a failed sandbox: %w", derr)
		}
		if !time.Now().Before(deadline) || ctx.Err() != nil {
			return failed, err
		}
		p.sandbox++
	}
}

// stopPod tears the pod's sandbox down (DEL) and removes the Pod, as the kubelet does last.
func stopPod(ctx context.Context, c client.Client, n *ipamNet, p benchPod) error {
	if err := n.cni.DelNetworkList(ctx, n.list, podRuntime(p.cid(), "default", p.name, p.uid)); err != nil {
		return fmt.Errorf("DEL %s: %w", p.name, err)
	}
	return c.Delete(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: p.name}}, client.GracePeriodSeconds(0))
}

// metrics is one scrape of a /metrics endpoint: every sample by its series (name{labels}).
type metrics map[string]float64

func scrape(url string) metrics {
	resp, err := http.Get(url)
	if err != nil {
		return metrics{}
	}
	defer resp.Body.Close()
	return parseMetrics(resp.Body)
}

// parseMetrics reads the Prometheus text format: comments and blank lines are skipped, a
// sample whose value does not parse is left out.
func parseMetrics(r io.Reader) metrics {
	m := metrics{}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
			m[line[:i]] = v
		}
	}
	return m
}

// sum adds the samples of metric whose labels contain every one of labels (`resource="x"`).
func (m metrics) sum(metric string, labels ...string) float64 {
	var s float64
next:
	for k, v := range m {
		if k != metric && !strings.HasPrefix(k, metric+"{") {
			continue
		}
		for _, l := range labels {
			if !strings.Contains(k, l) {
				continue next
			}
		}
		s += v
	}
	return s
}

// writeCount is the API writes of the controller and the agents, by kind.
type writeCount struct{ agentSpec, nodeStatus, poolStatus, other float64 }

func countWrites(ctrl string, agents []*node) writeCount {
	c := scrape("http://" + ctrl + "/metrics")
	w := writeCount{
		nodeStatus: c.sum("ipwarden_controller_api_writes_total", `resource="nodeipallocations/status"`),
		poolStatus: c.sum("ipwarden_controller_api_writes_total", `resource="ippools/status"`),
	}
	w.other = c.sum("ipwarden_controller_api_writes_total") - w.nodeStatus - w.poolStatus
	for _, n := range agents {
		w.agentSpec += scrape("http://" + n.metrics + "/metrics").sum("ipwarden_agent_spec_writes_total")
	}
	return w
}

func (w writeCount) minus(o writeCount) writeCount {
	return writeCount{w.agentSpec - o.agentSpec, w.nodeStatus - o.nodeStatus, w.poolStatus - o.poolStatus, w.other - o.other}
}

func (w writeCount) total() float64 { return w.agentSpec + w.nodeStatus + w.poolStatus + w.other }

func (w writeCount) String() string {
	s := fmt.Sprintf("agent spec %.0f, node status %.0f, pool status %.0f", w.agentSpec, w.nodeStatus, w.poolStatus)
	if w.other > 0 {
		s += fmt.Sprintf(", other %.0f", w.other)
	}
	return s
}

// holding is one node's share of a pool as its NodeIPAllocation shows it.
type holding struct {
	requested, held int
	runs            int // contiguous ranges of the held addresses: one route each at best
	addresses       string
}

func holdings(ctx context.Context, c client.Client, pool string, names []string) (map[string]holding, error) {
	out := map[string]holding{}
	for _, name := range names {
		a := &ipwardenv1.NodeIPAllocation{}
		if err := c.Get(ctx, client.ObjectKey{Name: name}, a); err != nil {
			return nil, err
		}
		var h holding
		for _, p := range a.Spec.Pools {
			if p.Pool == pool {
				h.requested = int(p.Requested)
			}
		}
		for _, p := range a.Status.Pools {
			if p.Pool != pool {
				continue
			}
			set, err := addr.ParseSet(p.Addresses)
			if err != nil {
				return nil, fmt.Errorf("node %s: %w", name, err)
			}
			h.held, h.runs, h.addresses = int(p.Held), set.NumRanges(), set.String()
		}
		out[name] = h
	}
	return out, nil
}

// poolSettled says whether the pool's status shows what the nodes hold (plus its cooling
// record): the controller's coalesced pool status write has landed.
func poolSettled(ctx context.Context, c client.Client, pool string, hs map[string]holding) error {
	p := &ipwardenv1.IPPool{}
	if err := c.Get(ctx, client.ObjectKey{Name: pool}, p); err != nil {
		return err
	}
	want := int64(0)
	for _, h := range hs {
		want += int64(h.held)
	}
	for _, cb := range p.Status.Cooling {
		set, err := addr.ParseSet(cb.Addresses)
		if err != nil {
			return err
		}
		want += set.Size().Int64Sat()
	}
	if p.Status.Allocated != want {
		return fmt.Errorf("pool status allocated %d, nodes hold and the pool cools %d", p.Status.Allocated, want)
	}
	return nil
}

// giveBacks watches the NodeIPAllocations and counts every status write that lowers a node's
// holding of the pool (a take-back of addresses the node gave back) until stop is called.
func giveBacks(ctx context.Context, env *benchEnv, pool string) (stop func() (events, addresses int), err error) {
	wc, err := client.NewWithWatch(env.cp.Config, client.Options{Scheme: env.c.Scheme()})
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	w, err := wc.Watch(ctx, &ipwardenv1.NodeIPAllocationList{})
	if err != nil {
		cancel()
		return nil, err
	}
	var events, addresses int
	done := make(chan struct{})
	go func() {
		defer close(done)
		last := map[string]int32{}
		for ev := range w.ResultChan() {
			a, ok := ev.Object.(*ipwardenv1.NodeIPAllocation)
			if !ok || ev.Type == watch.Deleted {
				continue
			}
			for _, p := range a.Status.Pools {
				if p.Pool != pool {
					continue
				}
				if prev, seen := last[a.Name]; seen && p.Held < prev {
					events++
					addresses += int(prev - p.Held)
				}
				last[a.Name] = p.Held
			}
		}
	}()
	return func() (int, int) {
		w.Stop()
		cancel()
		<-done
		return events, addresses
	}, nil
}

type churnOptions struct {
	nodes, pods  int
	interval     time.Duration // one pod replaced per node per interval
	duration     time.Duration
	releaseDelay time.Duration
	cooldown     time.Duration
}

// churnBench runs a few real agents on one pool with pods bound to each node and steady churn
// (a pod stopped and a new one started per node at a fixed rate), then lets the nodes come to
// rest. It counts every API write from the first replacement until the nodes are back at rest
// (the growth while freed addresses cool, and the give-back after the release delay), per pod
// lifecycle, against 1/batch.
func churnBench(ctx context.Context, env *benchEnv, o churnOptions) ([]figure, error) {
	const pool, batch, buffer = "bench-churn", 16, 50
	slack := int32(100)
	if err := env.c.Create(ctx, &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: pool}, Spec: ipwardenv1.IPPoolSpec{
		CIDRs: []ipwardenv1.CIDR{"10.250.0.0/16"}, ReuseCooldown: metav1.Duration{Duration: o.cooldown},
		Scaling: ipwardenv1.Scaling{BatchSize: batch, BufferPercent: buffer, MaxPerNode: 250,
			ReleaseSlackPercent: &slack, ReleaseDelay: &metav1.Duration{Duration: o.releaseDelay}},
		NodeSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"ipwarden.io/bench-pool": pool}},
	}}); err != nil {
		return nil, err
	}
	restIdle := batch * (buffer + 100) / 100 // batch*(buffer+1): the most a node holds idle at rest
	type churnNode struct {
		*node
		net     *ipamNet
		running []benchPod
		seq     int
	}
	var nodes []*churnNode
	var agents []*node
	var names []string
	defer func() {
		for _, n := range agents {
			n.agent.Stop()
		}
	}()
	for i := range o.nodes {
		n, err := startNode(ctx, env, fmt.Sprintf("bench-churn-%d", i), pool)
		if err != nil {
			return nil, err
		}
		agents, names = append(agents, n), append(names, n.name)
		net, err := ipamNetwork(env.bins.CNIDir, filepath.Join(env.cp.Dir, "cni-cache-"+n.name), map[string]any{"type": "ipwarden", "socket": n.socket})
		if err != nil {
			return nil, err
		}
		nodes = append(nodes, &churnNode{node: n, net: net})
	}
	fmt.Printf("  %d nodes, %d pods each, one replaced per node every %s for %s; pool batch %d, buffer %d%%, releaseSlackPercent %d, releaseDelay %s, reuseCooldown %s\n",
		o.nodes, o.pods, o.interval, o.duration, batch, buffer, slack, o.releaseDelay, o.cooldown)

	// Warm-up (not counted): every node's pods bound and started, the holdings settled.
	deadline := time.Now().Add(2 * time.Minute)
	var wg sync.WaitGroup
	errs := make(chan error, o.nodes*o.pods)
	for _, n := range nodes {
		n.running = make([]benchPod, o.pods)
		for i := range o.pods {
			wg.Add(1)
			go func() {
				defer wg.Done()
				p, err := createPod(ctx, env.c, n.name, fmt.Sprintf("%s-p%04d", n.name, i))
				if err == nil {
					_, err = n.net.addRetry(ctx, &p, deadline)
				}
				if err != nil {
					errs <- fmt.Errorf("warm-up pod %d on %s: %w", i, n.name, err)
				}
				n.running[i] = p
			}()
		}
		n.seq = o.pods
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return nil, err
	}
	settled := func(atRest bool) error {
		hs, err := holdings(ctx, env.c, pool, names)
		if err != nil {
			return err
		}
		for name, h := range hs {
			if h.held != h.requested {
				return fmt.Errorf("%s holds %d, requests %d", name, h.held, h.requested)
			}
			if atRest && h.held-o.pods > restIdle {
				return fmt.Errorf("%s holds %d for %d pods", name, h.held, o.pods)
			}
		}
		return poolSettled(ctx, env.c, pool, hs)
	}
	if err := localcluster.WaitFor(ctx, time.Minute, 100*time.Millisecond, func() error { return settled(false) }); err != nil {
		return nil, fmt.Errorf("warm-up did not settle: %w", err)
	}

	// The window: steady churn, then rest until every node is back within batch*(buffer+1)
	// idle (the give-back after the release delay) and the controller has written it all.
	stopWatch, err := giveBacks(ctx, env, pool)
	if err != nil {
		return nil, err
	}
	before := countWrites(env.ctrlMetrics, agents)
	var (
		mu       sync.Mutex
		runs     []int // every node's runs, sampled every 5 s through the window
		starts   int
		failed   int
		waits    []time.Duration
		churnErr error
	)
	sample := func() {
		hs, err := holdings(ctx, env.c, pool, names)
		if err != nil {
			return
		}
		mu.Lock()
		for _, h := range hs {
			runs = append(runs, h.runs)
		}
		mu.Unlock()
	}
	sampleCtx, stopSampling := context.WithCancel(ctx)
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		t := time.NewTicker(5 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-sampleCtx.Done():
				return
			case <-t.C:
				sample()
			}
		}
	}()
	t0 := time.Now()
	churnEnd := t0.Add(o.duration)
	for i, n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(i), 14))
			t := time.NewTicker(o.interval)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case now := <-t.C:
					if !now.Before(churnEnd) {
						return
					}
				}
				// A random pod stops; a new one is bound to the node and started.
				k := rng.IntN(len(n.running))
				err := stopPod(ctx, env.c, n.net, n.running[k])
				var p benchPod
				if err == nil {
					p, err = createPod(ctx, env.c, n.name, fmt.Sprintf("%s-p%04d", n.name, n.seq))
					n.seq++
				}
				var f int
				start := time.Now()
				if err == nil {
					f, err = n.net.addRetry(ctx, &p, start.Add(time.Minute))
				}
				mu.Lock()
				failed += f
				if err != nil {
					if churnErr == nil {
						churnErr = fmt.Errorf("%s: %w", n.name, err)
					}
					mu.Unlock()
					return
				}
				starts++
				waits = append(waits, time.Since(start))
				mu.Unlock()
				n.running[k] = p
			}
		}()
	}
	wg.Wait()
	if churnErr != nil {
		stopSampling()
		<-sampled
		stopWatch()
		return nil, churnErr
	}
	churned := countWrites(env.ctrlMetrics, agents).minus(before)
	restStart := time.Now()
	restErr := localcluster.WaitFor(ctx, o.cooldown+o.releaseDelay+2*time.Minute, 200*time.Millisecond, func() error { return settled(true) })
	rest := time.Since(restStart)
	stopSampling()
	<-sampled
	sample()
	final, err := holdings(ctx, env.c, pool, names)
	if err != nil {
		return nil, err
	}
	after := countWrites(env.ctrlMetrics, agents).minus(before)
	events, given := stopWatch()
	if restErr != nil {
		fmt.Fprintln(os.Stderr, "  nodes not at rest by the deadline:", restErr)
	}
	for _, n := range nodes {
		h := final[n.name]
		fmt.Printf("  %s at the end: holds %d in %d runs: %s; in use: %s\n", n.name, h.held, h.runs, h.addresses, inUse(ctx, n.node))
	}

	perPod := after.total() / float64(starts)
	var idle []string
	idleOK := true
	for _, name := range names {
		h := final[name]
		idle = append(idle, strconv.Itoa(h.held-o.pods))
		idleOK = idleOK && h.held-o.pods <= restIdle
	}
	meanRuns, p99Runs := runStats(runs)
	var finalRuns []string
	for _, name := range names {
		finalRuns = append(finalRuns, strconv.Itoa(final[name].runs))
	}
	giveBack := fmt.Sprintf("%d (%d addresses), at rest %s after the churn", events, given, rest.Round(time.Second))
	if events == 0 {
		giveBack = "none measured"
	}
	name := fmt.Sprintf("churn, %d real agents x %d pods, 1 replaced per node every %s for %s", o.nodes, o.pods, o.interval, o.duration)
	return []figure{
		{name: name + ": pod lifecycles; ADDs failed (CNI error 11)", value: fmt.Sprintf("%d; %d failed, ADD p99 %s", starts, failed, quantile(waits, 0.99).Round(time.Millisecond)),
			goal: "0 failed", ok: failed == 0},
		{name: "churn: API writes per pod lifecycle, give-back included", value: fmt.Sprintf("%.3f (%.0f writes: %s)", perPod, after.total(), after),
			goal: fmt.Sprintf("<= 1/batch = %.4f", 1.0/batch), ok: perPod <= 1.0/batch},
		{name: "churn: of those, while churning / coming to rest", value: fmt.Sprintf("%.0f / %.0f", churned.total(), after.total()-churned.total()),
			goal: "(informational)", ok: true},
		{name: fmt.Sprintf("churn: give-backs (releaseDelay %s)", o.releaseDelay), value: giveBack, goal: "> 0 (measured)", ok: events > 0},
		{name: "churn: idle addresses per node at rest (held - pods)", value: strings.Join(idle, ", "),
			goal: fmt.Sprintf("<= batch*(buffer+1) = %d", restIdle), ok: idleOK && restErr == nil},
		{name: "churn: address runs per node, every 5 s: mean / p99 (at the end)", value: fmt.Sprintf("%.2f / %d (%s)", meanRuns, p99Runs, strings.Join(finalRuns, ", ")),
			goal: "mean <= 2, p99 <= 4", ok: meanRuns <= 2 && p99Runs <= 4},
	}, nil
}

// equalBench binds as many pods as the pool has addresses (or fewer, for headroom) to three
// real agents at once, spread 50/30/20 %, every ADD retried as a runtime does on CNI error 11.
func equalBench(ctx context.Context, env *benchEnv, deadline time.Duration) ([]figure, error) {
	var figs []figure
	for _, v := range []struct {
		pool, cidr string
		headroom   bool
	}{{"bench-equal", "10.249.0.0/26", false}, {"bench-headroom", "10.249.1.0/26", true}} {
		f, err := equalRun(ctx, env, v.pool, v.cidr, v.headroom, deadline)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", v.pool, err)
		}
		figs = append(figs, f...)
	}
	return figs, nil
}

func equalRun(ctx context.Context, env *benchEnv, pool, cidr string, headroom bool, limit time.Duration) ([]figure, error) {
	gw := netip.MustParsePrefix(cidr).Addr().Next() // the first usable address is the gateway
	if err := env.c.Create(ctx, &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: pool}, Spec: ipwardenv1.IPPoolSpec{
		CIDRs: []ipwardenv1.CIDR{ipwardenv1.CIDR(cidr)}, Gateway: ipwardenv1.IPAddress(gw.String()), ReuseCooldown: metav1.Duration{Duration: 30 * time.Second},
		Scaling:      ipwardenv1.Scaling{BatchSize: 16, BufferPercent: 50, MaxPerNode: 250},
		NodeSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"ipwarden.io/bench-pool": pool}},
	}}); err != nil {
		return nil, err
	}
	var capacity int64
	if err := localcluster.WaitFor(ctx, 30*time.Second, 50*time.Millisecond, func() error {
		p := &ipwardenv1.IPPool{}
		if err := env.c.Get(ctx, client.ObjectKey{Name: pool}, p); err != nil {
			return err
		}
		if capacity = p.Status.Capacity; capacity == 0 {
			return fmt.Errorf("no capacity in the pool status yet")
		}
		return nil
	}); err != nil {
		return nil, err
	}
	pods := int(capacity)
	if headroom {
		pods = int(capacity * 10 / 11) // the pool holds at least 1.1 addresses per pod
	}
	share := []int{pods * 50 / 100, pods * 30 / 100}
	share = append(share, pods-share[0]-share[1])
	type eqNode struct {
		*node
		net *ipamNet
	}
	var nodes []eqNode
	defer func() {
		for _, n := range nodes {
			n.agent.Stop()
		}
	}()
	for i := range share {
		n, err := startNode(ctx, env, fmt.Sprintf("%s-%d", pool, i), pool)
		if err != nil {
			return nil, err
		}
		net, err := ipamNetwork(env.bins.CNIDir, filepath.Join(env.cp.Dir, "cni-cache-"+n.name), map[string]any{"type": "ipwarden", "socket": n.socket})
		if err != nil {
			return nil, err
		}
		nodes = append(nodes, eqNode{n, net})
	}
	fmt.Printf("  %s: capacity %d, %d pods on 3 nodes (%v), batch 16, buffer 50%%\n", pool, capacity, pods, share)

	// The scheduler binds them all; the kubelets start their sandboxes at once and retry.
	type job struct {
		n *eqNode
		p benchPod
	}
	var agents []*node
	for _, n := range nodes {
		agents = append(agents, n.node)
	}
	if traceChanges {
		tctx, stopTrace := context.WithCancel(ctx)
		defer stopTrace()
		if err := traceObjects(tctx, env, pool, time.Now()); err != nil {
			return nil, err
		}
	}
	before := countWrites(env.ctrlMetrics, agents) // the agents raise their requests as the pods are bound
	var jobs []*job
	for i, n := range nodes {
		for k := range share[i] {
			p, err := createPod(ctx, env.c, n.name, fmt.Sprintf("%s-p%03d", n.name, k))
			if err != nil {
				return nil, err
			}
			jobs = append(jobs, &job{&nodes[i], p})
		}
	}
	start := time.Now()
	end := start.Add(limit)
	var (
		wg                sync.WaitGroup
		mu                sync.Mutex
		failed, got, lost int
		last              time.Duration
		firstErr          error
	)
	for _, j := range jobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f, err := j.n.net.addRetry(ctx, &j.p, end)
			mu.Lock()
			defer mu.Unlock()
			failed += f
			if err != nil {
				lost++
				if firstErr == nil {
					firstErr = err
				}
				return
			}
			got++
			last = max(last, time.Since(start))
		}()
	}
	wg.Wait()
	if firstErr != nil {
		fmt.Fprintln(os.Stderr, "  first pod without an address:", firstErr)
	}
	// What it cost and whether the pool went through exhaustion (the mechanism that lets it
	// converge: nodes hold just their demand and give every spare back at once).
	exhausted := "no"
	if err := localcluster.WaitFor(ctx, 30*time.Second, 100*time.Millisecond, func() error {
		hs, err := holdings(ctx, env.c, pool, nodeNames(agents))
		if err != nil {
			return err
		}
		return poolSettled(ctx, env.c, pool, hs)
	}); err != nil {
		fmt.Fprintln(os.Stderr, "  pool status not settled:", err)
	}
	if p := (&ipwardenv1.IPPool{}); env.c.Get(ctx, client.ObjectKey{Name: pool}, p) == nil && p.Status.Exhausted {
		exhausted = "yes"
	}
	w := countWrites(env.ctrlMetrics, agents).minus(before)
	cost := figure{name: fmt.Sprintf("%s: API writes per pod start; pool marked exhausted at the end", pool),
		value: fmt.Sprintf("%.2f (%.0f: %s); %s", w.total()/float64(pods), w.total(), w, exhausted), goal: "(informational)", ok: true}
	if headroom {
		return []figure{
			{name: fmt.Sprintf("10%% headroom: %d pods, pool of %d, 3 real agents: ADDs failed past --address-wait (10s)", pods, capacity),
				value: fmt.Sprintf("%d (%d of %d pods got one, the last after %s)", failed, got, pods, last.Round(time.Millisecond)), goal: "0", ok: failed == 0 && lost == 0},
			cost,
		}, nil
	}
	return []figure{
		{name: fmt.Sprintf("equal pool: %d pods, pool of %d, 3 real agents (50/30/20 %%): pods with an address", pods, capacity),
			value: fmt.Sprintf("%d of %d, the last after %s", got, pods, last.Round(time.Millisecond)), goal: fmt.Sprintf("all (retried up to %s)", limit), ok: lost == 0},
		{name: "equal pool: ADDs that failed first (CNI error 11, retried)", value: strconv.Itoa(failed), goal: "(informational)", ok: true},
		cost,
	}, nil
}

// inUse lists the addresses the node's attachments use, as `ipwarden agent list` shows them.
func inUse(ctx context.Context, n *node) string {
	resp, err := cniproto.Call(ctx, n.socket, cniproto.Request{Op: cniproto.OpList})
	if err == nil {
		err = resp.AsError()
	}
	if err != nil {
		return err.Error()
	}
	var as []netip.Addr
	for _, a := range resp.Attachments {
		for _, ip := range a.IPs {
			if p, err := netip.ParsePrefix(ip.Address); err == nil {
				as = append(as, p.Addr())
			}
		}
	}
	return addr.SetOfAddrs(as...).String()
}

func nodeNames(ns []*node) []string {
	var out []string
	for _, n := range ns {
		out = append(out, n.name)
	}
	return out
}

// runStats is the mean and the p99 (nearest rank: under 100 samples, the largest) of runs.
func runStats(runs []int) (mean float64, p99 int) {
	if len(runs) == 0 {
		return 0, 0
	}
	s := append([]int(nil), runs...)
	sort.Ints(s)
	for _, r := range s {
		mean += float64(r)
	}
	return mean / float64(len(s)), s[int(math.Ceil(0.99*float64(len(s))))-1]
}

// traceObjects prints every change of the pool's status and of the NodeIPAllocations' share of
// it, with the time since start, until ctx ends (bench --trace: to see how a run converged).
func traceObjects(ctx context.Context, env *benchEnv, pool string, start time.Time) error {
	wc, err := client.NewWithWatch(env.cp.Config, client.Options{Scheme: env.c.Scheme()})
	if err != nil {
		return err
	}
	for _, list := range []client.ObjectList{&ipwardenv1.NodeIPAllocationList{}, &ipwardenv1.IPPoolList{}} {
		w, err := wc.Watch(ctx, list)
		if err != nil {
			return err
		}
		go func() {
			defer w.Stop()
			for {
				var ev watch.Event
				select {
				case <-ctx.Done():
					return
				case e, ok := <-w.ResultChan():
					if !ok {
						return
					}
					ev = e
				}
				at := time.Since(start).Round(time.Millisecond)
				switch o := ev.Object.(type) {
				case *ipwardenv1.IPPool:
					if o.Name == pool {
						fmt.Printf("  trace %8s pool %s: allocated %d free %d exhausted %t cooling %v\n", at, pool, o.Status.Allocated, o.Status.Free, o.Status.Exhausted, o.Status.Cooling)
					}
				case *ipwardenv1.NodeIPAllocation:
					for _, sp := range o.Spec.Pools {
						if sp.Pool == pool {
							fmt.Printf("  trace %8s %s spec: requested %d releasing %v releasingCooled %v\n", at, o.Name, sp.Requested, sp.Releasing, sp.ReleasingCooled)
						}
					}
					for _, st := range o.Status.Pools {
						if st.Pool == pool {
							fmt.Printf("  trace %8s %s status: held %d %v\n", at, o.Name, st.Held, st.Addresses)
						}
					}
				}
			}
		}()
	}
	return nil
}

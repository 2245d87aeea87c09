package main

import (
	"context"
	"fmt"
	"net/http"
	"path/filepath"
	"sort"
	"sync/atomic"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/agent"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// The scale bench's scenarios after its burst (issue 23): every agent restarted 10 % at a time, a
// controller failover, and a kube-apiserver restart. Each measures how long the fleet takes to be
// back to normal and what it costs the API server meanwhile.

// scaleAgents are the bench's agents (agent.Run in this process), each stoppable and restartable
// on its own state directory, as a DaemonSet pod is replaced on its node's hostPath.
type scaleAgents struct {
	parent  context.Context
	cfgs    []agent.Config
	sockets []string
	cancel  []context.CancelFunc
	done    []chan struct{}
}

func (a *scaleAgents) add(cfg agent.Config) {
	a.cfgs = append(a.cfgs, cfg)
	a.cancel = append(a.cancel, nil)
	a.done = append(a.done, nil)
	a.start(len(a.cfgs) - 1)
}

func (a *scaleAgents) start(i int) {
	ctx, cancel := context.WithCancel(a.parent)
	done := make(chan struct{})
	a.cancel[i], a.done[i] = cancel, done
	cfg := a.cfgs[i]
	go func() {
		defer close(done)
		// An agent that ends by itself (its metrics address taken, say) would only show as
		// not serving ADD minutes later: say why now.
		if err := agent.Run(ctx, cfg); err != nil && ctx.Err() == nil {
			fmt.Printf("  agent %s stopped: %v\n", cfg.Node, err)
		}
	}()
}

// stop ends agent i as SIGTERM ends a pod: it gives its Lease up and closes its journal.
func (a *scaleAgents) stop(i int) {
	if a.cancel[i] == nil {
		return
	}
	a.cancel[i]()
	<-a.done[i]
	a.cancel[i] = nil
}

func (a *scaleAgents) stopAll() {
	_ = forEach(context.Background(), len(a.cfgs), 64, func(i int) error { a.stop(i); return nil })
}

// startScaleController runs the controller as deployed: leader-elected, fenced by the policy.
func startScaleController(env *benchEnv, name string) (*localcluster.Process, string, error) {
	metrics := freeAddr()
	p, err := localcluster.Start(name, env.bins.Ipwarden, filepath.Join(env.cp.Dir, name+".log"),
		"controller", "--kubeconfig", env.cp.Kubeconfig, "--leader-elect=true",
		"--leader-election-namespace="+controlplane.ControllerNamespace, "--leader-election-id="+controlplane.ControllerLease,
		"--metrics-bind-address", metrics, "--health-probe-bind-address=0")
	return p, metrics, err
}

// scaleRun is the state the scenarios share.
type scaleRun struct {
	env     *benchEnv
	o       scaleOptions
	agents  *scaleAgents
	ctrl    *localcluster.Process // the leading controller
	standby *localcluster.Process // a second replica, once the failover started one
	log     func(string, ...any)
	burst   []podRef // the first burst's pods, each with its sandbox "sandbox-<name>" added
}

// podRef is a pod the bench created, bound to node (an index into the agents).
type podRef struct {
	node      int
	name, uid string
}

// freeOn is how many addresses agent i holds free (its STATUS), 0 when it does not answer.
func (s *scaleRun) freeOn(ctx context.Context, i int) int {
	c, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	resp, err := cniproto.Call(c, s.agents.sockets[i], cniproto.Request{Op: cniproto.OpStatus})
	if err != nil || resp.Error != nil {
		return 0
	}
	free := 0
	for _, p := range resp.Pools {
		free += p.Free
	}
	return free
}

// recreate DELs each pod's sandbox and ADDs a new one ("sandbox2-<name>"), as a runtime does
// when a pod's sandbox is re-created; it returns the ADDs' latencies, sorted, and how many of the
// DEL+ADD pairs failed.
func (s *scaleRun) recreate(ctx context.Context, pods []podRef) ([]time.Duration, int) {
	lat := make([]time.Duration, len(pods))
	var failed atomic.Int64
	_ = forEach(ctx, len(pods), s.o.workers, func(i int) error {
		p := pods[i]
		base := cniproto.Request{IfName: "eth0", Netns: "/proc/self/ns/net", Network: "bench", Pod: cniproto.Pod{Namespace: "default", Name: p.name, UID: p.uid}}
		del, add := base, base
		del.Op, del.ContainerID = cniproto.OpDel, "sandbox-"+p.name
		add.Op, add.ContainerID = cniproto.OpAdd, "sandbox2-"+p.name
		actx, cancel := context.WithTimeout(ctx, 90*time.Second)
		defer cancel()
		if resp, err := cniproto.Call(actx, s.agents.sockets[p.node], del); err != nil || resp.Error != nil {
			failed.Add(1)
			return nil
		}
		start := time.Now()
		resp, err := cniproto.Call(actx, s.agents.sockets[p.node], add)
		lat[i] = time.Since(start)
		if err != nil || resp.Error != nil {
			failed.Add(1)
		}
		return nil
	})
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	return lat, int(failed.Load())
}

func quantileOf(sorted []time.Duration, f float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[int(f*float64(len(sorted)-1))].Round(time.Millisecond)
}

// attachments counts each agent's attachments (LIST over its socket).
func (s *scaleRun) attachments(ctx context.Context) (int, error) {
	var total atomic.Int64
	err := forEach(ctx, len(s.agents.sockets), 32, func(i int) error {
		c, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		resp, err := cniproto.Call(c, s.agents.sockets[i], cniproto.Request{Op: cniproto.OpList})
		if err != nil {
			return err
		}
		if resp.Error != nil {
			return fmt.Errorf("LIST of %s: %s", scaleNode(i), resp.Error.Msg)
		}
		total.Add(int64(len(resp.Attachments)))
		return nil
	})
	return int(total.Load()), err
}

// rollingRestart restarts every agent, 10 % of the nodes at a time (the DaemonSet's rolling
// update with maxUnavailable 10 %), each on its own state directory: the time until each batch
// serves ADD again, and the API requests the restarts cost.
func (s *scaleRun) rollingRestart(ctx context.Context) ([]figure, error) {
	n := len(s.agents.cfgs)
	held, err := s.attachments(ctx)
	if err != nil {
		return nil, err
	}
	before, err := apiRequests(ctx, s.env.cp.Config)
	if err != nil {
		return nil, err
	}
	t0 := time.Now()
	var slowest time.Duration
	const batches = 10
	for b := range batches {
		var idx []int
		var socks []string
		for i := b; i < n; i += batches {
			idx = append(idx, i)
			socks = append(socks, s.agents.sockets[i])
		}
		bt := time.Now()
		_ = forEach(ctx, len(idx), 64, func(k int) error { s.agents.stop(idx[k]); return nil })
		for _, i := range idx {
			s.agents.start(i)
		}
		if err := waitAllServe(ctx, socks, 5*time.Minute); err != nil {
			return nil, fmt.Errorf("batch %d: %w", b, err)
		}
		slowest = max(slowest, time.Since(bt))
	}
	took := time.Since(t0)
	after, err := apiRequests(ctx, s.env.cp.Config)
	if err != nil {
		return nil, err
	}
	again, err := s.attachments(ctx)
	if err != nil {
		return nil, err
	}
	d := after.sub(before)
	reads := requestCounts{}
	for k, v := range d {
		switch k[0] {
		case "GET", "LIST", "WATCH":
			reads[k] = v
		}
	}
	s.log("rolling restart: %d agents in %d batches in %s (slowest batch %s); attachments %d before, %d after; requests per restarted agent: %s",
		n, batches, took.Round(time.Second), slowest.Round(time.Millisecond), held, again, d.perSecond(time.Second, float64(n)))
	return []figure{
		{name: fmt.Sprintf("scale %d nodes: every agent restarted, 10%% at a time: all serving ADD again after / slowest batch", n),
			value: fmt.Sprintf("%s / %s", took.Round(time.Second), slowest.Round(time.Millisecond)), goal: "(informational)", ok: true},
		{name: fmt.Sprintf("scale %d nodes: rolling restart, attachments kept from the journals", n),
			value: fmt.Sprintf("%d of %d", again, held), goal: "all", ok: again == held},
		{name: fmt.Sprintf("scale %d nodes: rolling restart, API requests per restarted agent (reads; writes)", n),
			value: fmt.Sprintf("%.1f (%s); %.1f (%s)", reads.total()/float64(n), reads.perSecond(time.Second, float64(n)),
				d.writes().ipwardens().total()/float64(n), d.writes().ipwardens().perSecond(time.Second, float64(n))),
			goal: "(informational)", ok: true},
	}, nil
}

// leaseHolder is the controller's leader election Lease holder ("" when none or unreadable).
func (s *scaleRun) leaseHolder(ctx context.Context) string {
	var l coordinationv1.Lease
	if err := s.env.c.Get(ctx, client.ObjectKey{Namespace: controlplane.ControllerNamespace, Name: controlplane.ControllerLease}, &l); err != nil {
		return ""
	}
	if l.Spec.HolderIdentity == nil {
		return ""
	}
	return *l.Spec.HolderIdentity
}

// waitHTTP waits until GET url answers 200.
func waitHTTP(ctx context.Context, url string, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	hc := &http.Client{Timeout: 2 * time.Second}
	for {
		resp, err := hc.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not answer within %s", url, limit)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// requested is each node's requested addresses and whether its status answers its spec: the
// status observed the spec's generation and holds at least what it requests in every pool.
func (s *scaleRun) requested(ctx context.Context) (map[string]int32, int, error) {
	var list ipwardenv1.NodeIPAllocationList
	if err := s.env.c.List(ctx, &list); err != nil {
		return nil, 0, err
	}
	req := map[string]int32{}
	short := 0
	for _, a := range list.Items {
		held := map[string]int32{}
		for _, p := range a.Status.Pools {
			held[p.Pool] = p.Held
		}
		ok := a.Status.ObservedGeneration >= a.Generation
		for _, p := range a.Spec.Pools {
			req[a.Name] += p.Requested
			if held[p.Pool] < p.Requested {
				ok = false
			}
		}
		if !ok {
			short++
		}
	}
	return req, short, nil
}

// failover starts a standby controller, kills the leader (SIGKILL), and at once doubles the
// pool's batch size, so every node asks for more: the time until the standby leads, and until every node holds what it
// requests again (the design's goal: --claim-settle plus 5 s after it leads; the agents'
// acknowledgements end the settle early).
func (s *scaleRun) failover(ctx context.Context) ([]figure, error) {
	n := len(s.agents.cfgs)
	standby, metrics, err := startScaleController(s.env, "controller-standby")
	if err != nil {
		return nil, err
	}
	if err := waitHTTP(ctx, "http://"+metrics+"/metrics", time.Minute); err != nil {
		standby.Stop()
		return nil, fmt.Errorf("the standby controller: %w", err)
	}
	old := s.leaseHolder(ctx)
	before, _, err := s.requested(ctx)
	if err != nil {
		return nil, err
	}
	killed := time.Now()
	s.ctrl.Kill()
	var ledAt atomic.Int64
	go func() {
		for ctx.Err() == nil && time.Since(killed) < 5*time.Minute {
			if h := s.leaseHolder(ctx); h != "" && h != old {
				ledAt.Store(int64(time.Since(killed)))
				return
			}
			time.Sleep(100 * time.Millisecond) // polling the Lease: a sample period, not a synchronization
		}
	}()
	// Every node wants more at once: the pool's batch doubles (its free buffer with it), so each
	// agent raises its request.
	var pool ipwardenv1.IPPool
	if err := s.env.c.Get(ctx, client.ObjectKey{Name: "bench-scale"}, &pool); err != nil {
		return nil, err
	}
	pool.Spec.Scaling.BatchSize *= 2
	if err := s.env.c.Update(ctx, &pool); err != nil {
		return nil, err
	}
	var grown time.Duration
	var raised int
	for {
		req, short, err := s.requested(ctx)
		if err == nil && short == 0 && ledAt.Load() > 0 {
			grown = time.Since(killed)
			for name, r := range req {
				if r > before[name] {
					raised++
				}
			}
			break
		}
		if time.Since(killed) > 5*time.Minute {
			return nil, fmt.Errorf("%d nodes still short 5 minutes after the leader was killed", short)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
	led := time.Duration(ledAt.Load())
	settle := 60 * time.Second // the controller's --claim-settle default
	s.log("failover: standby led %s after the kill; %d nodes raised their request (the pool's batch doubled at the kill); every node held what it requested %s after the kill (%s after the standby led)",
		led.Round(time.Millisecond), raised, grown.Round(time.Millisecond), (grown - led).Round(time.Millisecond))
	// The killed leader comes back as the standby, as its pod would.
	if err := s.ctrl.Restart(); err != nil {
		return nil, err
	}
	s.ctrl, s.standby = standby, s.ctrl
	return []figure{
		{name: fmt.Sprintf("scale %d nodes: failover, the standby leads after the leader is killed", n), value: led.Round(time.Millisecond).String(),
			goal: "<= lease 15s + jittered retry (2s x 2.2)", ok: led <= 15*time.Second+4400*time.Millisecond},
		{name: fmt.Sprintf("scale %d nodes: failover, every node holds what it requests (%d raised theirs), after the standby leads", n, raised),
			value: (grown - led).Round(time.Millisecond).String(), goal: "<= claim-settle + 5s", ok: grown-led <= settle+5*time.Second && raised > 0},
	}, nil
}

// apiserverRestart kills kube-apiserver (etcd stays) and starts it again: sandboxes of running
// pods are re-created (DEL, ADD) while it is down; then the relist storm on the new one, and
// how long until every watch is back and writes settle.
func (s *scaleRun) apiserverRestart(ctx context.Context) ([]figure, error) {
	n := len(s.agents.cfgs)
	w0, err := apiWatches(ctx, s.env.cp.Config)
	if err != nil {
		return nil, err
	}
	var watches0 float64
	for _, v := range w0 {
		watches0 += v
	}
	// Sandboxes re-created while it is down (a pod's sandbox restarted): DEL of the running
	// sandbox, then ADD of a new one for the same pod, on up to 50 nodes spread over the fleet
	// that hold a free address (the address the DEL frees cools down first, so a node with none
	// free waits for the API server to grow). The agents know these pods, so neither needs it.
	var again []podRef
	for i := 0; i < len(s.burst) && len(again) < 50; i += max(1, len(s.burst)/50) {
		p := s.burst[i]
		if s.freeOn(ctx, p.node) > 0 {
			again = append(again, p)
		}
	}
	down := time.Now()
	if err := s.env.cp.StopAPIServer(); err != nil {
		return nil, err
	}
	type result struct {
		lat    []time.Duration
		failed int
		took   time.Duration
	}
	rc := make(chan result, 1)
	go func() {
		lat, failed := s.recreate(ctx, again)
		rc <- result{lat, failed, time.Since(down)}
	}()
	if err := s.env.cp.RestartAPIServer(ctx); err != nil {
		return nil, fmt.Errorf("restart kube-apiserver: %w", err)
	}
	up := time.Now()
	outage := up.Sub(down)
	r := <-rc
	lat, failed, pods := r.lat, r.failed, again
	if r.took > outage {
		failed = len(pods) // not all served while it was down
	}
	// The new process counts from its start: every request it saw is part of the recovery.
	var back time.Duration
	for {
		w, err := apiWatches(ctx, s.env.cp.Config)
		var total float64
		for _, v := range w {
			total += v
		}
		if err == nil && total >= watches0 {
			back = time.Since(up)
			break
		}
		if time.Since(up) > 5*time.Minute {
			return nil, fmt.Errorf("watches %.0f of %.0f 5 minutes after the restart", total, watches0)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
	if err := settle(ctx, s.env.cp.Config, 10*time.Second, 5*time.Minute); err != nil {
		return nil, err
	}
	settled := time.Since(up) - 10*time.Second
	req, err := apiRequests(ctx, s.env.cp.Config)
	if err != nil {
		return nil, err
	}
	lists := requestCounts{}
	for k, v := range req {
		switch k[1] {
		case "ippools", "nodeipallocations", "leases", "nodes", "pods", "namespaces", "statefulsets":
			if k[0] == "LIST" {
				lists[k] = v
			}
		}
	}
	if err := waitAllServe(ctx, s.agents.sockets, 5*time.Minute); err != nil {
		return nil, err
	}
	holder := s.leaseHolder(ctx)
	s.log("API server restart: down %s, %d of %d sandboxes re-created meanwhile (p99 %s); all %.0f watches back %s after it was ready, writes settled after %s; LIST per node: %s; controller leader %s",
		outage.Round(time.Millisecond), len(pods)-failed, len(pods), quantileOf(lat, 0.99), watches0, back.Round(time.Millisecond),
		settled.Round(time.Second), lists.perSecond(time.Second, float64(n)), holder)
	return []figure{
		{name: fmt.Sprintf("scale %d nodes: API server restart, sandboxes re-created (DEL+ADD) while it was down (%s)", n, outage.Round(time.Second)),
			value: fmt.Sprintf("%d of %d, p99 %s", len(pods)-failed, len(pods), quantileOf(lat, 0.99)), goal: "all", ok: failed == 0},
		{name: fmt.Sprintf("scale %d nodes: API server restart, every watch back / writes settled, after it is ready", n),
			value: fmt.Sprintf("%s / %s", back.Round(time.Millisecond), settled.Round(time.Second)), goal: "(informational)", ok: holder != ""},
		{name: fmt.Sprintf("scale %d nodes: API server restart, the relist: ipwarden's LISTs per node", n),
			value: fmt.Sprintf("%.2f (%s)", lists.total()/float64(n), lists.perSecond(time.Second, float64(n))), goal: "(informational)", ok: true},
	}, nil
}

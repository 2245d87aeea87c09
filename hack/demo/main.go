// Command demo is ipwarden's local demonstration (make demo): a real kube-apiserver and etcd on
// loopback, a real controller, one real agent per demo node, and pods started through the real
// CNI plugin binary: in network namespaces with the bridge plugin when run as root, as plain IPAM
// calls otherwise. It plays a scripted scenario (burst, churn, the leading controller paused past
// its lease while the standby works, a pod force-deleted while its sandbox runs, a node deleted, a
// pool driven to exhaustion and back), then reports and checks the invariants.
//
//	go run ./hack/demo [--keep] [--nodes 3]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/ipwarden/ipwarden/internal/check"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

func main() {
	keep := flag.Bool("keep", false, "leave everything running at the end until Ctrl-C, to look around with kubectl")
	nodes := flag.Int("nodes", 3, "demo nodes (one agent each)")
	burst := flag.Int("burst", 40, "pods started at once on the first node")
	outDir := flag.String("output-dir", "", "where to write report.txt and the pictures (SVG) beside it; default _out/demo under the repository")
	flag.Parse()
	if *nodes < 3 {
		fmt.Fprintln(os.Stderr, "demo: --nodes must be at least 3 (the scenario deletes one and exhausts another)")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	d := &demo{nodeCount: *nodes, burst: *burst, outDir: *outDir}
	err := d.run(ctx, *keep)
	d.cleanup()
	if err != nil {
		fmt.Fprintln(os.Stderr, "\ndemo failed:", err)
		os.Exit(1)
	}
}

type demo struct {
	nodeCount, burst int
	root, dir        string
	bins             localcluster.Binaries
	cp               *controlplane.ControlPlane
	kube             *kube
	controller       *localcluster.Process
	standby          *localcluster.Process
	standbyMetrics   string
	nodes            []*node
	waits            []time.Duration
	mu               sync.Mutex
	started          int
	ctrlMetrics      string
	outDir           string
	// start is when the nodes started; holdings are their addresses sampled since (sample).
	start    time.Time
	holdings []holding
	// burstStart is set while the burst runs: each of its ADDs is kept in burstADDs by node.
	burstStart time.Time
	burstADDs  map[string][]addSample
}

type node struct {
	name    string
	agent   *localcluster.Process
	socket  string
	metrics string
	net     *localcluster.Network
	pods    map[string]*pod // by pod name
}

type pod struct {
	localcluster.Pod
	ips []string
}

func say(format string, a ...any) { fmt.Printf(format+"\n", a...) }

func step(title string) { say("\n== %s", title) }

func (d *demo) run(ctx context.Context, keep bool) error {
	var err error
	if d.root, err = controlplane.RepoRoot(); err != nil {
		return err
	}
	bridgeMode := localcluster.IsRoot()
	step("ipwarden demo")
	if bridgeMode {
		say("running as root: every pod gets a network namespace, wired by the real bridge plugin")
		say("which delegates IPAM to ipwarden-cni; pods ping each other to prove it")
	} else {
		say("not root: pods are plain CNI IPAM calls to ipwarden-cni (no network namespaces);")
		say("run as root (sudo make demo) to see real namespaces on a bridge")
	}
	binDir := controlplane.BinDir(d.root)
	if d.bins, err = localcluster.Build(d.root, filepath.Join(binDir, "demo"), os.Stdout); err != nil {
		return err
	}
	d.cp, err = controlplane.Start(ctx, controlplane.Options{Root: d.root})
	if err != nil {
		return err
	}
	d.dir = d.cp.Dir
	if d.kube, err = newKube(d.cp.Config); err != nil {
		return err
	}
	say("control plane: kube-apiserver %s (kubeconfig %s)", d.cp.URL, d.cp.Kubeconfig)

	step("a pool and the nodes")
	if err := d.kube.createPool(ctx); err != nil {
		return err
	}
	say("IPPool demo-v4: 10.244.0.0/24, gateway 10.244.0.1, batch 16, buffer 50%%, reuse cooldown 3s")
	d.ctrlMetrics, d.standbyMetrics = freeAddr(), freeAddr()
	// Two replicas with leader election, as the Deployment runs them; every status write is
	// fenced by the policy the control plane installs (docs/design.md, "Fencing").
	startCtrl := func(name, metrics string) (*localcluster.Process, error) {
		return localcluster.Start(name, d.bins.Ipwarden, filepath.Join(d.dir, name+".log"),
			"controller", "--kubeconfig", d.cp.Kubeconfig, "--claim-settle=1s",
			"--leader-elect=true", "--leader-election-namespace="+controlplane.ControllerNamespace, "--leader-election-id="+controlplane.ControllerLease,
			"--leader-election-lease-duration=3s", "--leader-election-renew-deadline=2s", "--leader-election-retry-period=500ms",
			"--metrics-bind-address", metrics, "--health-probe-bind-address=0", "--resync-period=10s")
	}
	if d.controller, err = startCtrl("controller-a", d.ctrlMetrics); err != nil {
		return err
	}
	if err := waitFor(ctx, 30*time.Second, func() (bool, error) { return serving(d.controller), nil }); err != nil {
		return fmt.Errorf("the controller did not start leading: %w", err)
	}
	if d.standby, err = startCtrl("controller-b", d.standbyMetrics); err != nil {
		return err
	}
	for i := 1; i <= d.nodeCount; i++ {
		n, err := d.startNode(ctx, fmt.Sprintf("demo-%d", i), bridgeMode)
		if err != nil {
			return err
		}
		d.nodes = append(d.nodes, n)
	}
	say("%d Nodes, two controller processes (one leads, one stands by) and %d agent processes running; each node holds:", d.nodeCount, d.nodeCount)
	d.start = time.Now()
	stopSampling := d.sample(ctx, append([]*node(nil), d.nodes...), 500*time.Millisecond)
	defer stopSampling()
	d.printNodes(ctx)

	step(fmt.Sprintf("burst: %d pods start at once on %s", d.burst, d.nodes[0].name))
	t0 := time.Now()
	writes0 := d.apiWrites()
	d.mu.Lock()
	d.burstStart, d.burstADDs = t0, map[string][]addSample{}
	d.mu.Unlock()
	err = d.startPods(ctx, d.nodes[0], d.burst)
	d.mu.Lock()
	d.burstStart = time.Time{}
	d.mu.Unlock()
	if err != nil {
		return err
	}
	say("%d pods running after %s; IP wait p50 %s, p99 %s", d.burst, time.Since(t0).Round(time.Millisecond),
		quantile(d.waits, 0.5), quantile(d.waits, 0.99))
	if err := waitFor(ctx, 10*time.Second, func() (bool, error) {
		p, err := d.kube.pool(ctx)
		return err == nil && p.Allocated >= 48+32, err // the status write that shows the burst
	}); err == nil {
		w := d.apiWrites() - writes0
		say("API writes for the burst: %.0f (%.2f per pod): the node asked for more once, not per pod", w, w/float64(d.burst))
	}
	if bridgeMode {
		a, b := d.nodes[0].anyPod(), d.nodes[0].otherPod()
		if err := d.nodes[0].net.Ping(a.Pod, b.ips[0]); err != nil {
			return fmt.Errorf("pods on the bridge cannot reach each other: %w", err)
		}
		say("pod %s (%s) pings pod %s (%s) over the bridge", a.Name, a.ips[0], b.Name, b.ips[0])
	}
	d.printNodes(ctx)

	step("churn: pods come and go on every node")
	churnWrites, churnStarts := d.apiWrites(), d.started
	for round := 0; round < 3; round++ {
		for _, n := range d.nodes {
			if err := d.startPods(ctx, n, 4); err != nil {
				return err
			}
			if err := d.stopPods(ctx, n, 3); err != nil {
				return err
			}
		}
		fmt.Printf("  round %d: %d pods running\n", round+1, d.runningPods())
	}
	d.printNodes(ctx)
	say("API writes during the churn: %.0f for %d pod starts", d.apiWrites()-churnWrites, d.started-churnStarts)

	if err := d.splitBrain(ctx); err != nil {
		return err
	}

	step("a pod is force-deleted (kubectl delete pod --force --grace-period=0) while its sandbox still runs")
	victim := d.nodes[1].anyPod()
	if err := d.kube.deletePod(ctx, victim.Name); err != nil {
		return err
	}
	delete(d.nodes[1].pods, victim.Name)
	attached := func() (bool, error) {
		att, err := listAttachments(d.nodes[1].socket)
		if err != nil {
			return false, err
		}
		for _, a := range att {
			if a.podName == victim.Name {
				return true, nil
			}
		}
		return false, nil
	}
	if bridgeMode {
		// The Pod object is gone, its network namespace is not: the address must stay held. Give
		// the agent time to see the deletion and re-check the pod with the API server.
		deadline := time.Now().Add(5 * time.Second)
		for time.Now().Before(deadline) {
			held, err := attached()
			if err != nil {
				return err
			}
			if !held {
				return fmt.Errorf("the agent freed %s while pod %s's network namespace still exists", victim.ips[0], victim.Name)
			}
			time.Sleep(250 * time.Millisecond) // sampling the held address over the window, not waiting for a change
		}
		say("the Pod object of %s is gone but its network namespace still exists: %s stays held (5 s checked)", victim.Name, victim.ips[0])
		say("the runtime now tears the sandbox down without a CNI DEL (the namespace disappears)")
	} else {
		say("not root: no network namespace to watch; the agent frees the address --gc-sandbox-grace after the pod is gone")
	}
	d.nodes[1].net.ForgetNamespace(victim.Pod)
	t0 = time.Now()
	if err := waitFor(ctx, 90*time.Second, func() (bool, error) {
		held, err := attached()
		return !held, err
	}); err != nil {
		return fmt.Errorf("the agent did not collect the deleted pod's address %s: %w", victim.ips[0], err)
	}
	say("the agent saw the sandbox gone, confirmed the pod's deletion with the API server and freed %s after %s", victim.ips[0], time.Since(t0).Round(time.Millisecond))
	say("(it rests for the pool's reuse cooldown before reuse); a Pod deletion alone never frees a live address")

	step(fmt.Sprintf("node %s is deleted", d.nodes[2].name))
	gone := d.nodes[2]
	if err := d.stopPods(ctx, gone, len(gone.pods)); err != nil {
		return err
	}
	goneHeld, err := poolStatus(gone.socket)
	if err != nil {
		return err
	}
	gone.agent.Stop()
	gone.net.Close() // the node's bridge goes with it (cleanup at the end no longer sees the node)
	before, _ := d.kube.pool(ctx)
	if err := d.kube.deleteNode(ctx, gone.name); err != nil {
		return err
	}
	if err := waitFor(ctx, 60*time.Second, func() (bool, error) {
		ok, err := d.kube.allocationGone(ctx, gone.name)
		return ok, err
	}); err != nil {
		return fmt.Errorf("the controller did not clean up after the deleted node: %w", err)
	}
	say("the controller deleted its NodeIPAllocation; the node's addresses cool down, then return:")
	if err := waitFor(ctx, 60*time.Second, func() (bool, error) {
		p, err := d.kube.pool(ctx)
		return err == nil && p.Free >= before.Free+int64(goneHeld.Held), err
	}); err != nil {
		return fmt.Errorf("the deleted node's addresses did not return to the pool: %w", err)
	}
	after, _ := d.kube.pool(ctx)
	say("pool free %d -> %d (the node held %d), no operator action", before.Free, after.Free, goneHeld.Held)
	d.nodes = d.nodes[:2]

	step(fmt.Sprintf("pool exhaustion: pods keep starting on %s until the pool runs dry", d.nodes[1].name))
	exhaustWrites, exhaustStarts := d.apiWrites(), d.started
	var failed error
	for i := 0; i < 400 && failed == nil; i++ {
		failed = d.startPods(ctx, d.nodes[1], 1)
	}
	if failed == nil {
		return fmt.Errorf("the pool never ran out")
	}
	code, msg := localcluster.CNICode(failed)
	say("pod %d on %s fails, as a runtime would see it: CNI error %d: %s", len(d.nodes[1].pods)+1, d.nodes[1].name, code, msg)
	if err := waitFor(ctx, 30*time.Second, func() (bool, error) {
		p, err := d.kube.pool(ctx)
		return p.Exhausted, err
	}); err != nil {
		return fmt.Errorf("pool not marked exhausted: %w", err)
	}
	p, _ := d.kube.pool(ctx)
	say("IPPool demo-v4: exhausted=%v, %d free of %d; nodes now grow one address at a time", p.Exhausted, p.Free, p.Capacity)
	// The flag clears only when the free addresses also cover what every node may hold again at
	// rest (docs/design.md, "The exhausted flag and its hysteresis"), so most of the pods go.
	if err := d.stopPods(ctx, d.nodes[1], 150); err != nil {
		return err
	}
	say("150 pods stop on %s; after the reuse cooldown their addresses serve new pods:", d.nodes[1].name)
	if err := waitFor(ctx, 60*time.Second, func() (bool, error) {
		err := d.startPods(ctx, d.nodes[0], 1)
		return err == nil, nil
	}); err != nil {
		return fmt.Errorf("no pod could start after addresses came back: %w", err)
	}
	if err := waitFor(ctx, 60*time.Second, func() (bool, error) {
		p, err := d.kube.pool(ctx)
		return !p.Exhausted, err
	}); err != nil {
		return fmt.Errorf("exhaustion did not clear: %w", err)
	}
	p, _ = d.kube.pool(ctx)
	say("a new pod on %s starts; the pool recovers: exhausted=%v, %d free", d.nodes[0].name, p.Exhausted, p.Free)
	say("API writes during exhaustion and recovery: %.0f for %d pod starts (one address per request while exhausted)",
		d.apiWrites()-exhaustWrites, d.started-exhaustStarts)

	stopSampling()
	if err := d.report(ctx); err != nil {
		return err
	}
	if keep {
		kubectl := filepath.Join(binDir, "kubectl")
		if _, err := os.Stat(kubectl); err != nil {
			kubectl = "kubectl"
		}
		step("left running (--keep); in another shell:")
		say("  export KUBECONFIG=%s", d.cp.Kubeconfig)
		say("  %s get ippools,nodeipallocations,pods -o wide", kubectl)
		say("  %s agent list --socket %s", d.bins.Ipwarden, d.nodes[0].socket)
		say("  %s check", d.bins.Ipwarden)
		say("  curl -s http://%s/metrics | grep ipwarden_", d.ctrlMetrics)
		say("Ctrl-C stops everything and removes it.")
		<-ctx.Done()
	} else {
		say("\nTo look around while it runs, use `make demo DEMO_FLAGS=--keep`: it prints a kubeconfig for kubectl.")
	}
	return nil
}

func (d *demo) startNode(ctx context.Context, name string, bridgeMode bool) (*node, error) {
	if err := d.kube.createNode(ctx, name); err != nil {
		return nil, err
	}
	dir := filepath.Join(d.dir, name)
	if err := os.MkdirAll(filepath.Join(dir, "run"), 0o700); err != nil {
		return nil, err
	}
	n := &node{name: name, socket: filepath.Join(dir, "run", "agent.sock"), metrics: freeAddr(), pods: map[string]*pod{}}
	var err error
	n.agent, err = localcluster.Start("agent "+name, d.bins.Ipwarden, filepath.Join(d.dir, name+".log"),
		"agent", "--node-name", name, "--kubeconfig", d.cp.Kubeconfig, "--socket", n.socket,
		"--state-dir", filepath.Join(dir, "state"), "--metrics-bind-address", n.metrics,
		"--health-probe-bind-address=0", "--gc-grace=2s", "--address-wait=3s",
		"--lease-namespace="+controlplane.ControllerNamespace, // acknowledge each new controller leader
		// Without root the plugin runs IPAM-only (CNI_NETNS /proc/self/ns/net, which the agent
		// cannot check): a deleted pod's address is then freed this long after the pod is gone.
		"--gc-sandbox-grace=2s")
	if err != nil {
		return nil, err
	}
	bridge := ""
	if bridgeMode {
		bridge = localcluster.RandomName("ipwd", 4)
	}
	n.net, err = localcluster.NewNetwork(d.bins.CNIDir, filepath.Join(dir, "cni-cache"), "demo", n.socket, bridge, "ipwd-"+name+"-")
	if err != nil {
		return nil, err
	}
	if err := waitFor(ctx, 60*time.Second, func() (bool, error) {
		_, err := listAttachments(n.socket)
		return err == nil, nil
	}); err != nil {
		return nil, fmt.Errorf("agent %s did not start serving; its log ends:\n%s", name, n.agent.LogTail(2000))
	}
	return n, nil
}

// startPods creates count Pod objects bound to n and starts them through the plugin at once.
func (d *demo) startPods(ctx context.Context, n *node, count int) error {
	var wg sync.WaitGroup
	errs := make(chan error, count)
	for i := 0; i < count; i++ {
		d.mu.Lock()
		d.started++
		name := fmt.Sprintf("pod-%04d", d.started)
		d.mu.Unlock()
		uid, err := d.kube.createPod(ctx, name, n.name)
		if err != nil {
			return err
		}
		p := &pod{Pod: localcluster.Pod{Namespace: "default", Name: name, UID: uid, ContainerID: localcluster.RandomName("", 8)}}
		wg.Add(1)
		go func() {
			defer wg.Done()
			t0 := time.Now()
			d.mu.Lock()
			burstStart := d.burstStart
			d.mu.Unlock()
			ips, err := n.net.Add(ctx, p.Pod)
			if err != nil {
				_ = d.kube.deletePod(ctx, name)
				errs <- fmt.Errorf("ADD %s: %w", name, err)
				return
			}
			wait := time.Since(t0)
			p.ips = ips
			if err := d.kube.setPodRunning(ctx, name, ips); err != nil {
				errs <- err
				return
			}
			d.mu.Lock()
			d.waits = append(d.waits, wait)
			if !burstStart.IsZero() {
				d.burstADDs[n.name] = append(d.burstADDs[n.name], addSample{At: t0.Sub(burstStart), Wait: wait})
			}
			n.pods[name] = p
			d.mu.Unlock()
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// stopPods stops up to count pods of n: CNI DEL, then the Pod object goes.
func (d *demo) stopPods(ctx context.Context, n *node, count int) error {
	names := n.podNames()
	for i := 0; i < count && i < len(names); i++ {
		p := n.pods[names[i]]
		if err := n.net.Del(ctx, p.Pod); err != nil {
			return fmt.Errorf("DEL %s: %w", p.Name, err)
		}
		if err := d.kube.deletePod(ctx, p.Name); err != nil {
			return err
		}
		delete(n.pods, p.Name)
	}
	return nil
}

func (n *node) podNames() []string {
	names := make([]string, 0, len(n.pods))
	for k := range n.pods {
		names = append(names, k)
	}
	sort.Strings(names)
	return names
}

func (n *node) anyPod() *pod   { return n.pods[n.podNames()[0]] }
func (n *node) otherPod() *pod { names := n.podNames(); return n.pods[names[len(names)-1]] }

func (d *demo) runningPods() int {
	total := 0
	for _, n := range d.nodes {
		total += len(n.pods)
	}
	return total
}

func (d *demo) printNodes(ctx context.Context) {
	for _, n := range d.nodes {
		ps, err := poolStatus(n.socket)
		if err != nil {
			say("  %-8s agent not answering: %v", n.name, err)
			continue
		}
		say("  %-8s %3d pods, holds %3d addresses (%d in use, %d free, %d requested)", n.name, len(n.pods), ps.Held, ps.InUse, ps.Free, ps.Requested)
	}
}

func (d *demo) report(ctx context.Context) error {
	step("report")
	r := demoReport{Started: d.started, Waits: d.waits, ControllerWrites: d.controllerWrites()}
	for _, n := range d.nodes {
		ps, err := poolStatus(n.socket)
		if err != nil {
			return err
		}
		r.Nodes = append(r.Nodes, nodeRow{Name: n.name, Pods: len(n.pods), Held: ps.Held, InUse: ps.InUse})
		// The table's reading is each node's last point in the picture.
		d.holdings = append(d.holdings, holding{At: time.Since(d.start), Node: n.name, Held: ps.Held, InUse: ps.InUse})
		r.AgentWrites += localcluster.ScrapeSum("http://"+n.metrics+"/metrics", "ipwarden_agent_spec_writes_total")
		r.Collected += localcluster.ScrapeSum("http://"+n.metrics+"/metrics", "ipwarden_agent_gc_collected_total")
	}
	r.Burst, r.Holdings = d.burstADDs, d.holdings
	c, err := d.check(ctx)
	if err != nil {
		return err
	}
	if !c.OK() {
		for _, f := range c.Findings {
			say("  PROBLEM %s %s %v %s", f.Kind, f.Addresses, f.Nodes, f.Detail)
		}
		return fmt.Errorf("the invariant check found %d problems", len(c.Findings))
	}
	r.Held, r.CheckedNodes, r.RunningPods, r.Attachments = c.Held, c.Nodes, c.RunningPods, c.Attachments
	fmt.Print(r.text())
	dir := d.outDir
	if dir == "" {
		dir = filepath.Join(d.root, "_out", "demo")
	}
	return r.write(dir)
}

// sample reads every node's holding of the demo pool every interval until the returned stop is
// called (more than once is fine); a node that does not answer (deleted) is skipped.
func (d *demo) sample(ctx context.Context, nodes []*node, interval time.Duration) (stop func()) {
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			for _, n := range nodes {
				if ps, err := poolStatus(n.socket); err == nil {
					d.mu.Lock()
					d.holdings = append(d.holdings, holding{At: time.Since(d.start), Node: n.name, Held: ps.Held, InUse: ps.InUse})
					d.mu.Unlock()
				}
			}
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() { close(done) })
		<-finished
	}
}

// apiWrites is what the controller and the live agents have written to the API server so far.
func (d *demo) apiWrites() float64 {
	w := d.controllerWrites()
	for _, n := range d.nodes {
		w += localcluster.ScrapeSum("http://"+n.metrics+"/metrics", "ipwarden_agent_spec_writes_total")
	}
	return w
}

func (d *demo) cleanup() {
	for _, n := range d.nodes {
		for _, name := range n.podNames() {
			_ = n.net.Del(context.Background(), n.pods[name].Pod)
		}
		if n.agent != nil {
			n.agent.Stop()
		}
		n.net.Close()
	}
	for _, c := range []*localcluster.Process{d.controller, d.standby} {
		if c != nil {
			c.Stop()
		}
	}
	if d.cp != nil {
		_ = d.cp.Stop()
		say("\nstopped: agents, controller, kube-apiserver and etcd; namespaces and bridges removed")
	}
}

func quantile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := int(q * float64(len(s)-1))
	return s[i].Round(100 * time.Microsecond)
}

func waitFor(ctx context.Context, timeout time.Duration, cond func() (bool, error)) error {
	return localcluster.WaitFor(ctx, timeout, 100*time.Millisecond, func() error {
		ok, err := cond()
		if ok {
			return nil
		}
		if err == nil {
			err = errors.New("not yet")
		}
		return err
	})
}

// controllerWrites adds up both controller replicas' API writes (a restarted one starts at 0
// again, so a phase's difference can undercount by what the paused one wrote before it).
func (d *demo) controllerWrites() float64 {
	return localcluster.ScrapeSum("http://"+d.ctrlMetrics+"/metrics", "ipwarden_controller_api_writes_total") +
		localcluster.ScrapeSum("http://"+d.standbyMetrics+"/metrics", "ipwarden_controller_api_writes_total")
}

// serving says whether a controller process has started leading (since its last start).
func serving(p *localcluster.Process) bool {
	return p.Running() && strings.Contains(p.LogTail(1<<20), `"msg":"controller serving"`)
}

// splitBrain pauses the leading controller past its lease while the standby takes over and moves
// addresses, then resumes it: every write it attempts is refused (by its own lease check or by the
// API server's fence policy), it exits and restarts as the standby, and no address is ever in two
// nodes' statuses (a watcher sees every change).
func (d *demo) splitBrain(ctx context.Context) error {
	step("split brain: the leading controller is paused (SIGSTOP) past its 3s lease")
	leader, standby := d.controller, d.standby
	if serving(standby) {
		leader, standby = standby, leader
	}
	tracker := check.NewTracker()
	wctx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	wc, err := client.NewWithWatch(d.cp.Config, client.Options{Scheme: d.kube.c.Scheme()})
	if err != nil {
		return err
	}
	go tracker.Watch(wctx, wc, nil)
	leader.Pause()
	paused := time.Now()
	if err := waitFor(ctx, 60*time.Second, func() (bool, error) { return serving(standby), nil }); err != nil {
		leader.Resume()
		return fmt.Errorf("the standby did not take over: %w", err)
	}
	say("%s paused; %s took over the Lease after %s and serves", leader.Name, standby.Name, time.Since(paused).Round(100*time.Millisecond))
	for _, n := range d.nodes {
		if err := d.startPods(ctx, n, 6); err != nil {
			return err
		}
		if err := d.stopPods(ctx, n, 6); err != nil {
			return err
		}
	}
	say("the new leader served churn on every node (fills and take-backs) while the old one slept")
	leader.Resume()
	if err := waitFor(ctx, 60*time.Second, func() (bool, error) { return !leader.Running(), nil }); err != nil {
		return fmt.Errorf("the resumed controller did not stop: %w", err)
	}
	log := leader.LogTail(1 << 22)
	refused := strings.Count(log, "write refused: this controller no longer holds its lease")
	byServer := strings.Count(log, `"refusedBy":"apiserver"`)
	say("%s resumed after %s: %d write(s) refused (%d by the API server's fence policy, %d by its own lease check), none landed; it exited",
		leader.Name, time.Since(paused).Round(100*time.Millisecond), refused, byServer, refused-byServer)
	if err := leader.Restart(); err != nil {
		return err
	}
	say("restarted as the standby, as its Deployment would")
	if v := tracker.Violations(); len(v) > 0 {
		return fmt.Errorf("an address was held twice during the split brain: %v", v)
	}
	say("a watcher over every NodeIPAllocation change saw no address in two nodes' statuses")
	d.printNodes(ctx)
	return nil
}

// Package chaos runs many pod lifecycles on several real agents while faults are injected at
// random. Half the pods also have net1 on a secondary network ("storage", its pool overlapping the
// pod network's), with Multus' network-status written for most of them, sometimes late. Faults:
// journals lost (the agent stopped, journal.db removed, truncated or its meta pages overwritten,
// started again under running pods), kill -9 timed to land on an ADD's journal write (the
// slow-add-write failpoint), kill -9 of agents and controllers mid-operation, agents stopped with SIGTERM and
// started again on their state directory (as a DaemonSet rollout ends and replaces them: once
// per run every node's agent in turn, and at random), the leading controller paused
// (SIGSTOP) past its lease and resumed, NodeIPAllocations deleted by hand with the controllers up
// and down, API server and etcd restarts, watch connections cut by a loopback proxy, interleaved
// ADD and DEL for one container, repeated DEL, pods deleted without DEL, and a node deleted
// mid-churn. Two controllers run with leader election and the fence policy; a supervisor
// restarts one that exits, as a Deployment would. A watcher over every NodeIPAllocation change
// (check.Tracker) flags any moment an address is in two statuses. After it quiesces, ipwarden's
// own invariant checker (internal/check) must find nothing, and the run's own ledger must show no
// address handed to two live pods and no running pod whose address changed.
//
//	go test ./test/chaos/                               short run (CI)
//	go test ./test/chaos/ -chaos.duration=10m -timeout 30m -v   long run
package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/check"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/localcluster"
	"github.com/ipwarden/ipwarden/internal/podinfo"
)

var (
	duration = flag.Duration("chaos.duration", 40*time.Second, "how long churn and faults run (the long run: 10m)")
	seed     = flag.Uint64("chaos.seed", 0, "random seed (0: from the clock; printed either way)")
	workers  = flag.Int("chaos.workers", 6, "concurrent pod lifecycles")
	keep     = flag.Bool("chaos.keep", false, "keep the run's directory (component logs) after a failure")
	// Every run restores etcd from a snapshot once (docs/design.md, "Claims and rewinds"); with
	// the claim settle a mere time bound, such a restore once put one address on two pods (seed
	// 1795379025702928941), which the agents' acknowledgement of each new leader closes.
	rewindFault = flag.Bool("chaos.rewind", true, "restore etcd from a snapshot once per run")
)

// maxLongRunning bounds the pods per node that run to the end of the run.
const maxLongRunning = 100

type chaos struct {
	t        *testing.T
	rng      *rand.Rand
	rngMu    sync.Mutex
	c        client.Client
	cp       *controlplane.ControlPlane
	proxy    *localcluster.Proxy
	bins     localcluster.Binaries
	dir      string
	kc       string                  // kubeconfig through the proxy
	ctrls    []*localcluster.Process // two replicas, leader-elected
	ctrlDown atomic.Bool             // the supervisor leaves them down (a fault)
	tracker  *check.Tracker
	quiet    sync.RWMutex // held for reading by each lifecycle, for writing by the etcd rewind
	nodes    []*chaosNode
	nodesMu  sync.RWMutex
	seq      atomic.Int64
	live     map[string]string  // address -> pod of running pods ("a,b": two pods of one VM, vm_test.go)
	vmAddr   map[string]string  // VM -> its address (vm_test.go)
	vmRuns   map[string]*podRun // VM launchers running now, by pod name (vm_test.go)
	restored bool               // etcd was restored from a snapshot (under liveMu)
	liveMu   sync.Mutex
	running  map[string]*podRun // pods left running at the end, by name
	counts   sync.Map           // name -> *atomic.Int64
	problems []string
	probMu   sync.Mutex
	// timeline is the run's faults and VM launches with their time, printed when the run
	// failed (a seed does not replay: the order of events is what explains a finding).
	timeline []string
	began    time.Time
}

// note adds an entry to the run's timeline.
func (x *chaos) note(format string, a ...any) {
	x.probMu.Lock()
	defer x.probMu.Unlock()
	x.timeline = append(x.timeline, fmt.Sprintf("%6.1fs ", time.Since(x.began).Seconds())+fmt.Sprintf(format, a...))
}

type chaosNode struct {
	name     string
	socket   string
	stateDir string
	fpDir    string // the slow-add-write failpoint's marker directory
	agent    *localcluster.Process
	net      *localcluster.Network // eth0 on the pod network
	net1     *localcluster.Network // net1 on the storage network
	deleted  atomic.Bool
}

// The pod network and the secondary network net1 is on. Their pools overlap (one CIDR), so the
// ledger keys an address by its network.
const (
	podNetwork     = "pod"
	storageNetwork = "storage"
	storagePool    = "chaos-storage"
	// multusNetworks is the annotation that asks Multus for secondary networks.
	multusNetworks = "k8s.v1.cni.cncf.io/networks"
)

type podRun struct {
	// gone: torn down by an etcd rewind that removed its Pod object (a VM's launcher, vm_test.go)
	gone   bool
	node   *chaosNode
	pod    localcluster.Pod
	ips    []string // eth0's
	net1   []string // net1's (storage network), nil for a pod without net1
	multus bool     // Multus' network-status annotation is written for it
}

// ledgerKey names an address on a network in x.live.
func ledgerKey(network, ip string) string { return network + "/" + ip }

func (x *chaos) inc(name string) {
	if slices.Contains(faultNames, name) {
		x.note("fault: %s", name)
	}
	v, _ := x.counts.LoadOrStore(name, new(atomic.Int64))
	v.(*atomic.Int64).Add(1)
}

func (x *chaos) count(name string) int64 {
	if v, ok := x.counts.Load(name); ok {
		return v.(*atomic.Int64).Load()
	}
	return 0
}

func (x *chaos) problem(format string, a ...any) {
	x.probMu.Lock()
	defer x.probMu.Unlock()
	x.problems = append(x.problems, fmt.Sprintf(format, a...))
}

func (x *chaos) intn(n int) int {
	x.rngMu.Lock()
	defer x.rngMu.Unlock()
	return x.rng.IntN(n)
}

func (x *chaos) between(lo, hi time.Duration) time.Duration {
	return lo + time.Duration(x.intn(int(hi-lo)/int(time.Millisecond)+1))*time.Millisecond
}

func TestChaos(t *testing.T) {
	if os.Geteuid() != 0 {
		// Not for namespaces (the pods are IPAM-only calls), but the agents' root-only sockets
		// and state directories are checked as root in CI.
		t.Log("running as non-root")
	}
	s := *seed
	if s == 0 {
		s = uint64(time.Now().UnixNano())
	}
	t.Logf("chaos seed %d (rerun with -chaos.seed=%d), duration %s", s, s, *duration)
	x := &chaos{t: t, rng: rand.New(rand.NewPCG(s, s>>1|1)), live: map[string]string{}, running: map[string]*podRun{}}
	x.setup()
	x.began = time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), *duration)
	defer cancel()

	var wg sync.WaitGroup
	for i := range chaosVMs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			x.vmLifecycle(ctx, vmName(i))
		}()
	}
	for range *workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				x.lifecycle(ctx)
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		x.faults(ctx)
	}()
	wg.Wait()
	x.quiesce()
}

func (x *chaos) setup() {
	t := x.t
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	if x.bins, err = localcluster.Build(root, filepath.Join(controlplane.BinDir(root), "chaos"), os.Stderr); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if x.cp, err = controlplane.Start(ctx, controlplane.Options{Log: os.Stderr, Keep: *keep}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			x.traceProblems()
		}
		_ = x.cp.Stop()
		if *keep {
			t.Logf("component logs kept in %s", x.dir)
		}
	})
	x.dir = x.cp.Dir
	// One ipwarden binary with the failpoints build tag (they stay off unless IPWARDEN_FAILPOINT
	// names one): the agents run slow-add-write, so a kill -9 can be timed to land on an ADD's
	// journal write (faultKillDuringWrite).
	x.bins.Ipwarden = filepath.Join(filepath.Dir(x.bins.Ipwarden), "ipwarden-failpoints")
	if err := (localcluster.GoBuild{Dir: root, Out: x.bins.Ipwarden, Pkgs: []string{"./cmd/ipwarden"}, Tags: []string{"failpoints"}}).Once(); err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(x.cp.URL)
	if x.proxy, err = localcluster.NewProxy(u.Host); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(x.proxy.Close)
	kc, err := clientcmd.LoadFromFile(x.cp.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range kc.Clusters {
		c.Server = "https://" + x.proxy.Addr
	}
	x.kc = filepath.Join(x.dir, "kubeconfig-proxy")
	if err := clientcmd.WriteToFile(*kc, x.kc); err != nil {
		t.Fatal(err)
	}
	scheme := runtime.NewScheme()
	_ = clientgoscheme.AddToScheme(scheme)
	_ = ipwardenv1.AddToScheme(scheme)
	if x.c, err = client.New(x.cp.Config, client.Options{Scheme: scheme}); err != nil {
		t.Fatal(err)
	}
	if err := x.c.Create(ctx, &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: "chaos"}, Spec: ipwardenv1.IPPoolSpec{
		CIDRs:         []ipwardenv1.CIDR{"10.96.0.0/22"},
		Scaling:       ipwardenv1.Scaling{BatchSize: 8, BufferPercent: 50, MaxPerNode: 250},
		ReuseCooldown: metav1.Duration{Duration: time.Second},
	}}); err != nil {
		t.Fatal(err)
	}
	// The storage network's pool: the same CIDR on another network (pools on different networks
	// may overlap), served to net1.
	if err := x.c.Create(ctx, &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: storagePool}, Spec: ipwardenv1.IPPoolSpec{
		CIDRs:         []ipwardenv1.CIDR{"10.96.0.0/22"},
		Network:       storageNetwork,
		Scaling:       ipwardenv1.Scaling{BatchSize: 8, BufferPercent: 50, MaxPerNode: 250},
		ReuseCooldown: metav1.Duration{Duration: time.Second},
	}}); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		c, err := localcluster.Start(fmt.Sprintf("controller-%d", i), x.bins.Ipwarden, filepath.Join(x.dir, fmt.Sprintf("controller-%d.log", i)),
			"controller", "--kubeconfig", x.kc, "--claim-settle=30s", "--metrics-bind-address=0", "--health-probe-bind-address=0",
			"--leader-elect=true", "--leader-election-namespace="+controlplane.ControllerNamespace, "--leader-election-id="+controlplane.ControllerLease,
			"--leader-election-lease-duration=2s", "--leader-election-renew-deadline=1500ms", "--leader-election-retry-period=250ms",
			"--min-sync-interval=20ms", "--resync-period=5s", "--audit-period=10s", "--backoff-base=50ms", "--backoff-max=2s")
		if err != nil {
			t.Fatal(err)
		}
		x.ctrls = append(x.ctrls, c)
		t.Cleanup(c.Kill)
	}
	superCtx, stopSuper := context.WithCancel(context.Background())
	t.Cleanup(stopSuper)
	go x.supervise(superCtx)
	wc, err := client.NewWithWatch(x.cp.Config, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	x.tracker = check.NewTracker()
	x.tracker.SetPoolNetworks(map[string]string{storagePool: storageNetwork})
	go x.tracker.Watch(superCtx, wc, nil)
	go x.tracker.WatchPools(superCtx, wc)
	localcluster.IPAMOnly()
	for i := 1; i <= 3; i++ {
		x.nodes = append(x.nodes, x.startNode(ctx, fmt.Sprintf("chaos-%d", i)))
	}
	x.setupVMs(ctx)
	t.Cleanup(func() {
		if t.Failed() {
			for _, c := range x.ctrls {
				t.Logf("%s log tail:\n%s", c.Name, c.LogTail(4000))
			}
			for _, n := range x.nodes {
				t.Logf("agent %s log tail:\n%s", n.name, n.agent.LogTail(4000))
			}
		}
	})
}

func (x *chaos) startNode(ctx context.Context, name string) *chaosNode {
	t := x.t
	if err := x.c.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(x.dir, name)
	if err := os.MkdirAll(filepath.Join(dir, "run"), 0o700); err != nil {
		t.Fatal(err)
	}
	n := &chaosNode{name: name, socket: filepath.Join(dir, "run", "agent.sock"), stateDir: filepath.Join(dir, "state"), fpDir: filepath.Join(dir, "failpoint")}
	if err := os.MkdirAll(n.fpDir, 0o700); err != nil {
		t.Fatal(err)
	}
	var err error
	n.agent, err = localcluster.StartEnv("agent "+name, x.bins.Ipwarden, filepath.Join(x.dir, name+".log"),
		[]string{"IPWARDEN_FAILPOINT=slow-add-write", "IPWARDEN_FAILPOINT_DIR=" + n.fpDir},
		"agent", "--node-name", name, "--kubeconfig", x.kc, "--socket", n.socket, "--state-dir", n.stateDir,
		"--metrics-bind-address=0", "--health-probe-bind-address=0", "--resync=5s", "--address-wait=5s",
		"--gc-grace=3s", "--gc-full-check-interval=5s", "--lease-namespace="+controlplane.ControllerNamespace,
		// IPAM only: CNI_NETNS is /proc/self/ns/net, which the agent cannot check, so a deleted
		// pod's address is freed --gc-sandbox-grace after the pod is gone.
		"--gc-sandbox-grace=3s",
		// After a lost journal, addresses of unknown owner are held until every pod is accounted
		// for on each network or this long. Pods without net1 never settle the storage pool, so
		// a lost journal may run a storage hold to its deadline; a pod with net1 but no
		// network-status lives far less than this (its address would rightly leave at the
		// deadline), one that runs to the end always gets network-status.
		"--rebuild-hold=15s")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.agent.Kill() })
	if n.net, err = localcluster.NewNetwork(x.bins.CNIDir, filepath.Join(dir, "cni-cache"), "chaos", n.socket, "", ""); err != nil {
		t.Fatal(err)
	}
	if n.net1, err = localcluster.NewSecondaryNetwork(x.bins.CNIDir, filepath.Join(dir, "cni-cache"), "chaos-storage", n.socket, storageNetwork, "net1"); err != nil {
		t.Fatal(err)
	}
	if err := localcluster.WaitFor(context.Background(), 60*time.Second, 50*time.Millisecond, func() error { return x.agentServing(n) }); err != nil {
		t.Fatalf("agent %s not serving (%v): %s", name, err, n.agent.LogTail(3000))
	}
	return n
}

func (x *chaos) agentServing(n *chaosNode) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	resp, err := cniproto.Call(ctx, n.socket, cniproto.Request{Op: cniproto.OpList})
	if err != nil {
		return err
	}
	return resp.AsError()
}

// retry runs f until it succeeds or d passes, every 100 ms: what a kubelet or runtime does.
func retry(d time.Duration, f func() error) error {
	return localcluster.WaitFor(context.Background(), d, 100*time.Millisecond, f)
}

func (x *chaos) pickNode() *chaosNode {
	x.nodesMu.RLock()
	defer x.nodesMu.RUnlock()
	var alive []*chaosNode
	for _, n := range x.nodes {
		if !n.deleted.Load() {
			alive = append(alive, n)
		}
	}
	return alive[x.intn(len(alive))]
}

// lifecycle is one pod: bound to a node, ADD of eth0 and, for half the pods, of net1 on the
// storage network (as Multus calls a secondary network's plugin after the default one), the
// status written as a kubelet and Multus would, running a while, then an ending.
func (x *chaos) lifecycle(ctx context.Context) {
	x.quiet.RLock() // an etcd rewind waits for lifecycles in flight
	defer x.quiet.RUnlock()
	n := x.pickNode()
	id := x.seq.Add(1)
	name := fmt.Sprintf("pod-%05d", id)
	// Half the pods have net1. Multus writes network-status for most of them, sometimes late
	// (after the kubelet's status); a pod that runs to the end always gets it: without it, a
	// lost journal's hold keeps the storage pool only until --rebuild-hold, and then its net1
	// address may rightly go to another pod (docs/design.md, "The node forgets").
	storage := x.intn(2) == 0
	multus := storage && (id%10 == 0 || x.intn(10) < 6)
	var late time.Duration
	if multus && x.intn(3) == 0 {
		late = x.between(200*time.Millisecond, 3*time.Second)
	}
	podObj := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name},
		Spec: corev1.PodSpec{NodeName: n.name, Containers: []corev1.Container{{Name: "c", Image: "chaos"}}}}
	if storage {
		podObj.Annotations = map[string]string{multusNetworks: storageNetwork}
	}
	if err := x.createPod(podObj); err != nil {
		x.inc("pod creates given up (API down)")
		return
	}
	p := localcluster.Pod{Namespace: "default", Name: name, UID: string(podObj.UID), ContainerID: fmt.Sprintf("c%011d", id)}
	pr := &podRun{node: n, pod: p, multus: multus}
	err := retry(20*time.Second, func() error {
		var err error
		pr.ips, err = n.net.Add(context.Background(), p)
		return err
	})
	if err == nil && storage {
		err = retry(20*time.Second, func() error {
			var err error
			pr.net1, err = n.net1.Add(context.Background(), p)
			return err
		})
	}
	if err != nil {
		// A runtime gives up: it tears the sandbox down (DEL) and the pod is deleted.
		x.inc("ADDs given up")
		x.delAll(pr, storage)
		x.deletePod(name)
		return
	}
	x.holdLive(name, pr.keys())
	if storage {
		x.inc("lifecycles with net1")
	}
	_ = retry(20*time.Second, func() error { return x.setRunning(name, pr.ips) })
	if multus {
		if late > 0 {
			x.inc("network-status written late")
			time.Sleep(late)
		}
		_ = retry(20*time.Second, func() error { return x.setNetworkStatus(pr) })
	}

	if id%10 == 0 {
		// Every tenth pod runs to the end, through every fault: its address must not change.
		// At most maxLongRunning per node, so a long run does not fill nodes to maxPerNode.
		x.liveMu.Lock()
		if n.deleted.Load() {
			// The node was deleted while the pod started: its pods went with it (deleteNode,
			// which checks this under liveMu too).
			x.liveMu.Unlock()
			x.dropLive(name, pr.keys())
			x.inc("lifecycles")
			return
		}
		onNode := 0
		for _, pr := range x.running {
			if pr.node == n {
				onNode++
			}
		}
		if onNode < maxLongRunning {
			x.running[name] = pr
			x.liveMu.Unlock()
			x.inc("lifecycles")
			return
		}
		x.liveMu.Unlock()
	}
	time.Sleep(x.between(0, 300*time.Millisecond)) // the pod runs
	x.dropLive(name, pr.keys())
	switch r := x.intn(100); {
	case r < 5: // deleted without DEL: leak collection must free it
		x.inc("pods deleted without DEL")
		x.deletePod(name)
	case r < 10: // DEL repeated
		x.inc("repeated DELs")
		x.delAll(pr, storage)
		x.delAll(pr, storage)
		x.deletePod(name)
	case r < 15: // ADD and DEL for one container interleaved, then the final DEL
		x.inc("interleaved ADD/DEL")
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); _, _ = n.net.Add(context.Background(), p) }()
		go func() { defer wg.Done(); _ = n.net.Del(context.Background(), p) }()
		wg.Wait()
		x.delAll(pr, storage)
		x.deletePod(name)
	default:
		x.delAll(pr, storage)
		x.deletePod(name)
	}
	x.inc("lifecycles")
}

// keys are the pod's addresses in the ledger, each on its network.
func (pr *podRun) keys() []string {
	var out []string
	for _, ip := range pr.ips {
		out = append(out, ledgerKey(podNetwork, ip))
	}
	for _, ip := range pr.net1 {
		out = append(out, ledgerKey(storageNetwork, ip))
	}
	return out
}

// delAll tears the sandbox's interfaces down as Multus does: net1 (when the pod has it), then eth0.
func (x *chaos) delAll(pr *podRun, storage bool) {
	if storage {
		_ = retry(20*time.Second, func() error { return pr.node.net1.Del(context.Background(), pr.pod) })
	}
	_ = retry(20*time.Second, func() error { return pr.node.net.Del(context.Background(), pr.pod) })
}

// setRunning writes what a kubelet writes: the phase and status.podIPs, eth0's addresses only.
func (x *chaos) setRunning(name string, ips []string) error {
	p := &corev1.Pod{}
	if err := x.c.Get(context.Background(), client.ObjectKey{Namespace: "default", Name: name}, p); err != nil {
		return err
	}
	p.Status.Phase = corev1.PodRunning
	p.Status.PodIP = ips[0]
	p.Status.PodIPs = nil
	for _, ip := range ips {
		p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: ip})
	}
	return x.c.Status().Update(context.Background(), p)
}

// setNetworkStatus writes what Multus writes after a pod's ADDs: network-status with eth0 on the
// default network and net1 on default/storage. A pod already gone is left alone.
func (x *chaos) setNetworkStatus(pr *podRun) error {
	status, _ := json.Marshal([]map[string]any{
		{"name": "ipwarden", "interface": "eth0", "ips": pr.ips, "default": true},
		{"name": "default/" + storageNetwork, "interface": "net1", "ips": pr.net1},
	})
	p := &corev1.Pod{}
	if err := x.c.Get(context.Background(), client.ObjectKey{Namespace: pr.pod.Namespace, Name: pr.pod.Name}, p); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return err
	}
	if string(p.UID) != pr.pod.UID {
		return nil
	}
	if p.Annotations == nil {
		p.Annotations = map[string]string{}
	}
	p.Annotations[multusNetworks] = storageNetwork
	p.Annotations[podinfo.AnnotationNetworkStatus] = string(status)
	return x.c.Update(context.Background(), p)
}

func (x *chaos) deletePod(name string) {
	_ = retry(30*time.Second, func() error {
		err := x.c.Delete(context.Background(), &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name}}, client.GracePeriodSeconds(0))
		if apierrors.IsNotFound(err) {
			return nil
		}
		return err
	})
}

// createPod creates pod, retrying while the API server is away; a create that landed but whose
// answer was lost is read back (its UID is the one the CNI calls name).
func (x *chaos) createPod(pod *corev1.Pod) error {
	return retry(20*time.Second, func() error {
		err := x.c.Create(context.Background(), pod)
		if apierrors.IsAlreadyExists(err) {
			return x.c.Get(context.Background(), client.ObjectKeyFromObject(pod), pod)
		}
		return err
	})
}

// faults injects one fault every 1-3 s until ctx ends; a quarter through, every agent is rolled
// (SIGTERM, then started again) one node after another; halfway through, a node is deleted.
func (x *chaos) faults(ctx context.Context) {
	deletedNode, snapshotted, rewound, rolled, lostJournal := false, false, false, false, false
	start := time.Now()
	half := start.Add(*duration / 2)
	snapshot := filepath.Join(x.dir, "etcd.snapshot")
	for {
		if !rolled && time.Since(start) > *duration/4 {
			rolled = true
			began := time.Since(start)
			x.rollout()
			x.t.Logf("agents rolled (SIGTERM, started again, one node after another) %s into the run (took %s)", began.Round(time.Second), (time.Since(start) - began).Round(100*time.Millisecond))
		}
		// The node is deleted after the etcd restore: a restore to before its deletion would
		// bring the Node back without its agent, which is an operator's mess, not ipwarden's.
		if !deletedNode && (rewound || !snapshotted) && time.Now().After(half) {
			deletedNode = true
			x.deleteNode()
		}
		if !snapshotted && *rewindFault && time.Since(start) > *duration/8 {
			snapshotted = true
			if err := x.cp.SnapshotEtcd(context.Background(), snapshot); err != nil {
				x.problem("etcd snapshot: %v", err)
			}
			x.t.Logf("etcd snapshot saved %s into the run", time.Since(start).Round(time.Second))
		}
		// Every run loses a journal at least once (the 40 s run too): by five eighths in.
		if !lostJournal && time.Since(start) > *duration*5/8 {
			lostJournal = true
			if x.count(faultLostJournal) == 0 {
				x.loseJournal(x.pickNode())
			}
		}
		if snapshotted && !rewound && time.Since(start) > *duration/3 {
			rewound = true
			began := time.Since(start)
			x.rewind(snapshot)
			x.t.Logf("etcd restored from the snapshot %s into the run (took %s)", began.Round(time.Second), (time.Since(start) - began).Round(100*time.Millisecond))
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(x.between(time.Second, 3*time.Second)):
		}
		switch x.intn(13) {
		case 10, 11:
			x.loseJournal(x.pickNode())
		case 12:
			x.killDuringWrite(x.pickNode())
		case 0:
			n := x.pickNode()
			x.inc("kill -9 agent")
			x.killAgent(n)
			time.Sleep(x.between(100*time.Millisecond, 1500*time.Millisecond)) // the node is down a while
			if err := n.agent.Restart(); err != nil {
				x.problem("restart agent %s: %v", n.name, err)
			}
		case 9:
			x.terminateAgent(x.pickNode())
		case 1:
			x.inc("kill -9 controller")
			x.leader().Kill() // the supervisor restarts it
		case 6:
			x.inc("leader paused past its lease")
			l, holder := x.leaderAndHolder()
			if holder == "" {
				x.inc("leader pause skipped (Lease unreadable)")
				break
			}
			l.Pause()
			// Paused past its lease: resume once the Lease shows another holder or has run out.
			if err := localcluster.WaitFor(context.Background(), 15*time.Second, 100*time.Millisecond, func() error { return x.leaseOutlived(holder) }); err != nil {
				x.inc("leader resumed before its lease ran out")
			}
			l.Resume()
		case 7:
			x.inc("NodeIPAllocation deleted (controllers up)")
			x.deleteRecord()
		case 8:
			x.inc("NodeIPAllocation deleted (controllers down)")
			x.ctrlDown.Store(true)
			for _, c := range x.ctrls {
				c.Kill()
			}
			x.deleteRecord()
			time.Sleep(x.between(500*time.Millisecond, 2*time.Second)) // the fault lasts a while
			x.ctrlDown.Store(false)
		case 2:
			x.inc("API server restart")
			_ = x.cp.StopAPIServer()
			time.Sleep(x.between(200*time.Millisecond, 1500*time.Millisecond)) // down a while
			if err := x.cp.RestartAPIServer(context.Background()); err != nil {
				x.problem("restart API server: %v", err)
			}
		case 3:
			x.inc("etcd restart")
			_ = x.cp.StopEtcd()
			time.Sleep(x.between(200*time.Millisecond, 1500*time.Millisecond)) // down a while
			if err := x.cp.RestartEtcd(context.Background()); err != nil {
				x.problem("restart etcd: %v", err)
			}
		case 4, 5:
			x.inc("watch connections cut")
			x.proxy.Cut()
		}
	}
}

// Fault names (counters) the checks and the summary use.
const (
	faultLostJournal     = "journal lost (agent stopped, journal.db removed or damaged, started again)"
	faultKillDuringWrite = "kill -9 agent timed on an ADD's journal write"
	killLandedOnWrite    = "kill -9 landed on an ADD's journal write"
)

// faultNames are the faults a run injects (counted, and noted in the timeline).
var faultNames = []string{"kill -9 agent", faultKillDuringWrite, faultLostJournal, "SIGTERM agent (stop, start again)", "kill -9 controller", "leader paused past its lease", "NodeIPAllocation deleted (controllers up)",
	"NodeIPAllocation deleted (controllers down)", "API server restart", "etcd restart", "etcd restored from a snapshot",
	"watch connections cut", "node deleted mid-churn"}

// killAgent sends the agent kill -9 and counts a kill that landed while an ADD's journal write
// was in flight (the slow-add-write failpoint's marker outlives the kill).
func (x *chaos) killAgent(n *chaosNode) {
	n.agent.Kill()
	marker := filepath.Join(n.fpDir, "add-write-in-flight")
	if _, err := os.Stat(marker); err == nil {
		x.inc(killLandedOnWrite)
		_ = os.Remove(marker)
	}
}

// killDuringWrite waits (up to 3 s) until an ADD's journal write is in flight on n's agent (the
// slow-add-write failpoint stretches each one by 2-30 ms around the write itself), kills it with
// kill -9 at once and starts it again a while later; its pods keep running.
func (x *chaos) killDuringWrite(n *chaosNode) {
	x.inc(faultKillDuringWrite)
	marker := filepath.Join(n.fpDir, "add-write-in-flight")
	_ = localcluster.WaitFor(context.Background(), 3*time.Second, time.Millisecond, func() error {
		_, err := os.Stat(marker)
		return err
	})
	x.killAgent(n)
	time.Sleep(x.between(100*time.Millisecond, time.Second))
	if err := n.agent.Restart(); err != nil {
		x.problem("restart agent %s: %v", n.name, err)
	}
}

// loseJournal stops n's agent (SIGTERM or kill -9), loses its journal (journal.db removed, as on a
// replaced disk; truncated; or both bbolt meta pages overwritten) and starts it again on the same
// state directory while its pods keep running: it must rebuild from what the node shows and hold
// addresses of unknown owner per network (docs/design.md, "The node forgets").
func (x *chaos) loseJournal(n *chaosNode) {
	x.inc(faultLostJournal)
	if x.intn(2) == 0 {
		x.killAgent(n)
	} else {
		n.agent.Stop()
	}
	path := filepath.Join(n.stateDir, "journal.db")
	switch x.intn(3) {
	case 0:
		x.inc("journal removed")
		if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
			x.problem("remove %s: %v", path, err)
		}
	case 1:
		x.inc("journal truncated")
		if fi, err := os.Stat(path); err == nil && fi.Size() > 0 {
			_ = os.Truncate(path, int64(x.intn(int(fi.Size()))))
		}
	default:
		x.inc("journal meta pages overwritten")
		junk := make([]byte, 8192)
		for i := range junk {
			junk[i] = byte(x.intn(256))
		}
		if f, err := os.OpenFile(path, os.O_WRONLY, 0); err == nil {
			_, _ = f.WriteAt(junk, 0)
			_ = f.Close()
		}
	}
	time.Sleep(x.between(100*time.Millisecond, time.Second))
	if err := n.agent.Restart(); err != nil {
		x.problem("restart agent %s after its journal was lost: %v", n.name, err)
		return
	}
	if err := localcluster.WaitFor(context.Background(), 30*time.Second, 50*time.Millisecond, func() error { return x.agentServing(n) }); err != nil {
		x.problem("agent %s not serving 30 s after its journal was lost: %v", n.name, err)
	}
}

// rollout replaces every live node's agent in turn, as a DaemonSet rollout with maxUnavailable 1
// does: SIGTERM, a new agent on the same state directory, and the next node once it serves.
func (x *chaos) rollout() {
	x.inc("agent rollouts (every node in turn)")
	x.nodesMu.RLock()
	nodes := append([]*chaosNode(nil), x.nodes...)
	x.nodesMu.RUnlock()
	for _, n := range nodes {
		if !n.deleted.Load() {
			x.terminateAgent(n)
		}
	}
}

// terminateAgent stops n's agent gracefully (SIGTERM: it finishes the requests in flight and
// gives the node's Lease up), leaves the node without one a while, as between a DaemonSet's old
// pod and its replacement, starts it again on the same state directory and waits until it serves.
func (x *chaos) terminateAgent(n *chaosNode) {
	x.inc("SIGTERM agent (stop, start again)")
	n.agent.Stop() // SIGTERM, SIGKILL after 10 s
	var exit *exec.ExitError
	if errors.As(n.agent.ExitErr(), &exit) {
		if ws, ok := exit.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
			x.inc("agents SIGKILLed 10 s after SIGTERM")
		}
	}
	time.Sleep(x.between(100*time.Millisecond, time.Second)) // the old pod is gone, the new one not yet started
	if err := n.agent.Restart(); err != nil {
		x.problem("restart agent %s after SIGTERM: %v", n.name, err)
		return
	}
	if err := localcluster.WaitFor(context.Background(), 30*time.Second, 50*time.Millisecond, func() error { return x.agentServing(n) }); err != nil {
		x.problem("agent %s not serving 30 s after its restart following SIGTERM: %v", n.name, err)
	}
}

// rewind restores etcd from the snapshot taken earlier in the run, by Kubernetes' documented
// procedure (revision bumped and compacted, API server restarted), under running agents whose
// pods' addresses are newer than the snapshot. Pod objects rewind too; the harness then does what
// kubelets would: pods the API no longer has are torn down (CNI DEL), pods it has again that no
// longer run are deleted. Lifecycles in flight finish first, so the ledger stays exact.
func (x *chaos) rewind(snapshot string) {
	x.quiet.Lock()
	defer x.quiet.Unlock()
	x.inc("etcd restored from a snapshot")
	if err := x.cp.RestoreEtcd(context.Background(), snapshot); err != nil {
		x.problem("etcd restore: %v", err)
		return
	}
	var pods corev1.PodList
	if err := retry(60*time.Second, func() error { return x.c.List(context.Background(), &pods) }); err != nil {
		x.problem("list pods after the restore: %v", err)
		return
	}
	inAPI := map[string]bool{}
	for _, p := range pods.Items {
		inAPI[p.Name] = true
		pr, running := x.running[p.Name]
		if !running {
			pr, running = x.vmRuns[p.Name] // a VM's launcher runs on between its steps
		}
		if !running {
			x.deletePod(p.Name) // deleted after the snapshot: it came back, but nothing runs it
			continue
		}
		// The Pod object rewound to before its status (or network-status) was written: the
		// kubelet writes its status again, and the harness stands in for Multus too, as a pod
		// whose sandbox runs on would show it (a report missing for good would only run a lost
		// journal's hold to its deadline).
		_ = retry(20*time.Second, func() error { return x.setRunning(p.Name, pr.ips) })
		if pr.multus {
			_ = retry(20*time.Second, func() error { return x.setNetworkStatus(pr) })
		}
	}
	x.liveMu.Lock()
	defer x.liveMu.Unlock()
	for name, pr := range x.running {
		if inAPI[name] {
			continue
		}
		// Created after the snapshot: the API no longer has it, so its kubelet stops it.
		x.delAll(pr, pr.net1 != nil)
		for _, k := range pr.keys() {
			delete(x.live, k)
		}
		delete(x.running, name)
		x.inc("running pods stopped by the rewind")
	}
	// A VM's binding recorded after the snapshot is gone from the pool's status (and the claim's
	// status.ips with it). The controller records it again from an attachment that still uses
	// it, but a VM restarted before that happens, or whose launcher the rewind stopped, gets a
	// new address: never one another pod has (the ledger checks that), but not the one it had.
	// So a rewind starts every VM's address afresh (a known gap: docs/design.md, "VM addresses").
	clear(x.vmAddr)
	x.restored = true
	for name, pr := range x.vmRuns {
		if inAPI[name] {
			continue
		}
		// A VM's launcher created after the snapshot: stopped as above. Its VM starts again; the
		// claim's binding and status may have rewound to before they existed (the claims were
		// made before the snapshot), so its next address may be another one: never a duplicate.
		x.delAll(pr, false)
		for _, k := range pr.keys() {
			x.dropLiveLocked(name, k)
		}
		pr.gone = true
		delete(x.vmRuns, name)
		x.inc("VM launchers stopped by the rewind")
	}
}

// supervise restarts a controller that exited (fenced, lease lost, killed), as a Deployment's
// kubelet would, unless a fault keeps them down.
func (x *chaos) supervise(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(200 * time.Millisecond):
		}
		if x.ctrlDown.Load() {
			continue
		}
		for _, c := range x.ctrls {
			if !c.Running() {
				x.inc("controller restarts")
				if err := c.Restart(); err != nil {
					x.problem("restart %s: %v", c.Name, err)
				}
			}
		}
	}
}

// leader is the controller process that holds the Lease (a random one if none does).
func (x *chaos) leader() *localcluster.Process {
	l, _ := x.leaderAndHolder()
	return l
}

// leaderAndHolder is the controller the Lease names and the Lease's holder identity ("" and a
// random controller when the Lease cannot be read).
func (x *chaos) leaderAndHolder() (*localcluster.Process, string) {
	var l coordinationv1.Lease
	if err := x.c.Get(context.Background(), client.ObjectKey{Namespace: controlplane.ControllerNamespace, Name: controlplane.ControllerLease}, &l); err == nil && l.Spec.HolderIdentity != nil {
		for _, c := range x.ctrls {
			if strings.Contains(c.LogTail(1<<20), `"identity":"`+*l.Spec.HolderIdentity+`"`) {
				return c, *l.Spec.HolderIdentity
			}
		}
	}
	return x.ctrls[x.intn(len(x.ctrls))], ""
}

// leaseOutlived returns nil once the controller Lease is held by someone other than holder, or
// its last renewal is older than its duration.
func (x *chaos) leaseOutlived(holder string) error {
	var l coordinationv1.Lease
	if err := x.c.Get(context.Background(), client.ObjectKey{Namespace: controlplane.ControllerNamespace, Name: controlplane.ControllerLease}, &l); err != nil {
		return err
	}
	if l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity != holder {
		return nil
	}
	if l.Spec.RenewTime != nil && l.Spec.LeaseDurationSeconds != nil &&
		time.Since(l.Spec.RenewTime.Time) > time.Duration(*l.Spec.LeaseDurationSeconds)*time.Second {
		return nil
	}
	return errors.New("the Lease is still held and renewed")
}

// deleteRecord deletes a live node's NodeIPAllocation by hand, as an operator might.
func (x *chaos) deleteRecord() {
	n := x.pickNode()
	err := x.c.Delete(context.Background(), &ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: n.name}})
	if err != nil && !apierrors.IsNotFound(err) {
		x.inc("NodeIPAllocation deletes failed (API down)")
	}
}

// deleteNode deletes the last node mid-churn: its agent stops, its pods are evicted, the Node goes.
func (x *chaos) deleteNode() {
	x.nodesMu.Lock()
	n := x.nodes[len(x.nodes)-1]
	n.deleted.Store(true)
	x.nodesMu.Unlock()
	x.inc("node deleted mid-churn")
	n.agent.Stop()
	var pods corev1.PodList
	_ = retry(30*time.Second, func() error {
		return x.c.List(context.Background(), &pods, client.MatchingFields{"spec.nodeName": n.name})
	})
	for _, p := range pods.Items {
		x.deletePod(p.Name)
	}
	var keys []string
	x.liveMu.Lock()
	for k := range x.live {
		keys = append(keys, k)
	}
	x.liveMu.Unlock()
	for _, p := range pods.Items {
		x.dropLive(p.Name, keys)
	}
	x.liveMu.Lock()
	for name, pr := range x.running {
		if pr.node == n {
			delete(x.running, name)
		}
	}
	x.liveMu.Unlock()
	_ = retry(30*time.Second, func() error {
		err := x.c.Delete(context.Background(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.name}})
		if apierrors.IsNotFound(err) {
			return nil
		}
		return err
	})
}

// quiesce waits for the system to settle, then checks the invariants and reports.
func (x *chaos) quiesce() {
	t := x.t
	for _, n := range x.nodes {
		if !n.deleted.Load() && !n.agent.Running() {
			_ = n.agent.Restart()
		}
	}
	x.ctrlDown.Store(false)
	// Leak collection needs grace (3 s) + a full check (5 s); the controller a resync (5 s).
	// A lost journal's hold (--rebuild-hold) may still run: its addresses leave at its deadline.
	var r check.Report
	var last error
	began, pending := time.Now(), map[string]int{}
	_ = localcluster.WaitFor(context.Background(), 90*time.Second, 500*time.Millisecond, func() error {
		r, last = x.snapshot()
		if last == nil && !r.OK() {
			for k, n := range r.CountsByKind {
				pending[k] = max(pending[k], n)
			}
			return errors.New("the invariants do not hold yet")
		}
		return last
	})
	if last != nil {
		t.Fatalf("cannot check the invariants: %v", last)
	}
	t.Logf("quiesced in %s (findings seen while settling, at most: %v)", time.Since(began).Round(100*time.Millisecond), pending)

	// Pods still running keep their addresses, on each network: eth0's in the pod network's
	// pool, net1's in the storage pool, under the pod's container id or, after a lost journal,
	// rebuilt under its UID.
	lists := map[*chaosNode]cniproto.Response{}
	for name, pr := range x.running {
		resp, ok := lists[pr.node]
		if !ok {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			r, err := cniproto.Call(ctx, pr.node.socket, cniproto.Request{Version: cniproto.Version, Op: cniproto.OpList})
			cancel()
			if err == nil {
				err = r.AsError()
			}
			if err != nil {
				t.Fatalf("LIST of %s: %v", pr.node.name, err)
			}
			resp, lists[pr.node] = *r, *r
		}
		got := map[string][]string{}
		for _, a := range resp.Attachments {
			if a.ContainerID != pr.pod.ContainerID && !(a.Rebuilt && a.Pod.UID == pr.pod.UID) {
				continue
			}
			for _, ip := range a.IPs {
				network := podNetwork
				if ip.Pool == storagePool {
					network = storageNetwork
				}
				a, _, _ := strings.Cut(ip.Address, "/")
				got[network] = append(got[network], a)
			}
		}
		for network, want := range map[string][]string{podNetwork: pr.ips, storageNetwork: pr.net1} {
			g := append([]string(nil), got[network]...)
			w := append([]string(nil), want...)
			sort.Strings(g)
			sort.Strings(w)
			switch {
			case len(w) > 0 && len(g) == 0:
				x.inc("live address freed")
				x.problem("running pod %s (%s %v): its attachment is gone: a live address was freed", name, network, w)
			case strings.Join(g, ",") != strings.Join(w, ","):
				x.inc("running pod's address changed")
				x.problem("running pod %s: address %v on %s became %v", name, w, network, g)
			}
		}
	}
	faults := faultNames
	var total int64
	for _, f := range faults {
		total += x.count(f)
	}
	t.Logf("chaos summary:")
	t.Logf("  lifecycles               %d (pods deleted without DEL %d, repeated DELs %d, interleaved ADD/DEL %d, ADDs given up %d)",
		x.count("lifecycles"), x.count("pods deleted without DEL"), x.count("repeated DELs"), x.count("interleaved ADD/DEL"), x.count("ADDs given up"))
	t.Logf("  faults injected          %d", total)
	for _, f := range faults {
		t.Logf("    %-44s %d", f, x.count(f))
	}
	t.Logf("  pods with net1 (storage network) %d, network-status written late %d", x.count("lifecycles with net1"), x.count("network-status written late"))
	t.Logf("  VMs %d: starts %d, restarts %d, migrations %d (failed %d, given up %d), ADDs given up %d, launchers stopped by the rewind %d, address changed %d (after the etcd restore %d)",
		chaosVMs, x.count("VM starts"), x.count("VM restarts"), x.count("VM migrations"), x.count("VM migrations failed"), x.count("VM migrations given up"),
		x.count("VM ADDs given up"), x.count("VM launchers stopped by the rewind"), x.count("VM address changed"), x.count("VM address changed after the etcd restore"))
	t.Logf("  journals lost: removed %d, truncated %d, meta pages overwritten %d; agent kills that landed on an ADD's journal write %d",
		x.count("journal removed"), x.count("journal truncated"), x.count("journal meta pages overwritten"), x.count(killLandedOnWrite))
	t.Logf("  agent rollouts (every node in turn) %d; agents SIGKILLed 10 s after SIGTERM %d",
		x.count("agent rollouts (every node in turn)"), x.count("agents SIGKILLed 10 s after SIGTERM"))
	t.Logf("  addresses held twice     %d", r.CountsByKind[check.HeldTwice]+r.CountsByKind[check.AttachedTwice])
	violations := x.tracker.Violations()
	t.Logf("  watcher: moments an address was in two statuses or a status dropped an unreleased address: %d", len(violations))
	t.Logf("  controller exits (fenced or lease lost), restarted by the supervisor: %d", x.count("controller restarts"))
	t.Logf("  running pods stopped because the etcd restore removed their Pod objects: %d", x.count("running pods stopped by the rewind"))
	for _, v := range violations {
		t.Errorf("status watcher: %s", v)
	}
	t.Logf("  leaked                   %d", r.CountsByKind[check.LeakedAttachment]+r.CountsByKind[check.OrphanAllocation])
	t.Logf("  live addresses freed     %d (handed to a second live pod %d)", x.count("live address freed"), x.count("live address handed out again"))
	t.Logf("  running pods whose address changed %d (of %d left running)", x.count("running pod's address changed"), len(x.running))
	for _, f := range r.Findings {
		t.Errorf("invariant checker: %s %s nodes=%v pod=%s: %s", f.Kind, f.Addresses, f.Nodes, f.Pod, f.Detail)
	}
	for _, p := range x.problems {
		t.Error(p)
	}
	if t.Failed() {
		t.Logf("timeline (faults, VM launches):\n%s", strings.Join(x.timeline, "\n"))
	}
	if x.count("SIGTERM agent (stop, start again)") == 0 {
		t.Errorf("no agent was stopped with SIGTERM: the run is too short for its rollout (-chaos.duration)")
	}
	if x.count(faultLostJournal) == 0 {
		t.Errorf("no journal was lost: the run is too short (-chaos.duration)")
	}
	if x.count("lifecycles") < 20 {
		t.Errorf("only %d lifecycles ran: the run proves little", x.count("lifecycles"))
	}
}

// snapshot reads the API objects and every live agent's attachments and checks them.
func (x *chaos) snapshot() (check.Report, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	in, err := check.Collect(ctx, x.c)
	if err != nil {
		return check.Report{}, err
	}
	in.Grace = 3 * time.Second
	in.Attachments = map[string][]check.Attachment{}
	for _, n := range x.nodes {
		if n.deleted.Load() {
			continue
		}
		atts, err := check.AskAgent(ctx, n.name, n.socket)
		if err != nil {
			return check.Report{}, fmt.Errorf("agent %s: %w", n.name, err)
		}
		in.Attachments[n.name] = atts
	}
	return check.Check(in), nil
}

// traceProblems prints every component log line that mentions an address of a problem, so a
// failed run explains itself.
func (x *chaos) traceProblems() {
	addrs := map[string]bool{}
	for _, p := range x.problems {
		for _, f := range strings.Fields(p) {
			f = strings.Trim(f, "[],:")
			if i := strings.LastIndexByte(f, '/'); i >= 0 {
				f = f[i+1:] // a ledger key, network/address
			}
			if strings.Count(f, ".") == 3 && strings.HasPrefix(f, "10.") {
				addrs[f] = true
			}
		}
	}
	if len(addrs) == 0 {
		return
	}
	logs, _ := filepath.Glob(filepath.Join(x.dir, "*.log"))
	for _, l := range logs {
		b, err := os.ReadFile(l)
		if err != nil {
			continue
		}
		shown := 0
		for _, line := range strings.Split(string(b), "\n") {
			for a := range addrs {
				if strings.Contains(line, a+"\"") || strings.Contains(line, a+",") || strings.Contains(line, a+"/") || strings.Contains(line, a+"-") || strings.Contains(line, "-"+a) {
					if shown < 60 {
						x.t.Logf("%s: %s", filepath.Base(l), line)
					}
					shown++
					break
				}
			}
		}
	}
}

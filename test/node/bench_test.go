package node

import (
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"os"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/utils/ptr"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// hostLocalConf is the shipped bridge config with host-local as IPAM on the same subnet: the
// coordination-free floor ipwarden is compared against.
const hostLocalConf = `{
  "cniVersion": "1.0.0",
  "cniVersions": ["1.0.0", "1.1.0"],
  "name": "ipwarden",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": true,
      "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24", "rangeStart": "10.244.0.2", "gateway": "10.244.0.1"}]],
               "dataDir": "/var/lib/ipwarden/host-local"}
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`

// whereaboutsConf is the same bridge config with Whereabouts (WhereaboutsVersion) as IPAM on
// the same range; its flat file (whereabouts.d/whereabouts.conf) names the kubeconfig.
const whereaboutsConf = `{
  "cniVersion": "1.0.0",
  "cniVersions": ["1.0.0", "1.1.0"],
  "name": "ipwarden",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": true,
      "ipam": {"type": "whereabouts", "range": "10.244.0.0/24", "range_start": "10.244.0.2", "gateway": "10.244.0.1"}
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`

// benchEnv turns the pod-startup bench on (make bench-node).
const benchEnv = "IPWARDEN_NODE_BENCH"

// TestPodStartupBench starts 100 pods on the node at once, with ipwarden, host-local and
// Whereabouts in turn as the IPAM of the same bridge config on the same kubelet, and reports
// the time until all run, the per-pod sandbox-ready p50/p99 (pod created ->
// PodReadyToStartContainers, as a watch sees it) and the API server's writes. A benchmark, not
// a timed test: it runs with IPWARDEN_NODE_BENCH=1 (BENCHMARKS.md) and asserts only that every
// pod starts with a pool address.
func TestPodStartupBench(t *testing.T) {
	if os.Getenv(benchEnv) == "" {
		t.Skip("a benchmark: IPWARDEN_NODE_BENCH=1 go test ./test/node -run TestPodStartupBench (BENCHMARKS.md)")
	}
	const pods = 100
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	n := startNode(t, ctx)
	n.pool = ipwardenv1.IPPoolSpec{
		Scaling:       ipwardenv1.Scaling{BatchSize: 16, BufferPercent: 50, MaxPerNode: 250},
		ReuseCooldown: metav1.Duration{Duration: 30 * time.Second},
	}
	n.deployIpwarden(ctx)
	if _, err := n.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	ipw := n.burst(ctx, "ipwarden", pods)
	if err := os.WriteFile("/etc/cni/net.d/10-ipwarden.conflist", []byte(hostLocalConf), 0o644); err != nil {
		t.Fatal(err)
	}
	hl := n.burst(ctx, "host-local", pods)
	n.installWhereabouts(ctx)
	wa := n.burst(ctx, "whereabouts", pods)
	t.Logf("RESULT pods=%d all-running ipwarden=%s host-local=%s whereabouts=%s ratios ipwarden/host-local=%.2f whereabouts/host-local=%.2f",
		pods, ipw.all, hl.all, wa.all, ratio(ipw.all, hl.all), ratio(wa.all, hl.all))
	t.Logf("RESULT sandbox-ready p50 ipwarden=%s host-local=%s whereabouts=%s ratios %.2f %.2f; p99 ipwarden=%s host-local=%s whereabouts=%s ratios %.2f %.2f",
		ipw.p50, hl.p50, wa.p50, ratio(ipw.p50, hl.p50), ratio(wa.p50, hl.p50), ipw.p99, hl.p99, wa.p99, ratio(ipw.p99, hl.p99), ratio(wa.p99, hl.p99))
	for _, r := range []struct {
		label string
		b     burstResult
		own   func(string) bool
	}{{"ipwarden", ipw, group(".ipwarden.io")}, {"host-local", hl, func(string) bool { return false }}, {"whereabouts", wa, group(".whereabouts.cni.cncf.io")}} {
		t.Logf("RESULT API writes per pod %s: own objects start %.2f start+delete %.2f; leases start %.2f start+delete %.2f; all writes start %.2f start+delete %.2f",
			r.label, perPod(r.b.start, r.own, pods), perPod(r.b.whole, r.own, pods),
			perPod(r.b.start, leaseGroup, pods), perPod(r.b.whole, leaseGroup, pods),
			perPod(r.b.start, allGroups, pods), perPod(r.b.whole, allGroups, pods))
	}
}

// group matches the resources of an API group: an IPAM's own objects. Leases are counted
// apart: Whereabouts takes a lease per ADD and DEL, and the kubelet and ipwarden (controller
// leader, agent per node) renew theirs all the time. Writes an IPAM makes after its burst (
// ipwarden's agent handing back addresses once the cooldown ends) land in the next burst's
// window, which counts only its own IPAM's group.
func group(suffix string) func(string) bool {
	return func(key string) bool {
		res, _, _ := strings.Cut(key, "/")
		return strings.HasSuffix(res, suffix)
	}
}

var (
	leaseGroup = func(key string) bool { return key == "leases.coordination.k8s.io" }
	allGroups  = func(string) bool { return true }
)

func perPod(writes map[string]float64, match func(string) bool, pods int) float64 {
	var sum float64
	for k, v := range writes {
		if match(k) {
			sum += v
		}
	}
	return sum / float64(pods)
}

// installWhereabouts puts Whereabouts on the node (installWhereaboutsPlugin) and the bridge
// config with it as IPAM.
func (n *realNode) installWhereabouts(ctx context.Context) {
	n.installWhereaboutsPlugin(ctx, "error")
	if err := os.WriteFile("/etc/cni/net.d/10-ipwarden.conflist", []byte(whereaboutsConf), 0o644); err != nil {
		n.t.Fatal(err)
	}
}

// apiWrites reads the API server's write counters (apiserver_request_total) per resource.
func (n *realNode) apiWrites(ctx context.Context) map[string]float64 {
	b, err := n.kube.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	if err != nil {
		n.t.Fatalf("API server metrics: %v", err)
	}
	w, err := localcluster.APIWrites(bytes.NewReader(b))
	if err != nil {
		n.t.Fatal(err)
	}
	return w
}

type burstResult struct {
	all, p50, p99 time.Duration
	// API writes per resource while the pods started (created -> all Running) and over their
	// whole life (created -> all deleted and gone).
	start, whole map[string]float64
}

func ratio(a, b time.Duration) float64 { return float64(a) / float64(b) }

// burst creates pods bare pods pinned to the node at once (no scheduler in the path), waits
// until all run, measures, then deletes them and waits until they are gone.
func (n *realNode) burst(ctx context.Context, label string, count int) burstResult {
	t := n.t
	w, err := n.kube.CoreV1().Pods(testNamespace).Watch(ctx, metav1.ListOptions{LabelSelector: "bench=" + label})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { w.Stop() }()
	writesBefore := n.apiWrites(ctx)
	var mu sync.Mutex
	created := map[string]time.Time{}
	ready := map[string]time.Duration{}
	running := map[string]bool{}
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, count)
	for i := range count {
		wg.Add(1)
		go func() {
			defer wg.Done()
			name := fmt.Sprintf("%s-%03d", label, i)
			p := &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: testNamespace, Labels: map[string]string{"bench": label}},
				Spec: corev1.PodSpec{
					NodeName:                      nodeName,
					TerminationGracePeriodSeconds: ptr.To(int64(1)),
					AutomountServiceAccountToken:  ptr.To(false),
					EnableServiceLinks:            ptr.To(false),
					Containers:                    []corev1.Container{{Name: "sleeper", Image: workloadImage, ImagePullPolicy: corev1.PullNever}},
				},
			}
			mu.Lock()
			created[name] = time.Now()
			mu.Unlock()
			if _, err := n.kube.CoreV1().Pods(testNamespace).Create(ctx, p, metav1.CreateOptions{}); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	var all time.Duration
	observe := func(p *corev1.Pod, now time.Time) {
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReadyToStartContainers && c.Status == corev1.ConditionTrue {
				if _, seen := ready[p.Name]; !seen {
					mu.Lock()
					ready[p.Name] = now.Sub(created[p.Name])
					mu.Unlock()
				}
			}
		}
		if p.Status.Phase == corev1.PodRunning && !running[p.Name] {
			ip, err := netip.ParseAddr(p.Status.PodIP)
			if err != nil || !poolPrefix.Contains(ip) {
				t.Fatalf("%s: pod %s runs with address %q, not in %s", label, p.Name, p.Status.PodIP, poolCIDR)
			}
			running[p.Name] = true
			all = now.Sub(start)
		}
	}
	deadline := time.After(10 * time.Minute)
	for len(running) < count {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				// The API server ended the watch (it does, under load): list what changed
				// meanwhile (seen late, so those pods' times run long) and watch on from there.
				list, err := n.kube.CoreV1().Pods(testNamespace).List(ctx, metav1.ListOptions{LabelSelector: "bench=" + label})
				if err != nil {
					t.Fatal(err)
				}
				now := time.Now()
				for i := range list.Items {
					observe(&list.Items[i], now)
				}
				n.logf("%s: pod watch ended; resumed with %d of %d running", label, len(running), count)
				w, err = n.kube.CoreV1().Pods(testNamespace).Watch(ctx, metav1.ListOptions{LabelSelector: "bench=" + label, ResourceVersion: list.ResourceVersion})
				if err != nil {
					t.Fatal(err)
				}
				continue
			}
			if ev.Type != watch.Added && ev.Type != watch.Modified {
				continue
			}
			observe(ev.Object.(*corev1.Pod), time.Now())
		case <-deadline:
			n.dumpState(ctx)
			t.Fatalf("%s: %d of %d pods running after 10 minutes", label, len(running), count)
		}
	}
	w.Stop()
	startWrites := localcluster.DiffWrites(writesBefore, n.apiWrites(ctx))
	var d []time.Duration
	for _, v := range ready {
		d = append(d, v)
	}
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	pct := func(q float64) time.Duration {
		if len(d) == 0 {
			return 0
		}
		return d[int(q*float64(len(d)-1))]
	}
	r := burstResult{all: all.Round(time.Millisecond), p50: pct(0.5).Round(time.Millisecond), p99: pct(0.99).Round(time.Millisecond), start: startWrites}
	n.logf("%s: %d pods running in %s; sandbox ready p50 %s p99 %s (%d observed); API writes while starting %v", label, count, r.all, r.p50, r.p99, len(d), startWrites)
	if err := n.kube.CoreV1().Pods(testNamespace).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: "bench=" + label}); err != nil {
		t.Fatal(err)
	}
	if err := localcluster.WaitFor(ctx, 5*time.Minute, 500*time.Millisecond, func() error { return n.noPodsIn(ctx, testNamespace) }); err != nil {
		t.Fatal(err)
	}
	r.whole = localcluster.DiffWrites(writesBefore, n.apiWrites(ctx))
	n.logf("%s: API writes from creation until every pod is gone %v", label, r.whole)
	return r
}

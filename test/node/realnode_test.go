package node

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

const (
	testNamespace = "workload"
	poolName      = "node-pods"
	poolCIDR      = "10.244.0.0/24"
)

var (
	scheme             = runtime.NewScheme()
	ipwardenDaemonSet  = appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Namespace: "ipwarden-system", Name: "ipwarden-agent"}}
	ipwardenDeployment = appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Namespace: "ipwarden-system", Name: "ipwarden-controller"}}
	poolPrefix         = netip.MustParsePrefix(poolCIDR)
)

func init() {
	_ = clientgoscheme.AddToScheme(scheme)
	_ = ipwardenv1.AddToScheme(scheme)
}

// TestRealNode runs ipwarden in-cluster from deploy/kustomize on a real kubelet and containerd
// and checks what pods see. Every step scans every pod network namespace for an address on two.
// powerCyclesEnv repeats the power cycle step (default once), to hunt a rare failure: a
// duplicate address once seen right after a power cycle (issue 24). Each cycle is scanned as the
// suite always scans: every pod network namespace at every poll.
const powerCyclesEnv = "IPWARDEN_NODE_POWER_CYCLES"

func TestRealNode(t *testing.T) {
	cycles := 1
	if v := os.Getenv(powerCyclesEnv); v != "" {
		c, err := strconv.Atoi(v)
		if err != nil || c < 1 {
			t.Fatalf("%s=%q: give a number of power cycles, at least 1", powerCyclesEnv, v)
		}
		cycles = c
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute+time.Duration(cycles-1)*4*time.Minute)
	defer cancel()
	began := time.Now()
	n := startNode(t, ctx)
	n.pool = suitePool
	n.deployIpwarden(ctx)
	n.createWorkload(ctx, 5)

	t.Run("scale up and down", func(t *testing.T) {
		n.t = t
		for _, replicas := range []int32{5, 2, 8} {
			n.scale(ctx, replicas)
			pods := n.waitPods(ctx, int(replicas))
			n.checkPing(ctx, pods)
			n.checkAttachments(ctx, pods)
		}
	})

	// The node holds maxPerNode (8) addresses, all in use: the replacement of a force-deleted pod
	// can only get the victim's address, and with reuseCooldown 0s it gets it the moment the
	// agent frees it. Freed before the old sandbox is gone, it is on two pods at once.
	t.Run("force delete with reuseCooldown 0s creates no duplicate", func(t *testing.T) {
		n.t = t
		before := n.waitPods(ctx, 8)
		victim := before[0]
		n.logf("force-deleting %s (%s)", victim.name, victim.ip)
		n.kubectl("delete", "pod", "-n", testNamespace, victim.name, "--force", "--grace-period=0")
		// Scan continuously while the kubelet stops the old sandbox and the Deployment starts a
		// replacement that may be handed the freed address.
		// The scan window ends when the old namespace lets go of the address, or after 30 s
		// (the checks below then judge the pods as they are).
		_ = localcluster.WaitFor(ctx, 30*time.Second, 50*time.Millisecond, func() error {
			n.scanNoDuplicates()
			if n.netnsCarries(victim.ip, victim.netns) {
				return errors.New("the old namespace still carries the address")
			}
			return nil
		})
		after := n.waitPods(ctx, 8)
		n.checkPing(ctx, after)
		n.checkAttachments(ctx, after)
	})

	restarts := []struct {
		name string
		do   func()
	}{
		{"kubelet", func() {
			n.kubelet.Stop()
			if err := n.kubelet.Restart(); err != nil {
				t.Fatal(err)
			}
		}},
		{"containerd", func() {
			n.containerd.Stop()
			if err := n.containerd.Restart(); err != nil {
				t.Fatal(err)
			}
			if err := n.waitContainerd(ctx); err != nil {
				t.Fatal(err)
			}
		}},
		{"agent pod", func() {
			n.replaceAgentPod(ctx, func() {})
			// The kubelet stopped the old agent with SIGTERM; its journal has nothing of unknown
			// owner: every ADD was answered after its write.
			if got := n.lostReservationsAtStart(ctx); got != 0 {
				n.dumpState(ctx)
				t.Fatalf("the agent restarted after a clean stop found %d lost reservations, want 0", got)
			}
		}},
		{"controller pods (rollout restart on one node)", func() {
			n.kubectl("rollout", "restart", "-n", "ipwarden-system", "deployment/ipwarden-controller")
			n.kubectl("rollout", "status", "-n", "ipwarden-system", "deployment/ipwarden-controller", "--timeout=3m")
		}},
	}
	n.scale(ctx, 7)
	for _, r := range restarts {
		t.Run("restart "+r.name+" keeps every address", func(t *testing.T) {
			n.t = t
			before := n.waitPods(ctx, 7)
			r.do()
			n.waitNodeReady(ctx)
			after := n.waitPods(ctx, 7)
			if b, a := podIPs(before), podIPs(after); b != a {
				t.Fatalf("addresses changed across the %s restart:\nbefore %s\nafter  %s", r.name, b, a)
			}
			n.checkPing(ctx, after)
			n.checkAttachments(ctx, after)
			// Still serving: a new pod starts after the restart.
			n.scale(ctx, 8)
			n.checkAttachments(ctx, n.waitPods(ctx, 8))
			n.scale(ctx, 7)
			n.waitPods(ctx, 7)
		})
	}

	for cycle := 1; cycle <= cycles; cycle++ {
		name := "power cycle leaks nothing"
		if cycles > 1 {
			name = fmt.Sprintf("power cycle %d of %d leaks nothing", cycle, cycles)
		}
		t.Run(name, func(t *testing.T) {
			n.t = t
			n.checkPowerCycle(ctx)
		})
	}

	t.Run("ipwarden check is clean", func(t *testing.T) {
		n.t = t
		n.checkClean(ctx)
	})

	// A sticky StatefulSet beside the Deployment: its pods keep their addresses across a pod
	// delete, a rollout restart and a sandbox restart; scaling down and deleting it return them.
	t.Run("sticky StatefulSet keeps its addresses", func(t *testing.T) {
		n.t = t
		n.checkStickyStatefulSet(ctx)
	})

	// Last, as it adds a node: a second kubelet (its own containerd) that runs only the
	// controller's pods.
	t.Run("controller rollout restart on two nodes", func(t *testing.T) {
		n.t = t
		n.startSecondNode(ctx)
		n.checkRolloutOnTwoNodes(ctx)
		// The new leader serves: a new pod on the first node gets an address.
		n.scale(ctx, 8)
		n.checkAttachments(ctx, n.waitPods(ctx, 8))
	})
	n.t = t
	n.logf("suite body took %s (preparation %s)", time.Since(began).Round(time.Second), prep.Prepared.Round(time.Second))
}

// checkPowerCycle power-cycles the node with 7 pods running and checks that the same pods run
// again in new sandboxes, ping each other and match the agent's attachments.
func (n *realNode) checkPowerCycle(ctx context.Context) {
	t := n.t
	// One pod replaced first, so the power cycle kills an agent that has just served a DEL (answered
	// before its write) and an ADD.
	n.scale(ctx, 6)
	n.waitPods(ctx, 6)
	n.scale(ctx, 7)
	before := n.waitPods(ctx, 7)
	if err := n.powerCycle(ctx); err != nil {
		t.Fatal(err)
	}
	n.waitNodeReady(ctx)
	n.logf("power cycle: node Ready again")
	// The same pods run again in new sandboxes; the dead sandboxes' addresses are freed
	// (the runtime's DEL for them) and nothing else is held for them.
	after := n.waitPods(ctx, 7)
	n.logf("power cycle: every pod Running again")
	for i := range after {
		if after[i].name != before[i].name {
			t.Fatalf("pods changed across the power cycle: %v -> %v", podIPs(before), podIPs(after))
		}
	}
	n.checkPing(ctx, after)
	n.checkAttachments(ctx, after)
	// The power cycle SIGKILLed the agent: every address it answered is in an attachment on
	// disk (answered after the write), so it finds nothing of unknown owner and holds nothing.
	if got := n.lostReservationsAtStart(ctx); got != 0 {
		n.dumpState(ctx)
		t.Fatalf("the agent killed by the power cycle found %d lost reservations in its journal, want 0", got)
	}
	if err := localcluster.WaitFor(ctx, 2*time.Minute, 250*time.Millisecond, func() error {
		out, err := exec.Command(prep.Ipwarden, "agent", "list", "-o", "json", "--socket", cniproto.DefaultSocket).Output()
		if err != nil {
			return fmt.Errorf("ipwarden agent list: %v", err)
		}
		var resp struct{ Hold *cniproto.Hold }
		if err := json.Unmarshal(out, &resp); err != nil {
			return err
		}
		if resp.Hold != nil {
			return fmt.Errorf("the agent still holds %d addresses, waiting for %v", resp.Hold.Addresses, resp.Hold.WaitingFor)
		}
		return nil
	}); err != nil {
		n.dumpState(ctx)
		t.Fatal(err)
	}
	n.logf("power cycle: no hold after the kill")
}

// lostReservationsRE finds the count in the agent's "journal loaded" log line (JSON or console).
var lostReservationsRE = regexp.MustCompile(`"lostReservations"\s*:\s*(\d+)`)

// lostReservationsAtStart waits for the running agent container's "journal loaded" log line and
// returns how many addresses an older agent reserved ahead its journal held (lost.go). It reads the
// container's log file where the kubelet writes it (/var/log/pods, the suite's own directory in
// its mount namespace): the API server cannot reach this kubelet for logs.
func (n *realNode) lostReservationsAtStart(ctx context.Context) int {
	t := n.t
	got := -1
	if err := localcluster.WaitFor(ctx, time.Minute, 250*time.Millisecond, func() error {
		text, err := n.agentContainerLog(ctx)
		if err != nil {
			return err
		}
		// The last start's line: a container started again after a power cycle may append to
		// the log file of the one before.
		lines := strings.Split(text, "\n")
		for i := len(lines) - 1; i >= 0; i-- {
			if !strings.Contains(lines[i], "journal loaded") {
				continue
			}
			m := lostReservationsRE.FindStringSubmatch(lines[i])
			if m == nil {
				return fmt.Errorf("the agent's journal-loaded line has no lostReservations: %s", lines[i])
			}
			got, _ = strconv.Atoi(m[1])
			n.logf("agent start: %s", strings.TrimSpace(lines[i]))
			return nil
		}
		return errors.New("no journal-loaded line in the agent's log yet")
	}); err != nil {
		n.dumpState(ctx)
		t.Fatal(err)
	}
	return got
}

// agentContainerLog returns the log of the ready agent pod's current agent container.
func (n *realNode) agentContainerLog(ctx context.Context) (string, error) {
	pods, err := n.kube.CoreV1().Pods("ipwarden-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=agent"})
	if err != nil {
		return "", err
	}
	for _, p := range pods.Items {
		if p.DeletionTimestamp != nil {
			continue
		}
		dir := filepath.Join("/var/log/pods", fmt.Sprintf("%s_%s_%s", p.Namespace, p.Name, p.UID), "agent")
		entries, err := os.ReadDir(dir)
		if err != nil {
			return "", err
		}
		last, lastN := "", -1
		for _, e := range entries {
			if k, err := strconv.Atoi(strings.TrimSuffix(e.Name(), ".log")); err == nil && k > lastN {
				last, lastN = e.Name(), k
			}
		}
		if last == "" {
			return "", fmt.Errorf("no container log in %s yet", dir)
		}
		b, err := os.ReadFile(filepath.Join(dir, last))
		return string(b), err
	}
	return "", errors.New("no agent pod")
}

// deployIpwarden applies deploy/kustomize through a thin overlay (kubectl apply -k): local
// images that are never pulled, the API server's loopback address (no kube-proxy here), and
// the CNI config installed by the init container.
func (n *realNode) deployIpwarden(ctx context.Context) {
	t := n.t
	overlay := filepath.Join(n.dir, "overlay")
	if err := os.MkdirAll(overlay, 0o755); err != nil {
		t.Fatal(err)
	}
	base, err := filepath.Rel(overlay, filepath.Join(prep.Root, "deploy", "kustomize"))
	if err != nil {
		t.Fatal(err)
	}
	port := strings.TrimPrefix(n.cp.URL, "https://127.0.0.1:")
	apiEnv := fmt.Sprintf(`
            - {name: KUBERNETES_SERVICE_HOST, value: "127.0.0.1"}
            - {name: KUBERNETES_SERVICE_PORT, value: "%s"}`, port)
	k := fmt.Sprintf(`apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
- %s
images:
- name: ipwarden
  newName: ipwarden.test/ipwarden
  newTag: "1"
patches:
- patch: |
    apiVersion: apps/v1
    kind: DaemonSet
    metadata: {name: ipwarden-agent, namespace: ipwarden-system}
    spec:
      template:
        spec:
          # The suite's second node runs only the controller: both nodes share this
          # machine's node paths, so the agent stays off it.
          affinity:
            nodeAffinity:
              requiredDuringSchedulingIgnoredDuringExecution:
                nodeSelectorTerms:
                - matchExpressions:
                  - {key: %s, operator: DoesNotExist}
          initContainers:
          - name: install-cni
            imagePullPolicy: Never
            env:
            - {name: INSTALL_CNI_CONFIG, value: "true"}
          containers:
          - name: agent
            imagePullPolicy: Never
            env:%s
- patch: |
    apiVersion: apps/v1
    kind: Deployment
    metadata: {name: ipwarden-controller, namespace: ipwarden-system}
    spec:
      template:
        spec:
          containers:
          - name: controller
            imagePullPolicy: Never
            env:%s
%s`, base, controllerOnlyLabel, apiEnv, apiEnv, n.overlayPatches)
	if len(n.overlayComponents) > 0 {
		k += "components:\n"
		for _, c := range n.overlayComponents {
			rel, err := filepath.Rel(overlay, filepath.Join(prep.Root, c))
			if err != nil {
				t.Fatal(err)
			}
			k += "- " + rel + "\n"
		}
	}
	if err := os.WriteFile(filepath.Join(overlay, "kustomization.yaml"), []byte(k), 0o644); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	n.kubectl("apply", "-k", overlay)
	// Then pools, as the README says; an agent is ready once its node's allocation exists.
	n.createPool(ctx)
	n.kubectl("rollout", "status", "-n", "ipwarden-system", "daemonset/ipwarden-agent", "--timeout=3m")
	n.kubectl("rollout", "status", "-n", "ipwarden-system", "deployment/ipwarden-controller", "--timeout=3m")
	n.waitNodeReady(ctx)
	n.logf("ipwarden deployed and the node Ready in %s", time.Since(start).Round(time.Millisecond))
}

// suitePool is the pool of TestRealNode: the node fills up at 8 pods, and a freed address is
// reused at once (the worst case for a double hand-out).
var suitePool = ipwardenv1.IPPoolSpec{
	Scaling:       ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 8},
	ReuseCooldown: metav1.Duration{Duration: 0},
}

func (n *realNode) createPool(ctx context.Context) {
	spec := n.pool
	if len(spec.CIDRs) == 0 { // the suite's pool; a pool with CIDRs is created as given
		spec.CIDRs = []ipwardenv1.CIDR{poolCIDR}
		spec.Exclude = []ipwardenv1.IPOrCIDR{"10.244.0.0", "10.244.0.1", "10.244.0.255"}
		spec.Gateway = "10.244.0.1"
	}
	pool := &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: poolName}, Spec: spec}
	if err := n.k8s.Create(ctx, pool); err != nil {
		n.t.Fatal(err)
	}
}

func (n *realNode) createWorkload(ctx context.Context, replicas int32) {
	t := n.t
	if _, err := n.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	d := sleeperDeployment("sleeper", replicas, map[string]string{"app": "sleeper"})
	if _, err := n.kube.AppsV1().Deployments(testNamespace).Create(ctx, d, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// sleeperDeployment is a Deployment of the workload image in the workload namespace whose pods
// carry labels (its selector).
func sleeperDeployment(name string, replicas int32, labels map[string]string) *appsv1.Deployment {
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: name},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To(replicas),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Strategy: appsv1.DeploymentStrategy{Type: appsv1.RollingUpdateDeploymentStrategyType,
				RollingUpdate: &appsv1.RollingUpdateDeployment{MaxSurge: ptr.To(intstr.FromInt32(1))}},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					TerminationGracePeriodSeconds: ptr.To(int64(2)),
					AutomountServiceAccountToken:  ptr.To(false),
					EnableServiceLinks:            ptr.To(false),
					Containers: []corev1.Container{{
						Name: "sleeper", Image: workloadImage, ImagePullPolicy: corev1.PullNever,
					}},
				},
			},
		},
	}
}

func (n *realNode) scale(ctx context.Context, replicas int32) {
	n.logf("scaling the workload to %d", replicas)
	n.kubectl("scale", "-n", testNamespace, "deployment/sleeper", fmt.Sprintf("--replicas=%d", replicas))
}

// pod is a running workload pod as the node sees it.
type pod struct {
	name, uid string
	ip        netip.Addr
	netns     string
	sandbox   string // set by waitStatefulSet only
}

// waitPods waits until exactly want workload pods exist, all Running with a pool address that
// sits on exactly one pod network namespace, scanning for duplicates on every poll.
func (n *realNode) waitPods(ctx context.Context, want int) []pod {
	t := n.t
	t.Helper()
	var pods []pod
	err := localcluster.WaitFor(ctx, 3*time.Minute, 250*time.Millisecond, func() error {
		addrs := n.scanNoDuplicates()
		list, err := n.kube.CoreV1().Pods(testNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app=sleeper"})
		if err != nil {
			return err
		}
		pods = pods[:0]
		for _, p := range list.Items {
			if p.DeletionTimestamp != nil {
				return fmt.Errorf("pod %s is terminating", p.Name)
			}
			if p.Status.Phase != corev1.PodRunning || p.Status.PodIP == "" {
				return fmt.Errorf("pod %s is %s (ip %q)", p.Name, p.Status.Phase, p.Status.PodIP)
			}
			ip, err := netip.ParseAddr(p.Status.PodIP)
			if err != nil || !poolPrefix.Contains(ip) {
				t.Fatalf("pod %s has address %q, not in pool %s", p.Name, p.Status.PodIP, poolCIDR)
			}
			ns := addrs[ip]
			if len(ns) != 1 {
				return fmt.Errorf("pod %s address %s is on %d network namespaces", p.Name, ip, len(ns))
			}
			pods = append(pods, pod{name: p.Name, uid: string(p.UID), ip: ip, netns: ns[0]})
		}
		if len(pods) != want {
			return fmt.Errorf("%d workload pods, want %d", len(pods), want)
		}
		// Every address in use on the node belongs to a running pod: nothing stale.
		var inPool int
		for a := range addrs {
			if poolPrefix.Contains(a) {
				inPool++
			}
		}
		if inPool != want+n.others {
			return fmt.Errorf("%d pool addresses on pod network namespaces, want %d", inPool, want+n.others)
		}
		return nil
	})
	if err != nil {
		n.dumpState(ctx)
		t.Fatalf("waiting for %d running pods: %v", want, err)
	}
	sort.Slice(pods, func(i, j int) bool { return pods[i].name < pods[j].name })
	return pods
}

// scanNoDuplicates fails the test if any address is on two pod network namespaces.
func (n *realNode) scanNoDuplicates() map[netip.Addr][]string {
	n.t.Helper()
	addrs, err := podAddresses()
	if err != nil {
		n.t.Fatal(err)
	}
	if d := duplicates(addrs); len(d) > 0 {
		n.t.Fatalf("an address is on two pod network namespaces: %v", d)
	}
	return addrs
}

func (n *realNode) netnsCarries(ip netip.Addr, netns string) bool {
	addrs, err := podAddresses()
	if err != nil {
		n.t.Fatal(err)
	}
	for _, ns := range addrs[ip] {
		if ns == netns {
			return true
		}
	}
	return false
}

// checkPing pings every pod from the first and the first from every pod, through the bridge.
// With reuseCooldown 0s the pinging pod may still hold a neighbor entry, from this test's own
// earlier pings, for a reused address's previous owner (the stale ARP a real cooldown exists
// for; re-resolving it took 10 to 20 s here): the entry for the target is flushed first.
func (n *realNode) checkPing(ctx context.Context, pods []pod) {
	n.t.Helper()
	for _, p := range pods[1:] {
		for _, pair := range [][2]pod{{pods[0], p}, {p, pods[0]}} {
			tries := 0
			_ = exec.Command("ip", "-n", pair[0].netns, "neigh", "flush", "to", pair[1].ip.String()).Run()
			err := localcluster.WaitFor(ctx, 10*time.Second, 100*time.Millisecond, func() error {
				tries++
				out, err := exec.Command("ip", "netns", "exec", pair[0].netns, "ping", "-c", "1", "-W", "1", pair[1].ip.String()).CombinedOutput()
				if err != nil {
					return fmt.Errorf("%v: %s", err, out)
				}
				return nil
			})
			if err != nil {
				n.t.Fatalf("%s (%s) cannot ping %s (%s): %v", pair[0].name, pair[0].ip, pair[1].name, pair[1].ip, err)
			}
			if tries > 1 {
				n.logf("%s reached %s after %d pings", pair[0].name, pair[1].ip, tries)
			}
		}
	}
}

// checkAttachments compares the agent's attachments (ipwarden agent list on its socket) with
// the running pods: one attachment per pod with its address, nothing else. So every address of
// a pod that is gone has been freed.
func (n *realNode) checkAttachments(ctx context.Context, pods []pod) {
	t := n.t
	t.Helper()
	want := map[string]string{}
	for _, p := range pods {
		want[p.ip.String()] = p.name
	}
	err := localcluster.WaitFor(ctx, 30*time.Second, 250*time.Millisecond, func() error {
		got, err := agentAttachments()
		if err != nil {
			return err
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			return fmt.Errorf("agent attachments %v, running pods %v", got, want)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// agentAttachments asks the agent (ipwarden agent list on its socket) for its attachments:
// address -> pod name.
func agentAttachments() (map[string]string, error) {
	return agentAddresses(func(cniproto.Attachment) bool { return true })
}

// agentAddresses asks the agent (ipwarden agent list on its socket) for the addresses of the
// attachments keep selects: address -> pod name.
func agentAddresses(keep func(cniproto.Attachment) bool) (map[string]string, error) {
	out, err := exec.Command(prep.Ipwarden, "agent", "list", "-o", "json", "--socket", cniproto.DefaultSocket).Output()
	if err != nil {
		return nil, fmt.Errorf("ipwarden agent list: %v", err)
	}
	var resp struct{ Attachments []cniproto.Attachment }
	if err := json.Unmarshal(out, &resp); err != nil {
		return nil, err
	}
	got := map[string]string{}
	for _, a := range resp.Attachments {
		if !keep(a) {
			continue
		}
		for _, ip := range a.IPs {
			addr := ip.Address
			if p, err := netip.ParsePrefix(addr); err == nil {
				addr = p.Addr().String()
			}
			got[addr] = a.Pod.Name
		}
	}
	return got, nil
}

// checkClean runs ipwarden check against the cluster and the agent and returns its report.
func (n *realNode) checkClean(ctx context.Context) string {
	out, err := exec.CommandContext(ctx, prep.Ipwarden, "check", "--kubeconfig", n.cp.Kubeconfig, "--grace=0s",
		"--agent", nodeName+"="+cniproto.DefaultSocket).CombinedOutput()
	if err != nil {
		n.t.Fatalf("ipwarden check: %v\n%s", err, out)
	}
	n.logf("ipwarden check:\n%s", out)
	return string(out)
}

func (n *realNode) waitNodeReady(ctx context.Context) {
	err := localcluster.WaitFor(ctx, 3*time.Minute, 250*time.Millisecond, func() error {
		node, err := n.kube.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady {
				if c.Status == corev1.ConditionTrue {
					return nil
				}
				return fmt.Errorf("node not ready: %s", c.Message)
			}
		}
		return fmt.Errorf("node has no Ready condition")
	})
	if err != nil {
		n.dumpState(ctx)
		n.t.Fatal(err)
	}
}

func (n *realNode) kubectl(args ...string) string {
	n.t.Helper()
	var stderr bytes.Buffer
	cmd := exec.Command(prep.Kubectl, append([]string{"--kubeconfig", n.cp.Kubeconfig}, args...)...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		n.dumpState(context.Background())
		n.t.Fatalf("kubectl %v: %v\n%s%s", args, err, out, stderr.String())
	}
	return string(out)
}

// dumpState logs what an operator would look at when something does not converge.
func (n *realNode) dumpState(ctx context.Context) {
	cmd := exec.Command(prep.Kubectl, "--kubeconfig", n.cp.Kubeconfig, "get", "pods,ippools,nodeipallocations", "-A", "-o", "wide")
	out, _ := cmd.CombinedOutput()
	n.t.Logf("state:\n%s", out)
	out, _ = exec.Command(prep.Kubectl, "--kubeconfig", n.cp.Kubeconfig, "get", "ippools,nodeipallocations", "-o", "yaml").CombinedOutput()
	n.t.Logf("pools and allocations:\n%s", out)
	out, _ = exec.Command(prep.Ipwarden, "agent", "list", "-o", "json", "--socket", cniproto.DefaultSocket).CombinedOutput()
	n.t.Logf("ipwarden agent list:\n%s", out)
	ev := exec.Command(prep.Kubectl, "--kubeconfig", n.cp.Kubeconfig, "get", "events", "-A", "--sort-by=.lastTimestamp")
	out, _ = ev.CombinedOutput()
	if len(out) > 6000 {
		out = out[len(out)-6000:]
	}
	n.t.Logf("events:\n%s", out)
	for _, c := range []string{"agent", "controller"} {
		lg := exec.Command(prep.Kubectl, "--kubeconfig", n.cp.Kubeconfig, "logs", "-n", "ipwarden-system", "-l",
			"app.kubernetes.io/component="+c, "--tail=40", "--prefix")
		out, _ = lg.CombinedOutput()
		n.t.Logf("%s logs:\n%s", c, out)
	}
}

// replaceAgentPod deletes the agent's pod (the kubelet stops it with SIGTERM) and waits until
// the DaemonSet's new one is ready, calling each at every poll.
func (n *realNode) replaceAgentPod(ctx context.Context, each func()) {
	n.t.Helper()
	old := n.agentPodUID(ctx)
	n.kubectl("delete", "pod", "-n", "ipwarden-system", "-l", "app.kubernetes.io/component=agent", "--wait=true")
	if err := localcluster.WaitFor(ctx, 3*time.Minute, 250*time.Millisecond, func() error {
		each()
		if uid := n.agentPodUID(ctx); uid == "" || uid == old {
			return fmt.Errorf("no new ready agent pod yet")
		}
		return nil
	}); err != nil {
		n.dumpState(ctx)
		n.t.Fatal(err)
	}
}

// agentPodUID is the UID of the ready agent pod ("" when there is none).
func (n *realNode) agentPodUID(ctx context.Context) string {
	pods, err := n.kube.CoreV1().Pods("ipwarden-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=agent"})
	if err != nil {
		return ""
	}
	for _, p := range pods.Items {
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue && p.DeletionTimestamp == nil {
				return string(p.UID)
			}
		}
	}
	return ""
}

// podIPs renders name -> address, for comparing before and after a restart.
func podIPs(pods []pod) string {
	var s []string
	for _, p := range pods {
		s = append(s, p.name+"="+p.ip.String())
	}
	return strings.Join(s, " ")
}

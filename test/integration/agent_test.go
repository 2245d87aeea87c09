package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	cnitypes "github.com/containernetworking/cni/pkg/types"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// agentPool creates a pool that selects only nodes labelled ipwarden.test/agent=<label>, so
// other tests' nodes and agents never draw from it.
func agentPool(t *testing.T, name, label string, spec ipwardenv1.IPPoolSpec) {
	t.Helper()
	spec.NodeSelector = &metav1.LabelSelector{MatchLabels: map[string]string{"ipwarden.test/agent": label}}
	createPool(t, name, spec)
}

func agentNode(t *testing.T, name, label string) {
	t.Helper()
	createNode(t, name, map[string]string{"ipwarden.test/agent": label})
}

// twoNodes is a pool, two nodes it selects, a controller, and a serving agent on each node with
// a plugin configuration for it.
type twoNodes struct {
	ctrl         *controllerProcess
	a, b         *agentProcess
	confA, confB string
}

// startTwoNodes creates pool name (with spec, selecting label name) and nodes name-a and name-b,
// starts a controller and an agent on each node with args, and waits until both agents serve.
func startTwoNodes(t *testing.T, name string, spec ipwardenv1.IPPoolSpec, args ...string) twoNodes {
	t.Helper()
	agentPool(t, name, name, spec)
	agentNode(t, name+"-a", name)
	agentNode(t, name+"-b", name)
	n := twoNodes{ctrl: startController(t)}
	n.a = startAgent(t, name+"-a", "", args...)
	n.b = startAgent(t, name+"-b", "", args...)
	n.a.waitServing(t)
	n.b.waitServing(t)
	n.confA, n.confB = pluginConf("1.1.0", n.a.socket, name), pluginConf("1.1.0", n.b.socket, name)
	return n
}

func nipa(t *testing.T, node string) *ipwardenv1.NodeIPAllocation {
	t.Helper()
	a := &ipwardenv1.NodeIPAllocation{}
	if err := k8s.Get(context.Background(), client.ObjectKey{Name: node}, a); err != nil {
		t.Fatal(err)
	}
	return a
}

func requested(t *testing.T, node, pool string) (int, []string) {
	t.Helper()
	for _, p := range nipa(t, node).Spec.Pools {
		if p.Pool == pool {
			var rel []string
			for _, b := range p.Releasing {
				rel = append(rel, string(b))
			}
			return int(p.Requested), rel
		}
	}
	return -1, nil
}

func addrOf(t *testing.T, cidr string) netip.Addr {
	t.Helper()
	p, err := netip.ParsePrefix(cidr)
	if err != nil {
		t.Fatal(err)
	}
	return p.Addr()
}

func metricValue(t *testing.T, body, series string) float64 {
	t.Helper()
	for _, line := range strings.Split(body, "\n") {
		if strings.HasPrefix(line, series+" ") {
			v, err := strconv.ParseFloat(strings.TrimSpace(strings.TrimPrefix(line, series)), 64)
			if err != nil {
				t.Fatal(err)
			}
			return v
		}
	}
	return -1
}

// An agent started before its NodeIPAllocation exists waits for the controller; then it answers
// ADD, DEL, CHECK, GC and STATUS through the real plugin binary, dual-stack, with the pool's
// gateway and routes, and its request, metrics and attachment list follow.
func TestAgentServesThroughPlugin(t *testing.T) {
	agentPool(t, "agent-v4", "serve", ipwardenv1.IPPoolSpec{
		CIDRs: []ipwardenv1.CIDR{"10.120.0.0/24"}, Exclude: []ipwardenv1.IPOrCIDR{"10.120.0.1"}, Gateway: "10.120.0.1",
		Routes:        []ipwardenv1.Route{{Dst: "0.0.0.0/0"}},
		Scaling:       ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 32},
		ReuseCooldown: cooldown(time.Hour),
	})
	agentPool(t, "agent-v6", "serve", ipwardenv1.IPPoolSpec{
		CIDRs:         []ipwardenv1.CIDR{"fd00:120::/120"},
		Scaling:       ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 32},
		ReuseCooldown: cooldown(time.Hour),
	})
	agentNode(t, "agent-serve", "serve")
	// No controller yet: nobody creates the NodeIPAllocation, the agent waits and says so.
	ag := startAgent(t, "agent-serve", "", "--gc-grace=0s")
	eventually(t, 30*time.Second, "the agent to log that it waits for the controller", func() error {
		if !ag.logContains("waiting for the controller to create this node's NodeIPAllocation") {
			return fmt.Errorf("not logged yet")
		}
		return nil
	})
	// It answers at once (DEL, CHECK, LIST from its journal) but refuses ADD and says why.
	if _, e := cni(t, "ADD", pluginConf("1.1.0", ag.socket), "early", podArgs("default", "early", "uid-early")); e == nil ||
		e.Code != 11 || !strings.Contains(e.Msg, "waiting for the controller to create NodeIPAllocation agent-serve") {
		t.Fatalf("ADD before the agent has reconciled: %v", e)
	}
	if _, e := cni(t, "DEL", pluginConf("1.1.0", ag.socket), "early", podArgs("default", "early", "uid-early")); e != nil {
		t.Fatalf("DEL before the agent has reconciled: %v", e)
	}
	startController(t)
	ag.waitServing(t)
	for path, mode := range map[string]os.FileMode{ag.socket: 0o600, ag.socket[:strings.LastIndex(ag.socket, "/")]: 0o700} {
		fi, err := os.Stat(path)
		if err != nil || fi.Mode().Perm() != mode {
			t.Fatalf("%s: mode %v (%v), want %v", path, fi.Mode().Perm(), err, mode)
		}
	}
	conf := pluginConf("1.1.0", ag.socket)

	r := mustAdd(t, conf, "c1")
	if len(r.IPs) != 2 || !strings.HasPrefix(r.IPs[0].Address, "10.120.0.") || !strings.HasSuffix(r.IPs[0].Address, "/24") ||
		r.IPs[0].Gateway != "10.120.0.1" || !strings.HasPrefix(r.IPs[1].Address, "fd00:120::") || !strings.HasSuffix(r.IPs[1].Address, "/120") ||
		len(r.Routes) != 1 || r.Routes[0].Dst != "0.0.0.0/0" {
		t.Fatalf("dual-stack ADD result %+v", r)
	}
	c1v4 := addrOf(t, r.IPs[0].Address)
	if !held(t, "agent-serve", "agent-v4").Contains(c1v4) || !held(t, "agent-serve", "agent-v6").Contains(addrOf(t, r.IPs[1].Address)) {
		t.Fatalf("ADD handed out %v, which the node's status does not hold", r.addrs())
	}
	if again := mustAdd(t, conf, "c1"); strings.Join(again.addrs(), ",") != strings.Join(r.addrs(), ",") {
		t.Fatalf("repeated ADD gave %v, first %v", again.addrs(), r.addrs())
	}
	for _, v := range []string{"0.4.0", "1.0.0"} {
		rv, e := cni(t, "ADD", pluginConf(v, ag.socket, "agent-v4"), "ver"+strings.ReplaceAll(v, ".", ""), podArgs("default", "v", "uid-v"+v))
		if e != nil || rv.CNIVersion != v || len(rv.IPs) != 1 {
			t.Fatalf("ADD with cniVersion %s: %+v %v", v, rv, e)
		}
	}
	eventually(t, 10*time.Second, "the request for 3 attachments (batch 4, buffer 50%: 8)", func() error {
		if n, _ := requested(t, "agent-serve", "agent-v4"); n != 8 {
			return fmt.Errorf("requested %d", n)
		}
		return nil
	})

	prev := fmt.Sprintf(`,"prevResult":{"cniVersion":"1.1.0","ips":[{"address":%q},{"address":%q}]}`, r.IPs[0].Address, r.IPs[1].Address)
	if _, e := cni(t, "CHECK", strings.TrimSuffix(conf, "}")+prev+"}", "c1", ""); e != nil {
		t.Fatalf("CHECK: %v", e)
	}
	if _, e := cni(t, "CHECK", conf, "unknown", ""); e == nil || e.Code != 3 {
		t.Fatalf("CHECK of an unknown attachment: %v", e)
	}
	if _, e := cni(t, "STATUS", conf, "", ""); e != nil {
		t.Fatalf("STATUS: %v", e)
	}

	mustDel(t, conf, "c1")
	mustDel(t, conf, "c1")
	mustDel(t, conf, "never-added")
	// The freed address cools down (1h): the next ADDs never get it.
	for i := range 5 {
		if got := addrOf(t, mustAdd(t, conf, fmt.Sprintf("n%d", i)).IPs[0].Address); got == c1v4 {
			t.Fatalf("ADD %d got %s, freed moments ago", i, got)
		}
	}

	// GC: the runtime lists only ver040 and n0..n4 as valid; ver100 goes.
	valid := []gcAttachment{{"ver040", "eth0"}}
	for i := range 5 {
		valid = append(valid, gcAttachment{fmt.Sprintf("n%d", i), "eth0"})
	}
	vb, _ := json.Marshal(valid)
	if _, e := cni(t, "GC", strings.TrimSuffix(conf, "}")+`,"cni.dev/valid-attachments":`+string(vb)+"}", "", ""); e != nil {
		t.Fatalf("GC: %v", e)
	}
	resp, err := ag.list(t)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, a := range resp.Attachments {
		ids = append(ids, a.ContainerID)
	}
	if got := strings.Join(ids, ","); got != "n0,n1,n2,n3,n4,ver040" {
		t.Fatalf("attachments after GC: %s", got)
	}

	// `ipwarden agent list` prints the same, as a table and as JSON.
	out, err := exec.Command(ipwardenBinary(t), "agent", "list", "--socket", ag.socket, "-o", "json").Output()
	if err != nil {
		t.Fatal(err)
	}
	var listed cniproto.Response
	if err := json.Unmarshal(out, &listed); err != nil || len(listed.Attachments) != 6 || listed.Node != "agent-serve" {
		t.Fatalf("agent list -o json: %v\n%s", err, out)
	}
	table, err := exec.Command(ipwardenBinary(t), "agent", "list", "--socket", ag.socket).Output()
	if err != nil || !strings.Contains(string(table), "default/pod-n3") || !strings.Contains(string(table), "agent-v6") {
		t.Fatalf("agent list: %v\n%s", err, table)
	}

	// Metrics: per-pool gauges, latency histograms, errors by code.
	eventually(t, 10*time.Second, "pool gauges", func() error {
		body, err := httpGet("http://" + ag.metrics + "/metrics")
		if err != nil {
			return err
		}
		if v := metricValue(t, body, `ipwarden_agent_pool_in_use_addresses{pool="agent-v4"}`); v != 6 {
			return fmt.Errorf("in use %v", v)
		}
		for _, s := range []string{`ipwarden_agent_pool_held_addresses{pool="agent-v6"}`, `ipwarden_agent_pool_free_addresses{pool="agent-v4"}`,
			`ipwarden_agent_pool_requested_addresses{pool="agent-v4"}`, `ipwarden_agent_pool_releasing_addresses{pool="agent-v4"}`,
			`ipwarden_agent_cni_request_duration_seconds_count{op="ADD"}`, `ipwarden_agent_cni_request_duration_seconds_count{op="DEL"}`,
			`ipwarden_agent_journal_write_seconds_count`, `ipwarden_agent_ip_wait_seconds_count`, `ipwarden_agent_cni_errors_total{code="3",op="CHECK"}`} {
			if metricValue(t, body, s) < 0 {
				return fmt.Errorf("no series %s", s)
			}
		}
		return nil
	})
}

type gcAttachment struct {
	ContainerID string `json:"containerID"`
	IfName      string `json:"ifname"`
}

// A burst of 110 concurrent ADDs (kubelet's pod limit) on a cold node: every one succeeds with
// a distinct address the node holds, the controller fills in batches, the agent writes its spec
// far less than once per pod, and when the pods go the node shrinks back to one batch.
func TestAgentBurstOnColdNode(t *testing.T) {
	// A short release delay, so the give-back after the burst is seen within the test.
	agentPool(t, "agent-burst", "burst", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.121.0.0/22"}, ReuseCooldown: cooldown(time.Second),
		Scaling: ipwardenv1.Scaling{BatchSize: 16, BufferPercent: 50, MaxPerNode: 250, ReleaseDelay: &metav1.Duration{Duration: 2 * time.Second}}})
	agentNode(t, "agent-burst", "burst")
	startController(t)
	ag := startAgent(t, "agent-burst", "", "--address-wait=20s")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)

	const n = 110
	start := time.Now()
	var wg sync.WaitGroup
	results := make([]string, n)
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			r, e := cni(t, "ADD", conf, fmt.Sprintf("burst%03d", i), podArgs("default", fmt.Sprintf("p%d", i), fmt.Sprintf("u%d", i)))
			if e != nil {
				errs[i] = e
				return
			}
			results[i] = r.IPs[0].Address
		})
	}
	wg.Wait()
	took := time.Since(start)
	seen := map[string]int{}
	for i, err := range errs {
		if err != nil {
			t.Errorf("ADD %d: %v", i, err)
			continue
		}
		if j, dup := seen[results[i]]; dup {
			t.Errorf("%s handed to ADD %d and %d", results[i], j, i)
		}
		seen[results[i]] = i
	}
	if t.Failed() {
		t.FailNow()
	}
	h := held(t, "agent-burst", "agent-burst")
	for a := range seen {
		if !h.Contains(addrOf(t, a)) {
			t.Fatalf("%s is not held by the node", a)
		}
	}
	body, err := httpGet("http://" + ag.metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	writes := metricValue(t, body, `ipwarden_agent_spec_writes_total{result="ok"}`)
	req, _ := requested(t, "agent-burst", "agent-burst")
	t.Logf("110 ADDs in %s; node holds %d, requests %d; %v spec writes", took.Round(time.Millisecond), size(h), req, writes)
	// Address economy: at most demand + batch*(buffer+1) = 110 + 16*1.5.
	if req > n+24 || size(h) > n+24 {
		t.Errorf("requests %d, holds %d: more than demand + batch*(buffer+1) = %d", req, size(h), n+24)
	}
	if writes > n/4 {
		t.Errorf("%v spec writes for %d pods: the agent writes per pod, not per batch", writes, n)
	}

	// The pods go at once, as on a drained node. (One at a time, each DEL here takes about a
	// second, so the last few could land after the agent's last give-back round and stay within
	// the hysteresis band: holding <= Keep is kept, by design.)
	delErrs := make([]*cnitypes.Error, n)
	for i := range n {
		wg.Go(func() {
			_, delErrs[i] = cni(t, "DEL", conf, fmt.Sprintf("burst%03d", i), podArgs("default", "pod-burst", "uid-burst"))
		})
	}
	wg.Wait()
	for i, e := range delErrs {
		if e != nil {
			t.Fatalf("DEL %d: %v", i, e)
		}
	}
	// Demand 0: target one batch (16); after the release delay the agent releases the rest,
	// the controller takes it. The agent does not write again only to clear its releasing
	// list (the controller never hands back an address the spec lists as releasing).
	waitHeld(t, "agent-burst", "agent-burst", 16)
	if r, _ := requested(t, "agent-burst", "agent-burst"); r != 16 {
		t.Fatalf("requested %d after the give-back, want 16", r)
	}
}

// An agent killed with SIGKILL comes back with every attachment (the journal is written before
// ADD answers), answers repeated ADDs with the same addresses, and still never reuses an address
// freed inside the cooldown. While the API server is down it keeps serving from its warm set.
func TestAgentRestartAndAPIServerOutage(t *testing.T) {
	agentPool(t, "agent-restart", "restart", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.122.0.0/24"},
		Scaling: ipwardenv1.Scaling{BatchSize: 8, BufferPercent: 100, MaxPerNode: 64}, ReuseCooldown: cooldown(time.Hour)})
	agentNode(t, "agent-restart", "restart")
	startController(t)
	// A pod bound before the restart: the restarted agent's watch lists it, so its ADD needs
	// no API call during the outage below.
	offline := createBoundPod(t, "pod-offline1", "agent-restart")
	ag := startAgent(t, "agent-restart", "")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	before := map[string]string{}
	for i := range 6 {
		cid := fmt.Sprintf("r%d", i)
		before[cid] = mustAdd(t, conf, cid).IPs[0].Address
	}
	mustDel(t, conf, "r5")
	freed := before["r5"]
	delete(before, "r5")

	ag.restart(t)
	ag.waitServing(t)
	for cid, want := range before {
		if got := mustAdd(t, conf, cid).IPs[0].Address; got != want {
			t.Fatalf("after a restart, repeated ADD %s gave %s, before %s", cid, got, want)
		}
	}
	for i := range 8 {
		if got := mustAdd(t, conf, fmt.Sprintf("x%d", i)).IPs[0].Address; got == freed {
			t.Fatalf("after a restart, %s was handed out inside its cooldown", got)
		}
	}

	// API server down: ADD and DEL from the warm set still work.
	eventually(t, 10*time.Second, "the warm set to have free addresses", func() error {
		if p := ag.pool(t, "agent-restart"); p.Free < 2 {
			return fmt.Errorf("free %d", p.Free)
		}
		return nil
	})
	if err := controlPlane.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	restarted := false
	t.Cleanup(func() {
		if !restarted {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			_ = controlPlane.RestartAPIServer(ctx)
		}
	})
	// API server down: a pod the agent's watch knows is served; one it cannot have seen is
	// refused (CNI error 11), never given pools as if it had no annotations.
	ip := addFor(t, conf, "offline1", offline)
	mustDel(t, conf, "x0")
	if again := addFor(t, conf, "offline1", offline); again != ip {
		t.Fatal("repeated ADD during the outage changed the address")
	}
	if _, e := cni(t, "ADD", conf, "unseen", podArgs("default", "pod-unseen", "uid-unseen")); e == nil || e.Code != 11 ||
		!strings.Contains(e.Msg, "cannot read pod default/pod-unseen's annotations") {
		t.Fatalf("ADD of a pod the agent cannot have seen, API server down: %+v", e)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := controlPlane.RestartAPIServer(ctx); err != nil {
		t.Fatal(err)
	}
	restarted = true
	// Back online, the agent's spec catches up (8 attachments, batch 8, buffer 100%: 16).
	eventually(t, 60*time.Second, "the request after the outage", func() error {
		n, _ := requested(t, "agent-restart", "agent-restart")
		if n != 24 {
			return fmt.Errorf("requested %d", n)
		}
		return nil
	})
}

// createBoundPod creates a pod bound to node and returns it (no IP yet).
func createBoundPod(t *testing.T, name, node string) *corev1.Pod {
	t.Helper()
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "c", Image: "none"}}}}
	if err := k8s.Create(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), p, client.GracePeriodSeconds(0)) })
	return p
}

func setPodIP(t *testing.T, p *corev1.Pod, ip string) {
	t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := k8s.Get(context.Background(), client.ObjectKeyFromObject(p), p); err != nil {
			return err
		}
		p.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}}}
		return k8s.Status().Update(context.Background(), p)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// With its journal lost, the agent rebuilds attachments from the pods' status.podIPs before it
// serves: those addresses are never handed out again, and the pod's next sandbox adopts its
// address. Pods bound to the node but without an address yet count as demand.
func TestAgentRebuildsLostJournalFromPods(t *testing.T) {
	agentPool(t, "agent-rebuild", "rebuild", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.123.0.0/24"},
		Scaling: ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 64}, ReuseCooldown: cooldown(time.Hour)})
	agentNode(t, "agent-rebuild", "rebuild")
	startController(t)
	// Its state directory is lost below: the new one is a new holder, which waits for the old
	// Lease to expire (short timings here; the default is 60s).
	ag := startAgent(t, "agent-rebuild", "", "--lease-duration=6s", "--lease-renew-interval=2s")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket, "agent-rebuild")

	web := createBoundPod(t, "rebuild-web", "agent-rebuild")
	r, e := cni(t, "ADD", conf, "sandbox1", podArgs("default", web.Name, string(web.UID)))
	if e != nil {
		t.Fatal(e)
	}
	ip := r.IPs[0].Address
	setPodIP(t, web, addrOf(t, ip).String())

	// Three more pods are bound but have no address: demand 4 (+1 running) -> 8.
	for i := range 3 {
		createBoundPod(t, fmt.Sprintf("rebuild-pending-%d", i), "agent-rebuild")
	}
	eventually(t, 10*time.Second, "pending pods to count as demand", func() error {
		if n, _ := requested(t, "agent-rebuild", "agent-rebuild"); n != 8 {
			return fmt.Errorf("requested %d", n)
		}
		return nil
	})

	ag.kill()
	if err := os.RemoveAll(ag.stateDir); err != nil {
		t.Fatal(err)
	}
	ag.start(t, "--lease-duration=6s", "--lease-renew-interval=2s")
	ag.waitServing(t)
	resp, err := ag.list(t)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Attachments) != 1 || !resp.Attachments[0].Rebuilt || resp.Attachments[0].Pod.UID != string(web.UID) ||
		resp.Attachments[0].IPs[0].Address != ip {
		t.Fatalf("after losing the journal: %+v", resp.Attachments)
	}
	for i := range 6 {
		if got := mustAdd(t, conf, fmt.Sprintf("other%d", i)).IPs[0].Address; got == ip {
			t.Fatalf("handed the running pod's address %s to another attachment", got)
		}
	}
	// The pod's sandbox is recreated: the old one's DEL (unknown container) succeeds, the new
	// sandbox gets the pod's address back.
	if _, e := cni(t, "DEL", conf, "sandbox1", podArgs("default", web.Name, string(web.UID))); e != nil {
		t.Fatal(e)
	}
	r2, e := cni(t, "ADD", conf, "sandbox2", podArgs("default", web.Name, string(web.UID)))
	if e != nil || r2.IPs[0].Address != ip {
		t.Fatalf("the pod's new sandbox got %+v (%v), want its address %s", r2, e, ip)
	}
}

// With no free address the ADD waits --address-wait, then fails with CNI error 11 naming the
// pool and why: the node is at maxPerNode, or the controller does not answer.
func TestAgentNoFreeAddress(t *testing.T) {
	agentPool(t, "agent-short", "short", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.124.0.0/24"},
		Scaling: ipwardenv1.Scaling{BatchSize: 2, BufferPercent: 0, MaxPerNode: 2}, ReuseCooldown: cooldown(time.Hour)})
	agentNode(t, "agent-short", "short")
	ctl := startController(t)
	ag := startAgent(t, "agent-short", "", "--address-wait=1s")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	mustAdd(t, conf, "a")
	mustAdd(t, conf, "b")
	start := time.Now()
	_, e := cni(t, "ADD", conf, "c", podArgs("default", "pod-c", "uid-c"))
	if e == nil || e.Code != 11 || !strings.Contains(e.Msg, "pool agent-short") || !strings.Contains(e.Msg, "maxPerNode") {
		t.Fatalf("ADD beyond maxPerNode: %+v", e)
	}
	if time.Since(start) < time.Second {
		t.Fatal("the ADD did not wait --address-wait")
	}

	// The controller is gone and the pool's limit is raised: the request rises, nobody fills it.
	ctl.kill()
	p := getPool(t, "agent-short")
	p.Spec.Scaling.MaxPerNode = 8
	if err := k8s.Update(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the agent to see the new limit", func() error {
		_, e := cni(t, "ADD", conf, "d", podArgs("default", "pod-d", "uid-d"))
		if e == nil {
			return fmt.Errorf("ADD succeeded without a controller")
		}
		if !strings.Contains(e.Msg, "controller has not answered") {
			return fmt.Errorf("%s", e.Msg)
		}
		return nil
	})
}

// An attachment whose address the controller's status no longer lists is a conflict: the agent
// logs and counts it and keeps serving it, never drops it.
func TestAgentKeepsConflictingAttachment(t *testing.T) {
	agentPool(t, "agent-conflict", "conflict", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.125.0.0/24"},
		Scaling: ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 16}})
	agentNode(t, "agent-conflict", "conflict")
	ctl := startController(t)
	ag := startAgent(t, "agent-conflict", "")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	ip := addrOf(t, mustAdd(t, conf, "a").IPs[0].Address)
	ctl.kill()
	// Someone (not the controller's rules) removes the address from the status.
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		a := nipa(t, "agent-conflict")
		for i, p := range a.Status.Pools {
			if p.Pool == "agent-conflict" {
				s, _ := addr.ParseSet(p.Addresses)
				s = s.Subtract(addr.SetOfAddrs(ip))
				a.Status.Pools[i].Addresses, a.Status.Pools[i].Held = s.Strings(), int32(size(s))
			}
		}
		return k8s.Status().Update(context.Background(), a)
	})
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the conflict to show", func() error {
		resp, err := ag.list(t)
		if err != nil {
			return err
		}
		if len(resp.Attachments) != 1 || len(resp.Attachments[0].Conflicts) != 1 {
			return fmt.Errorf("attachments %+v", resp.Attachments)
		}
		return nil
	})
	if !ag.logContains("conflict: an attachment uses an address the node no longer holds") {
		t.Fatal("conflict not logged")
	}
	if again := mustAdd(t, conf, "a"); addrOf(t, again.IPs[0].Address) != ip {
		t.Fatal("the conflicting attachment lost its address")
	}
}

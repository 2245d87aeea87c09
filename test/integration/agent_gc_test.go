package integration

// Leak collection by the node agent, against the real API server with real agent, controller and
// plugin processes: the event path, the full check after a restart, pods the cache has not seen,
// StatefulSet name reuse, dry run, CNI GC, and the events and metrics they leave.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/check"
)

// gcSetup makes a pool (batch 16, no reuse cooldown, so a freed address is free at once) that
// only node selects, the node, and a controller.
func gcSetup(t *testing.T, node, cidr string) {
	t.Helper()
	agentPool(t, node, node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{ipwardenv1.CIDR(cidr)},
		Scaling: ipwardenv1.Scaling{BatchSize: 16, BufferPercent: 50, MaxPerNode: 64}, ReuseCooldown: cooldown(0)})
	agentNode(t, node, node)
	startController(t)
}

// addFor runs ADD through the plugin for pod p (its namespace, name and UID in CNI_ARGS).
func addFor(t *testing.T, conf, cid string, p *corev1.Pod) string {
	t.Helper()
	r, e := cni(t, "ADD", conf, cid, podArgs(p.Namespace, p.Name, string(p.UID)))
	if e != nil {
		t.Fatalf("ADD %s for pod %s: %v", cid, p.Name, e)
	}
	return r.IPs[0].Address
}

func forceDelete(t *testing.T, p *corev1.Pod) {
	t.Helper()
	if err := k8s.Delete(context.Background(), p, client.GracePeriodSeconds(0)); err != nil {
		t.Fatal(err)
	}
}

// attachmentIDs lists the agent's attachments by container ID.
func (a *agentProcess) attachmentIDs(t *testing.T) []string {
	t.Helper()
	resp, err := a.list(t)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, at := range resp.Attachments {
		ids = append(ids, at.ContainerID)
	}
	slices.Sort(ids)
	return ids
}

// waitAttachments waits until the agent's attachments are exactly want.
func (a *agentProcess) waitAttachments(t *testing.T, timeout time.Duration, want ...string) {
	t.Helper()
	slices.Sort(want)
	eventually(t, timeout, fmt.Sprintf("attachments %v", want), func() error {
		if got := a.attachmentIDs(t); !slices.Equal(got, want) {
			return fmt.Errorf("attachments %v", got)
		}
		return nil
	})
}

// metric reads one series from the agent's /metrics (-1 when absent).
func (a *agentProcess) metric(t *testing.T, series string) float64 {
	t.Helper()
	body, err := httpGet("http://" + a.metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	return metricValue(t, body, series)
}

// waitMetric waits until a series reaches at least min.
func (a *agentProcess) waitMetric(t *testing.T, timeout time.Duration, series string, min float64) {
	t.Helper()
	eventually(t, timeout, fmt.Sprintf("%s >= %v", series, min), func() error {
		if v := a.metric(t, series); v < min {
			return fmt.Errorf("%s = %v", series, v)
		}
		return nil
	})
}

// waitEvent waits for an event with reason about the object kind/name (and uid, if given) whose
// message contains text, and returns it.
func waitEvent(t *testing.T, reason, kind, name, uid, text string) corev1.Event {
	t.Helper()
	var found corev1.Event
	eventually(t, 20*time.Second, fmt.Sprintf("event %s on %s %s", reason, kind, name), func() error {
		var list corev1.EventList
		if err := k8s.List(context.Background(), &list); err != nil {
			return err
		}
		for _, e := range list.Items {
			o := e.InvolvedObject
			if e.Reason == reason && o.Kind == kind && o.Name == name && (uid == "" || string(o.UID) == uid) && strings.Contains(e.Message, text) {
				found = e
				return nil
			}
		}
		return fmt.Errorf("not among %d events", len(list.Items))
	})
	return found
}

// The event path: a pod deleted without CNI DEL has its address freed within seconds (the
// deletion proves it, so no grace period applies), through the DEL path; a pod being deleted
// gracefully keeps it until its object is gone; a StatefulSet-style delete and recreate under the
// same name frees the old pod's address and keeps the new one's; events and metrics show it.
func TestAgentGCEventPath(t *testing.T) {
	const node = "gc-event"
	gcSetup(t, node, "10.130.0.0/24")
	// A long grace and full-check interval: only the event path can free anything here.
	ag := startAgent(t, node, "", "--gc-grace=10m", "--gc-full-check-interval=1h")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)

	web := createBoundPod(t, "gc-web", node)
	db := createBoundPod(t, "gc-db", node)
	webIP := addFor(t, conf, "web-sandbox", web)
	addFor(t, conf, "db-sandbox", db)
	// The runtime passed no K8S_POD_UID for this one: matched by name only.
	if _, e := cni(t, "ADD", conf, "db-noid", podArgs(db.Namespace, db.Name, "")); e != nil {
		t.Fatal(e)
	}
	waitHeld(t, node, node, 16)
	eventually(t, 10*time.Second, "13 free addresses", func() error {
		if p := ag.pool(t, node); p.Free != 13 || p.InUse != 3 {
			return fmt.Errorf("free %d, in use %d", p.Free, p.InUse)
		}
		return nil
	})

	start := time.Now()
	forceDelete(t, web)
	ag.waitAttachments(t, 10*time.Second, "db-noid", "db-sandbox")
	took := time.Since(start)
	if p := ag.pool(t, node); p.Free != 14 || p.InUse != 2 {
		t.Fatalf("after the event path: free %d, in use %d; want 14, 2", p.Free, p.InUse)
	}
	t.Logf("the deleted pod's address was free %s after the deletion", took.Round(time.Millisecond))
	ev := waitEvent(t, "IPAddressGarbageCollected", "Pod", web.Name, string(web.UID), strings.Split(webIP, "/")[0])
	if ev.Type != corev1.EventTypeNormal || ev.Namespace != web.Namespace || ev.Source.Component != "ipwarden-agent" {
		t.Fatalf("event %+v", ev)
	}
	if v := ag.metric(t, `ipwarden_agent_gc_collected_total{path="event"}`); v != 1 {
		t.Fatalf("collected{event} = %v", v)
	}
	if v := ag.metric(t, `ipwarden_agent_gc_delete_to_free_seconds_count{path="event"}`); v != 1 {
		t.Fatalf("delete-to-free samples = %v", v)
	}
	// The collector's work queue reports on the endpoint the agent serves (not a registry
	// nobody scrapes): the deletion went through it.
	if v := ag.metric(t, `workqueue_adds_total{name="ipwarden_agent_pod_gc"}`); v < 1 {
		t.Fatalf("workqueue_adds_total of the leak collector's queue = %v, want >= 1 (-1: not served)", v)
	}
	if v := ag.metric(t, `workqueue_depth{name="ipwarden_agent_pod_gc"}`); v < 0 {
		t.Fatalf("workqueue_depth of the leak collector's queue not served")
	}

	// StatefulSet: the pod is deleted and recreated under its name; the new pod's sandbox gets
	// an address, whichever comes first of that and the old pod's deletion reaching the agent.
	old := createBoundPod(t, "gc-sts-0", node)
	addFor(t, conf, "sts-old", old)
	forceDelete(t, old)
	recreated := createBoundPod(t, "gc-sts-0", node)
	if recreated.UID == old.UID {
		t.Fatal("the API server reused a UID")
	}
	newIP := addFor(t, conf, "sts-new", recreated)
	ag.waitAttachments(t, 10*time.Second, "db-noid", "db-sandbox", "sts-new")
	waitEvent(t, "IPAddressGarbageCollected", "Pod", old.Name, string(old.UID), "")
	// The new pod's attachment is the one kept, with the address its ADD got.
	resp, err := ag.list(t)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range resp.Attachments {
		if a.ContainerID == "sts-new" && (a.Pod.UID != string(recreated.UID) || a.IPs[0].Address != newIP) {
			t.Fatalf("the new pod's attachment changed: %+v", a)
		}
	}

	// A graceful deletion sets deletionTimestamp; the pod still runs (no kubelet here finishes
	// it), so it keeps its addresses. Once the object is gone, the UID-matched attachment goes
	// at once; the one without a UID waits out the grace period (the runtime may be ahead of
	// the API server for a pod of that name).
	if err := k8s.Delete(context.Background(), db); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the pod to be terminating", func() error {
		p := &corev1.Pod{}
		if err := k8s.Get(context.Background(), client.ObjectKeyFromObject(db), p); err != nil {
			return err
		}
		if p.DeletionTimestamp == nil {
			return fmt.Errorf("no deletionTimestamp")
		}
		return nil
	})
	forceDelete(t, db)
	ag.waitAttachments(t, 10*time.Second, "db-noid", "sts-new")
	if v := ag.metric(t, `ipwarden_agent_gc_collected_total{path="event"}`); v != 3 {
		t.Fatalf("collected{event} = %v, want 3", v)
	}
	if v := ag.metric(t, `ipwarden_agent_gc_failed_total{path="event"}`); v != 0 {
		t.Fatalf("failed{event} = %v", v)
	}
}

// With the agent stopped, pods are deleted: no event will ever tell the agent. Started again, its
// full check finds their attachments once they are past the grace period, re-checks each pod with
// the API server and frees them; the live pod's attachment stays. First in dry run: reported,
// nothing freed.
func TestAgentGCAfterRestart(t *testing.T) {
	const node = "gc-restart"
	gcSetup(t, node, "10.131.0.0/24")
	flags := []string{"--gc-grace=2s", "--gc-full-check-interval=300ms"}
	ag := startAgent(t, node, "", flags...)
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	var pods []*corev1.Pod
	for i := range 3 {
		p := createBoundPod(t, fmt.Sprintf("gc-restart-%d", i), node)
		addFor(t, conf, fmt.Sprintf("r%d", i), p)
		pods = append(pods, p)
	}
	waitHeld(t, node, node, 16)

	ag.kill()
	forceDelete(t, pods[0])
	forceDelete(t, pods[1])

	ag.start(t, append(flags, "--gc-dry-run")...)
	ag.waitServing(t)
	ag.waitMetric(t, 20*time.Second, `ipwarden_agent_gc_dry_run_total{path="full-check"}`, 2)
	waitEvent(t, "IPAddressGarbageCollectionDryRun", "NodeIPAllocation", node, "", "would free")
	if got := ag.attachmentIDs(t); !slices.Equal(got, []string{"r0", "r1", "r2"}) {
		t.Fatalf("dry run freed something: %v", got)
	}
	if v := ag.metric(t, `ipwarden_agent_gc_collected_total{path="full-check"}`); v != 0 {
		t.Fatalf("dry run counted %v collected", v)
	}
	free := ag.pool(t, node).Free

	ag.restart(t, flags...)
	ag.waitServing(t)
	ag.waitAttachments(t, 20*time.Second, "r2")
	if p := ag.pool(t, node); p.Free != free+2 {
		t.Fatalf("free %d, want %d", p.Free, free+2)
	}
	if v := ag.metric(t, `ipwarden_agent_gc_collected_total{path="full-check"}`); v != 2 {
		t.Fatalf("collected{full-check} = %v", v)
	}
	// The agent never saw these pods' deletion: the events go on the node's NodeIPAllocation.
	alloc := nipa(t, node)
	ev := waitEvent(t, "IPAddressGarbageCollected", "NodeIPAllocation", node, string(alloc.UID), "gc-restart-0")
	if !strings.Contains(ev.Message, "full check") {
		t.Fatalf("event %q", ev.Message)
	}
	waitEvent(t, "IPAddressGarbageCollected", "NodeIPAllocation", node, string(alloc.UID), "gc-restart-1")
}

// A pod the agent's cache has not seen is never freed: not within the grace period (the pod may
// not be in the cache yet), and not after it while the API server shows the pod. Here the cache
// never sees two pods (not bound to the node, so outside the agent's field selector) and a third
// is created only after its ADD; a fourth never exists and is freed after the grace period.
// The two phases run the agent with a grace no machine outruns (an hour) and then, restarted on
// the same journal, with none left (1 ns), so neither depends on how fast this machine is.
func TestAgentGCNeverFreesPodTheCacheHasNotSeen(t *testing.T) {
	const node = "gc-unseen"
	gcSetup(t, node, "10.132.0.0/24")
	ag := startAgent(t, node, "", "--gc-grace=1h", "--gc-full-check-interval=200ms")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)

	unbound := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "gc-unbound"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "none"}}}}
	if err := k8s.Create(context.Background(), unbound); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), unbound, client.GracePeriodSeconds(0)) })
	addFor(t, conf, "unseen", unbound)
	// The runtime is ahead of the API server: ADD (without UID, as it cannot know it yet) for
	// a pod that does not exist yet.
	if _, e := cni(t, "ADD", conf, "early", podArgs("default", "gc-late", "")); e != nil {
		t.Fatal(e)
	}
	if _, e := cni(t, "ADD", conf, "ghost", podArgs("default", "gc-ghost", "uid-ghost")); e != nil {
		t.Fatal(e)
	}
	// Within the grace period two full checks free nothing, not even the ghost.
	n := ag.metric(t, "ipwarden_agent_gc_full_checks_total")
	ag.waitMetric(t, 10*time.Second, "ipwarden_agent_gc_full_checks_total", n+2)
	if got := ag.attachmentIDs(t); !slices.Equal(got, []string{"early", "ghost", "unseen"}) {
		t.Fatalf("within the grace period: attachments %v", got)
	}
	late := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "gc-late"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "none"}}}}
	if err := k8s.Create(context.Background(), late); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), late, client.GracePeriodSeconds(0)) })

	// Past the grace period the ghost goes; the API server shows the other two pods, so the
	// re-check keeps them however often the full check asks.
	ag.restart(t, "--gc-grace=1ns", "--gc-full-check-interval=200ms")
	ag.waitServing(t)
	ag.waitAttachments(t, 20*time.Second, "early", "unseen")
	kept := ag.metric(t, `ipwarden_agent_gc_kept_total{path="full-check"}`)
	ag.waitMetric(t, 10*time.Second, `ipwarden_agent_gc_kept_total{path="full-check"}`, kept+4)
	if got := ag.attachmentIDs(t); !slices.Equal(got, []string{"early", "unseen"}) {
		t.Fatalf("after repeated API re-checks: attachments %v", got)
	}

	// The pod the cache never saw is deleted: no event reaches the agent, the full check frees it.
	forceDelete(t, unbound)
	ag.waitAttachments(t, 10*time.Second, "early")
	waitEvent(t, "IPAddressGarbageCollected", "NodeIPAllocation", node, "", "gc-unbound")
}

// CNI GC frees exactly the attachments of its network that the runtime does not list and that are
// past the grace period; it reports them on the node's NodeIPAllocation.
func TestAgentCNIGCFreesExactlyTheUnlisted(t *testing.T) {
	const node = "gc-cni"
	gcSetup(t, node, "10.133.0.0/24")
	const grace = 2 * time.Second
	ag := startAgent(t, node, "", "--gc-grace="+grace.String(), "--gc-full-check-interval=1h")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	other := strings.Replace(conf, `"name":"podnet"`, `"name":"othernet"`, 1)
	for _, cid := range []string{"g1", "g2", "g3"} {
		mustAdd(t, conf, cid)
	}
	mustAdd(t, other, "o1")
	added := time.Now()
	eventually(t, 10*time.Second, "the grace period to pass", func() error {
		if time.Since(added) <= grace {
			return fmt.Errorf("%s since the ADDs", time.Since(added))
		}
		return nil
	})
	mustAdd(t, conf, "young")

	valid, _ := json.Marshal([]gcAttachment{{"g1", "eth0"}, {"g3", "eth0"}})
	if _, e := cni(t, "GC", strings.TrimSuffix(conf, "}")+`,"cni.dev/valid-attachments":`+string(valid)+"}", "", ""); e != nil {
		t.Fatalf("GC: %v", e)
	}
	if got := ag.attachmentIDs(t); !slices.Equal(got, []string{"g1", "g3", "o1", "young"}) {
		t.Fatalf("after GC: %v, want g1 g3 o1 young", got)
	}
	if v := ag.metric(t, `ipwarden_agent_gc_collected_total{path="cni-gc"}`); v != 1 {
		t.Fatalf("collected{cni-gc} = %v", v)
	}
	waitEvent(t, "IPAddressGarbageCollected", "NodeIPAllocation", node, "", "pod-g2")

	// An empty valid list for the other network frees only that network's attachment.
	if _, e := cni(t, "GC", strings.TrimSuffix(other, "}")+`,"cni.dev/valid-attachments":[]}`, "", ""); e != nil {
		t.Fatalf("GC: %v", e)
	}
	if got := ag.attachmentIDs(t); !slices.Equal(got, []string{"g1", "g3", "young"}) {
		t.Fatalf("after GC of othernet: %v", got)
	}
}

// ipwarden check reads an agent's attachments with --agent and reports a leaked one.
func TestCheckCommandWithAgent(t *testing.T) {
	startController(t)
	createPool(t, "chk-agent", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.112.0.0/24"}})
	createNode(t, "chk-agent-node", nil)
	a := startAgent(t, "chk-agent-node", t.TempDir(), "--gc-full-check-interval=1h")
	a.waitServing(t)
	conf := pluginConf("1.1.0", a.socket, "chk-agent")
	// An ADD for a pod that never existed: a leak once past the grace.
	mustAdd(t, conf, "ghost-container")
	run := func(args ...string) (check.Report, int) {
		cmd := exec.Command(ipwardenBinary(t), append([]string{"check", "--kubeconfig", kubeconfigPath, "-o", "json"}, args...)...)
		out, err := cmd.Output()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		}
		var r check.Report
		_ = json.Unmarshal(out, &r)
		return r, code
	}
	r, code := run("--agent", "chk-agent-node="+a.socket, "--grace=0s")
	if code != 1 || r.CountsByKind[check.LeakedAttachment] != 1 || r.AgentsAsked != 1 {
		t.Fatalf("exit %d, report %+v", code, r)
	}
	if r, code := run("--agent", "chk-agent-node="+a.socket, "--grace=1h"); code != 0 || r.Attachments != 1 {
		t.Fatalf("within the grace: exit %d, report %+v", code, r)
	}
	if _, code := run("--agent", "bogus"); code != 2 {
		t.Fatalf("bad --agent: exit %d, want 2", code)
	}
}

package integration

// The node frees a deleted pod's address only when its sandbox is provably gone: real agent,
// controller and plugin processes, a real network namespace made with `ip netns add`.

import (
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ipwarden/ipwarden/internal/check"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// netnsAdd creates a network namespace under /run/netns (as containerd does under
// /var/run/netns, which is the same directory) and deletes it at the end of the test.
func netnsAdd(t *testing.T) (name, path string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("this test creates network namespaces: run it as root")
	}
	name = localcluster.RandomName("ipwt-", 4)
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add %s: %v: %s", name, err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	return name, "/run/netns/" + name
}

// A pod force-deleted (grace 0) while its network namespace still exists keeps its address: the
// Pod object's deletion is not proof that the sandbox is gone. Once the namespace is removed
// (the kubelet stopped the sandbox and never called DEL), the address is freed within seconds.
func TestAgentForceDeleteKeepsAddressWhileNetnsExists(t *testing.T) {
	const node = "gc-netns"
	gcSetup(t, node, "10.139.0.0/24")
	ag := startAgent(t, node, "", "--gc-grace=1s", "--gc-full-check-interval=1s", "--netns-dirs=/run/netns,/var/run/netns")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	name, path := netnsAdd(t)

	pod := createBoundPod(t, "gc-netns-pod", node)
	r, e := cniIn(t, "ADD", conf, "netns-sandbox", podArgs(pod.Namespace, pod.Name, string(pod.UID)), path)
	if e != nil {
		t.Fatal(e)
	}
	ip := strings.Split(r.IPs[0].Address, "/")[0]
	other := createBoundPod(t, "gc-netns-other", node)
	addFor(t, conf, "other-sandbox", other)

	forceDelete(t, pod)
	// The collector has looked several times (every 2s) and found the namespace in place.
	ag.waitMetric(t, 30*time.Second, `ipwarden_agent_gc_sandbox_held_total{netns="exists"}`, 3)
	if got := ag.attachmentIDs(t); strings.Join(got, ",") != "netns-sandbox,other-sandbox" {
		t.Fatalf("attachments %v while the deleted pod's namespace exists; want netns-sandbox,other-sandbox", got)
	}
	// The full check (every 1s, grace 1s) does not free it either.
	ag.waitMetric(t, 10*time.Second, `ipwarden_agent_gc_full_checks_total`, 4)
	if v := ag.metric(t, `ipwarden_agent_gc_collected_total{path="event"}`) + ag.metric(t, `ipwarden_agent_gc_collected_total{path="full-check"}`); v != 0 {
		t.Fatalf("collected %v attachments while the namespace exists", v)
	}
	if got := ag.attachmentIDs(t); strings.Join(got, ",") != "netns-sandbox,other-sandbox" {
		t.Fatalf("attachments %v after the full checks; want netns-sandbox,other-sandbox", got)
	}

	start := time.Now()
	if out, err := exec.Command("ip", "netns", "del", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns del: %v: %s", err, out)
	}
	ag.waitAttachments(t, 15*time.Second, "other-sandbox")
	t.Logf("freed %s after its namespace was removed", time.Since(start).Round(time.Millisecond))
	waitEvent(t, "IPAddressGarbageCollected", "Pod", pod.Name, string(pod.UID), "network namespace: gone")
	if !ag.logContains(ip) {
		t.Fatalf("the agent's log does not name the freed address %s", ip)
	}
}

// `ipwarden check --agent` sees what comes before a duplicate: a running pod whose address has
// no attachment on its node (freed while the pod runs), and an attachment whose network namespace
// is gone; and neither while the namespace exists and the attachment is in place.
func TestCheckSeesUnattachedPodAndGoneSandbox(t *testing.T) {
	const node = "chk-sandbox"
	gcSetup(t, node, "10.143.0.0/24")
	ag := startAgent(t, node, "", "--gc-full-check-interval=1h", "--netns-dirs=/run/netns,"+netnsDir)
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	_, path := netnsAdd(t)
	run := func() check.Report {
		t.Helper()
		cmd := exec.Command(ipwardenBinary(t), "check", "--kubeconfig", kubeconfigPath, "-o", "json", "--grace=0s", "--agent", node+"="+ag.socket)
		out, _ := cmd.Output()
		var r check.Report
		if err := json.Unmarshal(out, &r); err != nil {
			t.Fatalf("check output %q: %v", out, err)
		}
		return r
	}

	live := createBoundPod(t, "chk-live", node)
	r, e := cniIn(t, "ADD", conf, "live-sandbox", podArgs(live.Namespace, live.Name, string(live.UID)), path)
	if e != nil {
		t.Fatal(e)
	}
	setPodIP(t, live, strings.Split(r.IPs[0].Address, "/")[0])
	if rep := run(); len(findingsOn(rep, check.PodAddressNotAttached, node))+len(findingsOn(rep, check.SandboxGone, node)) != 0 {
		t.Fatalf("findings on a healthy node: %+v", rep.Findings)
	}

	// The address is freed while the pod runs (as the GC without a list did): a finding.
	mustDelFor(t, conf, "live-sandbox", live)
	if f := findingsOn(run(), check.PodAddressNotAttached, node); len(f) != 1 || f[0].Pod != "default/chk-live" {
		t.Fatalf("PodAddressNotAttached findings %+v", f)
	}

	// An attachment whose namespace is gone (the plugin's default CNI_NETNS does not exist).
	other := createBoundPod(t, "chk-gone", node)
	addFor(t, conf, "gone-sandbox", other)
	if f := findingsOn(run(), check.SandboxGone, node); len(f) != 1 || !strings.Contains(f[0].Pod, "chk-gone") {
		t.Fatalf("SandboxGone findings %+v", f)
	}
}

func mustDelFor(t *testing.T, conf, cid string, p *corev1.Pod) {
	t.Helper()
	if _, e := cni(t, "DEL", conf, cid, podArgs(p.Namespace, p.Name, string(p.UID))); e != nil {
		t.Fatalf("DEL %s: %v", cid, e)
	}
}

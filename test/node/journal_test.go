package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/localcluster"
	"github.com/ipwarden/ipwarden/internal/podinfo"
)

const (
	// storageNetwork is the second network every pod of TestRealNodeLostJournalTwoNetworks joins
	// as eth1: the IPPool's spec.network and the ipam "network" of its conflist.
	storageNetwork  = "storage"
	storageConflist = "20-storage.conflist"
	storageCIDR     = "10.245.0.0/24"
	// lostJournalOld pods run on both networks when the journal is removed; lostJournalNew more
	// start after the agent restarts without it.
	lostJournalOld = 4
	lostJournalNew = 6
	// lostJournalHold is the agent's --rebuild-hold here: the test lets it run out, then starts
	// six more pods.
	lostJournalHold = 20 * time.Second
)

var storagePrefix = netip.MustParsePrefix(storageCIDR)

// twoNetPod is a running pod and its address on the storage network (eth1).
type twoNetPod struct {
	pod
	eth1 netip.Addr
}

// TestRealNodeLostJournalTwoNetworks removes the agent's journal under running pods that have an
// address on two networks (issue 35, path 1, on a real kubelet and containerd). containerd's
// max_conf_num 2 attaches every pod to the first two configs in /etc/cni/net.d, as a runtime
// with Multus would: eth0 on the pod network (ipwarden's shipped conflist) and eth1 on
// "storage" (a second bridge whose ipam is ipwarden with "network": "storage", and an IPPool of
// that network). Half the old pods carry Multus' network-status annotation naming their eth1
// address, half do not. The agent pod is stopped (the node is labelled off the DaemonSet),
// journal.db is removed from its state directory, the agent starts again and rebuilds from what
// the node shows: the runtime's sandboxes through the shipped --cri-socket mount (it logs the
// sandboxes it read, and counts the reading), the pods' reports. Then more pods start beside the
// old ones. No old pod's address changes on either interface, no address is on two pod network
// namespaces at any poll, the new pods get none of the old pods' addresses on either network,
// and ipwarden check is clean.
func TestRealNodeLostJournalTwoNetworks(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	began := time.Now()
	n := startNodeIn(t, ctx, "lost-journal", "lost-journal-fs", func(n *realNode) {
		n.cniNetworks = 2
		// The read line (V(1)) names each sandbox the agent read from the runtime.
		n.overlayPatches = `- target: {kind: DaemonSet, name: ipwarden-agent}
  patch: |
    - {op: add, path: /spec/template/spec/containers/0/args/-, value: --zap-log-level=1}`
		n.overlayPatches += fmt.Sprintf(`
    - {op: add, path: /spec/template/spec/containers/0/args/-, value: --rebuild-hold=%s}`, lostJournalHold)
	})
	// Room for the old and the new pods beside the addresses the hold keeps out of use.
	n.pool = ipwardenv1.IPPoolSpec{
		Scaling:       ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 32},
		ReuseCooldown: metav1.Duration{Duration: 0},
	}
	n.deployIpwarden(ctx)
	storage := &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: "node-storage"}, Spec: ipwardenv1.IPPoolSpec{
		CIDRs:         []ipwardenv1.CIDR{storageCIDR},
		Network:       storageNetwork,
		Scaling:       ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 32},
		ReuseCooldown: metav1.Duration{Duration: 0},
	}}
	if err := n.k8s.Create(ctx, storage); err != nil {
		t.Fatal(err)
	}
	conf := fmt.Sprintf(`{"cniVersion": "1.0.0", "name": %q, "plugins": [{"type": "bridge", "bridge": "stor0", "ipam": {"type": "ipwarden", "socket": %q, "network": %q}}]}`,
		storageNetwork, cniproto.DefaultSocket, storageNetwork)
	if err := os.WriteFile(filepath.Join("/etc/cni/net.d", storageConflist), []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	n.waitRuntimeNetworks(ctx, map[string]string{"eth0": "ipwarden", "eth1": storageNetwork})
	n.logf("the runtime attaches pods to ipwarden (eth0) and %s (eth1)", storageNetwork)

	n.createWorkload(ctx, lostJournalOld)
	old := n.waitTwoNetPods(ctx, lostJournalOld)
	for i := range old {
		sb, netns, err := n.podSandbox(ctx, old[i].uid)
		if err != nil {
			t.Fatalf("pod %s: %v", old[i].name, err)
		}
		if netns != old[i].netns {
			t.Fatalf("pod %s: its sandbox's network namespace is %s, its address is on %s", old[i].name, netns, old[i].netns)
		}
		old[i].sandbox = sb
	}
	// What Multus writes after the pod's ADDs, on half of the pods: the other half has only
	// status.podIPs, as without Multus (or before it wrote the annotation).
	reported := map[string]bool{}
	for _, p := range old[:lostJournalOld/2] {
		n.writeNetworkStatus(ctx, p)
		reported[p.name] = true
	}
	n.logf("old pods: %s", twoNetIPs(old))

	// The agent stops cleanly, and its journal is removed before it starts again (a replaced
	// disk, a journal moved aside).
	start := time.Now()
	oldAgent := n.agentPodUID(ctx)
	n.kubectl("label", "node", nodeName, controllerOnlyLabel+"=true")
	n.waitOrDump(ctx, 2*time.Minute, func() error {
		n.scanNoDuplicates()
		pods, err := n.kube.CoreV1().Pods("ipwarden-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=agent"})
		if err != nil {
			return err
		}
		if len(pods.Items) > 0 {
			return fmt.Errorf("%d agent pods still exist", len(pods.Items))
		}
		return nil
	})
	journal := "/var/lib/ipwarden/journal.db"
	if _, err := os.Stat(journal); err != nil {
		t.Fatalf("the stopped agent's journal: %v", err)
	}
	if err := os.Remove(journal); err != nil {
		t.Fatal(err)
	}
	n.logf("agent stopped and %s removed", journal)
	n.kubectl("label", "node", nodeName, controllerOnlyLabel+"-")
	n.waitOrDump(ctx, 3*time.Minute, func() error {
		n.scanNoDuplicates()
		if uid := n.agentPodUID(ctx); uid == "" || uid == oldAgent {
			return errors.New("no new ready agent pod yet")
		}
		return nil
	})
	n.logf("agent ready again without its journal after %s", time.Since(start).Round(time.Millisecond))

	// The rebuild rests on the node: the runtime's sandboxes, read through the shipped mount.
	n.checkRuntimeRead(ctx, old, reported)

	// New pods while the old ones run.
	n.scale(ctx, lostJournalOld+lostJournalNew)
	all := n.waitTwoNetPods(ctx, lostJournalOld+lostJournalNew)
	byName := map[string]twoNetPod{}
	for _, p := range all {
		byName[p.name] = p
	}
	oldAddrs := map[netip.Addr]string{}
	for _, p := range old {
		oldAddrs[p.ip], oldAddrs[p.eth1] = p.name, p.name
		now, ok := byName[p.name]
		if !ok {
			t.Fatalf("old pod %s is gone: %s", p.name, twoNetIPs(all))
		}
		if now.ip != p.ip || now.eth1 != p.eth1 || now.netns != p.netns || now.uid != p.uid {
			t.Fatalf("old pod %s changed: eth0 %s -> %s, eth1 %s -> %s, netns %s -> %s", p.name, p.ip, now.ip, p.eth1, now.eth1, p.netns, now.netns)
		}
		sb, _, err := n.podSandbox(ctx, p.uid)
		if err != nil || sb != p.sandbox {
			t.Fatalf("old pod %s: sandbox %s, now %s (%v)", p.name, p.sandbox, sb, err)
		}
	}
	var fresh []twoNetPod
	for _, p := range all {
		if _, isOld := oldAddrs[p.ip]; isOld && oldAddrs[p.ip] != p.name {
			t.Fatalf("new pod %s got old pod %s's eth0 address %s", p.name, oldAddrs[p.ip], p.ip)
		}
		if _, isOld := oldAddrs[p.eth1]; isOld && oldAddrs[p.eth1] != p.name {
			t.Fatalf("new pod %s got old pod %s's eth1 address %s", p.name, oldAddrs[p.eth1], p.eth1)
		}
		if oldAddrs[p.ip] != p.name {
			fresh = append(fresh, p)
		}
	}
	if len(fresh) != lostJournalNew {
		t.Fatalf("%d new pods, want %d: %s", len(fresh), lostJournalNew, twoNetIPs(all))
	}
	n.logf("new pods: %s", twoNetIPs(fresh))
	unproven := map[string]bool{}
	for _, p := range old {
		unproven[p.name] = !reported[p.name]
	}
	n.checkTwoNetAttachments(ctx, all, unproven)
	n.checkClean(ctx)
	// The hold's deadline passes. The old pods without network-status still run with the eth1
	// addresses nothing on the node can prove (the runtime shows eth0 only): the storage pool's
	// addresses of unknown owner stay held past the deadline while their sandboxes run. Six
	// more pods then get none of them (waitTwoNetPods scans every namespace at every poll).
	n.waitOrDump(ctx, 2*time.Minute, func() error {
		r, err := agentList()
		if err != nil {
			return err
		}
		switch {
		case r.Hold == nil:
			return fmt.Errorf("the hold ended, but old pods without network-status still run with unproven eth1 addresses")
		case time.Now().Before(r.Hold.Until):
			return fmt.Errorf("the hold runs until %s", r.Hold.Until.Format(time.RFC3339))
		case r.Hold.Addresses == 0:
			return fmt.Errorf("the hold holds nothing: %+v", *r.Hold)
		}
		return nil
	})
	n.logf("the hold's deadline passed with the unproven eth1 addresses still held; six more pods")
	n.scale(ctx, lostJournalOld+2*lostJournalNew)
	n.waitTwoNetPods(ctx, lostJournalOld+2*lostJournalNew)
	n.logf("lost journal on two networks: %s (node up and ipwarden deployed included)", time.Since(began).Round(time.Second))
}

// waitRuntimeNetworks waits until the runtime's loaded CNI config attaches each interface of want
// to the network named there.
func (n *realNode) waitRuntimeNetworks(ctx context.Context, want map[string]string) {
	n.t.Helper()
	n.waitOrDump(ctx, time.Minute, func() error {
		st, err := n.cri.Status(ctx, &runtimeapi.StatusRequest{Verbose: true})
		if err != nil {
			return err
		}
		var cfg struct {
			Networks []struct {
				IFName string
				Config struct{ Name string }
			}
		}
		if err := json.Unmarshal([]byte(st.Info["cniconfig"]), &cfg); err != nil {
			return fmt.Errorf("runtime status cniconfig: %w", err)
		}
		got := map[string]string{}
		for _, nw := range cfg.Networks {
			if nw.IFName != "lo" {
				got[nw.IFName] = nw.Config.Name
			}
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			return fmt.Errorf("the runtime attaches %v, want %v", got, want)
		}
		return nil
	})
}

// waitTwoNetPods waits for want running workload pods (waitPods: an address of the pod pool on
// eth0 of exactly one network namespace, every namespace scanned for duplicates at every poll),
// each with one storage address on eth1 of its own namespace and on no other.
func (n *realNode) waitTwoNetPods(ctx context.Context, want int) []twoNetPod {
	n.t.Helper()
	var out []twoNetPod
	n.waitOrDump(ctx, 3*time.Minute, func() error {
		pods := n.waitPods(ctx, want)
		addrs := n.scanNoDuplicates()
		out = out[:0]
		for _, p := range pods {
			ifs, err := netnsInterfaces(p.netns)
			if err != nil {
				return err
			}
			if len(ifs["eth0"]) != 1 || ifs["eth0"][0] != p.ip {
				return fmt.Errorf("pod %s: eth0 has %v, status says %s", p.name, ifs["eth0"], p.ip)
			}
			if len(ifs["eth1"]) != 1 || !storagePrefix.Contains(ifs["eth1"][0]) {
				return fmt.Errorf("pod %s: eth1 has %v, want one address of %s", p.name, ifs["eth1"], storageCIDR)
			}
			if ns := addrs[ifs["eth1"][0]]; len(ns) != 1 {
				return fmt.Errorf("pod %s: eth1 address %s is on %v", p.name, ifs["eth1"][0], ns)
			}
			out = append(out, twoNetPod{pod: p, eth1: ifs["eth1"][0]})
		}
		var inStorage int
		for a := range addrs {
			if storagePrefix.Contains(a) {
				inStorage++
			}
		}
		if inStorage != want {
			return fmt.Errorf("%d storage addresses on pod network namespaces, want %d", inStorage, want)
		}
		return nil
	})
	return out
}

// netnsInterfaces reads a pod network namespace's global addresses by interface.
func netnsInterfaces(netns string) (map[string][]netip.Addr, error) {
	b, err := exec.Command("ip", "-n", netns, "-o", "addr", "show", "scope", "global").CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("ip -n %s addr: %v: %s", netns, err, b)
	}
	out := map[string][]netip.Addr{}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 4 || (f[2] != "inet" && f[2] != "inet6") {
			continue
		}
		name, _, _ := strings.Cut(f[1], "@")
		if p, err := netip.ParsePrefix(f[3]); err == nil {
			out[name] = append(out[name], p.Addr())
		}
	}
	return out, nil
}

// writeNetworkStatus writes what Multus writes after a pod's ADDs: both interfaces' addresses.
func (n *realNode) writeNetworkStatus(ctx context.Context, p twoNetPod) {
	n.t.Helper()
	status, _ := json.Marshal([]map[string]any{
		{"name": "ipwarden", "interface": "eth0", "ips": []string{p.ip.String()}, "default": true},
		{"name": "default/" + storageNetwork, "interface": "eth1", "ips": []string{p.eth1.String()}},
	})
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{podinfo.AnnotationNetworkStatus: string(status)}}})
	if _, err := n.kube.CoreV1().Pods(testNamespace).Patch(ctx, p.name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		n.t.Fatal(err)
	}
}

var (
	runtimeAskedRE     = regexp.MustCompile(`"runtimeAsked"\s*:\s*(true|false)`)
	runtimeSandboxesRE = regexp.MustCompile(`"runtimeSandboxes"\s*:\s*(\d+)`)
)

// checkRuntimeRead checks that the agent started without its journal read the node's sandboxes
// from the runtime and rebuilt from them: its log names every old pod's sandbox, the hold says
// it asked the runtime, every old pod's eth0 and the reported pods' eth1 are recorded from what
// the node shows, and the reading is counted ok.
func (n *realNode) checkRuntimeRead(ctx context.Context, old []twoNetPod, reported map[string]bool) {
	t := n.t
	t.Helper()
	var readLine, holdLine string
	recorded := map[string]string{}
	n.waitOrDump(ctx, 2*time.Minute, func() error {
		text, err := n.agentContainerLog(ctx)
		if err != nil {
			return err
		}
		readLine, holdLine = "", ""
		for _, line := range strings.Split(text, "\n") {
			switch {
			case strings.Contains(line, "read the node's pod sandboxes from the container runtime") && readLine == "":
				readLine = line
			case strings.Contains(line, "rebuilt journal:"):
				holdLine = line
			case strings.Contains(line, "recorded an attachment from what the node shows of the pod"):
				for _, p := range old {
					if strings.Contains(line, testNamespace+"/"+p.name) {
						recorded[p.name] += line
					}
				}
			}
		}
		if readLine == "" || holdLine == "" {
			return errors.New("the agent has not logged its runtime reading and rebuild yet")
		}
		return nil
	})
	n.logf("agent: %s", strings.TrimSpace(readLine))
	n.logf("agent: %s", strings.TrimSpace(holdLine))
	for _, p := range old {
		if !strings.Contains(readLine, p.sandbox[:13]) || !strings.Contains(readLine, testNamespace+"/"+p.name) {
			t.Errorf("the agent's runtime reading does not name pod %s's sandbox %s", p.name, p.sandbox[:13])
		}
		// The pod informer's first pods (SetPods) may rebuild before catchUp's reading lands:
		// then the line says runtimeShowsPod false, and the reading serves the hold.
		rec := recorded[p.name]
		if !strings.Contains(rec, p.ip.String()) {
			t.Errorf("pod %s's eth0 %s not recorded: %q", p.name, p.ip, rec)
		}
		n.logf("agent: %s", strings.TrimSpace(rec))
		if reported[p.name] != strings.Contains(rec, p.eth1.String()) {
			t.Errorf("pod %s (network-status %v): eth1 %s recorded: %q", p.name, reported[p.name], p.eth1, rec)
		}
	}
	if m := runtimeAskedRE.FindStringSubmatch(holdLine); m == nil || m[1] != "true" {
		t.Errorf("the hold did not ask the runtime: %s", holdLine)
	}
	if m := runtimeSandboxesRE.FindStringSubmatch(holdLine); m == nil {
		t.Errorf("the hold names no runtime sandboxes: %s", holdLine)
	} else if k, _ := strconv.Atoi(m[1]); k < len(old) {
		t.Errorf("the runtime showed %d sandboxes, want at least the %d old pods'", k, len(old))
	}
	ok, err := agentMetric(ctx, `ipwarden_agent_runtime_reads_total{result="ok"}`)
	if err != nil || ok < 1 {
		t.Errorf("ipwarden_agent_runtime_reads_total{result=\"ok\"} = %v (%v), want at least 1", ok, err)
	}
	if t.Failed() {
		n.dumpState(ctx)
		if text, err := n.agentContainerLog(ctx); err == nil {
			t.Logf("agent log:\n%s", text)
		}
		t.FailNow()
	}
}

// agentMetric reads one sample from the agent's metrics endpoint (host network, :10372).
func agentMetric(ctx context.Context, name string) (float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://127.0.0.1:10372/metrics", nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			return strconv.ParseFloat(strings.TrimSpace(v), 64)
		}
	}
	return 0, fmt.Errorf("no %s in the agent's metrics", name)
}

// checkTwoNetAttachments compares the agent's attachments with the pods: every pod's eth0 and
// the eth1 of every pod the agent has evidence for (an ADD here, or network-status) is attached
// to it; an old pod without network-status (unproven) may have its eth1 unattached (held until the hold's
// end), never attached to another pod; nothing else is attached.
func (n *realNode) checkTwoNetAttachments(ctx context.Context, pods []twoNetPod, unproven map[string]bool) {
	t := n.t
	t.Helper()
	n.waitOrDump(ctx, 30*time.Second, func() error {
		got, err := agentAttachments()
		if err != nil {
			return err
		}
		want, maybe := map[string]string{}, map[string]string{}
		for _, p := range pods {
			want[p.ip.String()] = p.name
			if unproven[p.name] {
				maybe[p.eth1.String()] = p.name
			} else {
				want[p.eth1.String()] = p.name
			}
		}
		for a, name := range got {
			if m, ok := maybe[a]; ok {
				if m != name {
					return fmt.Errorf("%s (eth1 of %s) is attached to %s", a, m, name)
				}
				want[a] = name
			}
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			return fmt.Errorf("agent attachments %v, want %v", got, want)
		}
		return nil
	})
}

// twoNetIPs renders name=eth0,eth1 for the log.
func twoNetIPs(pods []twoNetPod) string {
	var s []string
	for _, p := range pods {
		s = append(s, fmt.Sprintf("%s=%s,%s", p.name, p.ip, p.eth1))
	}
	return strings.Join(s, " ")
}

// waitOrDump waits for cond and fails the test with the node's state when it does not hold.
func (n *realNode) waitOrDump(ctx context.Context, timeout time.Duration, cond func() error) {
	n.t.Helper()
	if err := localcluster.WaitFor(ctx, timeout, 250*time.Millisecond, cond); err != nil {
		n.dumpState(ctx)
		n.t.Fatal(err)
	}
}

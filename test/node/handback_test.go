package node

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

const (
	// handbackOld pods start through ipwarden; one of them is deleted after the handback,
	// before the switch; then handbackNew pods start through host-local beside the others.
	// host-local's range holds exactly handbackOld-1+handbackNew addresses: the deleted pod's
	// address must be free in host-local again.
	handbackOld = 3
	handbackNew = 4
)

// TestRealNodeHandback is TestRealNodeTakeover in reverse: a node runs pods through ipwarden and
// goes back to bridge + host-local without draining, as docs/operations.md ("Going back to
// host-local") says. A handback whose host-local range misses a pod's address, or to
// Whereabouts, is refused and writes nothing. `ipwarden agent handback` then writes host-local's
// reservation files for the running pods, and the agent refuses every ADD with CNI error 100. An
// old pod deleted before the switch has its DEL go to the agent, which removes its file. The
// operator switches the conflist to host-local; the refused pod starts on the runtime's retry and
// new pods get host-local's other addresses (the range is exactly as large as old and new pods
// together), and deleting the old pods makes host-local free their files (DEL, ReleaseByID) and
// ipwarden's leak collector free its attachments. Every poll scans
// every pod network namespace for an address on two.
func TestRealNodeHandback(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()
	began := time.Now()
	n := startNodeIn(t, ctx, "handback", "handback-fs")
	dataDir := filepath.Join(n.dir, "host-local")
	resDir := filepath.Join(dataDir, takeoverNetwork)
	conflist := func(ipam string) string {
		return fmt.Sprintf(`{"cniVersion": "1.0.0", "name": %q, "plugins": [{"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "ipam": %s}, {"type": "portmap", "capabilities": {"portMappings": true}}]}`,
			takeoverNetwork, ipam)
	}
	hostLocal := func(start, end string) string {
		return fmt.Sprintf(`{"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24", "rangeStart": %q, "rangeEnd": %q, "gateway": "10.244.0.1"}]], "dataDir": %q}`,
			start, end, dataDir)
	}

	// 1. The node runs ipwarden, under the network name host-local will use (it keeps its files
	// in dataDir/<network name>). The pool is 10.244.0.10-15: host-local's range to come.
	n.overlayPatches = cniConfigPatch(conflist(fmt.Sprintf(`{"type": "ipwarden", "socket": %q}`, cniproto.DefaultSocket))) + fmt.Sprintf(`
# The agent sees host-local's dataDir where the CLI writes it, as deploy/ mounts
# /var/lib/cni/networks: it removes the file of a pod deleted while the node is handed back.
- target: {kind: DaemonSet, name: ipwarden-agent, namespace: ipwarden-system}
  patch: |
    - {op: add, path: /spec/template/spec/containers/0/volumeMounts/-, value: {name: test-host-local, mountPath: %s}}
    - {op: add, path: /spec/template/spec/volumes/-, value: {name: test-host-local, hostPath: {path: %s, type: DirectoryOrCreate}}}
`, dataDir, dataDir)
	n.pool = sixAddressPool()
	n.deployIpwarden(ctx)
	n.waitRuntimeIPAM(ctx, "ipwarden")
	old := n.startOldPods(ctx, handbackOld)
	n.checkFromIpwarden(ctx, old)
	n.logf("handback: %d pods run with ipwarden's addresses: %s", len(old), podIPs(old))

	t.Run("a handback that cannot be made safe is refused and writes nothing", func(t *testing.T) {
		n.t = t
		// Two addresses cannot cover three pods: at least one is outside.
		out, err := handbackCLI("--to", hostLocal("10.244.0.10", "10.244.0.11"), "--network", takeoverNetwork)
		if err == nil || !strings.Contains(out, "handback refused, nothing written") || !strings.Contains(out, "outside every range") {
			t.Fatalf("handback with a range too small: %v\n%s", err, out)
		}
		named := false
		for _, p := range old {
			if p.ip.Compare(netip.MustParseAddr("10.244.0.11")) > 0 && strings.Contains(out, "pod "+testNamespace+"/"+p.name+" uses "+p.ip.String()) {
				named = true
			}
		}
		if !named {
			t.Fatalf("the refusal names no pod outside 10.244.0.10-11 (pods %s):\n%s", podIPs(old), out)
		}
		out, err = handbackCLI("--to", `{"type": "whereabouts", "range": "10.244.0.0/24"}`, "--network", takeoverNetwork)
		if err == nil || !strings.Contains(out, "drain the node") {
			t.Fatalf("handback to whereabouts: %v\n%s", err, out)
		}
		if _, err := os.Stat(resDir); !os.IsNotExist(err) {
			t.Fatalf("a refused handback created %s: %v", resDir, err)
		}
		if resp, err := agentList(); err != nil || resp.Handback != nil {
			t.Fatalf("after refused handbacks the agent reports %+v (%v)", resp.Handback, err)
		}
	})

	var refusedUID string // the pod started while the node was handed back
	t.Run("handback writes host-local's reservations and refuses ADD", func(t *testing.T) {
		n.t = t
		out, err := handbackCLI("--to", hostLocal("10.244.0.10", "10.244.0.15"), "--network", takeoverNetwork)
		if err != nil {
			t.Fatalf("handback: %v\n%s", err, out)
		}
		n.logf("ipwarden agent handback:\n%s", out)
		if err := hostLocalReservations(dataDir, old); err != nil {
			t.Fatal(err)
		}
		for _, p := range old {
			b, err := os.ReadFile(filepath.Join(resDir, p.ip.String()))
			if err != nil || string(b) != p.sandbox+"\r\neth0" {
				t.Fatalf("host-local's file for %s: %q (%v), want %q", p.ip, b, err, p.sandbox+"\r\neth0")
			}
		}
		resp, err := agentList()
		if err != nil || resp.Handback == nil || !resp.Handback.Marked || resp.Handback.To != "host-local" {
			t.Fatalf("the agent reports the handback as %+v (%v)", resp.Handback, err)
		}
		// The Node shows it (the pool monitor's next round).
		if err := localcluster.WaitFor(ctx, time.Minute, 250*time.Millisecond, func() error {
			node, err := n.kube.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
			if err != nil {
				return err
			}
			for _, c := range node.Status.Conditions {
				if c.Type == "ipwarden.io/HandedBack" && c.Status == corev1.ConditionTrue &&
					strings.Contains(c.Message, "handed back to host-local at "+resp.Handback.At.UTC().Format(time.RFC3339)) {
					return nil
				}
			}
			return fmt.Errorf("Node %s shows no condition ipwarden.io/HandedBack True: %+v", nodeName, node.Status.Conditions)
		}); err != nil {
			t.Fatal(err)
		}
		// A pod started now, while the node's configuration still names ipwarden, gets no
		// address: its sandbox fails with the agent's error (the first of the new pods; it
		// starts once the configuration names host-local).
		if _, err := n.kube.AppsV1().Deployments(testNamespace).Create(ctx,
			sleeperDeployment("new", 1, map[string]string{"app": "sleeper", "ipam": "new"}), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		want := "handed back to host-local at " + resp.Handback.At.UTC().Format(time.RFC3339)
		if err := localcluster.WaitFor(ctx, 2*time.Minute, 250*time.Millisecond, func() error {
			evs, err := n.kube.CoreV1().Events(testNamespace).List(ctx, metav1.ListOptions{})
			if err != nil {
				return err
			}
			for _, e := range evs.Items {
				if e.Reason == "FailedCreatePodSandBox" && strings.Contains(e.Message, want) && strings.Contains(e.Message, "ipwarden agent handback --undo") {
					return nil
				}
			}
			return fmt.Errorf("no FailedCreatePodSandBox event saying %q", want)
		}); err != nil {
			t.Fatal(err)
		}
		pending, err := n.kube.CoreV1().Pods(testNamespace).List(ctx, metav1.ListOptions{LabelSelector: "ipam=new"})
		if err != nil || len(pending.Items) != 1 || pending.Items[0].Status.PodIP != "" {
			t.Fatalf("the new pod while the node is handed back: %v %+v", err, pending)
		}
		refusedUID = string(pending.Items[0].UID)
		n.checkOldPods(ctx, old)
		n.checkAttachments(ctx, old)
		// The handed-back attachments are still ipwarden's until their pods go.
		n.checkClean(ctx)
	})

	t.Run("an old pod deleted before the switch frees its file", func(t *testing.T) {
		n.t = t
		// Its DEL goes to ipwarden (the configuration still names it), which frees the
		// attachment and removes the file naming it: host-local may hand the address out again.
		n.kubectl("scale", "-n", testNamespace, "deployment/old", fmt.Sprintf("--replicas=%d", handbackOld-1))
		// (Not waitPods: the refused new pod has no address yet.)
		var gone []pod
		if err := localcluster.WaitFor(ctx, 2*time.Minute, 250*time.Millisecond, func() error {
			n.scanNoDuplicates()
			list, err := n.kube.CoreV1().Pods(testNamespace).List(ctx, metav1.ListOptions{LabelSelector: "ipam=old"})
			if err != nil {
				return err
			}
			if len(list.Items) != handbackOld-1 {
				return fmt.Errorf("%d old pods, want %d", len(list.Items), handbackOld-1)
			}
			gone = gone[:0]
			for _, p := range old {
				if !slices.ContainsFunc(list.Items, func(q corev1.Pod) bool { return string(q.UID) == p.uid }) {
					gone = append(gone, p)
				}
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		if len(gone) != 1 {
			t.Fatalf("%d old pods gone, want 1", len(gone))
		}
		n.logf("handback: deleted old pod %s (%s) before the switch", gone[0].name, gone[0].ip)
		old = slices.DeleteFunc(old, func(p pod) bool { return p.uid == gone[0].uid })
		if err := localcluster.WaitFor(ctx, time.Minute, 250*time.Millisecond, func() error {
			return hostLocalReservations(dataDir, old)
		}); err != nil {
			t.Fatalf("after the DEL of %s (%s): %v", gone[0].name, gone[0].ip, err)
		}
		n.checkAttachments(ctx, old)
		n.checkOldPods(ctx, old)
	})

	var fresh []pod
	t.Run("after the switch to host-local new pods get its other addresses", func(t *testing.T) {
		n.t = t
		// The operator points the node at host-local again, under the same network name, and
		// removes ipwarden's conflist:
		//   write /etc/cni/net.d/10-containerd-net.conflist (bridge + host-local)
		//   mv /etc/cni/net.d/10-ipwarden.conflist /etc/cni/net.d/10-ipwarden.conflist.handed-back
		if err := os.WriteFile(filepath.Join("/etc/cni/net.d", takeoverConflist), []byte(conflist(hostLocal("10.244.0.10", "10.244.0.15"))), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename("/etc/cni/net.d/10-ipwarden.conflist", "/etc/cni/net.d/10-ipwarden.conflist.handed-back"); err != nil {
			t.Fatal(err)
		}
		n.waitRuntimeIPAM(ctx, "host-local")
		// The pod refused during the handback starts on the runtime's retry, through host-local.
		n.kubectl("scale", "-n", testNamespace, "deployment/new", fmt.Sprintf("--replicas=%d", handbackNew))
		all := n.waitPods(ctx, len(old)+handbackNew)
		fresh = newPods(all)
		if !slices.ContainsFunc(fresh, func(p pod) bool { return p.uid == refusedUID }) {
			t.Fatalf("the pod refused during the handback (uid %s) is not among the running new pods %s", refusedUID, podIPs(fresh))
		}
		oldIPs := map[netip.Addr]bool{}
		for _, p := range old {
			oldIPs[p.ip] = true
		}
		for i := range fresh {
			p := &fresh[i]
			if oldIPs[p.ip] || p.ip.Compare(netip.MustParseAddr("10.244.0.10")) < 0 || p.ip.Compare(netip.MustParseAddr("10.244.0.15")) > 0 {
				t.Fatalf("new pod %s has %s: want one of host-local's addresses no old pod has", p.name, p.ip)
			}
			sb, _, err := n.podSandbox(ctx, p.uid)
			if err != nil {
				t.Fatalf("new pod %s: %v", p.name, err)
			}
			p.sandbox = sb
		}
		n.checkOldPods(ctx, old)
		if err := hostLocalReservations(dataDir, append(append([]pod(nil), old...), fresh...)); err != nil {
			t.Fatal(err)
		}
		n.checkPing(ctx, append(append([]pod(nil), old...), fresh...))
	})

	t.Run("deleting the old pods frees host-local's files and ipwarden's attachments", func(t *testing.T) {
		n.t = t
		n.kubectl("scale", "-n", testNamespace, "deployment/old", "--replicas=0")
		n.waitPods(ctx, handbackNew)
		// The runtime's DEL went to host-local, which freed the files the handback wrote.
		if err := localcluster.WaitFor(ctx, time.Minute, 250*time.Millisecond, func() error {
			n.scanNoDuplicates()
			return hostLocalReservations(dataDir, fresh)
		}); err != nil {
			t.Fatalf("host-local's reservations after the old pods were deleted: %v", err)
		}
		// No DEL reaches ipwarden any more: its leak collector frees the old pods' attachments
		// once their pods and sandboxes are gone.
		if err := localcluster.WaitFor(ctx, 2*time.Minute, 250*time.Millisecond, func() error {
			resp, err := agentList()
			if err != nil {
				return err
			}
			for _, a := range resp.Attachments {
				if !a.Rebuilt {
					return fmt.Errorf("the agent still records %s/%s for pod %s", a.ContainerID, a.IfName, a.Pod.Name)
				}
			}
			return nil
		}); err != nil {
			n.dumpState(ctx)
			t.Fatal(err)
		}
		resp, err := agentList()
		if err != nil || resp.Handback == nil || !resp.Handback.Marked {
			t.Fatalf("the handback mark after the old pods went: %+v (%v)", resp.Handback, err)
		}
		n.logf("agent after the old pods went: %d attachments (adopted from host-local pods' status: %d)", len(resp.Attachments), countRebuilt(resp))
		n.checkClean(ctx)
	})
	n.t = t
	n.logf("handback: test body took %s (preparation %s)", time.Since(began).Round(time.Second), prep.Prepared.Round(time.Second))
}

// handbackCLI runs `ipwarden agent handback` on the node and returns its combined output.
func handbackCLI(args ...string) (string, error) {
	out, err := exec.Command(prep.Ipwarden, append([]string{"agent", "handback", "--socket", cniproto.DefaultSocket}, args...)...).CombinedOutput()
	return string(out), err
}

func countRebuilt(resp cniproto.Response) int {
	n := 0
	for _, a := range resp.Attachments {
		if a.Rebuilt {
			n++
		}
	}
	return n
}

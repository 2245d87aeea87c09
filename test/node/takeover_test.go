package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/localcluster"
	"github.com/ipwarden/ipwarden/internal/previous"
)

const (
	// takeoverOld pods run with host-local's addresses before ipwarden is installed;
	// takeoverNew pods start through ipwarden beside them. The pool holds exactly
	// takeoverOld+takeoverNew addresses.
	takeoverOld = 3
	takeoverNew = 3
	// takeoverNetwork is the network name of the node's CNI config before ipwarden (containerd's
	// example config, 10-containerd-net.conflist). ipwarden's conflist keeps it: host-local keeps
	// its reservations in dataDir/<network name>, so a DEL delegated under another name would
	// free nothing (and bridge's ipMasq rules are named for it too).
	takeoverNetwork  = "containerd-net"
	takeoverConflist = "10-containerd-net.conflist"
)

// previousIPAM is the IPAM a node runs before ipwarden takes it over: the takeover tests differ
// only in it.
type previousIPAM struct {
	typ     string // its CNI type, the plugin's name in /opt/cni/bin
	dir, fs string // the node's scratch directories (startNodeIn)
	// install puts it on the node and returns its ipam object, which hands out
	// takeoverOldRange (10.244.0.10-12 of 10.244.0.0/24, gateway 10.244.0.1).
	install func(ctx context.Context, n *realNode) string
	// reservations compares what it holds with want, the pods it handed addresses to (their
	// addresses and sandboxes): nil when it must hold nothing.
	reservations func(ctx context.Context, n *realNode, want []pod) error
	// agentPatch is more of the test overlay's patches ("" for none): what the agent needs to
	// read the previous IPAM's reservations.
	agentPatch func(n *realNode) string
}

// takeoverOldRange is the previous IPAM's range: takeoverOld addresses, inside the pool to come.
var takeoverOldRange = map[netip.Addr]bool{
	netip.MustParseAddr("10.244.0.10"): true, netip.MustParseAddr("10.244.0.11"): true, netip.MustParseAddr("10.244.0.12"): true,
}

// TestRealNodeTakeover takes a running node over from host-local without draining it, as an
// operator would: pods run with host-local's addresses (the real bridge and host-local plugins
// called by containerd), then ipwarden is installed from deploy/kustomize with host-local's ipam
// object as "previous", the old conflist is moved aside and a pool that overlaps host-local's
// range, exactly as large as the old pods plus the new, is created. The old pods keep running in
// their sandboxes with their addresses, the agent adopts them, new pods get the pool's other
// addresses and reach the old ones, deleting the old pods frees host-local's reservations (DEL
// delegated through "previous") and gives their addresses to new pods. Every poll scans every
// pod network namespace for an address on two.
// cniConfigPatch is an overlay patch that installs conf (a conflist) as ipwarden's CNI
// configuration, declaring CNI 1.0.0 and 1.1.0 (the runtime picks 1.1.0 for GC and STATUS).
func cniConfigPatch(conf string) string {
	conf = strings.Replace(conf, `"cniVersion": "1.0.0",`, `"cniVersion": "1.0.0", "cniVersions": ["1.0.0", "1.1.0"],`, 1)
	return fmt.Sprintf(`- patch: |
    apiVersion: v1
    kind: ConfigMap
    metadata: {name: ipwarden-cni-config, namespace: ipwarden-system}
    data:
      10-ipwarden.conflist: '%s'`, conf)
}

func TestRealNodeTakeover(t *testing.T) {
	testTakeover(t, previousIPAM{
		typ: "host-local", dir: "takeover", fs: "takeover-fs",
		// host-local keeps its reservations as files in dataDir, which the test reads.
		install: func(ctx context.Context, n *realNode) string {
			return fmt.Sprintf(`{"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24", "rangeStart": "10.244.0.10", "rangeEnd": "10.244.0.12", "gateway": "10.244.0.1"}]], "dataDir": %q}`,
				filepath.Join(n.dir, "host-local"))
		},
		reservations: func(ctx context.Context, n *realNode, want []pod) error {
			return hostLocalReservations(filepath.Join(n.dir, "host-local"), want)
		},
		agentPatch: func(n *realNode) string { return hostLocalMountPatch(filepath.Join(n.dir, "host-local")) },
	})
}

// TestRealNodeTakeoverFromWhereabouts is TestRealNodeTakeover with Whereabouts
// (localcluster.WhereaboutsVersion) as the previous IPAM: its CRDs in the node's API server,
// the plugin in /opt/cni/bin reaching the API server through its flat config file's kubeconfig.
// Its reservations (IPPool allocations and OverlappingRangeIPReservations) are exactly the old
// pods' until they are deleted, then none are left.
func TestRealNodeTakeoverFromWhereabouts(t *testing.T) {
	testTakeover(t, previousIPAM{
		typ: "whereabouts", dir: "takeover-wb", fs: "takeover-wb-fs",
		install: func(ctx context.Context, n *realNode) string {
			n.installWhereaboutsPlugin(ctx, "debug")
			return `{"type": "whereabouts", "range": "10.244.0.0/24", "range_start": "10.244.0.10", "range_end": "10.244.0.12", "gateway": "10.244.0.1"}`
		},
		reservations: whereaboutsReservations,
	})
}

// testTakeover runs the takeover from prev (TestRealNodeTakeover).
func testTakeover(t *testing.T, prev previousIPAM) {
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()
	began := time.Now()
	n := startNodeIn(t, ctx, prev.dir, prev.fs)

	// 1. The node before ipwarden: bridge with the previous IPAM, whose reservations the test
	// reads. Its range is 10.244.0.10-12, inside the pool to come.
	previous := prev.install(ctx, n)
	conflist := func(ipam string) string {
		return fmt.Sprintf(`{"cniVersion": "1.0.0", "name": %q, "plugins": [{"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "ipam": %s}, {"type": "portmap", "capabilities": {"portMappings": true}}]}`,
			takeoverNetwork, ipam)
	}
	oldConf := filepath.Join("/etc/cni/net.d", takeoverConflist)
	if err := os.WriteFile(oldConf, []byte(conflist(previous)), 0o644); err != nil {
		t.Fatal(err)
	}
	n.waitRuntimeIPAM(ctx, prev.typ)
	n.waitNodeReady(ctx)
	old := n.startOldPods(ctx, takeoverOld)
	for _, p := range old {
		if !takeoverOldRange[p.ip] {
			t.Fatalf("old pod %s has %s, outside %s's range", p.name, p.ip, prev.typ)
		}
	}
	if err := prev.reservations(ctx, n, old); err != nil {
		t.Fatal(err)
	}
	n.logf("takeover: %d pods run with %s's addresses: %s", len(old), prev.typ, podIPs(old))

	// 2. Install ipwarden. Its conflist is the old one with ipam {"type": "ipwarden", "previous":
	// <the previous IPAM's ipam object>}, under the old network name. The pool overlaps the
	// previous range: 10.244.0.10-15 and nothing else, the old pods' three addresses and three
	// for new pods (the /24 with everything else excluded, so pods get the old prefix and
	// gateway).
	ipwardenIPAM := fmt.Sprintf(`{"type": "ipwarden", "socket": %q, "previous": %s}`, cniproto.DefaultSocket, previous)
	n.overlayPatches = cniConfigPatch(conflist(ipwardenIPAM)) + `
# The adopted attachments (no network namespace recorded) are freed --gc-grace after their pod
# is gone: 10s rather than the default minute keeps the test short.
- target: {kind: DaemonSet, name: ipwarden-agent, namespace: ipwarden-system}
  patch: |
    - {op: add, path: /spec/template/spec/containers/0/args/-, value: --gc-grace=10s}
`
	if prev.agentPatch != nil {
		n.overlayPatches += prev.agentPatch(n)
	}
	n.pool = sixAddressPool()
	poolAddrs := map[netip.Addr]bool{}
	for a := netip.MustParseAddr("10.244.0.10"); a.Compare(netip.MustParseAddr("10.244.0.15")) <= 0; a = a.Next() {
		poolAddrs[a] = true
	}
	n.deployIpwarden(ctx)
	// The agent's init container wrote 10-ipwarden.conflist, but the runtime uses the first
	// config file by name, still 10-containerd-net.conflist. The operator moves the old one
	// aside (the runtime reads only .conf, .conflist and .json files):
	//   mv /etc/cni/net.d/10-containerd-net.conflist /etc/cni/net.d/10-containerd-net.conflist.pre-ipwarden
	if _, err := os.Stat("/etc/cni/net.d/10-ipwarden.conflist"); err != nil {
		t.Fatalf("the agent's init container installed no conflist: %v", err)
	}
	n.waitRuntimeIPAM(ctx, prev.typ) // still the old config, until it is moved aside
	if err := os.Rename(oldConf, oldConf+".pre-ipwarden"); err != nil {
		t.Fatal(err)
	}
	n.waitRuntimeIPAM(ctx, "ipwarden")
	n.logf("takeover: ipwarden installed and the runtime uses its conflist")

	t.Run("old pods keep their addresses and are adopted", func(t *testing.T) {
		n.t = t
		n.checkOldPods(ctx, old)
		n.waitAdopted(ctx, old)
		n.checkAttachments(ctx, old)
		n.checkClean(ctx)
	})

	var fresh []pod
	t.Run("new pods get the pool's other addresses", func(t *testing.T) {
		n.t = t
		if _, err := n.kube.AppsV1().Deployments(testNamespace).Create(ctx,
			sleeperDeployment("new", takeoverNew, map[string]string{"app": "sleeper", "ipam": "new"}), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		all := n.waitPods(ctx, takeoverOld+takeoverNew)
		fresh = newPods(all)
		for _, p := range fresh {
			if !poolAddrs[p.ip] || takeoverOldRange[p.ip] {
				t.Fatalf("new pod %s has %s: want one of the pool's addresses no old pod has (10.244.0.13-15)", p.name, p.ip)
			}
		}
		n.checkOldPods(ctx, old)
		n.checkFromIpwarden(ctx, fresh)
		// An old pod first: checkPing pings between it and every other pod, both ways.
		n.checkPing(ctx, append(append([]pod(nil), old...), fresh...))
		n.checkAttachments(ctx, all)
		// ADD never goes to the previous IPAM: its reservations are still exactly the old pods'.
		if err := prev.reservations(ctx, n, old); err != nil {
			t.Fatal(err)
		}
		n.waitAdopted(ctx, old)
		n.checkClean(ctx)
	})

	t.Run("deleting the old pods frees the previous IPAM's reservations and returns their addresses", func(t *testing.T) {
		n.t = t
		n.logf("takeover: deleting the old pods")
		n.kubectl("scale", "-n", testNamespace, "deployment/old", "--replicas=0")
		n.waitPods(ctx, takeoverNew)
		// The runtime's DEL went to the agent, then to the previous IPAM through "previous".
		if err := localcluster.WaitFor(ctx, time.Minute, 250*time.Millisecond, func() error {
			n.scanNoDuplicates()
			return prev.reservations(ctx, n, nil)
		}); err != nil {
			t.Fatalf("%s's reservations after the old pods were deleted: %v", prev.typ, err)
		}
		// The adopted attachments are freed once the pods are gone.
		n.checkAttachments(ctx, fresh)
		n.waitAdopted(ctx, nil)
		n.checkClean(ctx)
		// The pool has no other address: the new pods can only get the old pods' addresses.
		n.kubectl("scale", "-n", testNamespace, "deployment/new", fmt.Sprintf("--replicas=%d", takeoverOld+takeoverNew))
		all := n.waitPods(ctx, takeoverOld+takeoverNew)
		got := map[netip.Addr]bool{}
		for _, p := range all {
			got[p.ip] = true
		}
		if fmt.Sprint(got) != fmt.Sprint(poolAddrs) {
			t.Fatalf("pods have %s, want every pool address 10.244.0.10-15 in use", podIPs(all))
		}
		n.checkFromIpwarden(ctx, all)
		n.checkPing(ctx, all)
		n.checkAttachments(ctx, all)
		if err := prev.reservations(ctx, n, nil); err != nil {
			t.Fatal(err)
		}
		n.checkClean(ctx)
	})
	n.t = t
	n.logf("takeover from %s: test body took %s (preparation %s)", prev.typ, time.Since(began).Round(time.Second), prep.Prepared.Round(time.Second))
}

// hostLocalMountPatch is an overlay patch that mounts host-local's dataDir into the agent's
// container at the same path: every ADD with host-local as "previous" reads its reservations
// there (deploy/ mounts only host-local's default, /var/lib/cni/networks).
func hostLocalMountPatch(dataDir string) string {
	return fmt.Sprintf(`
- target: {kind: DaemonSet, name: ipwarden-agent, namespace: ipwarden-system}
  patch: |
    - {op: add, path: /spec/template/spec/containers/0/volumeMounts/-, value: {name: test-host-local, mountPath: %s}}
    - {op: add, path: /spec/template/spec/volumes/-, value: {name: test-host-local, hostPath: {path: %s, type: DirectoryOrCreate}}}
`, dataDir, dataDir)
}

// newPods are the pods of the Deployment "new".
func newPods(all []pod) []pod {
	var out []pod
	for _, p := range all {
		if strings.HasPrefix(p.name, "new-") {
			out = append(out, p)
		}
	}
	return out
}

// waitRuntimeIPAM waits until the runtime's pod network config (eth0, as the CRI status reports
// the config it loaded) uses an IPAM plugin of type ipamType.
func (n *realNode) waitRuntimeIPAM(ctx context.Context, ipamType string) {
	n.t.Helper()
	err := localcluster.WaitFor(ctx, time.Minute, 100*time.Millisecond, func() error {
		st, err := n.cri.Status(ctx, &runtimeapi.StatusRequest{Verbose: true})
		if err != nil {
			return err
		}
		var cfg struct {
			Networks []struct {
				IFName string
				Config struct {
					Name    string
					Plugins []struct {
						Network struct {
							Type string `json:"type"`
							IPAM struct {
								Type string `json:"type"`
							} `json:"ipam"`
						}
					}
				}
			}
		}
		if err := json.Unmarshal([]byte(st.Info["cniconfig"]), &cfg); err != nil {
			return fmt.Errorf("runtime status cniconfig: %w", err)
		}
		for _, nw := range cfg.Networks {
			if nw.IFName != "eth0" {
				continue
			}
			for _, p := range nw.Config.Plugins {
				if p.Network.IPAM.Type == ipamType {
					return nil
				}
			}
			return fmt.Errorf("the runtime's pod network %q has no plugin with ipam %s", nw.Config.Name, ipamType)
		}
		return errors.New("the runtime has no pod network config loaded")
	})
	if err != nil {
		n.t.Fatal(err)
	}
}

// checkOldPods checks that every old pod still runs as before: same UID, sandbox and address,
// no container restart, the address on eth0 of its own network namespace and on no other, and
// the runtime reporting that address for the sandbox.
func (n *realNode) checkOldPods(ctx context.Context, old []pod) {
	t := n.t
	t.Helper()
	addrs := n.scanNoDuplicates()
	for _, o := range old {
		p, err := n.kube.CoreV1().Pods(testNamespace).Get(ctx, o.name, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("old pod %s: %v", o.name, err)
		}
		if string(p.UID) != o.uid || p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning {
			t.Fatalf("old pod %s: uid %s (was %s), phase %s, deleting %v", o.name, p.UID, o.uid, p.Status.Phase, p.DeletionTimestamp != nil)
		}
		if p.Status.PodIP != o.ip.String() {
			t.Fatalf("old pod %s reports %q, had %s", o.name, p.Status.PodIP, o.ip)
		}
		for _, c := range p.Status.ContainerStatuses {
			if c.RestartCount != 0 || c.State.Running == nil {
				t.Fatalf("old pod %s container %s: %d restarts, running %v", o.name, c.Name, c.RestartCount, c.State.Running != nil)
			}
		}
		sb, netns, err := n.podSandbox(ctx, o.uid)
		if err != nil {
			t.Fatalf("old pod %s: %v", o.name, err)
		}
		if sb != o.sandbox || netns != o.netns {
			t.Fatalf("old pod %s runs in sandbox %s (netns %s), was %s (netns %s)", o.name, sb[:12], netns, o.sandbox[:12], o.netns)
		}
		st, err := n.cri.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: sb})
		if err != nil {
			t.Fatal(err)
		}
		if ip := st.GetStatus().GetNetwork().GetIp(); ip != o.ip.String() {
			t.Fatalf("old pod %s: the runtime reports %q for its sandbox, want %s", o.name, ip, o.ip)
		}
		if ns := addrs[o.ip]; len(ns) != 1 || ns[0] != o.netns {
			t.Fatalf("old pod %s: %s is on network namespaces %v, want only %s", o.name, o.ip, ns, o.netns)
		}
		out, err := exec.Command("ip", "-n", o.netns, "-o", "addr", "show", "dev", "eth0").CombinedOutput()
		if err != nil || !strings.Contains(string(out), " "+o.ip.String()+"/24 ") {
			t.Fatalf("old pod %s: eth0 of %s does not carry %s/24: %v %s", o.name, o.netns, o.ip, err, out)
		}
	}
}

// agentList is `ipwarden agent list -o json` on the agent's socket.
func agentList() (cniproto.Response, error) {
	var resp cniproto.Response
	out, err := exec.Command(prep.Ipwarden, "agent", "list", "-o", "json", "--socket", cniproto.DefaultSocket).Output()
	if err != nil {
		return resp, fmt.Errorf("ipwarden agent list: %v", err)
	}
	return resp, json.Unmarshal(out, &resp)
}

// waitAdopted waits until the agent reports exactly the pods adopted as the pool's adopted
// addresses (ADOPTED) and as rebuilt attachments of those pods with their addresses.
func (n *realNode) waitAdopted(ctx context.Context, adopted []pod) {
	n.t.Helper()
	want := map[string]string{}
	for _, p := range adopted {
		want[p.ip.String()] = p.name
	}
	err := localcluster.WaitFor(ctx, time.Minute, 250*time.Millisecond, func() error {
		resp, err := agentList()
		if err != nil {
			return err
		}
		count := -1
		for _, ps := range resp.Pools {
			if ps.Pool == poolName {
				count = ps.Adopted
			}
		}
		if count != len(adopted) {
			return fmt.Errorf("the agent lists %d adopted addresses in pool %s, want %d", count, poolName, len(adopted))
		}
		got := map[string]string{}
		for _, a := range resp.Attachments {
			if !a.Rebuilt {
				continue
			}
			for _, ip := range a.IPs {
				got[strings.Split(ip.Address, "/")[0]] = a.Pod.Name
			}
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			return fmt.Errorf("adopted attachments %v, want %v", got, want)
		}
		return nil
	})
	if err != nil {
		n.dumpState(ctx)
		n.t.Fatal(err)
	}
}

// checkFromIpwarden checks that the pods' attachments were made by an ADD through ipwarden:
// not adopted, recorded under the pod's sandbox ID.
func (n *realNode) checkFromIpwarden(ctx context.Context, pods []pod) {
	n.t.Helper()
	resp, err := agentList()
	if err != nil {
		n.t.Fatal(err)
	}
	for _, p := range pods {
		sb, _, err := n.podSandbox(ctx, p.uid)
		if err != nil {
			n.t.Fatalf("pod %s: %v", p.name, err)
		}
		found := false
		for _, a := range resp.Attachments {
			if a.Pod.Name == p.name && !a.Rebuilt && a.ContainerID == sb {
				found = true
			}
		}
		if !found {
			n.t.Fatalf("pod %s: no attachment from an ADD for its sandbox %s: %+v", p.name, sb[:12], resp.Attachments)
		}
	}
}

// hostLocalReservations compares host-local's reservation files (dataDir/<network>/<address>,
// holding the container ID and interface) with want.
func hostLocalReservations(dataDir string, want []pod) error {
	dir := filepath.Join(dataDir, takeoverNetwork)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	var got, exp []string
	for _, e := range ents {
		if _, err := netip.ParseAddr(e.Name()); err != nil {
			continue // last_reserved_ip.0, lock
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			return err
		}
		if previous.IsOwnHostLocal(string(b)) {
			continue // ipwarden's own reservation of an address it handed out (package previous)
		}
		id, _, _ := strings.Cut(string(b), "\n")
		got = append(got, e.Name()+"="+strings.TrimSpace(id))
	}
	for _, p := range want {
		exp = append(exp, p.ip.String()+"="+p.sandbox)
	}
	sort.Strings(got)
	sort.Strings(exp)
	if strings.Join(got, " ") != strings.Join(exp, " ") {
		return fmt.Errorf("host-local's reservations in %s: %v, want %v", dir, got, exp)
	}
	return nil
}

// whereaboutsReservations compares Whereabouts' reservations, the allocations of its IPPool
// objects and its OverlappingRangeIPReservations, with want: each pod's address held for the pod
// in both, and for its sandbox in the IPPool.
func whereaboutsReservations(ctx context.Context, n *realNode, want []pod) error {
	dyn, err := dynamic.NewForConfig(n.cp.Config)
	if err != nil {
		return err
	}
	gv := schema.GroupVersion{Group: "whereabouts.cni.cncf.io", Version: "v1alpha1"}
	var got, exp []string
	pools, err := dyn.Resource(gv.WithResource("ippools")).List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list Whereabouts IPPools: %w", err)
	}
	for _, p := range pools.Items {
		rs, err := localcluster.WhereaboutsPoolReservations(p.Object)
		if err != nil {
			return err
		}
		for _, r := range rs {
			if strings.HasPrefix(r.ContainerID, previous.WhereaboutsIDPrefix) {
				continue // ipwarden's own allocation of an address it handed out (package previous)
			}
			got = append(got, "IPPool "+r.String())
		}
	}
	orips, err := dyn.Resource(gv.WithResource("overlappingrangeipreservations")).List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list Whereabouts OverlappingRangeIPReservations: %w", err)
	}
	for _, o := range orips.Items {
		r, err := localcluster.WhereaboutsOverlappingReservation(o.Object)
		if err != nil {
			return err
		}
		got = append(got, "OverlappingRangeIPReservation "+r.String())
	}
	for _, p := range want {
		r := localcluster.WhereaboutsReservation{IP: p.ip, ContainerID: p.sandbox, PodRef: testNamespace + "/" + p.name}
		exp = append(exp, "IPPool "+r.String())
		// Whereabouts v0.9.4 records no container ID in its OverlappingRangeIPReservations.
		r.ContainerID = ""
		exp = append(exp, "OverlappingRangeIPReservation "+r.String())
	}
	sort.Strings(got)
	sort.Strings(exp)
	if strings.Join(got, " ") != strings.Join(exp, " ") {
		return fmt.Errorf("Whereabouts' reservations: %v, want %v", got, exp)
	}
	return nil
}

// installWhereaboutsPlugin puts Whereabouts (prep.Whereabouts) on the node: its CRDs in the API
// server, the plugin in the CNI bin directory and its flat config file in its default place
// (/etc/cni/net.d/whereabouts.d/whereabouts.conf), naming the test control plane's admin
// kubeconfig: the plugin runs on the node as root. Its log goes to the node's directory.
func (n *realNode) installWhereaboutsPlugin(ctx context.Context, logLevel string) {
	t := n.t
	w := prep.Whereabouts
	if w.Plugin == "" {
		t.Fatal("prepare built no Whereabouts")
	}
	if err := controlplane.InstallCRDs(ctx, n.cp.Config, w.CRDDir()); err != nil {
		t.Fatal(err)
	}
	if err := copyFile(w.Plugin, "/opt/cni/bin/whereabouts"); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll("/etc/cni/net.d/whereabouts.d", 0o755); err != nil {
		t.Fatal(err)
	}
	flat := localcluster.WhereaboutsFlatConfig(n.cp.Kubeconfig, filepath.Join(n.dir, "whereabouts.log"), logLevel)
	if err := os.WriteFile("/etc/cni/net.d/whereabouts.d/whereabouts.conf", flat, 0o600); err != nil {
		t.Fatal(err)
	}
}

// startOldPods creates the test namespace and count "old" sleeper pods (labels app=sleeper,
// ipam=old), waits until they run, and records each one's sandbox, checked to be the sandbox
// whose network namespace holds its address.
func (n *realNode) startOldPods(ctx context.Context, count int32) []pod {
	t := n.t
	t.Helper()
	if _, err := n.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := n.kube.AppsV1().Deployments(testNamespace).Create(ctx,
		sleeperDeployment("old", count, map[string]string{"app": "sleeper", "ipam": "old"}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	old := n.waitPods(ctx, int(count))
	for i := range old {
		p := &old[i]
		sb, netns, err := n.podSandbox(ctx, p.uid)
		if err != nil {
			t.Fatalf("old pod %s: %v", p.name, err)
		}
		if netns != p.netns {
			t.Fatalf("old pod %s: its sandbox's network namespace is %s, its address is on %s", p.name, netns, p.netns)
		}
		p.sandbox = sb
	}
	return old
}

// sixAddressPool is the pool of the takeover and handback tests: the node's /24 with everything
// but 10.244.0.10-15 excluded (so pods get the old prefix and gateway), batch 2, no cooldown.
func sixAddressPool() ipwardenv1.IPPoolSpec {
	return ipwardenv1.IPPoolSpec{
		CIDRs: []ipwardenv1.CIDR{poolCIDR},
		Exclude: []ipwardenv1.IPOrCIDR{"10.244.0.0/29", "10.244.0.8/31", "10.244.0.16/28",
			"10.244.0.32/27", "10.244.0.64/26", "10.244.0.128/25"},
		Gateway:       "10.244.0.1",
		Scaling:       ipwardenv1.Scaling{BatchSize: 2, BufferPercent: 0, MaxPerNode: 8},
		ReuseCooldown: metav1.Duration{Duration: 0},
	}
}

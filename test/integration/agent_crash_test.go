package integration

// Crash tests of the node agent (docs/design.md, invariant 7: an address a runtime is told is on
// disk first). The integration tests' ipwarden binary is built with the failpoints build tag
// (ipwardenBinary), so IPWARDEN_FAILPOINT=hold-add-write holds every ADD before its journal write.

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	cnitypes "github.com/containernetworking/cni/pkg/types"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/agent/journal"
)

// runtimeRecord is the test's own record of what the runtime was told: each live sandbox
// interface and the address its ADD was answered with. It fails as soon as an answer names an
// address a live sandbox of the same network has.
type runtimeRecord struct {
	t    *testing.T
	live map[string]netip.Addr // "network/container/ifname" -> address
}

func (r *runtimeRecord) answered(network, cid, ifname string, res *cniResult) netip.Addr {
	r.t.Helper()
	a := addrOf(r.t, res.IPs[0].Address)
	for k, b := range r.live {
		if b == a && strings.HasPrefix(k, network+"/") {
			r.t.Fatalf("ADD %s/%s on %s answered %s, which live sandbox %s was told", cid, ifname, network, a, k)
		}
	}
	r.live[network+"/"+cid+"/"+ifname] = a
	return a
}

func (r *runtimeRecord) deleted(network, cid, ifname string) {
	delete(r.live, network+"/"+cid+"/"+ifname)
}

// The paths of issue 30 on real processes: an ADD held before its journal write while the agent
// is killed (SIGKILL), then stopped cleanly (SIGTERM) before anything reports; a re-created
// sandbox of a pod whose status still shows its first sandbox's address; a secondary interface
// (net1, a pool with spec.network) killed the same way. The runtime is never told an address the
// journal lacks, so no later ADD hands a live sandbox's address to another, and the agent's
// attachments after it all are exactly the live sandboxes.
func TestAgentKilledAndStoppedDuringAnAdd(t *testing.T) {
	const node = "crash-add"
	const maxPerNode = 6
	scale := ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: maxPerNode}
	agentPool(t, "crash-add-pod", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.160.0.0/24"}, Scaling: scale, ReuseCooldown: cooldown(0)})
	agentPool(t, "crash-add-storage", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.161.0.0/24"}, Network: "storage",
		Scaling: scale, ReuseCooldown: cooldown(0)})
	agentNode(t, node, node)
	t.Cleanup(func() {
		_ = k8s.Delete(context.Background(), &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{
			Namespace: "ipwarden-system", Name: "ipwarden-agent-" + node}})
	})
	startController(t)
	ag := startAgent(t, node, "", "--address-wait=2s")
	ag.waitServing(t)
	podConf := pluginConf("1.1.0", ag.socket)
	storageConf := networkConf(ag.socket, "storage-net", "storage")
	rt := &runtimeRecord{t: t, live: map[string]netip.Addr{}}
	pod := func(name string) *corev1.Pod { return createBoundPod(t, "crash-add-"+name, node) }
	args := func(p *corev1.Pod) string { return podArgs(p.Namespace, p.Name, string(p.UID)) }
	add := func(conf, network, cid, ifname string, p *corev1.Pod) (*cniResult, *cnitypes.Error) {
		t.Helper()
		return cniIf(t, "ADD", conf, cid, ifname, args(p))
	}
	mustAdd := func(conf, network, cid, ifname string, p *corev1.Pod) netip.Addr {
		t.Helper()
		res, e := add(conf, network, cid, ifname, p)
		if e != nil {
			t.Fatalf("ADD %s/%s: %v", cid, ifname, e)
		}
		return rt.answered(network, cid, ifname, res)
	}
	// heldAndKilled runs an ADD with the agent holding it before its journal write, kills the
	// agent (SIGKILL) there, and checks that the runtime was told nothing; the agent restarts
	// without the failpoint.
	heldAndKilled := func(conf, network, cid, ifname string, p *corev1.Pod) {
		t.Helper()
		ag.env = []string{"IPWARDEN_FAILPOINT=hold-add-write"}
		ag.restart(t, "--address-wait=2s")
		ag.waitServing(t)
		type answer struct {
			res *cniResult
			e   *cnitypes.Error
		}
		done := make(chan answer, 1)
		go func() { r, e := add(conf, network, cid, ifname, p); done <- answer{r, e} }()
		eventually(t, 30*time.Second, "the ADD to reach the failpoint", func() error {
			if !ag.logContains("failpoint hold-add-write") {
				return fmt.Errorf("not yet")
			}
			return nil
		})
		ag.kill()
		a := <-done
		if a.e == nil {
			t.Fatalf("ADD %s/%s held before its journal write was answered %v: the runtime was told an address the journal lacks", cid, ifname, a.res.IPs)
		}
		ag.env = nil
		ag.start(t, "--address-wait=2s")
		ag.waitServing(t)
	}

	// Pod P's first sandbox gets X on eth0 and an address on net1; P's status reports X; the
	// sandbox ends with DELs. Pod Q runs.
	P, Q := pod("p"), pod("q")
	X := mustAdd(podConf, "pod", "p-1", "eth0", P)
	mustAdd(storageConf, "storage", "p-1", "net1", P)
	setPodIP(t, P, X.String())
	for _, c := range []struct{ conf, network, ifname string }{{podConf, "pod", "eth0"}, {storageConf, "storage", "net1"}} {
		if _, e := cniIf(t, "DEL", c.conf, "p-1", c.ifname, args(P)); e != nil {
			t.Fatalf("DEL p-1/%s: %v", c.ifname, e)
		}
		rt.deleted(c.network, "p-1", c.ifname)
	}
	mustAdd(podConf, "pod", "q-1", "eth0", Q)

	// Path 2: P's next sandbox's ADD is held and the agent killed; P's status still shows X.
	heldAndKilled(podConf, "pod", "p-2", "eth0", P)
	// Path 1: then a clean stop (SIGTERM, a DaemonSet rollout) before anything reports.
	ag.stop(t)
	ag.start(t, "--address-wait=2s")
	ag.waitServing(t)
	// The runtime makes P a new sandbox, eth0 first.
	mustAdd(podConf, "pod", "p-3", "eth0", P)
	// Path 3: P's net1 ADD (secondary network) is held and the agent killed; P reports eth0 only.
	heldAndKilled(storageConf, "storage", "p-3", "net1", P)
	ag.stop(t)
	ag.start(t, "--address-wait=2s")
	ag.waitServing(t)
	mustAdd(storageConf, "storage", "p-3", "net1", P)

	// New pods take every address either network's pool lets the node hold: none is a live one
	// (rt.answered fails at once otherwise).
	for _, c := range []struct{ conf, network, ifname string }{{podConf, "pod", "eth0"}, {storageConf, "storage", "net1"}} {
		for i := 0; ; i++ {
			if i > 2*maxPerNode {
				t.Fatalf("network %s: more than %d ADDs served at maxPerNode %d", c.network, i, maxPerNode)
			}
			cid := fmt.Sprintf("n%d", i)
			p := pod(c.network + "-" + cid)
			res, e := add(c.conf, c.network, cid, c.ifname, p)
			if e != nil {
				if e.Code != 11 {
					t.Fatalf("ADD %s on %s: %v, want no free address (code 11)", cid, c.network, e)
				}
				break
			}
			rt.answered(c.network, cid, c.ifname, res)
		}
	}
	// The agent's attachments are exactly the live sandboxes: every address the runtime was told
	// is attached to its sandbox, and nothing else is.
	resp, err := ag.list(t)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]netip.Addr{}
	for _, at := range resp.Attachments {
		network := "pod"
		if at.IfName == "net1" {
			network = "storage"
		}
		for _, ip := range at.IPs {
			got[network+"/"+at.ContainerID+"/"+at.IfName] = addrOf(t, ip.Address)
		}
	}
	if fmt.Sprint(got) != fmt.Sprint(rt.live) {
		t.Fatalf("agent attachments %v\nlive sandboxes     %v", got, rt.live)
	}
	// Nothing reserved ahead on disk: this agent never answers before its write.
	ag.kill()
	j, err := journal.Open(ag.stateDir, journal.Options{Node: node})
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	snap, err := j.Load()
	if err != nil {
		t.Fatal(err)
	}
	if len(snap.Ahead) != 0 {
		t.Fatalf("the journal records addresses reserved ahead: %v", snap.Ahead)
	}
}

// Path 4 of issue 30: the agent's state directory on a full filesystem. An ADD whose journal
// write fails is refused and hands nothing out; every ADD that was answered is in the journal
// when space returns (after the agent restarts, if the failed write broke the journal), so no
// running pod's address is attached nowhere. Needs root (it mounts a small tmpfs).
func TestAgentOnAFullDisk(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("this test mounts a tmpfs as the agent's state directory: run it as root (CI does)")
	}
	const node = "full-disk"
	agentPool(t, "full-disk", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.162.0.0/24"},
		Scaling: ipwardenv1.Scaling{BatchSize: 16, BufferPercent: 50, MaxPerNode: 128}, ReuseCooldown: cooldown(0)})
	agentNode(t, node, node)
	t.Cleanup(func() {
		_ = k8s.Delete(context.Background(), &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{
			Namespace: "ipwarden-system", Name: "ipwarden-agent-" + node}})
	})
	stateDir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=1m", "ipwarden-full-disk", stateDir).CombinedOutput(); err != nil {
		t.Fatalf("mount tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", "-l", stateDir).Run() })
	startController(t)
	ag := startAgent(t, node, stateDir, "--address-wait=2s")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	rt := &runtimeRecord{t: t, live: map[string]netip.Addr{}}
	for i := range 3 {
		cid := fmt.Sprintf("a%d", i)
		p := createBoundPod(t, "full-disk-"+cid, node)
		res, e := cniIf(t, "ADD", conf, cid, "eth0", podArgs(p.Namespace, p.Name, string(p.UID)))
		if e != nil {
			t.Fatalf("ADD %s before the disk filled: %v", cid, e)
		}
		rt.answered("pod", cid, "eth0", res)
	}
	// Fill the filesystem.
	filler := filepath.Join(stateDir, "filler")
	f, err := os.Create(filler)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	for {
		if _, err := f.Write(buf); err != nil {
			break
		}
	}
	f.Close()
	refused := 0
	for i := range 40 {
		cid := fmt.Sprintf("b%d", i)
		p := createBoundPod(t, "full-disk-"+cid, node)
		res, e := cniIf(t, "ADD", conf, cid, "eth0", podArgs(p.Namespace, p.Name, string(p.UID)))
		if e != nil {
			refused++
			continue
		}
		rt.answered("pod", cid, "eth0", res)
	}
	if refused == 0 {
		t.Fatal("no ADD was refused on a full disk: the test did not reach a failing journal write")
	}
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	// The agent may have stopped on a broken journal; a restart (as the kubelet would) opens it.
	ag.restart(t, "--address-wait=2s")
	ag.waitServing(t)
	resp, err := ag.list(t)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]netip.Addr{}
	for _, at := range resp.Attachments {
		if strings.HasPrefix(at.ContainerID, "rebuilt:") {
			continue
		}
		for _, ip := range at.IPs {
			got["pod/"+at.ContainerID+"/"+at.IfName] = addrOf(t, ip.Address)
		}
	}
	for k, a := range rt.live {
		if got[k] != a {
			t.Fatalf("sandbox %s was answered %s; after the disk came back the agent attaches %v to it (attachments %v)", k, a, got[k], got)
		}
	}
	t.Logf("%d ADDs answered, %d refused on the full disk", len(rt.live), refused)
	// And new pods get addresses again, none a live one.
	p := createBoundPod(t, "full-disk-after", node)
	res, e := cniIf(t, "ADD", conf, "after", "eth0", podArgs(p.Namespace, p.Name, string(p.UID)))
	if e != nil {
		t.Fatalf("ADD after the disk came back: %v", e)
	}
	rt.answered("pod", "after", "eth0", res)
}

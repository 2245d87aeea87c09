package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	cnitypes "github.com/containernetworking/cni/pkg/types"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/localcluster"
	prevpkg "github.com/ipwarden/ipwarden/internal/previous"
)

// Taking over from Whereabouts (localcluster.WhereaboutsVersion, the real plugin and its CRDs on
// the real API server): three pods got their addresses from Whereabouts, which keeps them as
// reservations in its own IPPool objects. An ipwarden pool over Whereabouts' whole range is
// created; the node's agent adopts the three addresses; a new pod, through ipwarden with
// Whereabouts as "previous", gets none of them. Then the old pods end: the runtime's DEL goes
// through ipwarden's plugin, which hands it to Whereabouts, and Whereabouts' reservations are
// gone; the addresses come back to ipwarden's pool.
func TestTakeoverFromWhereabouts(t *testing.T) {
	ctx := context.Background()
	wb := setUpWhereabouts(ctx, t)
	// CNI_PATH holds both plugins under their CNI types, as /opt/cni/bin would.
	cniPath := t.TempDir()
	for name, bin := range map[string]string{"whereabouts": wb.Plugin, "ipwarden": cniBinary(t)} {
		if err := os.Symlink(bin, filepath.Join(cniPath, name)); err != nil {
			t.Fatal(err)
		}
	}
	scratch := t.TempDir()
	flat := filepath.Join(scratch, "whereabouts.conf")
	fb := localcluster.WhereaboutsFlatConfig(kubeconfigPath, filepath.Join(scratch, "whereabouts.log"), "debug")
	if err := os.WriteFile(flat, fb, 0o600); err != nil {
		t.Fatal(err)
	}
	const wbRange = "10.133.0.0/29"
	previous := map[string]any{"type": "whereabouts", "range": wbRange, "configuration_path": flat}
	netconf := func(ipam map[string]any) string {
		b, _ := json.Marshal(map[string]any{"cniVersion": "1.0.0", "name": "podnet", "type": "bridge", "ipam": ipam})
		return string(b)
	}

	agentNode(t, "takeover-wb", "takeover-wb")
	agentPool(t, "takeover-wb-base", "takeover-wb", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.133.1.0/28"},
		Scaling: ipwardenv1.Scaling{BatchSize: 2, BufferPercent: 0, MaxPerNode: 16}, ReuseCooldown: cooldown(0)})
	startController(t, "--pool-settle=60s")
	ag := startAgent(t, "takeover-wb", "", "--gc-grace=1s", "--address-wait=2s")
	ag.waitServing(t)

	// The old pods: their sandboxes' addresses come from Whereabouts (the node's CNI config
	// before the switch names it as IPAM), and the kubelet reports them in status.podIPs.
	type oldPod struct{ name, uid, cid, ip string }
	var olds []oldPod
	oldIPs := map[string]bool{}
	for i := range 3 {
		p := createBoundPod(t, fmt.Sprintf("takeover-wb-old-%d", i), "takeover-wb")
		cid := fmt.Sprintf("wb-old-%d", i)
		out, e := runPlugin(t, wb.Plugin, cniPath, "ADD", netconf(previous), cid, podArgs("default", p.Name, string(p.UID)))
		if e != nil {
			t.Fatalf("Whereabouts ADD: %v", e)
		}
		var r cniResult
		if err := json.Unmarshal(out, &r); err != nil || len(r.IPs) != 1 {
			t.Fatalf("Whereabouts ADD result %s: %v", out, err)
		}
		ip := addrOf(t, r.IPs[0].Address).String()
		setPodIP(t, p, ip)
		olds = append(olds, oldPod{name: p.Name, uid: string(p.UID), cid: cid, ip: ip})
		oldIPs[ip] = true
	}
	if own, _ := whereaboutsAllocationsIn(t, wbRange); len(own) != 3 {
		n := len(own)
		t.Fatalf("Whereabouts holds %d reservations after three ADDs, want 3", n)
	}

	// ipwarden's pool over Whereabouts' whole range.
	agentPool(t, "takeover-wb", "takeover-wb", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{wbRange},
		Scaling: ipwardenv1.Scaling{BatchSize: 2, BufferPercent: 0, MaxPerNode: 16}, ReuseCooldown: cooldown(0)})
	eventually(t, 30*time.Second, "the old pods' addresses to be adopted and held by the node", func() error {
		p := ag.pool(t, "takeover-wb")
		h := held(t, "takeover-wb", "takeover-wb")
		for ip := range oldIPs {
			if !h.Contains(addrOf(t, ip+"/32")) {
				return fmt.Errorf("the node holds %v, not the old pod's %s", h, ip)
			}
		}
		if p.Adopted != 3 {
			return fmt.Errorf("agent's view: %+v, want 3 adopted", p)
		}
		return nil
	})

	// The node's config now names ipwarden, with Whereabouts as the previous IPAM.
	newConf := netconf(map[string]any{"type": "ipwarden", "socket": ag.socket, "pools": []string{"takeover-wb"}, "previous": previous})
	fresh := createBoundPod(t, "takeover-wb-new", "takeover-wb")
	out, e := runPlugin(t, cniBinary(t), cniPath, "ADD", newConf, "wb-new", podArgs("default", fresh.Name, string(fresh.UID)))
	if e != nil {
		t.Fatalf("ipwarden ADD of a new pod: %v", e)
	}
	var r cniResult
	if err := json.Unmarshal(out, &r); err != nil || len(r.IPs) != 1 {
		t.Fatalf("ipwarden ADD result %s: %v", out, err)
	}
	newIP := addrOf(t, r.IPs[0].Address).String()
	if oldIPs[newIP] {
		t.Fatalf("the new pod got %s, an old pod's address", newIP)
	}
	// ADD never reaches Whereabouts (it allocates nothing), but the agent has written its own
	// allocation of the new pod's address into Whereabouts' IPPool before it answered, so a
	// Whereabouts ADD still in flight never picks it.
	// Only this test's range: the tests share the API server, and another test's Whereabouts
	// pools may still hold its entries.
	own, mine := whereaboutsAllocationsIn(t, wbRange)
	if len(own) != 3 {
		t.Fatalf("Whereabouts holds %d reservations of its own after ipwarden's ADD, want the old 3: ADD must never reach it", len(own))
	}
	if len(mine) != 1 || mine[0].IP.String() != newIP || mine[0].ContainerID != prevpkg.OwnWhereaboutsID("wb-new") || mine[0].PodRef != "default/"+fresh.Name {
		t.Fatalf("ipwarden's allocations in Whereabouts' IPPools %+v, want one of %s for container wb-new", mine, newIP)
	}
	// CHECK of an old pod's sandbox, which ipwarden never ADDed, is Whereabouts' to answer.
	old := olds[0]
	if _, e := runPlugin(t, cniBinary(t), cniPath, "CHECK", newConf, old.cid, podArgs("default", old.name, old.uid)); e != nil {
		t.Fatalf("CHECK of an old pod's sandbox through ipwarden: %v", e)
	}

	// The old pods end: the runtime's DEL reaches Whereabouts through ipwarden's plugin.
	for _, o := range olds {
		if _, e := runPlugin(t, cniBinary(t), cniPath, "DEL", newConf, o.cid, podArgs("default", o.name, o.uid)); e != nil {
			t.Fatalf("DEL of old pod %s through ipwarden: %v", o.name, e)
		}
	}
	if own, _ := whereaboutsAllocationsIn(t, wbRange); len(own) != 0 {
		n := len(own)
		t.Fatalf("Whereabouts still holds %d reservations after the old pods' DELs", n)
	}
	// The new pod ends: the agent removes its allocation once the DEL is journaled.
	if _, e := runPlugin(t, cniBinary(t), cniPath, "DEL", newConf, "wb-new", podArgs("default", fresh.Name, string(fresh.UID))); e != nil {
		t.Fatalf("DEL of the new pod: %v", e)
	}
	eventually(t, 10*time.Second, "ipwarden's allocation to leave Whereabouts' IPPool", func() error {
		if _, mine := whereaboutsAllocationsIn(t, wbRange); len(mine) != 0 {
			return fmt.Errorf("ipwarden's allocations %+v", mine)
		}
		return nil
	})
}

// runPlugin runs a CNI plugin binary for one verb with CNI_PATH cniPath and returns its stdout,
// or its CNI error.
func runPlugin(t *testing.T, bin, cniPath, verb, conf, containerID, podArgs string) ([]byte, *cnitypes.Error) {
	t.Helper()
	cmd := exec.Command(bin)
	cmd.Env = []string{"CNI_COMMAND=" + verb, "CNI_CONTAINERID=" + containerID, "CNI_NETNS=" + filepath.Join(netnsDir, "none"),
		"CNI_NETNS_OVERRIDE=1", "CNI_IFNAME=eth0", "CNI_PATH=" + cniPath, "CNI_ARGS=" + podArgs, localcluster.RaceEnv}
	cmd.Stdin = strings.NewReader(conf)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Run(); err != nil {
		var e cnitypes.Error
		if jerr := json.Unmarshal(out.Bytes(), &e); jerr != nil {
			t.Fatalf("%s %s %s: %v without a CNI error: %s %s", filepath.Base(bin), verb, containerID, err, out.String(), errOut.String())
		}
		return nil, &e
	}
	return out.Bytes(), nil
}

// whereaboutsAllocations reads the allocations of Whereabouts' IPPools: Whereabouts' own, and
// ipwarden's (written while the node's configuration names Whereabouts as "previous").
// whereaboutsAllocationsIn is whereaboutsAllocations within the CIDR prefix.
func whereaboutsAllocationsIn(t *testing.T, prefix string) (own, ipwardens []localcluster.WhereaboutsReservation) {
	t.Helper()
	p := netip.MustParsePrefix(prefix)
	all, allMine := whereaboutsAllocations(t)
	for _, r := range all {
		if p.Contains(r.IP) {
			own = append(own, r)
		}
	}
	for _, r := range allMine {
		if p.Contains(r.IP) {
			ipwardens = append(ipwardens, r)
		}
	}
	return own, ipwardens
}

func whereaboutsAllocations(t *testing.T) (own, ipwardens []localcluster.WhereaboutsReservation) {
	t.Helper()
	for _, p := range whereaboutsPools(t) {
		rs, err := localcluster.WhereaboutsPoolReservations(p)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range rs {
			if strings.HasPrefix(r.ContainerID, prevpkg.WhereaboutsIDPrefix) {
				ipwardens = append(ipwardens, r)
			} else {
				own = append(own, r)
			}
		}
	}
	return own, ipwardens
}

// whereaboutsPools lists Whereabouts' IPPool objects (their JSON form).
func whereaboutsPools(t *testing.T) []map[string]any {
	t.Helper()
	list := &unstructured.UnstructuredList{}
	list.SetGroupVersionKind(schema.GroupVersionKind{Group: "whereabouts.cni.cncf.io", Version: "v1alpha1", Kind: "IPPoolList"})
	if err := k8s.List(context.Background(), list); err != nil {
		t.Fatalf("list Whereabouts IPPools: %v", err)
	}
	var out []map[string]any
	for _, p := range list.Items {
		out = append(out, p.Object)
	}
	return out
}

// setUpWhereabouts builds Whereabouts (localcluster.WhereaboutsVersion) once into _bin/test and
// installs its CRDs on the test API server.
func setUpWhereabouts(ctx context.Context, t *testing.T) localcluster.Whereabouts {
	t.Helper()
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	wb, err := localcluster.EnsureWhereabouts(filepath.Join(controlplane.BinDir(root), "test"), os.Stderr)
	if err != nil {
		t.Fatalf("build Whereabouts %s: %v", localcluster.WhereaboutsVersion, err)
	}
	if err := controlplane.InstallCRDs(ctx, restConfig, wb.CRDDir()); err != nil {
		t.Fatal(err)
	}
	return wb
}

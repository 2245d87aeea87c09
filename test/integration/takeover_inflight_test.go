package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// inflightIPAM is the previous IPAM of TestTakeoverWhileAnADDIsInFlight: the real plugin, the
// ipam object of the node's configuration before the switch (whose range is 16-18 of its /24),
// and how the test reads what it reserves.
type inflightIPAM struct {
	typ  string // its CNI type
	bin  string // the real plugin
	ipam func(typ string) map[string]any
	// reserved reports whether it holds a reservation of ip.
	reserved func(t *testing.T, ip string) bool
	prefix   string // its /24, e.g. "10.136.0."
}

// TestTakeoverWhileAHostLocalADDIsInFlight: a pod's ADD goes through host-local on a node just
// before the node switches to ipwarden (host-local has written its reservation; a wrapper holds
// its answer, as a slow bridge or a busy runtime would), and its status comes later. Meanwhile
// new pods start through ipwarden with host-local as "previous": none gets the in-flight pod's
// address, although the node holds it and it is the lowest free one. Once the pod has ended and
// its DEL has gone through host-local (the reservation file removed), the address is handed out.
// Real host-local, ipwarden-cni, agent and controller processes, real API server.
func TestTakeoverWhileAHostLocalADDIsInFlight(t *testing.T) {
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	pluginDir := filepath.Join(controlplane.BinDir(root), "test", "cni-"+localcluster.PluginsVersion)
	if err := localcluster.InstallPlugins(pluginDir, os.Stderr, "ipam/host-local"); err != nil {
		t.Fatal(err)
	}
	dataDir := t.TempDir()
	testInflightTakeover(t, "inflight-hl", inflightIPAM{
		typ: "host-local", bin: filepath.Join(pluginDir, "host-local"), prefix: "10.136.0.",
		ipam: func(typ string) map[string]any {
			return map[string]any{"type": typ, "dataDir": dataDir, "ranges": [][]map[string]string{{{"subnet": "10.136.0.0/24",
				"rangeStart": "10.136.0.16", "rangeEnd": "10.136.0.18", "gateway": "10.136.0.1"}}}}
		},
		reserved: func(t *testing.T, ip string) bool {
			_, err := os.Stat(filepath.Join(dataDir, "podnet", ip))
			if err != nil && !errors.Is(err, os.ErrNotExist) {
				t.Fatal(err)
			}
			return err == nil
		},
	})
}

// TestTakeoverWhileAWhereaboutsADDIsInFlight is TestTakeoverWhileAHostLocalADDIsInFlight with
// Whereabouts (localcluster.WhereaboutsVersion, its CRDs on the real API server) as the previous
// IPAM: the agent reads Whereabouts' IPPool allocations at every ADD.
func TestTakeoverWhileAWhereaboutsADDIsInFlight(t *testing.T) {
	ctx := context.Background()
	wb := setUpWhereabouts(ctx, t)
	scratch := t.TempDir()
	flat := filepath.Join(scratch, "whereabouts.conf")
	if err := os.WriteFile(flat, localcluster.WhereaboutsFlatConfig(kubeconfigPath, filepath.Join(scratch, "whereabouts.log"), "debug"), 0o600); err != nil {
		t.Fatal(err)
	}
	testInflightTakeover(t, "inflight-wb", inflightIPAM{
		typ: "whereabouts", bin: wb.Plugin, prefix: "10.137.0.",
		ipam: func(typ string) map[string]any {
			return map[string]any{"type": typ, "range": "10.137.0.0/24", "range_start": "10.137.0.16", "range_end": "10.137.0.18",
				"gateway": "10.137.0.1", "configuration_path": flat}
		},
		reserved: func(t *testing.T, ip string) bool {
			for _, r := range whereaboutsReservationList(t) {
				if r == ip {
					return true
				}
			}
			return false
		},
	})
}

func testInflightTakeover(t *testing.T, name string, prev inflightIPAM) {
	ctx := context.Background()
	ip := func(n int) string { return fmt.Sprintf("%s%d", prev.prefix, n) }
	node := name + "-a"
	agentNode(t, node, name)
	// A pool of other addresses selects the node, so the agent serves before the takeover pool
	// exists.
	agentPool(t, name+"-base", name, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{ipwardenv1.CIDR(strings.TrimSuffix(prev.prefix, "0.") + "1.0/28")},
		Scaling: ipwardenv1.Scaling{BatchSize: 2, BufferPercent: 0, MaxPerNode: 16}, ReuseCooldown: cooldown(0)})

	// CNI_PATH: the real previous plugin, ipwarden's, and "<type>-slow", the previous plugin
	// behind a wrapper that holds its ADD's answer (after the plugin has reserved) until the test
	// opens the gate.
	cniPath, marks := t.TempDir(), t.TempDir()
	slow := prev.typ + "-slow"
	wrapper := fmt.Sprintf(`#!/bin/sh
# %[1]s whose ADD answer waits, after %[1]s has reserved, until %[2]s/gate-<container> is opened.
# The configuration names this wrapper's type; %[1]s gets its own (Whereabouts checks it).
out=$(/bin/sed 's/"%[1]s-slow"/"%[1]s"/' | %[3]q)
rc=$?
if [ "$CNI_COMMAND" = ADD ]; then
	: > %[2]q/reserved-"$CNI_CONTAINERID"
	/bin/cat %[2]q/gate-"$CNI_CONTAINERID" > /dev/null
fi
printf '%%s\n' "$out"
exit $rc
`, prev.typ, marks, prev.bin)
	netconf := slowedPluginDir(t, cniPath, slow, wrapper, prev.typ, prev.bin)
	oldConf, slowConf := netconf(prev.ipam(prev.typ)), netconf(prev.ipam(slow))

	startController(t, "--pool-settle=60s")
	ag := startAgent(t, node, "", "--gc-grace=1s", "--address-wait=2s")
	ag.waitServing(t)
	newConf := netconf(map[string]any{"type": "ipwarden", "socket": ag.socket, "pools": []string{name}, "previous": prev.ipam(prev.typ)})

	// Two pods got their addresses from the previous IPAM and run; their status shows them.
	var olds []string
	for i := range 2 {
		p := createBoundPod(t, fmt.Sprintf("%s-old-%d", name, i), node)
		out, e := runPlugin(t, prev.bin, cniPath, "ADD", oldConf, fmt.Sprintf("%s-old-%d", name, i), podArgs("default", p.Name, string(p.UID)))
		if e != nil {
			t.Fatalf("%s ADD: %v", prev.typ, e)
		}
		got := resultAddr(t, out)
		setPodIP(t, p, got)
		olds = append(olds, got)
		// The old pods' reservations go with the test (Whereabouts' are the API server's,
		// which other tests count).
		old, cid := p, fmt.Sprintf("%s-old-%d", name, i)
		t.Cleanup(func() {
			_, _ = runPlugin(t, prev.bin, cniPath, "DEL", oldConf, cid, podArgs("default", old.Name, string(old.UID)))
		})
	}
	if !slices.Equal(olds, []string{ip(16), ip(17)}) {
		t.Fatalf("the old pods got %v from %s, want %s and %s", olds, prev.typ, ip(16), ip(17))
	}

	// ipwarden's pool: the previous IPAM's range and one more address.
	var cidrs []ipwardenv1.CIDR
	for n := 16; n <= 19; n++ {
		cidrs = append(cidrs, ipwardenv1.CIDR(ip(n)+"/32"))
	}
	agentPool(t, name, name, ipwardenv1.IPPoolSpec{CIDRs: cidrs,
		Scaling: ipwardenv1.Scaling{BatchSize: 2, BufferPercent: 0, MaxPerNode: 8}, ReuseCooldown: cooldown(0)})
	eventually(t, 30*time.Second, "the old pods' addresses to be adopted and held by the node", func() error {
		if h := held(t, node, name); !h.Contains(addrOf(t, ip(16)+"/32")) || !h.Contains(addrOf(t, ip(17)+"/32")) {
			return fmt.Errorf("the node holds %v", h)
		}
		if p := ag.pool(t, name); p.Adopted != 2 {
			return fmt.Errorf("agent's view %+v, want 2 adopted", p)
		}
		return nil
	})

	// The in-flight pod: its ADD goes through the previous IPAM (the configuration before the
	// switch), which reserves the next address of its range; the answer is held.
	inflight := createBoundPod(t, name+"-inflight", node)
	cid := name + "-inflight"
	gate, err := localcluster.NewGate(filepath.Join(marks, "gate-"+cid))
	if err != nil {
		t.Fatal(err)
	}
	openGate := gate.Open
	type answer struct {
		out []byte
		err error
	}
	answered := make(chan answer, 1)
	rctx, cancel := context.WithCancel(ctx)
	t.Cleanup(func() { _ = openGate(); cancel() })
	go func() {
		cmd := exec.CommandContext(rctx, filepath.Join(cniPath, slow))
		cmd.Env = []string{"CNI_COMMAND=ADD", "CNI_CONTAINERID=" + cid, "CNI_NETNS=" + filepath.Join(netnsDir, "none"), "CNI_NETNS_OVERRIDE=1",
			"CNI_IFNAME=eth0", "CNI_PATH=" + cniPath, "CNI_ARGS=" + podArgs("default", inflight.Name, string(inflight.UID)), localcluster.RaceEnv}
		cmd.Stdin = strings.NewReader(slowConf)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, os.Stderr
		err := cmd.Run()
		answered <- answer{out.Bytes(), err}
	}()
	eventually(t, 30*time.Second, "the previous IPAM to reserve the in-flight pod's address", func() error {
		if _, err := os.Stat(filepath.Join(marks, "reserved-"+cid)); err != nil {
			return err
		}
		return nil
	})
	if !prev.reserved(t, ip(18)) {
		t.Fatalf("%s reserved no %s for the in-flight pod", prev.typ, ip(18))
	}

	// The switch: new pods start through ipwarden, with the previous IPAM as "previous". The
	// node is granted the pool's free addresses, 18 and 19; 18 is the in-flight pod's.
	fresh := createBoundPod(t, name+"-new", node)
	eventually(t, 30*time.Second, "a new pod to get an address through ipwarden", func() error {
		out, e := runPlugin(t, cniBinary(t), cniPath, "ADD", newConf, name+"-new-1", podArgs("default", fresh.Name, string(fresh.UID)))
		if e != nil {
			return e // the runtime retries: the node may still wait for the controller's grant
		}
		if got := resultAddr(t, out); got != ip(19) {
			t.Fatalf("the new pod got %s, want %s: %s is the in-flight pod's", got, ip(19), ip(18))
		}
		return nil
	})
	if h := held(t, node, name); !h.Contains(addrOf(t, ip(18)+"/32")) {
		t.Fatalf("the node holds %v: the test shows nothing unless it holds %s", h, ip(18))
	}
	second := createBoundPod(t, name+"-new-2", node)
	if out, e := runPlugin(t, cniBinary(t), cniPath, "ADD", newConf, name+"-new-2", podArgs("default", second.Name, string(second.UID))); e == nil {
		t.Fatalf("a second new pod got %s: the only address left is the in-flight pod's", resultAddr(t, out))
	}
	if p := ag.pool(t, name); p.PreviousReserved != 1 || p.Free != 0 {
		t.Fatalf("agent's view %+v: want the in-flight address previous-reserved, none free", p)
	}

	// The in-flight ADD answers; the kubelet writes the pod's status seconds later. Its address
	// is adopted like the other old pods'.
	eventually(t, 30*time.Second, "the wrapper to take the gate's opening", openGate)
	a := <-answered
	if a.err != nil {
		t.Fatalf("the in-flight %s ADD: %v: %s", prev.typ, a.err, a.out)
	}
	if got := resultAddr(t, a.out); got != ip(18) {
		t.Fatalf("the in-flight pod got %s from %s, want %s", got, prev.typ, ip(18))
	}
	setPodIP(t, inflight, ip(18))
	eventually(t, 30*time.Second, "the in-flight pod's address to be adopted", func() error {
		if p := ag.pool(t, name); p.Adopted != 3 {
			return fmt.Errorf("agent's view %+v, want 3 adopted", p)
		}
		return nil
	})

	// The pod ends. Its Pod object goes first: the leak collector frees the adopted attachment,
	// but the previous IPAM still holds the reservation (its DEL has not run), and the address
	// stays out of use.
	if err := k8s.Delete(ctx, inflight, client.GracePeriodSeconds(0)); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "the leak collector to free the in-flight pod's adopted attachment", func() error {
		if p := ag.pool(t, name); p.Adopted != 2 {
			return fmt.Errorf("agent's view %+v, want 2 adopted", p)
		}
		return nil
	})
	if out, e := runPlugin(t, cniBinary(t), cniPath, "ADD", newConf, name+"-new-2", podArgs("default", second.Name, string(second.UID))); e == nil {
		t.Fatalf("the second new pod got %s while %s still reserves %s", resultAddr(t, out), prev.typ, ip(18))
	}
	// The runtime's DEL goes through ipwarden's plugin to the previous IPAM, which releases it;
	// the next ADD reads that and gets the address.
	if _, e := runPlugin(t, cniBinary(t), cniPath, "DEL", newConf, cid, podArgs("default", inflight.Name, string(inflight.UID))); e != nil {
		t.Fatalf("DEL of the in-flight pod through ipwarden: %v", e)
	}
	if prev.reserved(t, ip(18)) {
		t.Fatalf("%s still reserves %s after the pod's DEL", prev.typ, ip(18))
	}
	out, e := runPlugin(t, cniBinary(t), cniPath, "ADD", newConf, name+"-new-2", podArgs("default", second.Name, string(second.UID)))
	if e != nil {
		t.Fatalf("ipwarden ADD of the second new pod once %s released %s: %v", prev.typ, ip(18), e)
	}
	if got := resultAddr(t, out); got != ip(18) {
		t.Fatalf("the second new pod got %s, want %s", got, ip(18))
	}
	if p := ag.pool(t, name); p.PreviousReserved != 0 {
		t.Fatalf("agent's view %+v: nothing is previous-reserved any more", p)
	}
	assertDisjoint(t, map[string]addr.Set{node: held(t, node, name)})
}

// resultAddr is the one address of a CNI ADD result.
func resultAddr(t *testing.T, out []byte) string {
	t.Helper()
	var r cniResult
	if err := json.Unmarshal(out, &r); err != nil || len(r.IPs) != 1 {
		t.Fatalf("ADD result %s: %v", out, err)
	}
	return addrOf(t, r.IPs[0].Address).String()
}

// whereaboutsReservationList lists the addresses Whereabouts' IPPool objects reserve for
// Whereabouts (not ipwarden's own allocations).
func whereaboutsReservationList(t *testing.T) []string {
	t.Helper()
	var out []string
	own, _ := whereaboutsAllocations(t)
	for _, r := range own {
		out = append(out, r.IP.String())
	}
	return out
}

// slowedPluginDir writes wrapper into cniPath as the plugin slow, beside links to the previous
// IPAM's plugin (typ, at bin) and ipwarden's, and returns the bridge network configuration
// around an ipam object.
func slowedPluginDir(t *testing.T, cniPath, slow, wrapper, typ, bin string) func(ipam map[string]any) string {
	t.Helper()
	if err := os.WriteFile(filepath.Join(cniPath, slow), []byte(wrapper), 0o755); err != nil {
		t.Fatal(err)
	}
	for n, b := range map[string]string{typ: bin, "ipwarden": cniBinary(t)} {
		if err := os.Symlink(b, filepath.Join(cniPath, n)); err != nil {
			t.Fatal(err)
		}
	}
	return func(ipam map[string]any) string {
		b, _ := json.Marshal(map[string]any{"cniVersion": "1.0.0", "name": "podnet", "type": "bridge", "ipam": ipam})
		return string(b)
	}
}

package integration

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/controlplane"
	"github.com/ipwarden/ipwarden/internal/handback"
	"github.com/ipwarden/ipwarden/internal/localcluster"
	prevpkg "github.com/ipwarden/ipwarden/internal/previous"
)

// slowedIPAM is the previous IPAM of testPreviousSlowedBeforeItsLock: the real plugin and the
// ipam object of the node's configuration before the switch (whose range is .16-.47 of prefix).
type slowedIPAM struct {
	typ    string // its CNI type
	bin    string // the real plugin
	ipam   func(typ string) map[string]any
	prefix string // its /24, e.g. "10.138.0."
	// ipwardens lists the addresses of ipwarden's own entries in its store, sorted.
	ipwardens func(t *testing.T) []string
}

// TestTakeoverWhileAHostLocalADDWaitsForItsLock: a pod's ADD goes through host-local just before
// the node switches to ipwarden, and reaches host-local's lock late (a wrapper holds it before
// host-local runs, as a loaded node would). Meanwhile 20 pods start through ipwarden with
// host-local as "previous", each answered. Then host-local runs: it must pick an address none of
// ipwarden's pods has, since ipwarden made each of them unavailable in host-local's own store
// (a reservation file) before it answered. Real host-local, ipwarden-cni, agent and controller
// processes, real API server; `ipwarden check` is clean after.
func TestTakeoverWhileAHostLocalADDWaitsForItsLock(t *testing.T) {
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	pluginDir := filepath.Join(controlplane.BinDir(root), "test", "cni-"+localcluster.PluginsVersion)
	if err := localcluster.InstallPlugins(pluginDir, os.Stderr, "ipam/host-local"); err != nil {
		t.Fatal(err)
	}
	dataDir := t.TempDir()
	testPreviousSlowedBeforeItsLock(t, "prevres-hl", slowedIPAM{
		typ: "host-local", bin: filepath.Join(pluginDir, "host-local"), prefix: "10.138.0.",
		ipam: func(typ string) map[string]any {
			return map[string]any{"type": typ, "dataDir": dataDir, "ranges": [][]map[string]string{{{"subnet": "10.138.0.0/24",
				"rangeStart": "10.138.0.16", "rangeEnd": "10.138.0.47", "gateway": "10.138.0.1"}}}}
		},
		ipwardens: func(t *testing.T) []string {
			files, err := handback.ReadExisting(filepath.Join(dataDir, "podnet"))
			if err != nil {
				t.Fatal(err)
			}
			var out []netip.Addr
			for a, content := range files {
				if prevpkg.IsOwnHostLocal(content) {
					out = append(out, a)
				}
			}
			return sortedAddrs(out)
		},
	})
}

// TestTakeoverWhileAWhereaboutsADDWaitsForItsLock is TestTakeoverWhileAHostLocalADDWaitsForItsLock
// with Whereabouts (localcluster.WhereaboutsVersion, its CRDs on the real API server) as the
// previous IPAM, held before it reads and updates its IPPool: ipwarden's allocations in that
// IPPool keep it off ipwarden's addresses.
func TestTakeoverWhileAWhereaboutsADDWaitsForItsLock(t *testing.T) {
	ctx := context.Background()
	wb := setUpWhereabouts(ctx, t)
	scratch := t.TempDir()
	flat := filepath.Join(scratch, "whereabouts.conf")
	if err := os.WriteFile(flat, localcluster.WhereaboutsFlatConfig(kubeconfigPath, filepath.Join(scratch, "whereabouts.log"), "debug"), 0o600); err != nil {
		t.Fatal(err)
	}
	testPreviousSlowedBeforeItsLock(t, "prevres-wb", slowedIPAM{
		typ: "whereabouts", bin: wb.Plugin, prefix: "10.139.0.",
		ipam: func(typ string) map[string]any {
			return map[string]any{"type": typ, "range": "10.139.0.0/24", "range_start": "10.139.0.16", "range_end": "10.139.0.47",
				"gateway": "10.139.0.1", "configuration_path": flat}
		},
		ipwardens: func(t *testing.T) []string {
			_, mine := whereaboutsAllocations(t)
			var out []netip.Addr
			for _, r := range mine {
				if strings.HasPrefix(r.IP.String(), "10.139.0.") {
					out = append(out, r.IP)
				}
			}
			return sortedAddrs(out)
		},
	})
}

func testPreviousSlowedBeforeItsLock(t *testing.T, name string, prev slowedIPAM) {
	const news = 20
	ctx := context.Background()
	ip := func(n int) string { return fmt.Sprintf("%s%d", prev.prefix, n) }
	node := name + "-a"
	agentNode(t, node, name)
	// A pool of other addresses selects the node, so the agent serves before the takeover pool
	// exists.
	agentPool(t, name+"-base", name, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{ipwardenv1.CIDR(strings.TrimSuffix(prev.prefix, "0.") + "1.0/28")},
		Scaling: ipwardenv1.Scaling{BatchSize: 2, BufferPercent: 0, MaxPerNode: 16}, ReuseCooldown: cooldown(0)})

	// CNI_PATH: the real previous plugin, ipwarden's, and "<type>-slow", a wrapper that, for an
	// ADD, waits until the test opens the gate and only then runs the previous plugin: the
	// plugin has not taken its lock (host-local's flock, Whereabouts' IPPool update) before.
	cniPath, marks := t.TempDir(), t.TempDir()
	slow := prev.typ + "-slow"
	wrapper := fmt.Sprintf(`#!/bin/sh
# %[1]s whose ADD starts only once %[2]s/gate-<container> is opened.
# The configuration names this wrapper's type; %[1]s gets its own (Whereabouts checks it).
conf=$(/bin/sed 's/"%[1]s-slow"/"%[1]s"/')
if [ "$CNI_COMMAND" = ADD ]; then
	: > %[2]q/started-"$CNI_CONTAINERID"
	/bin/cat %[2]q/gate-"$CNI_CONTAINERID" > /dev/null
fi
printf '%%s' "$conf" | %[3]q
`, prev.typ, marks, prev.bin)
	netconf := slowedPluginDir(t, cniPath, slow, wrapper, prev.typ, prev.bin)
	oldConf, slowConf := netconf(prev.ipam(prev.typ)), netconf(prev.ipam(slow))

	startController(t, "--pool-settle=60s")
	ag := startAgent(t, node, "", "--gc-grace=1s", "--address-wait=10s")
	ag.waitServing(t)
	newConf := netconf(map[string]any{"type": "ipwarden", "socket": ag.socket, "pools": []string{name}, "previous": prev.ipam(prev.typ)})

	// One pod got its address from the previous IPAM before and runs (Whereabouts' IPPool for
	// the range exists from then on, as on any node that ran Whereabouts).
	old := createBoundPod(t, name+"-old", node)
	out, e := runPlugin(t, prev.bin, cniPath, "ADD", oldConf, name+"-old", podArgs("default", old.Name, string(old.UID)))
	if e != nil {
		t.Fatalf("%s ADD: %v", prev.typ, e)
	}
	if got := resultAddr(t, out); got != ip(16) {
		t.Fatalf("the old pod got %s from %s, want %s", got, prev.typ, ip(16))
	}
	setPodIP(t, old, ip(16))
	t.Cleanup(func() {
		_, _ = runPlugin(t, prev.bin, cniPath, "DEL", oldConf, name+"-old", podArgs("default", old.Name, string(old.UID)))
	})

	// ipwarden's pool: the previous IPAM's whole range, address by address (a /28 would keep
	// its first and last address out of the pool).
	var cidrs []ipwardenv1.CIDR
	for n := 16; n <= 47; n++ {
		cidrs = append(cidrs, ipwardenv1.CIDR(ip(n)+"/32"))
	}
	agentPool(t, name, name, ipwardenv1.IPPoolSpec{CIDRs: cidrs,
		Scaling: ipwardenv1.Scaling{BatchSize: 8, BufferPercent: 0, MaxPerNode: 32}, ReuseCooldown: cooldown(0)})
	eventually(t, 30*time.Second, "the old pod's address to be adopted", func() error {
		if p := ag.pool(t, name); p.Adopted != 1 {
			return fmt.Errorf("agent's view %+v, want 1 adopted", p)
		}
		return nil
	})

	// The slowed pod: its ADD goes through the previous IPAM (the configuration before the
	// switch) and waits before the plugin runs.
	slowPod := createBoundPod(t, name+"-slow", node)
	cid := name + "-slow"
	gate, err := localcluster.NewGate(filepath.Join(marks, "gate-"+cid))
	if err != nil {
		t.Fatal(err)
	}
	type answer struct {
		out []byte
		err error
	}
	answered := make(chan answer, 1)
	rctx, cancel := context.WithCancel(ctx)
	t.Cleanup(func() { _ = gate.Open(); cancel() })
	go func() {
		cmd := exec.CommandContext(rctx, filepath.Join(cniPath, slow))
		cmd.Env = []string{"CNI_COMMAND=ADD", "CNI_CONTAINERID=" + cid, "CNI_NETNS=" + filepath.Join(netnsDir, "none"), "CNI_NETNS_OVERRIDE=1",
			"CNI_IFNAME=eth0", "CNI_PATH=" + cniPath, "CNI_ARGS=" + podArgs("default", slowPod.Name, string(slowPod.UID)), localcluster.RaceEnv}
		cmd.Stdin = strings.NewReader(slowConf)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, os.Stderr
		err := cmd.Run()
		answered <- answer{out.Bytes(), err}
	}()
	eventually(t, 30*time.Second, "the previous IPAM's ADD to start", func() error {
		_, err := os.Stat(filepath.Join(marks, "started-"+cid))
		return err
	})

	// The switch: new pods start through ipwarden, with the previous IPAM as "previous", and
	// are answered while the previous IPAM's ADD has not reached its lock.
	given := map[string]string{} // address -> pod
	var pods []*corev1.Pod
	for i := range news {
		p := createBoundPod(t, fmt.Sprintf("%s-new-%d", name, i), node)
		eventually(t, 30*time.Second, "a new pod to get an address through ipwarden", func() error {
			out, e := runPlugin(t, cniBinary(t), cniPath, "ADD", newConf, p.Name, podArgs("default", p.Name, string(p.UID)))
			if e != nil {
				return e // the node may still wait for the controller's grant; the runtime retries
			}
			got := resultAddr(t, out)
			if other, dup := given[got]; dup || got == ip(16) {
				t.Fatalf("ipwarden gave %s to %s, already %s's (or the old pod's)", got, p.Name, other)
			}
			given[got] = p.Name
			return nil
		})
		pods = append(pods, p)
	}
	for _, p := range pods {
		for a, who := range given {
			if who == p.Name {
				setPodIP(t, p, a)
			}
		}
	}
	// Each answered ADD's address is ipwarden's in the previous IPAM's own store.
	if got, want := prev.ipwardens(t), sortedAddrs(addrsOf(t, slices.Collect(maps.Keys(given)))); !slices.Equal(got, want) {
		t.Fatalf("ipwarden's entries in %s's store %v, want the 20 addresses it answered %v", prev.typ, got, want)
	}
	select {
	case a := <-answered:
		t.Fatalf("the previous IPAM's ADD answered before the gate opened: %v %s", a.err, a.out)
	default:
	}

	// The previous IPAM's ADD reaches its lock now: it must pick an address no pod uses.
	eventually(t, 30*time.Second, "the wrapper to take the gate's opening", gate.Open)
	a := <-answered
	if a.err != nil {
		t.Fatalf("the slowed %s ADD: %v: %s", prev.typ, a.err, a.out)
	}
	got := resultAddr(t, a.out)
	if who, dup := given[got]; dup {
		t.Fatalf("%s gave the slowed pod %s, which ipwarden had given to %s", prev.typ, got, who)
	}
	if got == ip(16) {
		t.Fatalf("%s gave the slowed pod %s, the old pod's", prev.typ, got)
	}
	t.Logf("ipwarden gave %d pods %s; %s gave the slowed pod %s", len(given), strings.Join(slices.Sorted(maps.Keys(given)), ","), prev.typ, got)
	setPodIP(t, slowPod, got)
	t.Cleanup(func() {
		_, _ = runPlugin(t, prev.bin, cniPath, "DEL", oldConf, cid, podArgs("default", slowPod.Name, string(slowPod.UID)))
	})
	eventually(t, 30*time.Second, "the slowed pod's address to be adopted", func() error {
		if p := ag.pool(t, name); p.Adopted != 2 {
			return fmt.Errorf("agent's view %+v, want 2 adopted", p)
		}
		return nil
	})
	// ipwarden check over the whole test cluster; this test's findings are those naming its
	// node, its pool or one of its pods.
	r, _, stderr := runCheck(t, "--agent", node+"="+ag.socket)
	for _, f := range r.Findings {
		if slices.Contains(f.Nodes, node) || f.Pool == name || strings.HasPrefix(f.Pod, "default/"+name+"-") {
			t.Errorf("ipwarden check: %+v", f)
		}
	}
	if t.Failed() {
		t.Fatalf("ipwarden check: %s", stderr)
	}

	// The new pods end: their DELs (through ipwarden's plugin, which also runs the previous
	// IPAM's DEL) free their addresses, and the agent removes its entries from the previous
	// IPAM's store once each free is journaled.
	for _, p := range pods {
		if _, e := runPlugin(t, cniBinary(t), cniPath, "DEL", newConf, p.Name, podArgs("default", p.Name, string(p.UID))); e != nil {
			t.Fatalf("DEL of %s: %v", p.Name, e)
		}
	}
	eventually(t, 10*time.Second, "ipwarden's entries to leave the previous IPAM's store", func() error {
		if got := prev.ipwardens(t); len(got) != 0 {
			return fmt.Errorf("ipwarden's entries %v", got)
		}
		return nil
	})
}

func addrsOf(t *testing.T, ss []string) []netip.Addr {
	t.Helper()
	out := make([]netip.Addr, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParseAddr(s)
	}
	return out
}

// sortedAddrs renders as, sorted by address.
func sortedAddrs(as []netip.Addr) []string {
	slices.SortFunc(as, func(x, y netip.Addr) int { return x.Compare(y) })
	out := make([]string, len(as))
	for i, a := range as {
		out[i] = a.String()
	}
	return out
}

package integration

// The node agent's IO edges against the real API server with real agent, controller and plugin
// processes: a damaged journal (truncated, random pages, another version), a lost journal with a
// pod whose status.podIPs was not written yet, CNI GC without a list, an ADD without pod
// identity, a plugin that goes away mid-ADD, and a flood of the agent's socket.

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// edgeSetup makes a pool only node uses (batch 4, no reuse cooldown, so a wrongly freed address
// would be handed out again at once), the node, and a controller.
func edgeSetup(t *testing.T, node, cidr string) {
	t.Helper()
	agentPool(t, node, node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{ipwardenv1.CIDR(cidr)},
		Scaling: ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 64}, ReuseCooldown: cooldown(0)})
	agentNode(t, node, node)
	startController(t)
}

// setPodRunningWithoutIPs marks p Running with no status.podIPs: its ADD was answered but the
// kubelet has not reported the address yet.
func setPodRunningWithoutIPs(t *testing.T, p *corev1.Pod) {
	t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := k8s.Get(context.Background(), client.ObjectKeyFromObject(p), p); err != nil {
			return err
		}
		p.Status = corev1.PodStatus{Phase: corev1.PodRunning}
		return k8s.Status().Update(context.Background(), p)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// Ways to damage a journal file.
var journalDamage = map[string]func(t *testing.T, path string){
	"truncated": func(t *testing.T, path string) {
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(path, fi.Size()/2); err != nil {
			t.Fatal(err)
		}
	},
	"corrupt": func(t *testing.T, path string) { // random bytes over every page after the two meta pages
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		r := rand.New(rand.NewPCG(12, 34))
		for i := 2 * os.Getpagesize(); i < len(b); i++ {
			b[i] = byte(r.Uint32())
		}
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
	},
	"incompatible_version": func(t *testing.T, path string) { // a journal format this agent does not read
		db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		if err := db.Update(func(tx *bolt.Tx) error { return tx.Bucket([]byte("meta")).Put([]byte("format"), []byte("99")) }); err != nil {
			t.Fatal(err)
		}
	},
}

// A damaged journal never crashes the agent: it starts, moves the file aside (log line, metric,
// Warning event on the NodeIPAllocation), rebuilds the running pod's attachment from its
// status.podIPs, and never hands that address to another pod.
func TestAgentRecoversDamagedJournal(t *testing.T) {
	for i, reason := range []string{"truncated", "corrupt", "incompatible_version"} {
		t.Run(reason, func(t *testing.T) {
			node := "journal-" + strings.ReplaceAll(reason, "_", "-")
			edgeSetup(t, node, fmt.Sprintf("10.140.%d.0/24", i))
			ag := startAgent(t, node, "")
			ag.waitServing(t)
			conf := pluginConf("1.1.0", ag.socket)
			web := createBoundPod(t, node+"-web", node)
			ip := addFor(t, conf, "sandbox-web", web)
			setPodIP(t, web, addrOf(t, ip).String())
			for j := range 20 { // more records, so the file spans more pages
				mustAdd(t, conf, fmt.Sprintf("%s-%d", node, j))
			}
			ag.kill()
			path := filepath.Join(ag.stateDir, "journal.db")
			journalDamage[reason](t, path)

			ag.start(t)
			ag.waitServing(t)
			if !ag.logContains("the journal is damaged: moved it aside") || !ag.logContains(`"reason":"`+reason+`"`) {
				t.Fatal("no log line naming the damage")
			}
			aside, _ := filepath.Glob(path + ".damaged-*")
			if len(aside) != 1 {
				t.Fatalf("damaged files kept: %v", aside)
			}
			if v := ag.metric(t, `ipwarden_agent_journal_recovered_total{reason="`+reason+`"}`); v != 1 {
				t.Fatalf("journal_recovered_total{reason=%q} = %v", reason, v)
			}
			waitEvent(t, "JournalRecovered", "NodeIPAllocation", node, "", reason)
			resp, err := ag.list(t)
			if err != nil {
				t.Fatal(err)
			}
			var rebuilt []string
			for _, a := range resp.Attachments {
				if a.Rebuilt && a.Pod.UID == string(web.UID) {
					rebuilt = append(rebuilt, a.IPs[0].Address)
				}
			}
			if !slices.Equal(rebuilt, []string{ip}) {
				t.Fatalf("rebuilt attachments of the running pod: %v, want [%s]", rebuilt, ip)
			}
			for j := range 24 {
				if got := mustAdd(t, conf, fmt.Sprintf("after-%d", j)).IPs[0].Address; got == ip {
					t.Fatalf("handed the running pod's address %s to another attachment", got)
				}
			}
		})
	}
}

// The lost journal: pod web's ADD was answered, the kubelet has not written its status.podIPs,
// and the journal is lost. After the rebuild no record shows web's address, so the agent holds
// every held address of unknown owner out of use (LIST and metrics show it) while it serves new
// pods from addresses the controller grants; once web reports its address, the agent records it
// and frees the rest. web's address never goes to another pod.
func TestAgentHoldsAddressOfUnreportedPod(t *testing.T) {
	const node = "hold-unreported"
	edgeSetup(t, node, "10.141.0.0/24")
	// Its state directory is lost below: the new one is a new holder, which waits for the old
	// Lease to expire (short timings here; the default is 60s).
	short := []string{"--lease-duration=6s", "--lease-renew-interval=2s"}
	ag := startAgent(t, node, "", short...)
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	web := createBoundPod(t, "hold-web", node)
	ip := addFor(t, conf, "sandbox-web", web)
	setPodRunningWithoutIPs(t, web)
	held := ag.pool(t, node).Held

	ag.kill()
	if err := os.RemoveAll(ag.stateDir); err != nil {
		t.Fatal(err)
	}
	ag.start(t, append(short, "--rebuild-hold=10m")...)
	ag.waitServing(t)
	resp, err := ag.list(t)
	if err != nil {
		t.Fatal(err)
	}
	if resp.Hold == nil || resp.Hold.Addresses != held || !slices.Contains(resp.Hold.WaitingFor, "default/hold-web") {
		t.Fatalf("after losing the journal: hold %+v, want %d addresses waiting for default/hold-web", resp.Hold, held)
	}
	if p := ag.pool(t, node); p.Unattributed != held {
		t.Fatalf("pool during the hold: %+v, want %d unattributed", p, held)
	}
	if v := ag.metric(t, `ipwarden_agent_pool_unattributed_addresses{pool="`+node+`"}`); v != float64(held) {
		t.Fatalf("pool_unattributed_addresses = %v", v)
	}
	if v := ag.metric(t, "ipwarden_agent_unattributed_hold_active"); v != 1 {
		t.Fatalf("unattributed_hold_active = %v", v)
	}
	// New pods are served, from addresses granted after the loss.
	for j := range 6 {
		if got := mustAdd(t, conf, fmt.Sprintf("new-%d", j)).IPs[0].Address; got == ip {
			t.Fatalf("during the hold, handed the unreported pod's address %s to another attachment", got)
		}
	}
	// A restart during the hold resumes it, although the journal is no longer empty.
	ag.restart(t, "--rebuild-hold=10m")
	ag.waitServing(t)
	if resp, err := ag.list(t); err != nil || resp.Hold == nil || !slices.Contains(resp.Hold.WaitingFor, "default/hold-web") {
		t.Fatalf("after a restart during the hold: %v %+v", err, resp)
	}
	for j := range 6 {
		if got := mustAdd(t, conf, fmt.Sprintf("resumed-%d", j)).IPs[0].Address; got == ip {
			t.Fatalf("after a restart during the hold, handed the unreported pod's address %s to another attachment", got)
		}
	}
	// web reports its address: recorded, and the hold ends.
	setPodIP(t, web, addrOf(t, ip).String())
	eventually(t, 20*time.Second, "the hold to end", func() error {
		resp, err := ag.list(t)
		if err != nil {
			return err
		}
		if resp.Hold != nil {
			return fmt.Errorf("hold %+v", resp.Hold)
		}
		return nil
	})
	resp, _ = ag.list(t)
	found := false
	for _, a := range resp.Attachments {
		found = found || (a.Rebuilt && a.Pod.UID == string(web.UID) && a.IPs[0].Address == ip)
	}
	if !found {
		t.Fatalf("web's address is not recorded after it reported it: %+v", resp.Attachments)
	}
	if !ag.logContains("unattributed hold ended") || ag.metric(t, "ipwarden_agent_unattributed_hold_active") != 0 {
		t.Fatal("the end of the hold is not logged or not in the metric")
	}
	if _, err := os.Stat(filepath.Join(ag.stateDir, "rebuild-hold")); !os.IsNotExist(err) {
		t.Fatalf("hold marker after the hold: %v", err)
	}
	for j := range 12 {
		if got := mustAdd(t, conf, fmt.Sprintf("later-%d", j)).IPs[0].Address; got == ip {
			t.Fatalf("after the hold, handed web's address %s to another attachment", got)
		}
	}
}

// CNI GC without cni.dev/valid-attachments (as `cnitool gc` sends it) frees nothing and says so;
// with a list, an unlisted attachment whose pod the API server still shows is kept.
func TestAgentCNIGCWithoutListAndLivePods(t *testing.T) {
	const node = "gc-nolist"
	edgeSetup(t, node, "10.142.0.0/24")
	ag := startAgent(t, node, "", "--gc-grace=0s", "--gc-full-check-interval=1h")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	live := createBoundPod(t, "gc-nolist-live", node)
	addFor(t, conf, "live", live)
	for _, cid := range []string{"g1", "g2", "g3"} {
		mustAdd(t, conf, cid) // pods pod-g1.. do not exist
	}
	_, e := cni(t, "GC", conf, "", "")
	if e == nil || e.Code != 7 || !strings.Contains(e.Msg, "without cni.dev/valid-attachments frees nothing") {
		t.Fatalf("GC without a list: %+v", e)
	}
	if got := ag.attachmentIDs(t); !slices.Equal(got, []string{"g1", "g2", "g3", "live"}) {
		t.Fatalf("after GC without a list: %v", got)
	}
	// The runtime lists only g1: g2 and g3 (pods gone) are freed, live (pod exists) is kept.
	if _, e := cni(t, "GC", strings.TrimSuffix(conf, "}")+`,"cni.dev/valid-attachments":[{"containerID":"g1","ifname":"eth0"}]}`, "", ""); e != nil {
		t.Fatalf("GC: %v", e)
	}
	if got := ag.attachmentIDs(t); !slices.Equal(got, []string{"g1", "live"}) {
		t.Fatalf("after GC: %v, want g1 live", got)
	}
	if v := ag.metric(t, `ipwarden_agent_gc_kept_total{path="cni-gc"}`); v != 1 {
		t.Fatalf("gc_kept_total{cni-gc} = %v", v)
	}
}

// An ADD whose CNI_ARGS carry no pod identity is refused with CNI error 7 naming what is missing,
// unless the configuration says allowNonKubernetes.
func TestAgentRefusesADDWithoutIdentity(t *testing.T) {
	const node = "add-noid"
	edgeSetup(t, node, "10.143.0.0/24")
	ag := startAgent(t, node, "")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	_, e := cni(t, "ADD", conf, "anon", "")
	if e == nil || e.Code != 7 || !strings.Contains(e.Msg, "lacks K8S_POD_NAMESPACE and K8S_POD_NAME") {
		t.Fatalf("ADD without identity: %+v", e)
	}
	if got := ag.attachmentIDs(t); len(got) != 0 {
		t.Fatalf("a refused ADD left attachments %v", got)
	}
	allow := strings.Replace(conf, `"type":"ipwarden"`, `"type":"ipwarden","allowNonKubernetes":true`, 1)
	if r, e := cni(t, "ADD", allow, "anon", ""); e != nil || len(r.IPs) != 1 {
		t.Fatalf("ADD with allowNonKubernetes: %v", e)
	}
	// A too-long container ID is named as such.
	long := strings.Repeat("a", 300)
	_, e = cni(t, "ADD", conf, long, podArgs("default", "p", "u"))
	if e == nil || !strings.Contains(e.Msg, "container ID (CNI_CONTAINERID) too long (300 bytes, at most 256)") {
		t.Fatalf("ADD with a 300-byte container ID: %+v", e)
	}
}

// A plugin that goes away while its ADD waits for addresses (the runtime killed it) cancels the
// ADD: when an address frees up later, it is not taken for the abandoned sandbox.
func TestAgentDropsADDWhosePluginWentAway(t *testing.T) {
	const node = "add-abandoned"
	agentPool(t, node, node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.144.0.0/24"},
		Scaling: ipwardenv1.Scaling{BatchSize: 1, BufferPercent: 0, MaxPerNode: 1}, ReuseCooldown: cooldown(0)})
	agentNode(t, node, node)
	startController(t)
	ag := startAgent(t, node, "", "--address-wait=5m")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	mustAdd(t, conf, "first") // the node's only address

	cmd := exec.Command(cniBinary(t))
	cmd.Env = []string{"CNI_COMMAND=ADD", "CNI_CONTAINERID=abandoned", "CNI_NETNS=/var/run/netns/none", "CNI_IFNAME=eth0",
		"CNI_PATH=/opt/cni/bin", "CNI_ARGS=" + podArgs("default", "pod-abandoned", "uid-abandoned"), localcluster.RaceEnv}
	cmd.Stdin = strings.NewReader(conf)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	ag.waitMetric(t, 10*time.Second, "ipwarden_agent_socket_connections", 1)
	// The runtime kills the plugin.
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	eventually(t, 10*time.Second, "the agent to drop the abandoned ADD", func() error {
		if v := ag.metric(t, "ipwarden_agent_socket_connections"); v != 0 {
			return fmt.Errorf("%v connections", v)
		}
		return nil
	})
	mustDel(t, conf, "first")
	if got := ag.attachmentIDs(t); len(got) != 0 {
		t.Fatalf("attachments after the abandoned ADD and the DEL: %v", got)
	}
	mustAdd(t, conf, "next") // the freed address serves the next pod
}

// A flood of the agent's socket: 1,000 connections that send nothing and 200 requests of 15 MiB
// each. The agent stays within a fraction of its 256Mi limit, logs nothing unbounded, answers the
// oversized requests with an error naming the limit, and serves an ADD afterwards.
func TestAgentSocketFlood(t *testing.T) {
	const node = "socket-flood"
	edgeSetup(t, node, "10.145.0.0/24")
	ag := startAgentBinary(t, plainIpwardenBinary(t), node, "") // its memory is measured: no race runtime
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	mustAdd(t, conf, "before")
	t.Logf("agent peak RSS (VmHWM) before the flood: %.1f MiB", float64(peakRSS(t, ag.cmd.Process.Pid))/(1<<20))

	var idle []net.Conn
	dialErrs := 0
	for range 1000 {
		c, err := net.DialTimeout("unix", ag.socket, time.Second)
		if err != nil {
			dialErrs++
			continue
		}
		idle = append(idle, c)
	}
	defer func() {
		for _, c := range idle {
			c.Close()
		}
	}()
	big := make([]byte, 15<<20)
	prefix := `{"version":1,"op":"ADD","containerID":"`
	copy(big, prefix)
	for i := len(prefix); i < len(big); i++ {
		big[i] = 'x'
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	answers := map[string]int{}
	for range 200 {
		wg.Go(func() {
			c, err := net.DialTimeout("unix", ag.socket, 10*time.Second)
			if err != nil {
				mu.Lock()
				answers["dial: "+err.Error()]++
				mu.Unlock()
				return
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(60 * time.Second))
			go func() { _, _ = c.Write(big) }()
			var resp cniproto.Response
			msg := "no answer"
			if err := json.NewDecoder(c).Decode(&resp); err == nil && resp.Error != nil {
				msg = resp.Error.Msg
			}
			mu.Lock()
			answers[msg]++
			mu.Unlock()
		})
	}
	wg.Wait()
	for _, c := range idle {
		c.Close()
	}
	t.Logf("answers to 200 requests of 15 MiB: %v; %d of 1000 idle connections could not connect", answers, dialErrs)
	if answers["ipwarden agent: request larger than 65536 bytes"] == 0 {
		t.Fatalf("no oversized request was refused as such: %v", answers)
	}
	peak := peakRSS(t, ag.cmd.Process.Pid)
	t.Logf("agent peak RSS (VmHWM) after the flood: %.1f MiB", float64(peak)/(1<<20))
	if peak > 128<<20 {
		t.Fatalf("agent peak RSS %d bytes, more than half the DaemonSet's 256Mi limit", peak)
	}
	fi, err := os.Stat(ag.log)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("agent log: %d bytes", fi.Size())
	if fi.Size() > 4<<20 {
		t.Fatalf("agent log is %d bytes after the flood", fi.Size())
	}
	eventually(t, 30*time.Second, "an ADD after the flood", func() error {
		if _, e := cni(t, "ADD", conf, "after", podArgs("default", "pod-after", "uid-after")); e != nil {
			return e
		}
		return nil
	})
}

// peakRSS reads a process's peak resident set size (VmHWM) from /proc.
func peakRSS(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "VmHWM:" && f[2] == "kB" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatal("no VmHWM in /proc status")
	return 0
}

// A stopped agent (SIGSTOP): the plugin gives up after its own timeout (30 s for DEL, below
// containerd's and CRI-O's 1 min) with CNI error 11 saying so, instead of being killed by the
// runtime.
func TestPluginGivesUpOnAStoppedAgent(t *testing.T) {
	const node = "agent-stopped"
	edgeSetup(t, node, "10.146.0.0/24")
	ag := startAgent(t, node, "")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	mustAdd(t, conf, "a")
	ag.proc.Pause()
	defer ag.proc.Resume()
	start := time.Now()
	_, e := cni(t, "DEL", conf, "a", podArgs("default", "pod-a", "uid-a"))
	took := time.Since(start)
	// The plugin hears no heartbeat for cniproto.Silence (10s) and gives up within that plus 1 s
	// (its own start included), well before its own DEL timeout (30s) and the runtimes'.
	if e == nil || e.Code != 11 || !strings.Contains(e.Msg, ag.socket) || !strings.Contains(e.Msg, "nothing for 10s") {
		t.Fatalf("DEL to a stopped agent: %+v after %s", e, took)
	}
	if bound := cniproto.Silence + time.Second; took > bound {
		t.Fatalf("the plugin gave up on the stopped agent after %s, more than its silence bound %s plus 1 s", took, cniproto.Silence)
	}
	t.Logf("the plugin gave up on the stopped agent after %s (silence bound %s)", took, cniproto.Silence)
	ag.proc.Resume()
	mustDel(t, conf, "a")
}

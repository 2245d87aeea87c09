package integration

// One agent per node (the node's Lease) and an agent that starts while the API server is away:
// real agent, controller and plugin processes on the real API server.

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	cnitypes "github.com/containernetworking/cni/pkg/types"
	coordinationv1 "k8s.io/api/coordination/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/controlplane"
)

// stop sends SIGTERM, as the kubelet does, and waits for the agent to exit.
func (a *agentProcess) stop(t *testing.T) {
	t.Helper()
	_ = syscall.Kill(a.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-a.done:
	case <-time.After(30 * time.Second):
		t.Fatal("the agent did not stop within 30s of SIGTERM")
	}
}

// identity returns the Lease identity the agent keeps in its state directory.
func (a *agentProcess) identity(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(a.stateDir, "agent-id"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func (a *agentProcess) logCount(s string) int {
	b, _ := os.ReadFile(a.log)
	return bytes.Count(b, []byte(s))
}

// Two agents for one node with separate journals and sockets: the first holds the node's Lease
// and serves; the second refuses ADD naming the first, publishes nothing, and takes over only when
// the first stops. No address is handed to two pods.
func TestAgentOneAgentPerNode(t *testing.T) {
	const node = "lease-node"
	gcSetup(t, node, "10.140.0.0/24")
	first := startAgent(t, node, "")
	first.waitServing(t)
	firstConf := pluginConf("1.1.0", first.socket)
	second := startAgent(t, node, "")
	secondConf := pluginConf("1.1.0", second.socket)

	eventually(t, 30*time.Second, "the second agent to refuse, naming the first", func() error {
		if !second.logContains("another agent holds the node's Lease") || !second.logContains(first.identity(t)) {
			return fmt.Errorf("not logged yet")
		}
		return nil
	})
	handed := map[string]string{}
	for i := range 4 {
		p := createBoundPod(t, fmt.Sprintf("lease-pod-%d", i), node)
		ip := addFor(t, firstConf, fmt.Sprintf("first-%d", i), p)
		setPodIP(t, p, strings.Split(ip, "/")[0])
		handed[ip] = p.Name
		_, e := cni(t, "ADD", secondConf, fmt.Sprintf("second-%d", i), podArgs(p.Namespace, p.Name+"-b", "uid-b"))
		if e == nil || e.Code != 11 || !strings.Contains(e.Msg, first.identity(t)) || !strings.Contains(e.Msg, "Lease") {
			t.Fatalf("ADD through the second agent: %+v; want code 11 naming %s", e, first.identity(t))
		}
	}
	if ids := second.attachmentIDs(t); len(ids) != 0 {
		t.Fatalf("the second agent recorded attachments %v", ids)
	}
	if second.logContains("published request") {
		t.Fatal("the second agent published the node's request")
	}

	// The first stops (SIGTERM gives the Lease up): the second takes over, rebuilds the running
	// pods' attachments from their status and hands out only other addresses.
	first.stop(t)
	second.waitServing(t)
	for i := range 4 {
		p := createBoundPod(t, fmt.Sprintf("lease-next-%d", i), node)
		ip := addFor(t, secondConf, fmt.Sprintf("next-%d", i), p)
		if owner, dup := handed[ip]; dup {
			t.Fatalf("%s handed to %s by the second agent, and to %s by the first", ip, p.Name, owner)
		}
		handed[ip] = p.Name
	}
}

// Restarted while the API server is down, the agent serves from its journal: DEL, and ADD from
// the free addresses it holds, through the real plugin. It stays up (no crash loop), and an agent
// with a new journal says that it waits for the API server. When the API server returns, the
// agent reconciles and publishes the request its new attachments need.
func TestAgentStartsWithoutAPIServer(t *testing.T) {
	const node = "offline-node"
	agentPool(t, node, node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.141.0.0/24"},
		Scaling: ipwardenv1.Scaling{BatchSize: 8, BufferPercent: 100, MaxPerNode: 64}, ReuseCooldown: cooldown(0)})
	agentNode(t, node, node)
	startController(t)
	ag := startAgent(t, node, "")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	before := map[string]string{}
	for i := range 3 {
		cid := fmt.Sprintf("on-%d", i)
		before[cid] = mustAdd(t, conf, cid).IPs[0].Address
	}
	eventually(t, 20*time.Second, "16 held, 13 free", func() error {
		if p := ag.pool(t, node); p.Held != 16 || p.Free != 13 {
			return fmt.Errorf("held %d free %d", p.Held, p.Free)
		}
		return nil
	})

	if err := controlPlane.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	restarted := false
	t.Cleanup(func() {
		if !restarted {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			_ = controlPlane.RestartAPIServer(ctx)
		}
	})
	ag.restart(t)
	ag.waitServing(t)
	mustDel(t, conf, "on-0")
	for cid, want := range before {
		if cid == "on-0" {
			continue
		}
		if got := mustAdd(t, conf, cid).IPs[0].Address; got != want {
			t.Fatalf("repeated ADD %s during the outage gave %s, before %s", cid, got, want)
		}
	}
	for i := range 7 {
		r := mustAdd(t, conf, fmt.Sprintf("off-%d", i))
		for cid, ip := range before {
			if cid != "on-0" && ip == r.IPs[0].Address {
				t.Fatalf("ADD during the outage handed out %s, which %s holds", ip, cid)
			}
		}
	}

	fresh := startAgent(t, "offline-fresh", "")
	eventually(t, 30*time.Second, "the agent with a new journal to say it waits for the API server", func() error {
		_, e := cni(t, "ADD", pluginConf("1.1.0", fresh.socket), "f0", podArgs("default", "f0", "uid-f0"))
		if e == nil {
			t.Fatal("an agent with a new journal served ADD while the API server was down")
		}
		if e.Code != 11 || !strings.Contains(e.Msg, "waiting for the API server") {
			return fmt.Errorf("error %+v", e)
		}
		return nil
	})
	// No crash loop: both stay up while they keep retrying (the old agent exited every ~12s).
	eventually(t, 60*time.Second, "the agents to retry the API server for 20s without exiting", func() error {
		for _, a := range []*agentProcess{ag, fresh} {
			select {
			case <-a.done:
				t.Fatalf("agent %s exited while the API server was down", a.node)
			default:
			}
		}
		if n := ag.logCount("waiting for the API server; serving from the journal meanwhile"); n < 3 {
			return fmt.Errorf("logged %d times", n)
		}
		return nil
	})

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := controlPlane.RestartAPIServer(ctx); err != nil {
		t.Fatal(err)
	}
	restarted = true
	eventually(t, 60*time.Second, "the agent to reconcile", func() error {
		if !ag.logContains("reconciled with the API server") {
			return fmt.Errorf("not yet")
		}
		return nil
	})
	// 9 attachments (2 from before, 7 made offline), batch 8, buffer 100%: 24.
	eventually(t, 60*time.Second, "the request to catch up", func() error {
		if n, _ := requested(t, node, node); n != 24 {
			return fmt.Errorf("requested %d", n)
		}
		return nil
	})
	if p := ag.pool(t, node); p.InUse != 9 {
		t.Fatalf("in use %d after catching up, want 9", p.InUse)
	}
}

// An agent that loses the node's Lease (here another holder writes itself in, as a second agent
// would after the first stalled past the Lease) stops serving ADD within a renewal period, names
// the new holder, and serves again once the Lease is free. DEL keeps working throughout.
func TestAgentStopsServingWhenItLosesTheLease(t *testing.T) {
	const node = "lease-lost"
	gcSetup(t, node, "10.144.0.0/24")
	// A holder sees another holder at its next renewal: renew every 2s here (default 15s).
	ag := startAgent(t, node, "", "--lease-renew-interval=2s", "--lease-duration=6s")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	mustAdd(t, conf, "before")

	setHolder := func(holder string) { t.Helper(); setAgentLeaseHolder(t, node, holder) }
	setHolder("intruder-1")
	eventually(t, 10*time.Second, "ADD to be refused naming the new holder", func() error {
		_, e := cni(t, "ADD", conf, "during", podArgs("default", "pod-during", "uid-during"))
		if e == nil {
			mustDel(t, conf, "during")
			return fmt.Errorf("ADD still served")
		}
		if e.Code != 11 || !strings.Contains(e.Msg, "intruder-1") {
			t.Fatalf("ADD after losing the Lease: %+v", e)
		}
		return nil
	})
	mustDel(t, conf, "before")
	setHolder("")
	eventually(t, 10*time.Second, "ADD to be served again", func() error {
		if _, e := cni(t, "ADD", conf, "after", podArgs("default", "pod-after", "uid-after")); e != nil {
			return e
		}
		return nil
	})
}

// setAgentLeaseHolder writes holder ("": none) into node's agent Lease, as another agent taking
// it would.
func setAgentLeaseHolder(t *testing.T, node, holder string) {
	t.Helper()
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		l := &coordinationv1.Lease{}
		if err := k8s.Get(context.Background(), client.ObjectKey{Namespace: controlplane.ControllerNamespace, Name: "ipwarden-agent-" + node}, l); err != nil {
			return err
		}
		if holder == "" {
			l.Spec.HolderIdentity = nil
		} else {
			l.Spec.HolderIdentity = &holder
		}
		return k8s.Update(context.Background(), l)
	}); err != nil {
		t.Fatal(err)
	}
}

// An ADD already waiting for addresses (the pool is full) when the agent sees another holder of
// the node's Lease fails at once with the refusal naming it, never later with an address: the
// machine asks the gate at every attempt, not once before the wait (issue 35).
func TestAgentWaitingAddRefusedWhenItLosesTheLease(t *testing.T) {
	const node = "lease-lost-waiting"
	gcSetup(t, node, "10.147.0.0/29") // six addresses
	ag := startAgent(t, node, "", "--lease-renew-interval=1s", "--lease-duration=6s", "--address-wait=60s")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	for i := range 6 {
		mustAdd(t, conf, fmt.Sprintf("full-%d", i))
	}
	type outcome struct {
		e     *cnitypes.Error
		after time.Duration
	}
	done := make(chan outcome, 1)
	start := time.Now()
	go func() {
		_, e := cni(t, "ADD", conf, "waiting", podArgs("default", "pod-waiting", "uid-waiting"))
		done <- outcome{e, time.Since(start)}
	}()
	select {
	case o := <-done:
		t.Fatalf("the seventh ADD on a full pool did not wait: %+v", o.e)
	case <-time.After(3 * time.Second):
	}
	setAgentLeaseHolder(t, node, "intruder-2")
	select {
	case o := <-done:
		if o.e == nil || o.e.Code != 11 || !strings.Contains(o.e.Msg, "intruder-2") {
			t.Fatalf("the waiting ADD after the agent lost its Lease: %+v, want code 11 naming intruder-2", o.e)
		}
		t.Logf("the waiting ADD was refused %v after it started", o.after.Round(time.Millisecond))
	case <-time.After(20 * time.Second):
		t.Fatal("the waiting ADD was still waiting 20s after another agent took the Lease (--address-wait is 60s)")
	}
}

// A second agent for the node configured with the same socket path does not take the socket
// from the agent serving on it: it waits, saying so, and the first keeps serving.
func TestAgentSecondAgentLeavesTheSocketAlone(t *testing.T) {
	const node = "lease-socket"
	gcSetup(t, node, "10.145.0.0/24")
	first := startAgent(t, node, "")
	first.waitServing(t)
	second := &agentProcess{node: node, socket: first.socket, stateDir: t.TempDir(), metrics: freeAddr(t)}
	second.start(t)
	eventually(t, 20*time.Second, "the second agent to say that the socket is in use", func() error {
		if !second.logContains("another process answers on the agent's socket") {
			return fmt.Errorf("not logged yet")
		}
		return nil
	})
	conf := pluginConf("1.1.0", first.socket)
	mustAdd(t, conf, "still-first")
	if ids := first.attachmentIDs(t); len(ids) != 1 || ids[0] != "still-first" {
		t.Fatalf("the first agent's attachments %v: the socket was taken over", ids)
	}
	select {
	case <-second.done:
		t.Fatal("the second agent exited")
	default:
	}
}

// An agent paused (SIGSTOP) past its Lease while a second agent for the node takes it over never
// serves an ADD after it resumes: its permit ran out, so it re-checks the Lease first and refuses,
// naming the new holder. (Short Lease timings here; the defaults are 60s and 15s.)
func TestAgentPausedPastItsLeaseRechecksBeforeServing(t *testing.T) {
	const node = "lease-paused"
	gcSetup(t, node, "10.145.0.0/24")
	timing := []string{"--lease-duration=3s", "--lease-renew-interval=1s"}
	first := startAgent(t, node, "", timing...)
	first.waitServing(t)
	firstConf := pluginConf("1.1.0", first.socket)
	second := startAgent(t, node, "", timing...)
	secondConf := pluginConf("1.1.0", second.socket)
	eventually(t, 30*time.Second, "the second agent to wait for the first's Lease", func() error {
		if !second.logContains("another agent holds the node's Lease") {
			return fmt.Errorf("not logged yet")
		}
		return nil
	})

	first.proc.Pause()
	second.waitServing(t)
	p := createBoundPod(t, "lease-paused-pod", node)
	ip := addFor(t, secondConf, "second", p)
	first.proc.Resume()
	q := createBoundPod(t, "lease-paused-late", node)
	r, e := cni(t, "ADD", firstConf, "first-after", podArgs(q.Namespace, q.Name, string(q.UID)))
	if e == nil {
		t.Fatalf("the resumed agent served an ADD (%v) after another agent took its Lease (which handed out %s)", r.IPs, ip)
	}
	if e.Code != 11 || !strings.Contains(e.Msg, second.identity(t)) {
		t.Fatalf("ADD through the resumed agent: %+v; want code 11 naming %s", e, second.identity(t))
	}
}

package integration

// Issue 35 on real processes: the node's own evidence beats hints. A lost journal on a node whose
// pods have a secondary network (net1) and a stale status after a re-created sandbox, through the
// real agent, controller, API server and ipwarden-cni.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
)

// setMultusStatus writes what Multus writes on a pod after its ADDs: the networks annotation and
// network-status listing eth0 on the default network and net1 on "storage".
func setMultusStatus(t *testing.T, p *corev1.Pod, eth0, net1 netip.Addr) {
	t.Helper()
	status, _ := json.Marshal([]map[string]any{
		{"name": "ipwarden", "interface": "eth0", "ips": []string{eth0.String()}, "default": true},
		{"name": "default/storage", "interface": "net1", "ips": []string{net1.String()}},
	})
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := k8s.Get(context.Background(), client.ObjectKeyFromObject(p), p); err != nil {
			return err
		}
		if p.Annotations == nil {
			p.Annotations = map[string]string{}
		}
		p.Annotations["k8s.v1.cni.cncf.io/networks"] = "storage"
		p.Annotations["k8s.v1.cni.cncf.io/network-status"] = string(status)
		return k8s.Update(context.Background(), p)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// Path 1: six pods each have eth0 on the pod network and net1 on "storage"; status.podIPs shows
// eth0 only. The agent stops cleanly and its journal is removed. After the restart six new pods'
// net1 ADDs must not get a running pod's net1 address. Before issue 35 all six did: the rebuild
// attached eth0 from status.podIPs, and any reported address settled a pod for every pool. With
// Multus' annotations the running pods' net1 addresses are attached from network-status; without
// them the storage pool's addresses of unknown owner stay held until --rebuild-hold.
func TestLostJournalWithASecondaryNetwork(t *testing.T) {
	for _, multus := range []bool{true, false} {
		name := "without-multus-annotations"
		if multus {
			name = "with-multus-annotations"
		}
		t.Run(name, func(t *testing.T) {
			node := "lost-net1-" + map[bool]string{true: "m", false: "p"}[multus]
			base := map[bool]int{true: 172, false: 174}[multus]
			scale := ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 32}
			agentPool(t, node+"-pod", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{ipwardenv1.CIDR(fmt.Sprintf("10.%d.0.0/24", base))},
				Scaling: scale, ReuseCooldown: cooldown(0)})
			agentPool(t, node+"-storage", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{ipwardenv1.CIDR(fmt.Sprintf("10.%d.0.0/24", base+1))},
				Network: "storage", Scaling: scale, ReuseCooldown: cooldown(0)})
			agentNode(t, node, node)
			startController(t)
			args := []string{"--address-wait=10s", "--lease-duration=6s", "--lease-renew-interval=2s"}
			ag := startAgent(t, node, "", args...)
			ag.waitServing(t)
			podConf := pluginConf("1.1.0", ag.socket)
			storageConf := networkConf(ag.socket, "storage-net", "storage")
			rt := &runtimeRecord{t: t, live: map[string]netip.Addr{}}
			add := func(conf, network, cid, ifname string, p *corev1.Pod) netip.Addr {
				t.Helper()
				res, e := cniIf(t, "ADD", conf, cid, ifname, podArgs(p.Namespace, p.Name, string(p.UID)))
				if e != nil {
					t.Fatalf("ADD %s/%s: %v", cid, ifname, e)
				}
				return rt.answered(network, cid, ifname, res)
			}
			for i := range 6 {
				p := createBoundPod(t, fmt.Sprintf("%s-old-%d", node, i), node)
				cid := fmt.Sprintf("old-%d", i)
				eth0 := add(podConf, "pod", cid, "eth0", p)
				net1 := add(storageConf, "storage", cid, "net1", p)
				setPodIP(t, p, eth0.String()) // the kubelet reports eth0 only
				if multus {
					setMultusStatus(t, p, eth0, net1)
				}
			}
			// A replaced disk: the agent stops cleanly, its journal goes.
			ag.stop(t)
			if err := os.Remove(filepath.Join(ag.stateDir, "journal.db")); err != nil {
				t.Fatal(err)
			}
			ag.start(t, args...)
			ag.waitServing(t)
			resp, err := ag.list(t)
			if err != nil {
				t.Fatal(err)
			}
			attached := map[netip.Addr]bool{}
			for _, at := range resp.Attachments {
				for _, ip := range at.IPs {
					attached[addrOf(t, ip.Address)] = true
				}
			}
			for k, a := range rt.live {
				onStorage := strings.HasPrefix(k, "storage/")
				if !onStorage || multus {
					if !attached[a] {
						t.Errorf("after the journal was lost, running %s (%s) is not attached again", k, a)
					}
				} else if attached[a] {
					t.Errorf("%s (%s) was attached from nothing the node reported", k, a)
				}
			}
			if !multus && (resp.Hold == nil || resp.Hold.Addresses == 0) {
				t.Errorf("without network-status the storage pool's addresses must stay held: hold %+v", resp.Hold)
			}
			// Six new pods, eth0 and net1 each: rt.answered fails on a running pod's address.
			for i := range 6 {
				p := createBoundPod(t, fmt.Sprintf("%s-new-%d", node, i), node)
				cid := fmt.Sprintf("new-%d", i)
				add(podConf, "pod", cid, "eth0", p)
				add(storageConf, "storage", cid, "net1", p)
			}
			if r, code, stderr := runCheck(t); code != 0 {
				t.Fatalf("ipwarden check exit %d: %+v\n%s", code, r.Findings, stderr)
			}
			if !ag.logContains("runtimeAsked") {
				t.Error("the agent's log does not say whether it asked the runtime for the node's sandboxes")
			}
		})
	}
}

// Path 3: a pod's first sandbox got X (its status shows X) and ended with its DEL; the new
// sandbox got Y, journaled; the node gave X back (the pool is exhausted, so every spare goes back
// at once). The agent is SIGKILLed and restarts before the kubelet updates the status. The
// journal attaches the pod to Y on the pod network, so the stale X gets no second attachment and
// is never claimed. Before issue 35 the agent recorded X for the pod from its status ("a pod the
// journal did not know"), kept it for the pod's whole life and claimed it from the controller.
//
// Then the journal is lost while the status is still stale: X is recorded from the status (the
// only report there is), and once the status shows Y, X goes through the cooldown and Y is
// attached: a rebuilt address a pod no longer reports does not outlive the report.
func TestStaleStatusAfterARecreatedSandbox(t *testing.T) {
	const node = "stale-status"
	scale := ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 16}
	// Six usable addresses and a batch of four: the pool is exhausted at once, so the node holds
	// exactly its demand and gives every spare back.
	agentPool(t, node, node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.176.0.0/29"}, Scaling: scale, ReuseCooldown: cooldown(0)})
	agentNode(t, node, node)
	startController(t)
	args := []string{"--address-wait=10s", "--lease-duration=6s", "--lease-renew-interval=2s"}
	ag := startAgent(t, node, "", args...)
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket)
	p := createBoundPod(t, node+"-web", node)
	pa := podArgs(p.Namespace, p.Name, string(p.UID))
	add := func(cid string) netip.Addr {
		t.Helper()
		r, e := cniIf(t, "ADD", conf, cid, "eth0", pa)
		if e != nil {
			t.Fatalf("ADD %s: %v", cid, e)
		}
		return addrOf(t, r.IPs[0].Address)
	}
	x := add("web-1")
	setPodIP(t, p, x.String())
	if _, e := cniIf(t, "DEL", conf, "web-1", "eth0", pa); e != nil {
		t.Fatal(e)
	}
	// LIST waits for every DEL answered before it to be journaled: X is free again (reuse
	// cooldown 0). Another pod takes it for a while, so the pod's new sandbox gets another.
	if _, err := ag.list(t); err != nil {
		t.Fatal(err)
	}
	q := createBoundPod(t, node+"-q", node)
	qa := podArgs(q.Namespace, q.Name, string(q.UID))
	if r, e := cniIf(t, "ADD", conf, "q-1", "eth0", qa); e != nil || addrOf(t, r.IPs[0].Address) != x {
		t.Fatalf("the other pod's ADD: %+v %v, want the freed %s", r, e, x)
	}
	y := add("web-2")
	if y == x {
		t.Fatalf("the new sandbox got the old address %s", x)
	}
	if _, e := cniIf(t, "DEL", conf, "q-1", "eth0", qa); e != nil {
		t.Fatal(e)
	}
	if err := k8s.Delete(context.Background(), q, client.GracePeriodSeconds(0)); err != nil { // no longer demand
		t.Fatal(err)
	}
	if _, err := ag.list(t); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, "the node to give the old address back", func() error {
		if h := held(t, node, node); h.Contains(x) {
			return fmt.Errorf("the node still holds %s (%s)", x, h)
		}
		return nil
	})
	// SIGKILL before the kubelet reports the new sandbox: the status still shows X.
	ag.kill()
	ag.start(t, args...)
	ag.waitServing(t)
	attachments := func() map[string][]string {
		resp, err := ag.list(t)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string][]string{}
		for _, at := range resp.Attachments {
			for _, ip := range at.IPs {
				out[at.ContainerID] = append(out[at.ContainerID], addrOf(t, ip.Address).String())
			}
		}
		return out
	}
	// The agent serves once it reconciled: the start-up rebuild saw the pod's stale status.
	if got := attachments(); len(got) != 1 || fmt.Sprint(got["web-2"]) != fmt.Sprint([]string{y.String()}) {
		t.Fatalf("after the restart the agent attaches %v, want only web-2 = %s (the stale %s must not be recorded)", got, y, x)
	}
	if ag.logContains("recorded an attachment from") {
		t.Fatal("the agent recorded an attachment from the pod's stale status")
	}
	// A pod event runs the rebuild again; nothing changes and nothing is claimed.
	setPodIP(t, p, x.String())
	claimsX := func() bool {
		for _, pr := range nipa(t, node).Spec.Pools {
			for _, c := range pr.Claimed {
				if s, err := addr.ParseSet([]string{string(c)}); err == nil && s.Contains(x) {
					return true
				}
			}
		}
		return false
	}
	// Nothing to wait for happens here: watch a fixed window of pod events and monitor rounds.
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); <-tick.C {
		if claimsX() {
			t.Fatalf("the agent claims the stale %s from the controller", x)
		}
		if got := attachments(); len(got) != 1 {
			t.Fatalf("attachments %v", got)
		}
	}

	// The journal is lost while the status is still stale: X is recorded from the only report.
	ag.stop(t)
	if err := os.Remove(filepath.Join(ag.stateDir, "journal.db")); err != nil {
		t.Fatal(err)
	}
	ag.start(t, args...)
	ag.waitServing(t)
	if got := attachments(); len(got) != 1 || fmt.Sprint(got["rebuilt:"+string(p.UID)]) != fmt.Sprint([]string{x.String()}) {
		t.Fatalf("after the journal was lost the agent attaches %v, want the pod's reported %s", got, x)
	}
	// The kubelet reports the new sandbox: X goes, Y is the pod's.
	setPodIP(t, p, y.String())
	eventually(t, 10*time.Second, "the stale rebuilt address to be replaced", func() error {
		got := attachments()
		if len(got) != 1 || fmt.Sprint(got["rebuilt:"+string(p.UID)]) != fmt.Sprint([]string{y.String()}) {
			return fmt.Errorf("attachments %v", got)
		}
		return nil
	})
	if r, code, stderr := runCheck(t); code != 0 {
		t.Fatalf("ipwarden check exit %d: %+v\n%s", code, r.Findings, stderr)
	}
}

package integration

// Crash tests of the node agent that need a failpoint (internal/agent/failpoints.go): the
// integration tests' ipwarden binary is built with the failpoints build tag (ipwardenBinary).

import (
	"context"
	"fmt"
	"slices"
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

// An ADD whose address was reserved ahead (journaled by the ADD before it) is answered before its
// own journal write; the agent is killed (SIGKILL) after the answer and before the write. The
// restarted agent finds the record of that address, which it cannot tell from the records of
// addresses nobody was given, and holds them all out of use: ADDs exhaust every other address of
// the node without getting it. Once the pod that got it reports it in status.podIPs, the agent
// adopts it (a rebuilt attachment), the hold ends, and the records are gone from the journal.
func TestAgentKilledBetweenAnEarlyAnswerAndItsWrite(t *testing.T) {
	const node = "crash-early"
	const maxPerNode = 8
	agentPool(t, node, node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.160.0.0/24"},
		Scaling: ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: maxPerNode}, ReuseCooldown: cooldown(0)})
	agentNode(t, node, node)
	// The agent's Lease goes with the test, so that it can run again (-count) with a new journal.
	t.Cleanup(func() {
		_ = k8s.Delete(context.Background(), &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{
			Namespace: "ipwarden-system", Name: "ipwarden-agent-" + node}})
	})
	startController(t)
	// Every early ADD's journal write blocks forever; its answer still goes out.
	ag := startAgentEnv(t, "", []string{"IPWARDEN_FAILPOINT=hold-early-add-write"}, node, "")
	ag.waitServing(t)
	conf := pluginConf("1.1.0", ag.socket, node)

	pods := map[string]*corev1.Pod{}
	add := func(cid string) (string, *cnitypes.Error) {
		t.Helper()
		p := createBoundPod(t, "crash-"+cid, node)
		pods[cid] = p
		r, e := cni(t, "ADD", conf, cid, podArgs(p.Namespace, p.Name, string(p.UID)))
		if e != nil {
			return "", e
		}
		return r.IPs[0].Address, nil
	}
	// c1: nothing reserved ahead yet, so answered after its write, which reserves 2 ahead.
	a1, e := add("c1")
	if e != nil {
		t.Fatalf("ADD c1: %v", e)
	}
	if v := ag.metric(t, "ipwarden_agent_adds_early_total"); v != 0 {
		t.Fatalf("adds_early_total after the first ADD = %v, want 0", v)
	}
	// c2: its address A was reserved ahead, so it is answered at once; its write is held.
	A, e := add("c2")
	if e != nil {
		t.Fatalf("ADD c2: %v", e)
	}
	if A == a1 {
		t.Fatalf("c1 and c2 both got %s", A)
	}
	if v := ag.metric(t, "ipwarden_agent_adds_early_total"); v != 1 {
		t.Fatalf("adds_early_total after c2 = %v, want 1 (c2 was not answered early)", v)
	}
	if v := ag.metric(t, "ipwarden_agent_adds_in_flight"); v != 1 {
		t.Fatalf("adds_in_flight = %v, want 1 (c2's write held by the failpoint)", v)
	}

	// Killed between c2's answer and its write; back without the failpoint.
	ag.env = nil
	ag.restart(t, "--address-wait=3s", "--rebuild-hold=10m")
	ag.waitServing(t)
	c2 := "default/" + pods["c2"].Name
	eventually(t, 30*time.Second, "the hold of the addresses reserved ahead", func() error {
		resp, err := ag.list(t)
		if err != nil {
			return err
		}
		// c2's A and the one reserved ahead after it (by c1's write) are lost.
		if resp.Hold == nil || resp.Hold.Addresses != 2 || !slices.Contains(resp.Hold.WaitingFor, c2) {
			return fmt.Errorf("hold %+v, want 2 addresses waiting for %s", resp.Hold, c2)
		}
		return nil
	})
	if v := ag.metric(t, "ipwarden_agent_unattributed_hold_active"); v != 1 {
		t.Fatalf("unattributed_hold_active = %v, want 1", v)
	}
	resp, err := ag.list(t)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Attachments) != 1 || resp.Attachments[0].ContainerID != "c1" || resp.Attachments[0].IPs[0].Address != a1 {
		t.Fatalf("attachments after the crash: %+v, want only c1 with %s", resp.Attachments, a1)
	}

	// New pods take every other address the node may hold (maxPerNode): never A.
	served := 0
	for i := 3; ; i++ {
		if i > 3+2*maxPerNode {
			t.Fatalf("%d ADDs beyond maxPerNode %d were served", served, maxPerNode)
		}
		cid := fmt.Sprintf("c%d", i)
		got, e := add(cid)
		if e != nil {
			if e.Code != 11 || !strings.Contains(e.Msg, "maxPerNode") {
				t.Fatalf("ADD %s: %+v, want no free address at maxPerNode", cid, e)
			}
			// Its pod never got an address: gone, so the hold does not wait for it.
			forceDelete(t, pods[cid])
			break
		}
		if got == A {
			t.Fatalf("during the hold, handed %s, which c2 was told before the crash, to %s", A, cid)
		}
		served++
	}
	// maxPerNode, less c1's and the 2 lost addresses: the node ran dry with A unused.
	if want := maxPerNode - 3; served != want {
		t.Fatalf("%d ADDs served during the hold, want %d", served, want)
	}
	if resp, err := ag.list(t); err != nil || resp.Hold == nil || !slices.Contains(resp.Hold.WaitingFor, c2) {
		t.Fatalf("the hold after the node ran dry: %v %+v", err, resp)
	}
	assertDistinctAttachments(t, ag, A, false)

	// c2's pod reports A, as the kubelet would: adopted, and the hold ends.
	setPodIP(t, pods["c2"], addrOf(t, A).String())
	rebuilt := "rebuilt:" + string(pods["c2"].UID)
	eventually(t, 30*time.Second, "c2's address to be adopted and the hold to end", func() error {
		resp, err := ag.list(t)
		if err != nil {
			return err
		}
		if resp.Hold != nil {
			return fmt.Errorf("hold %+v", resp.Hold)
		}
		for _, at := range resp.Attachments {
			if at.ContainerID == rebuilt && at.Rebuilt && len(at.IPs) == 1 && at.IPs[0].Address == A {
				return nil
			}
		}
		return fmt.Errorf("no attachment %s with %s: %+v", rebuilt, A, resp.Attachments)
	})
	if v := ag.metric(t, "ipwarden_agent_unattributed_hold_active"); v != 0 {
		t.Fatalf("unattributed_hold_active after the hold = %v", v)
	}
	// The other lost address's record is forgotten: it is free again.
	eventually(t, 30*time.Second, "the lost records to be forgotten", func() error {
		if p := ag.pool(t, node); p.Unattributed != 0 {
			return fmt.Errorf("pool %+v", p)
		}
		return nil
	})
	if got, e := add("after"); e != nil {
		t.Fatalf("ADD after the hold: %v", e)
	} else if got == A {
		t.Fatalf("after the hold, handed c2's adopted address %s to another pod", A)
	}
	assertDistinctAttachments(t, ag, A, true)

	// On disk: A is c2's (rebuilt) attachment's, and no longer reserved ahead.
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
	a := addrOf(t, A)
	for _, r := range snap.Ahead {
		if r.Addr == a {
			t.Fatalf("the journal still records %s as reserved ahead: %+v", A, snap.Ahead)
		}
	}
	owners := 0
	for _, at := range snap.Attachments {
		for _, ad := range at.Addresses {
			if ad.Addr == a {
				owners++
				if at.Key.ContainerID != rebuilt {
					t.Fatalf("the journal records %s for %s, want %s", A, at.Key, rebuilt)
				}
			}
		}
	}
	if owners != 1 {
		t.Fatalf("the journal records %s in %d attachments, want 1", A, owners)
	}
}

// assertDistinctAttachments fails unless the agent's attachments share no address, and A is in
// one of them exactly when inUse.
func assertDistinctAttachments(t *testing.T, ag *agentProcess, A string, inUse bool) {
	t.Helper()
	resp, err := ag.list(t)
	if err != nil {
		t.Fatal(err)
	}
	owner := map[string]string{}
	for _, at := range resp.Attachments {
		for _, ip := range at.IPs {
			if other, dup := owner[ip.Address]; dup {
				t.Fatalf("%s is in attachments %s and %s", ip.Address, other, at.ContainerID)
			}
			owner[ip.Address] = at.ContainerID
		}
	}
	if _, used := owner[A]; used != inUse {
		t.Fatalf("%s in an attachment: %v, want %v (attachments %+v)", A, used, inUse, resp.Attachments)
	}
}

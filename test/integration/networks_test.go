package integration

// Secondary networks (docs/design.md, "Secondary networks"): real agent, controller and plugin
// processes on the real API server.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	cnitypes "github.com/containernetworking/cni/pkg/types"
	"k8s.io/apimachinery/pkg/api/meta"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/check"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// cniIf runs the real plugin for one verb on interface ifname.
func cniIf(t *testing.T, verb, conf, containerID, ifname, podArgs string) (*cniResult, *cnitypes.Error) {
	t.Helper()
	cmd := exec.Command(cniBinary(t))
	cmd.Env = []string{"CNI_COMMAND=" + verb, "CNI_CONTAINERID=" + containerID, "CNI_NETNS=" + filepath.Join(netnsDir, "none"),
		"CNI_NETNS_OVERRIDE=1", "CNI_IFNAME=" + ifname, "CNI_PATH=/opt/cni/bin", "CNI_ARGS=" + podArgs, localcluster.RaceEnv}
	cmd.Stdin = strings.NewReader(conf)
	var out bytes.Buffer
	cmd.Stdout = &out
	if err := cmd.Run(); err != nil {
		var e cnitypes.Error
		if jerr := json.Unmarshal(out.Bytes(), &e); jerr != nil {
			t.Fatalf("%s %s/%s: %v: %s", verb, containerID, ifname, err, out.String())
		}
		return nil, &e
	}
	if verb != "ADD" {
		return nil, nil
	}
	var r cniResult
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatal(err)
	}
	return &r, nil
}

// networkConf is a macvlan-style secondary network (as a Multus NetworkAttachmentDefinition
// carries it) delegating IPAM to ipwarden on network.
func networkConf(socket, name, network string) string {
	b, _ := json.Marshal(map[string]any{"cniVersion": "1.1.0", "name": name, "type": "macvlan",
		"ipam": map[string]any{"type": "ipwarden", "socket": socket, "network": network}})
	return string(b)
}

// Two pools with the same CIDR on different networks both serve; a third on one of those
// networks overlapping it is rejected. One pod's eth0 (pod network) and net1 (storage network)
// get addresses from their own pools, possibly the same address, and are independent: DEL of one
// leaves the other. ipwarden check finds nothing held twice.
func TestOverlappingPoolsOnDifferentNetworks(t *testing.T) {
	const node = "networks"
	scale := ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 64}
	agentPool(t, "nw-pod", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.153.0.0/24"}, ReuseCooldown: cooldown(0), Scaling: scale})
	agentPool(t, "nw-storage", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.153.0.0/24"}, Network: "storage",
		ReuseCooldown: cooldown(0), Scaling: scale})
	agentNode(t, node, node)
	startController(t)
	eventually(t, 20*time.Second, "both pools Ready, neither Invalid", func() error {
		for _, name := range []string{"nw-pod", "nw-storage"} {
			p := getPool(t, name)
			if c := meta.FindStatusCondition(p.Status.Conditions, ipwardenv1.ConditionInvalid); c == nil || c.Status != "False" {
				return fmt.Errorf("pool %s: Invalid %+v", name, c)
			}
		}
		return nil
	})
	// A second pool on the storage network overlapping the first is rejected.
	agentPool(t, "nw-storage-2", node, ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.153.0.128/25"}, Network: "storage", Scaling: scale})
	eventually(t, 20*time.Second, "the overlapping pool on one network to be Invalid", func() error {
		c := meta.FindStatusCondition(getPool(t, "nw-storage-2").Status.Conditions, ipwardenv1.ConditionInvalid)
		if c == nil || c.Status != "True" || !strings.Contains(c.Message, "nw-storage") {
			return fmt.Errorf("Invalid %+v", c)
		}
		return nil
	})
	if err := k8s.Delete(context.Background(), getPool(t, "nw-storage-2")); err != nil {
		t.Fatal(err)
	}

	ag := startAgent(t, node, "")
	ag.waitServing(t)
	pod := createAnnotatedPod(t, "default", "multi", node, nil)
	args := podArgs(pod.Namespace, pod.Name, string(pod.UID))
	eth0, e := cniIf(t, "ADD", pluginConf("1.1.0", ag.socket), "mn-1", "eth0", args)
	if e != nil {
		t.Fatalf("eth0 ADD: %v", e)
	}
	storageConf := networkConf(ag.socket, "storage-net", "storage")
	net1, e := cniIf(t, "ADD", storageConf, "mn-1", "net1", args)
	if e != nil {
		t.Fatalf("net1 ADD: %v", e)
	}
	if len(eth0.IPs) != 1 || len(net1.IPs) != 1 || !inPrefix(t, eth0.IPs[0].Address, "10.153.0.0/24") || !inPrefix(t, net1.IPs[0].Address, "10.153.0.0/24") {
		t.Fatalf("eth0 %v net1 %v", eth0.addrs(), net1.addrs())
	}
	// Each network's pool holds its own address: the node holds from both.
	if !held(t, node, "nw-pod").Contains(addrOf(t, eth0.IPs[0].Address)) || !held(t, node, "nw-storage").Contains(addrOf(t, net1.IPs[0].Address)) {
		t.Fatalf("holdings: pod %v storage %v", held(t, node, "nw-pod"), held(t, node, "nw-storage"))
	}
	// A storage attachment naming a pod-network pool is refused.
	bad := networkConf(ag.socket, "storage-net", "storage")
	bad = strings.Replace(bad, `"network":"storage"`, `"network":"storage","pools":["nw-pod"]`, 1)
	if _, e := cniIf(t, "ADD", bad, "mn-1", "net2", args); e == nil || e.Code != 7 || !strings.Contains(e.Msg, `is on network ""`) {
		t.Fatalf("pod-network pool on a storage attachment: %+v", e)
	}
	// DEL of net1 leaves eth0; the same address again on net1 is fine.
	if _, e := cniIf(t, "DEL", storageConf, "mn-1", "net1", args); e != nil {
		t.Fatal(e)
	}
	resp, err := ag.list(t)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Attachments) != 1 || resp.Attachments[0].IfName != "eth0" || resp.Attachments[0].IPs[0].Address != eth0.IPs[0].Address {
		t.Fatalf("after DEL of net1: %+v", resp.Attachments)
	}
	if _, e := cniIf(t, "ADD", storageConf, "mn-1", "net1", args); e != nil {
		t.Fatalf("net1 ADD again: %v", e)
	}
	// ipwarden check: both pools hold 10.153.0.x on one node, on two networks: not held twice.
	if r, _, _ := runCheck(t); len(findingsOn(r, check.HeldTwice, node)) != 0 {
		t.Fatalf("ipwarden check: %+v", findingsOn(r, check.HeldTwice, node))
	}
}

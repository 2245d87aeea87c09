package check

import (
	"testing"
	"time"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
)

// A live migration's pair is not a finding; everything else around a claim's address is.
func TestCheckClaims(t *testing.T) {
	bind := func(in *Input, address, uid string, shared ...string) {
		in.Pools[0].Status.IPAMClaims = append(in.Pools[0].Status.IPAMClaims, ipwardenv1.ClaimBinding{Address: ipwardenv1.IPAddress(address), Namespace: "vms", Name: "vm-" + uid, UID: uid})
		if len(shared) > 0 {
			in.Pools[0].Status.Shared = append(in.Pools[0].Status.Shared, ipwardenv1.SharedClaimAddress{Address: ipwardenv1.IPAddress(address), UID: uid, Nodes: shared})
		}
	}
	// migrate has 10.0.0.17 (n1's, pod p1) held by n2 too and used by a target pod there.
	migrate := func(in *Input) {
		in.Allocs[1].Status.Pools[0].Addresses = []string{"10.0.0.17", "10.0.0.32/28"}
		in.Pods = append(in.Pods, Pod{Namespace: "a", Name: "target", UID: "u9", Node: "n2", IPs: ips("10.0.0.17"), Running: true})
	}
	for _, tc := range []struct {
		name string
		mod  func(*Input)
		want map[string]int
	}{
		{"a bound address held by one node", func(in *Input) { bind(in, "10.0.0.17", "c1") }, nil},
		{"a live migration across nodes under a shared grant", func(in *Input) { bind(in, "10.0.0.17", "c1", "n1", "n2"); migrate(in) }, nil},
		{"two nodes without a shared grant", func(in *Input) { bind(in, "10.0.0.17", "c1"); migrate(in) }, map[string]int{HeldTwice: 1}},
		{"a shared grant naming other nodes", func(in *Input) { bind(in, "10.0.0.17", "c1", "n1", "n3"); migrate(in) }, map[string]int{HeldTwice: 1}},
		{"two pods sharing an address that no claim binds", func(in *Input) { migrate(in) }, map[string]int{HeldTwice: 1, AttachedTwice: 1}},
		{"a claim held by a third node", func(in *Input) {
			bind(in, "10.0.0.17", "c1", "n1", "n2")
			migrate(in)
			in.Allocs = append(in.Allocs, alloc("n3", "v4", "10.0.0.17"))
			in.Nodes = append(in.Nodes, "n3")
		}, map[string]int{HeldTwice: 1, ClaimOverShared: 1}},
		{"a third running pod on a claim's address", func(in *Input) {
			bind(in, "10.0.0.17", "c1", "n1", "n2")
			migrate(in)
			in.Pods = append(in.Pods, Pod{Namespace: "a", Name: "third", UID: "u10", Node: "n2", IPs: ips("10.0.0.17"), Running: true})
		}, map[string]int{ClaimOverShared: 1}},
		{"one address bound to two claims", func(in *Input) { bind(in, "10.0.0.17", "c1"); bind(in, "10.0.0.17", "c2") }, map[string]int{ClaimAddressTwice: 1}},
		{"two attachments of a migration on one node", func(in *Input) {
			bind(in, "10.0.0.17", "c1")
			in.Attachments["n1"][0].Claims = []string{"c1"}
			in.Attachments["n1"] = append(in.Attachments["n1"], Attachment{Node: "n1", ContainerID: "c2", IfName: "eth0", PodUID: "u1", Addrs: ips("10.0.0.17"), Created: now, Claims: []string{"c1"}})
		}, nil},
		{"a claim's address on an attachment with no claim", func(in *Input) {
			bind(in, "10.0.0.17", "c1")
			in.Attachments["n1"][0].Claims = []string{}
		}, map[string]int{ClaimAddressMisused: 1}},
		{"a binding whose claim is gone and unused", func(in *Input) {
			bind(in, "10.0.0.17", "c1")
			in.Claims = []ClaimRef{{Namespace: "vms", Name: "vm-c2", UID: "c2"}}
		}, map[string]int{ClaimBindingOrphan: 1}},
		{"a binding whose claim is gone while a node uses it", func(in *Input) {
			bind(in, "10.0.0.17", "c1")
			in.Claims = []ClaimRef{}
			in.Allocs[0].Spec.Pools = []ipwardenv1.NodePoolRequest{{Pool: "v4", IPAMClaims: []ipwardenv1.ClaimUse{{Namespace: "vms", Name: "vm-c1", UID: "c1", Attached: true}}}}
		}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := healthy()
			in.Attachments = map[string][]Attachment{"n1": in.Attachments["n1"]}
			tc.mod(&in)
			in.Now = now
			in.Grace = time.Minute
			r := Check(in)
			if len(r.CountsByKind) != len(tc.want) {
				t.Fatalf("findings %+v, want %v", r.Findings, tc.want)
			}
			for k, v := range tc.want {
				if r.CountsByKind[k] != v {
					t.Fatalf("findings %+v, want %v", r.Findings, tc.want)
				}
			}
		})
	}
}

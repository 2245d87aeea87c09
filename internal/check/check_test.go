package check

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
)

var now = time.Unix(1_700_000_000, 0)

func pool(name, cidr string, exclude ...string) ipwardenv1.IPPool {
	p := ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{ipwardenv1.CIDR(cidr)}}}
	for _, e := range exclude {
		p.Spec.Exclude = append(p.Spec.Exclude, ipwardenv1.IPOrCIDR(e))
	}
	return p
}

func alloc(node, pool string, addrs ...string) ipwardenv1.NodeIPAllocation {
	return ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: node},
		Status: ipwardenv1.NodeIPAllocationStatus{Pools: []ipwardenv1.NodePoolStatus{{Pool: pool, Addresses: addrs}}}}
}

func ips(s ...string) []netip.Addr {
	var out []netip.Addr
	for _, x := range s {
		out = append(out, netip.MustParseAddr(x))
	}
	return out
}

func healthy() Input {
	return Input{
		Pools:  []ipwardenv1.IPPool{pool("v4", "10.0.0.0/24", "10.0.0.1")},
		Allocs: []ipwardenv1.NodeIPAllocation{alloc("n1", "v4", "10.0.0.16/28"), alloc("n2", "v4", "10.0.0.32/28")},
		Nodes:  []string{"n1", "n2"},
		Pods: []Pod{
			{Namespace: "a", Name: "p1", UID: "u1", Node: "n1", IPs: ips("10.0.0.17"), Running: true},
			{Namespace: "a", Name: "p2", UID: "u2", Node: "n2", IPs: ips("10.0.0.33"), Running: true},
			{Namespace: "a", Name: "host", UID: "u3", Node: "n2", IPs: ips("192.168.1.5"), Running: true}, // not ours
			{Namespace: "a", Name: "done", UID: "u4", Node: "n2", IPs: ips("10.0.0.99"), Running: false},
		},
		Attachments: map[string][]Attachment{
			"n1": {{Node: "n1", ContainerID: "c1", IfName: "eth0", PodNamespace: "a", PodName: "p1", PodUID: "u1", Addrs: ips("10.0.0.17"), Created: now.Add(-time.Hour)}},
		},
		Now: now, Grace: time.Minute,
	}
}

func TestCheck(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(*Input)
		want map[string]int
	}{
		{"healthy", func(*Input) {}, nil},
		{"held twice", func(in *Input) {
			in.Allocs = append(in.Allocs, alloc("n3", "v4", "10.0.0.30-10.0.0.34"))
			in.Nodes = append(in.Nodes, "n3")
		},
			map[string]int{HeldTwice: 1}},
		{"one address on two networks is not held twice", func(in *Input) {
			storage := pool("storage", "10.0.0.0/24")
			storage.Spec.Network = "storage"
			in.Pools = append(in.Pools, storage)
			in.Allocs = append(in.Allocs, alloc("n3", "storage", "10.0.0.16/28"))
			in.Nodes = append(in.Nodes, "n3")
			in.Attachments["n3"] = []Attachment{{Node: "n3", ContainerID: "c9", IfName: "net1", PodNamespace: "a", PodName: "p1", PodUID: "u1",
				Addrs: ips("10.0.0.17"), Pool: "storage", Created: now.Add(-time.Hour)}}
		}, map[string]int{PodAddressNotHeld: 0}},
		{"held twice on one secondary network", func(in *Input) {
			for _, n := range []string{"s1", "s2"} {
				p := pool(n, "10.0.0.0/24")
				p.Spec.Network = "storage"
				in.Pools = append(in.Pools, p)
			}
			in.Allocs = append(in.Allocs, alloc("n3", "s1", "10.0.0.16/28"), alloc("n4", "s2", "10.0.0.20"))
			in.Nodes = append(in.Nodes, "n3", "n4")
		}, map[string]int{HeldTwice: 1}},
		{"outside the pool", func(in *Input) { in.Allocs[0] = alloc("n1", "v4", "10.0.0.0/27") }, map[string]int{OutsidePool: 1}},
		{"unknown pool", func(in *Input) { in.Allocs[1] = alloc("n2", "gone", "10.0.0.32/28") },
			map[string]int{UnknownPool: 1, PodAddressNotHeld: 0}},
		{"node gone", func(in *Input) { in.Nodes = in.Nodes[:1] }, map[string]int{OrphanAllocation: 1}},
		{"running pod's address not held", func(in *Input) { in.Pods[1].IPs = ips("10.0.0.200") }, map[string]int{PodAddressNotHeld: 1}},
		{"two running pods share an address", func(in *Input) { in.Pods[1].IPs = ips("10.0.0.17"); in.Pods[1].Node = "n1" }, map[string]int{AttachedTwice: 1}},
		{"attachment of a deleted pod", func(in *Input) { in.Pods = in.Pods[1:] }, map[string]int{LeakedAttachment: 1}},
		{"young attachment is not a leak", func(in *Input) {
			in.Pods = in.Pods[1:]
			in.Attachments["n1"][0].Created = now.Add(-10 * time.Second)
		}, nil},
		{"attachment outside the node's holding", func(in *Input) { in.Attachments["n1"][0].Addrs = ips("10.0.0.40") },
			map[string]int{PodAddressNotHeld: 1, PodAddressNotAttached: 1}},
		{"running pod's address has no attachment (freed while the pod runs)", func(in *Input) { in.Attachments["n1"] = []Attachment{} },
			map[string]int{PodAddressNotAttached: 1}},
		{"a pod on a node whose agent was not asked is not judged", func(in *Input) { delete(in.Attachments, "n1") }, nil},
		{"attachment whose sandbox is gone", func(in *Input) { in.Attachments["n1"][0].Sandbox = "gone" },
			map[string]int{SandboxGone: 1}},
		{"young attachment whose sandbox is gone is not judged", func(in *Input) {
			in.Attachments["n1"][0].Sandbox = "gone"
			in.Attachments["n1"][0].Created = now.Add(-10 * time.Second)
		}, nil},
		{"attachment whose sandbox exists or cannot be seen", func(in *Input) {
			in.Attachments["n1"][0].Sandbox = "exists"
			in.Attachments["n1"] = append(in.Attachments["n1"], Attachment{Node: "n1", ContainerID: "c2", IfName: "eth1", PodUID: "u1",
				Addrs: ips("10.0.0.18"), Created: now.Add(-time.Hour), Sandbox: "unknown"})
		}, nil},
		{"an attachment with an address on each of two overlapping networks", func(in *Input) {
			// A lost journal's rebuilt attachment carries one pod's addresses on every network:
			// its net1 address 10.0.0.17 on storage is the pod network's 10.0.0.17 of c1.
			storage := pool("storage", "10.0.0.0/24")
			storage.Spec.Network = "storage"
			in.Pools = append(in.Pools, storage)
			in.Attachments["n1"] = append(in.Attachments["n1"], Attachment{Node: "n1", ContainerID: "rebuilt:u1", IfName: "-", PodUID: "u1",
				Addrs: ips("10.0.0.18", "10.0.0.17"), Pool: "v4", AddrPools: []string{"v4", "storage"}, Created: now})
		}, nil},
		{"a DRA reservation and its pod's attachment share an address", func(in *Input) {
			in.Attachments["n1"] = append(in.Attachments["n1"], Attachment{Node: "n1", ContainerID: "dra:claim-1/addr", IfName: "v4-s0", PodUID: "u1", Addrs: ips("10.0.0.17"), Created: now})
		}, nil},
		{"another pod's attachment of a reserved address", func(in *Input) {
			in.Attachments["n1"] = append(in.Attachments["n1"], Attachment{Node: "n1", ContainerID: "dra:claim-1/addr", IfName: "v4-s0", PodUID: "u9", Addrs: ips("10.0.0.17"), Created: now})
		}, map[string]int{AttachedTwice: 1}},
		{"two attachments share an address", func(in *Input) {
			in.Attachments["n1"] = append(in.Attachments["n1"], Attachment{Node: "n1", ContainerID: "c2", IfName: "eth0", PodUID: "u1", Addrs: ips("10.0.0.17"), Created: now})
		}, map[string]int{AttachedTwice: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := healthy()
			tc.mod(&in)
			r := Check(in)
			want := map[string]int{}
			for k, v := range tc.want {
				if v > 0 {
					want[k] = v
				}
			}
			if len(r.CountsByKind) != len(want) {
				t.Fatalf("findings %+v, want counts %v", r.Findings, want)
			}
			for k, v := range want {
				if r.CountsByKind[k] != v {
					t.Fatalf("findings %+v, want counts %v", r.Findings, want)
				}
			}
			if r.OK() != (len(want) == 0) {
				t.Fatalf("OK() = %v with findings %v", r.OK(), r.Findings)
			}
		})
	}
}

func TestCheckListsStickyReservations(t *testing.T) {
	in := healthy()
	in.Pools[0].Status.Sticky = []ipwardenv1.StickyAddress{{Address: "10.0.0.17", Namespace: "a", StatefulSet: "web", Ordinal: 0}}
	r := Check(in)
	if len(r.Sticky) != 1 || r.Sticky[0] != (StickyReservation{Pool: "v4", Identity: "a/web-0", Address: "10.0.0.17"}) || !r.OK() {
		t.Fatalf("report %+v", r)
	}
}

func TestCheckCounts(t *testing.T) {
	r := Check(healthy())
	if r.Pools != 1 || r.Nodes != 2 || r.Held != 32 || r.RunningPods != 3 || r.Attachments != 1 || r.AgentsAsked != 1 || r.OutsidePools != 1 {
		t.Fatalf("report %+v", r)
	}
}

// A running pod whose address lies outside every pool (the previous IPAM's, during a takeover)
// is counted and named, not a finding: it is not ipwarden's to hand out.
func TestCheckCountsPodsOutsideEveryPool(t *testing.T) {
	in := healthy()
	p := in.Pods[0]
	p.Namespace, p.Name, p.UID = "old", "web", "uid-old-web"
	p.IPs = []netip.Addr{netip.MustParseAddr("192.168.77.7")}
	in.Pods = append(in.Pods, p)
	r := Check(in)
	if !r.OK() || r.OutsidePools != 2 || r.OutsidePoolsExample != "a/host 192.168.1.5" {
		t.Fatalf("report %+v", r)
	}
}

// A node claims an address (its pods use it) that another node holds: a finding naming both
// nodes and the pods on each whose status shows it.
func TestClaimConflictNamesBothPods(t *testing.T) {
	in := healthy()
	a := alloc("n3", "v4", "10.0.0.64")
	a.Spec.Pools = []ipwardenv1.NodePoolRequest{{Pool: "v4", Claimed: []ipwardenv1.AddressBlock{"10.0.0.17"}}}
	in.Allocs = append(in.Allocs, a)
	in.Nodes = append(in.Nodes, "n3")
	in.Pods = append(in.Pods, Pod{Namespace: "default", Name: "other", UID: "u9", Node: "n3", IPs: ips("10.0.0.17"), Running: true})
	r := Check(in)
	found := false
	for _, f := range r.Findings {
		if f.Kind == ClaimConflict {
			found = true
			if f.Addresses != "10.0.0.17" || len(f.Nodes) != 2 || f.Nodes[0] != "n3" || f.Nodes[1] != "n1" ||
				!strings.Contains(f.Pod, "default/other on n3") || !strings.Contains(f.Pod, "a/p1 on n1") {
				t.Fatalf("finding %+v", f)
			}
		}
	}
	if !found {
		t.Fatalf("no ClaimConflict finding: %+v", r.Findings)
	}
}

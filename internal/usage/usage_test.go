package usage

import (
	"net/netip"
	"reflect"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/check"
)

var now = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

func ips(s ...string) []netip.Addr {
	var out []netip.Addr
	for _, x := range s {
		out = append(out, netip.MustParseAddr(x))
	}
	return out
}

// snapshot: pool a, 10.0.0.0/28 (16 addresses): network .0, broadcast .15 and gateway .1
// reserved, .14 excluded: 12 usable. n1 holds .2-.5 (one run), n2 holds .6 and .10 (two runs;
// .10 releasing). .8 cools for 30 s more; .9's cooldown ran out. Pods use .2, .3 (n1) and .6
// (n2); a finished pod on n2 had .10; a pod on n2 uses .12, which nobody holds.
func snapshot() check.Input {
	p := ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: "a"}, Spec: ipwardenv1.IPPoolSpec{
		CIDRs: []ipwardenv1.CIDR{"10.0.0.0/28"}, Exclude: []ipwardenv1.IPOrCIDR{"10.0.0.14"}, Gateway: "10.0.0.1",
		Scaling: ipwardenv1.Scaling{BatchSize: 4, BufferPercent: 50, MaxPerNode: 8}}}
	p.Status.Cooling = []ipwardenv1.CoolingBlock{
		{Addresses: []string{"10.0.0.8"}, Until: metav1.NewTime(now.Add(30 * time.Second))},
		{Addresses: []string{"10.0.0.9"}, Until: metav1.NewTime(now.Add(-time.Second))},
	}
	p.Status.Exhausted = true
	n1 := ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: "n1"},
		Spec:   ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "a", Requested: 4}}},
		Status: ipwardenv1.NodeIPAllocationStatus{Pools: []ipwardenv1.NodePoolStatus{{Pool: "a", Addresses: []string{"10.0.0.2-10.0.0.5"}, Held: 4}}}}
	n2 := ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: "n2"},
		Spec: ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "a", Requested: 8,
			Releasing: []ipwardenv1.AddressBlock{"10.0.0.10"}}}},
		Status: ipwardenv1.NodeIPAllocationStatus{Pools: []ipwardenv1.NodePoolStatus{{Pool: "a", Addresses: []string{"10.0.0.6", "10.0.0.10"}, Held: 2}}}}
	return check.Input{
		Now:    now,
		Pools:  []ipwardenv1.IPPool{p},
		Allocs: []ipwardenv1.NodeIPAllocation{n2, n1},
		Nodes:  []string{"n1", "n2"},
		Pods: []check.Pod{
			{Namespace: "default", Name: "p1", Node: "n1", IPs: ips("10.0.0.2"), Running: true},
			{Namespace: "default", Name: "p2", Node: "n1", IPs: ips("10.0.0.3"), Running: true},
			{Namespace: "default", Name: "p3", Node: "n2", IPs: ips("10.0.0.6"), Running: true},
			{Namespace: "default", Name: "done", Node: "n2", IPs: ips("10.0.0.10"), Running: false},
			{Namespace: "default", Name: "stray", Node: "n2", IPs: ips("10.0.0.12"), Running: true},
		},
	}
}

// n2's agent was asked: its journal has p3 on .6 and a sandbox whose pod name it did not get on .10.
func withAgent(in check.Input) check.Input {
	in.Attachments = map[string][]check.Attachment{"n2": {
		{Node: "n2", ContainerID: "c-p3", PodNamespace: "default", PodName: "p3", Addrs: ips("10.0.0.6")},
		{Node: "n2", ContainerID: "c-anon", Addrs: ips("10.0.0.10")},
	}}
	return in
}

func TestPools(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   check.Input
		want []Pool
	}{
		{"from pods", snapshot(), []Pool{{Name: "a", Capacity: 12, Allocated: 7, Held: 6, InUse: 3, Free: 5, Cooling: 1, Reserved: 4, Exhausted: true, Nodes: 2}}},
		{"n2 from its agent", withAgent(snapshot()), []Pool{{Name: "a", Capacity: 12, Allocated: 7, Held: 6, InUse: 4, Free: 5, Cooling: 1, Reserved: 4, Exhausted: true, Nodes: 2}}},
		{"cooldown over", func() check.Input { in := snapshot(); in.Now = now.Add(time.Minute); return in }(),
			[]Pool{{Name: "a", Capacity: 12, Allocated: 6, Held: 6, InUse: 3, Free: 6, Cooling: 0, Reserved: 4, Exhausted: true, Nodes: 2}}},
		{"a cooling address granted back is held, not cooling", func() check.Input {
			in := snapshot()
			in.Allocs[1].Status.Pools[0].Addresses = []string{"10.0.0.2-10.0.0.5", "10.0.0.8"}
			return in
		}(), []Pool{{Name: "a", Capacity: 12, Allocated: 7, Held: 7, InUse: 3, Free: 5, Cooling: 0, Reserved: 4, Exhausted: true, Nodes: 2}}},
		{"no nodes", check.Input{Now: now, Pools: snapshot().Pools}, []Pool{{Name: "a", Capacity: 12, Allocated: 1, Free: 11, Cooling: 1, Reserved: 4, Exhausted: true}}},
		{"invalid spec", check.Input{Now: now, Pools: []ipwardenv1.IPPool{{ObjectMeta: metav1.ObjectMeta{Name: "bad"},
			Spec: ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.1.0.0/30", "fd00::/126"}}}}},
			[]Pool{{Name: "bad", Capacity: 5, Free: 5, Reserved: 3, Invalid: "all cidrs of a pool must be of one family"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Pools(tc.in); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("Pools:\n got %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

func TestNodes(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   check.Input
		want []Node
	}{
		{"from pods", snapshot(), []Node{
			{Node: "n1", Pool: "a", Held: 4, InUse: 2, Requested: 4, Runs: 1, Source: FromPods},
			{Node: "n2", Pool: "a", Held: 2, InUse: 1, Requested: 8, Releasing: 1, Runs: 2, Source: FromPods},
		}},
		{"n2 from its agent", withAgent(snapshot()), []Node{
			{Node: "n1", Pool: "a", Held: 4, InUse: 2, Requested: 4, Runs: 1, Source: FromPods},
			{Node: "n2", Pool: "a", Held: 2, InUse: 2, Requested: 8, Releasing: 1, Runs: 2, Source: FromAgent},
		}},
		{"requested, nothing held yet", check.Input{Now: now, Allocs: []ipwardenv1.NodeIPAllocation{{ObjectMeta: metav1.ObjectMeta{Name: "new"},
			Spec: ipwardenv1.NodeIPAllocationSpec{Pools: []ipwardenv1.NodePoolRequest{{Pool: "b", Requested: 16}}}}}},
			[]Node{{Node: "new", Pool: "b", Requested: 16, Source: FromPods}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Nodes(tc.in); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("Nodes:\n got %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

func TestWhoHolds(t *testing.T) {
	until := now.Add(30 * time.Second)
	twice := snapshot()
	twice.Allocs = append(twice.Allocs, ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: "n3"},
		Status: ipwardenv1.NodeIPAllocationStatus{Pools: []ipwardenv1.NodePoolStatus{{Pool: "a", Addresses: []string{"10.0.0.4"}}}}})
	for _, tc := range []struct {
		name string
		in   check.Input
		addr string
		want Who
	}{
		{"held and used", snapshot(), "10.0.0.2", Who{Address: "10.0.0.2", Pool: "a", State: StateHeld, Nodes: []string{"n1"},
			Holders: []Holder{{Node: "n1", Pod: "default/p1", Source: FromPods}}, Detail: "held by node n1, used by default/p1"}},
		{"held spare", snapshot(), "10.0.0.4", Who{Address: "10.0.0.4", Pool: "a", State: StateHeld, Nodes: []string{"n1"},
			Detail: "held by node n1, not used by any pod (the node's spare)"}},
		{"held by a finished pod's node: the pod no longer counts", snapshot(), "10.0.0.10", Who{Address: "10.0.0.10", Pool: "a", State: StateHeld,
			Nodes: []string{"n2"}, Detail: "held by node n2, not used by any pod (the node's spare)"}},
		{"the agent's journal answers for its node", withAgent(snapshot()), "10.0.0.10", Who{Address: "10.0.0.10", Pool: "a", State: StateHeld,
			Nodes: []string{"n2"}, Holders: []Holder{{Node: "n2", ContainerID: "c-anon", Source: FromAgent}}, Detail: "held by node n2, used by container c-anon"}},
		{"held twice", twice, "10.0.0.4", Who{Address: "10.0.0.4", Pool: "a", State: StateHeld, Nodes: []string{"n1", "n3"},
			Detail: "held by 2 nodes at once (n1, n3): run ipwarden check"}},
		{"cooling", snapshot(), "10.0.0.8", Who{Address: "10.0.0.8", Pool: "a", State: StateCooling, CoolingUntil: &until,
			Detail: "released; cooling until 2026-01-02T03:04:35Z (in 30s)"}},
		{"cooldown over", snapshot(), "10.0.0.9", Who{Address: "10.0.0.9", Pool: "a", State: StateFree, Detail: "free in pool a"}},
		{"excluded", snapshot(), "10.0.0.14", Who{Address: "10.0.0.14", Pool: "a", State: StateExcluded, Detail: "excluded by pool a (spec.exclude)"}},
		{"gateway", snapshot(), "10.0.0.1", Who{Address: "10.0.0.1", Pool: "a", State: StateReserved,
			Detail: "reserved in pool a (network, broadcast, first IPv6 address or gateway): never handed out"}},
		{"network address", snapshot(), "10.0.0.0", Who{Address: "10.0.0.0", Pool: "a", State: StateReserved,
			Detail: "reserved in pool a (network, broadcast, first IPv6 address or gateway): never handed out"}},
		{"used, held by nobody", snapshot(), "10.0.0.12", Who{Address: "10.0.0.12", Pool: "a", State: StateUnheld,
			Holders: []Holder{{Node: "n2", Pod: "default/stray", Source: FromPods}}, Detail: "used by default/stray but held by no node: run ipwarden check"}},
		{"no pool", snapshot(), "192.168.1.1", Who{Address: "192.168.1.1", State: StateNoPool, Detail: "in no IPPool's CIDRs"}},
		{"another IPAM's", func() check.Input {
			in := snapshot()
			in.Pods = append(in.Pods, check.Pod{Namespace: "kube-system", Name: "other", Node: "n1", IPs: ips("192.168.1.1"), Running: true})
			return in
		}(), "192.168.1.1", Who{Address: "192.168.1.1", State: StateNoPool, Holders: []Holder{{Node: "n1", Pod: "kube-system/other", Source: FromPods}},
			Detail: "in no IPPool's CIDRs (used by kube-system/other: another IPAM's address)"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := WhoHolds(tc.in, netip.MustParseAddr(tc.addr)); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("WhoHolds(%s):\n got %+v\nwant %+v", tc.addr, got, tc.want)
			}
		})
	}
}

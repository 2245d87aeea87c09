package controller

import (
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
)

func TestPoolGrowth(t *testing.T) {
	s := NewState(DefaultExhaustionMarks)
	known := testPool("p", "10.0.0.0/28", time.Minute)
	s.Rebuild([]ipwardenv1.IPPool{known}, nil, t0)
	excluded := testPool("p", "10.0.0.0/28", time.Minute)
	excluded.Spec.Exclude = []ipwardenv1.IPOrCIDR{"10.0.0.8/29"}
	bad := testPool("q", "not-a-cidr", time.Minute)
	for _, tc := range []struct {
		name string
		pool ipwardenv1.IPPool
		want string // the addresses added
	}{
		{"unknown pool", testPool("q", "10.1.0.0/28", time.Minute), "10.1.0.1-10.1.0.14"},
		{"same addresses", known, ""},
		{"more CIDRs", testPool("p", "10.0.0.0/27", time.Minute), "10.0.0.15-10.0.0.30"},
		{"fewer addresses", excluded, ""},
		{"unparsable", bad, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := s.PoolGrowth(&tc.pool); got.String() != tc.want {
				t.Fatalf("PoolGrowth = %q, want %q", got.String(), tc.want)
			}
		})
	}
	// An exclusion lifted later gives addresses back: that grows the pool again.
	s.SetPool(&excluded)
	if got := s.PoolGrowth(&known); got.IsEmpty() {
		t.Fatal("lifting an exclusion does not count as growth")
	}
}

// A pool that appears while the controller leads hands out none of its free addresses while it
// settles: a node's claims (its pods' addresses, from a previous IPAM say) are granted, nothing
// else; the settle's end, or its bound, lets fills through.
func TestPoolSettleServesClaimsOnly(t *testing.T) {
	for _, tc := range []struct {
		name    string
		at      time.Time
		end     bool
		wantAdd int // addresses a is given, the claimed 10.0.0.5 among them
		reason  string
	}{
		{name: "settling: the claim only", at: t0, wantAdd: 1, reason: "is new or grew"},
		{name: "every node reported", at: t0, end: true, wantAdd: 4},
		{name: "bound passed", at: t0.Add(time.Minute), wantAdd: 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewState(DefaultExhaustionMarks)
			s.Rebuild(nil, nil, t0)
			p := testPool("p", "10.0.0.0/28", time.Minute)
			p.UID, p.Generation = "uid-p", 1
			if s.PoolGrowth(&p).IsEmpty() {
				t.Fatal("a new pool does not grow")
			}
			s.SetPool(&p)
			s.StartPoolSettle("p", "uid-p", 1, set(t, "10.0.0.0/28"), t0, t0.Add(time.Minute))
			if tc.end {
				s.EndPoolSettle("p")
			}
			if got := s.PoolsSettling(); (len(got) == 1) == tc.end {
				t.Fatalf("PoolsSettling = %+v", got)
			}
			f := s.PlanFill("a", claimSpec("p", 4, "10.0.0.5"), tc.at)
			if got := f.Pools["p"].Added; count(got) != tc.wantAdd || !got.ContainsSet(set(t, "10.0.0.5")) {
				t.Fatalf("a was given %v, want %d addresses with the claimed 10.0.0.5", got, tc.wantAdd)
			}
			if r := f.Pools["p"].Reason; !strings.Contains(r, tc.reason) || (tc.reason == "" && r != "") {
				t.Fatalf("reason %q, want one naming %q", r, tc.reason)
			}
		})
	}
}

// A pool that grows again while it settles waits for both growths' addresses, from the first
// start (a read of the nodes' pods since then still counts), until the later bound; a pool of
// the same name with another UID starts afresh.
func TestStartPoolSettleTwice(t *testing.T) {
	s := NewState(DefaultExhaustionMarks)
	s.StartPoolSettle("p", "u", 1, set(t, "10.0.0.0/28"), t0, t0.Add(time.Minute))
	s.StartPoolSettle("p", "u", 2, set(t, "10.0.1.0/28"), t0.Add(time.Second), t0.Add(time.Minute+time.Second))
	got := s.PoolsSettling()
	if len(got) != 1 || got[0].Generation != 2 || !got[0].Added.Equal(set(t, "10.0.0.0/28", "10.0.1.0/28")) ||
		!got[0].Started.Equal(t0) || !got[0].Until.Equal(t0.Add(time.Minute+time.Second)) {
		t.Fatalf("settle after a second growth: %+v", got)
	}
	s.StartPoolSettle("p", "v", 1, set(t, "10.0.2.0/28"), t0.Add(2*time.Second), t0.Add(time.Hour))
	if got := s.PoolsSettling(); !got[0].Added.Equal(set(t, "10.0.2.0/28")) || !got[0].Started.Equal(t0.Add(2*time.Second)) {
		t.Fatalf("a new pool of the same name kept the old one's settle: %+v", got)
	}
}

// Which nodes a settling pool's free addresses wait for: every node that could have an agent
// until it observed the pool, unless its pods were read and use none of the new addresses; a node
// whose record or pods show one of them until it observed the pool.
func TestPoolWaits(t *testing.T) {
	obs := func(name string, pools ...ipwardenv1.ObservedPool) ipwardenv1.NodeIPAllocation {
		return ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: ipwardenv1.NodeIPAllocationSpec{ObservedPools: pools}}
	}
	seen := ipwardenv1.ObservedPool{Pool: "p", UID: "u", Generation: 2}
	now := metav1.Now()
	deleting := obs("d", seen)
	deleting.DeletionTimestamp = &now
	// A node holding, under the deleted pool "old", addresses p now hands out.
	holdsOld := obs("h")
	holdsOld.Status.Pools = []ipwardenv1.NodePoolStatus{{Pool: "old", Addresses: []string{"10.0.0.4/30"}}}
	holdsElsewhere := obs("h")
	holdsElsewhere.Status.Pools = []ipwardenv1.NodePoolStatus{{Pool: "q", Addresses: []string{"10.9.0.0/30"}}}
	holdsInP := obs("h") // its holding in p itself is in the record already
	holdsInP.Status.Pools = []ipwardenv1.NodePoolStatus{{Pool: "p", Addresses: []string{"10.0.0.4/30"}}}
	claimsOld := obs("h")
	claimsOld.Spec.Pools = []ipwardenv1.NodePoolRequest{{Pool: "old", Claimed: []ipwardenv1.AddressBlock{"10.0.0.9"}}}

	added := set(t, "10.0.0.0/28")
	none, inside, outside := set(t), set(t, "10.0.0.7", "10.9.0.1"), set(t, "10.9.0.1", "10.0.1.7")
	unread := SettleNode{Selected: true}
	read := func(pods addr.Set) SettleNode { return SettleNode{Selected: true, Pods: &pods} }
	for _, tc := range []struct {
		name       string
		allocs     []ipwardenv1.NodeIPAllocation
		nodes      map[string]SettleNode
		wait, read string
	}{
		{"observed at the generation", []ipwardenv1.NodeIPAllocation{obs("a", seen)}, map[string]SettleNode{"a": unread}, "", ""},
		{"observed a later generation", []ipwardenv1.NodeIPAllocation{obs("a", ipwardenv1.ObservedPool{Pool: "p", UID: "u", Generation: 3})}, map[string]SettleNode{"a": unread}, "", ""},
		{"observed, a pod uses a new address (claimed)", []ipwardenv1.NodeIPAllocation{obs("a", seen)}, map[string]SettleNode{"a": read(inside)}, "", ""},
		{"older generation, pods unread: wait and read", []ipwardenv1.NodeIPAllocation{obs("a", ipwardenv1.ObservedPool{Pool: "p", UID: "u", Generation: 1})}, map[string]SettleNode{"a": unread}, "a", "a"},
		{"a pool of the same name before", []ipwardenv1.NodeIPAllocation{obs("a", ipwardenv1.ObservedPool{Pool: "p", UID: "old", Generation: 5})}, map[string]SettleNode{"a": unread}, "a", "a"},
		{"nothing observed (an old agent, or down)", []ipwardenv1.NodeIPAllocation{obs("a")}, map[string]SettleNode{"a": unread}, "a", "a"},
		{"silent, no pod", []ipwardenv1.NodeIPAllocation{obs("a")}, map[string]SettleNode{"a": read(none)}, "", ""},
		{"silent, pods use addresses outside the new ones", []ipwardenv1.NodeIPAllocation{obs("a")}, map[string]SettleNode{"a": read(outside)}, "", ""},
		{"silent, a pod uses a new address", []ipwardenv1.NodeIPAllocation{obs("a")}, map[string]SettleNode{"a": read(inside)}, "a", ""},
		{"silent, no pool selects it, has an object (drains)", []ipwardenv1.NodeIPAllocation{obs("c")}, map[string]SettleNode{"c": {Pods: &inside}}, "c", ""},
		{"holds new addresses under a deleted pool", []ipwardenv1.NodeIPAllocation{holdsOld}, map[string]SettleNode{"h": read(none)}, "h", ""},
		{"holds new addresses under a deleted pool, pods unread: no read needed", []ipwardenv1.NodeIPAllocation{holdsOld}, map[string]SettleNode{"h": unread}, "h", ""},
		{"claims a new address under another pool", []ipwardenv1.NodeIPAllocation{claimsOld}, map[string]SettleNode{"h": read(none)}, "h", ""},
		{"holds other addresses", []ipwardenv1.NodeIPAllocation{holdsElsewhere}, map[string]SettleNode{"h": read(none)}, "", ""},
		{"holds some of this pool (in the record)", []ipwardenv1.NodeIPAllocation{holdsInP}, map[string]SettleNode{"h": read(none)}, "", ""},
		{"selected, without its object: read", nil, map[string]SettleNode{"b": unread}, "b", "b"},
		{"selected, without its object, a pod uses a new address", nil, map[string]SettleNode{"b": read(inside)}, "b", ""},
		{"selected, without its object, no pod uses one", nil, map[string]SettleNode{"b": read(none)}, "", ""},
		{"object being deleted: not an observation", []ipwardenv1.NodeIPAllocation{deleting}, map[string]SettleNode{"d": unread}, "d", "d"},
		{"no pool selects it, no object: no agent to wait for", nil, map[string]SettleNode{"c": {}}, "", ""},
		{"node gone: its object waits for deletion, not for an agent", []ipwardenv1.NodeIPAllocation{obs("gone")}, map[string]SettleNode{}, "", ""},
		{"sorted", []ipwardenv1.NodeIPAllocation{obs("z"), obs("y"), obs("a")}, map[string]SettleNode{"a": read(inside), "z": unread, "y": unread}, "a,y,z", "y,z"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wait, read, _ := PoolWaits(tc.allocs, tc.nodes, "p", "u", 2, added)
			if got := strings.Join(wait, ","); got != tc.wait {
				t.Errorf("waits for %q, want %q", got, tc.wait)
			}
			if got := strings.Join(read, ","); got != tc.read {
				t.Errorf("reads the pods of %q, want %q", got, tc.read)
			}
		})
	}
}

// PoolWaits counts the nodes that observed the pool (the reads wait while it grows).
func TestPoolWaitsCountsObservers(t *testing.T) {
	seen := ipwardenv1.NodeIPAllocationSpec{ObservedPools: []ipwardenv1.ObservedPool{{Pool: "p", UID: "u", Generation: 2}}}
	allocs := []ipwardenv1.NodeIPAllocation{
		{ObjectMeta: metav1.ObjectMeta{Name: "a"}, Spec: seen},
		{ObjectMeta: metav1.ObjectMeta{Name: "b"}, Spec: seen},
		{ObjectMeta: metav1.ObjectMeta{Name: "c"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "gone"}, Spec: seen}, // no Node: not counted
	}
	nodes := map[string]SettleNode{"a": {Selected: true}, "b": {Selected: true}, "c": {Selected: true}}
	if wait, read, observed := PoolWaits(allocs, nodes, "p", "u", 2, set(t, "10.0.0.0/28")); observed != 2 ||
		strings.Join(wait, ",") != "c" || strings.Join(read, ",") != "c" {
		t.Fatalf("PoolWaits = %v, %v, %d observed; want c, c, 2", wait, read, observed)
	}
}

// A silent node's pods are read podReadAfter after the settle started, or after the last report
// of another node, whichever is later.
func TestPodReadDue(t *testing.T) {
	for _, tc := range []struct {
		name     string
		progress time.Time
		want     time.Time
	}{
		{"no report yet", time.Time{}, t0.Add(podReadAfter)},
		{"a report at the start", t0, t0.Add(podReadAfter)},
		{"reports still coming", t0.Add(5 * time.Second), t0.Add(5*time.Second + podReadAfter)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := PodReadDue(t0, tc.progress); !got.Equal(tc.want) {
				t.Fatalf("PodReadDue = %s, want %s", got.Sub(t0), tc.want.Sub(t0))
			}
		})
	}
}

// The addresses a node's pods report that an agent would adopt: not a finished pod's, not a
// host-network pod's (the node's own address).
func TestPodAddrs(t *testing.T) {
	pod := func(phase corev1.PodPhase, hostNet bool, ips ...string) corev1.Pod {
		p := corev1.Pod{Spec: corev1.PodSpec{HostNetwork: hostNet}, Status: corev1.PodStatus{Phase: phase}}
		for _, ip := range ips {
			p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: ip})
		}
		return p
	}
	got := PodAddrs([]corev1.Pod{
		pod(corev1.PodRunning, false, "10.0.0.5", "fd00::5"),
		pod(corev1.PodPending, false, "10.0.0.6"),
		pod(corev1.PodSucceeded, false, "10.0.0.7"),
		pod(corev1.PodFailed, false, "10.0.0.8"),
		pod(corev1.PodRunning, true, "192.168.0.1"),
		pod(corev1.PodRunning, false, "not-an-address"),
		pod(corev1.PodPending, false),
	})
	if want := set(t, "10.0.0.5-10.0.0.6", "fd00::5"); !got.Equal(want) {
		t.Fatalf("PodAddrs = %v, want %v", got, want)
	}
}

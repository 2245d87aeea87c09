package ipam

import (
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/podinfo"
)

// One rule: an unattributed address leaves the hold only once every pod that may run is
// accounted for on its pool's network, and then only if nothing may still use it; at the
// deadline everything leaves. Pools on two networks (the pod network and "storage").
func TestDecideHold(t *testing.T) {
	until := t0.Add(5 * time.Minute)
	web := PodRef{"ns", "web", "u-web"}
	db := PodRef{"ns", "db", "u-db"}
	pools := []HoldPool{
		{Name: "v4", Unattributed: addr.SetOfAddrs(ip("10.0.0.8"), ip("10.0.0.9"))},
		{Name: "s4", Network: "storage", Unattributed: addr.SetOfAddrs(ip("10.99.0.8"), ip("10.99.0.9"))},
	}
	eth0 := Pod{Ref: web, IPs: []netip.Addr{ip("10.0.0.8")}}
	both := eth0
	both.Networks = []podinfo.NetworkStatus{
		{Name: "cbr0", Interface: "eth0", IPs: []netip.Addr{ip("10.0.0.8")}, Default: true},
		{Name: "default/storage", Interface: "net1", IPs: []netip.Addr{ip("10.99.0.8")}},
	}
	noIPsOnStorage := eth0
	noIPsOnStorage.Networks = []podinfo.NetworkStatus{{Name: "default/storage", Interface: "net1"}}
	sandboxOf := func(r PodRef, ready bool, ips ...string) RuntimeSandbox {
		sb := RuntimeSandbox{ID: "sb-" + r.Name, Pod: r, Ready: ready}
		for _, s := range ips {
			sb.IPs = append(sb.IPs, ip(s))
		}
		return sb
	}
	v4 := func(as ...string) map[string]addr.Set { return map[string]addr.Set{"v4": setOfStrings(as...)} }
	v4s4 := func(a4, s4 []string) map[string]addr.Set {
		return map[string]addr.Set{"v4": setOfStrings(a4...), "s4": setOfStrings(s4...)}
	}
	tests := []struct {
		name    string
		pods    []Pod
		ev      NodeSandboxes
		adds    map[string]string // pod UID -> network of its ADD here
		now     time.Time
		release bool
		reason  string
		free    map[string]addr.Set
		waiting []PodRef
	}{
		{"no pods: everything leaves", nil, NodeSandboxes{}, nil, t0, true, HoldReasonAllReported,
			v4s4([]string{"10.0.0.8", "10.0.0.9"}, []string{"10.99.0.8", "10.99.0.9"}), nil},
		{"status.podIPs settles the pod network only: the secondary pool stays held", []Pod{eth0}, NodeSandboxes{}, nil, t0, false, "",
			v4("10.0.0.9"), []PodRef{web}},
		{"network-status naming the network settles it; reported addresses stay held", []Pod{both}, NodeSandboxes{}, nil, t0, false, "",
			v4s4([]string{"10.0.0.9"}, []string{"10.99.0.9"}), nil},
		{"an entry without addresses settles nothing", []Pod{noIPsOnStorage}, NodeSandboxes{}, nil, t0, false, "",
			v4("10.0.0.9"), []PodRef{web}},
		{"an ADD here on the secondary network settles it", []Pod{eth0}, NodeSandboxes{}, map[string]string{"u-web": "storage"}, t0, false, "",
			v4s4([]string{"10.0.0.9"}, []string{"10.99.0.8", "10.99.0.9"}), nil},
		{"an ADD here on the pod network does not settle the secondary one", []Pod{{Ref: web}}, NodeSandboxes{}, map[string]string{"u-web": ""}, t0, false, "",
			v4("10.0.0.8", "10.0.0.9"), []PodRef{web}},
		{"the runtime shows the pod's sandbox: the pod network settles without a status", []Pod{{Ref: web}},
			NodeSandboxes{Known: true, Sandboxes: []RuntimeSandbox{sandboxOf(web, true, "10.0.0.8")}}, nil, t0, false, "",
			v4("10.0.0.9"), []PodRef{web}},
		{"a pod the runtime does not show keeps the pod network held, whatever its status says", []Pod{eth0},
			NodeSandboxes{Known: true}, nil, t0, false, "", map[string]addr.Set{}, []PodRef{web}},
		{"an address a sandbox uses stays held, ready or not, bound pod or not", []Pod{both},
			NodeSandboxes{Known: true, Sandboxes: []RuntimeSandbox{sandboxOf(web, true, "10.0.0.8"), sandboxOf(db, false, "10.0.0.9")}}, nil, t0, false, "",
			v4s4(nil, []string{"10.99.0.9"}), nil},
		{"host network and finished pods settle everything", []Pod{{Ref: db, HostNetwork: true}, {Ref: web, Finished: true}}, NodeSandboxes{}, nil, t0, true,
			HoldReasonAllReported, v4s4([]string{"10.0.0.8", "10.0.0.9"}, []string{"10.99.0.8", "10.99.0.9"}), nil},
		{"a deleting pod may still run", []Pod{{Ref: db, Deleting: true}}, NodeSandboxes{}, nil, t0, false, "", map[string]addr.Set{}, []PodRef{db}},
		{"a pod without UID cannot have an ADD", []Pod{{Ref: PodRef{"ns", "x", ""}}}, NodeSandboxes{}, map[string]string{"": ""}, t0, false, "",
			map[string]addr.Set{}, []PodRef{{"ns", "x", ""}}},
		{"deadline: everything leaves, naming those it waited for", []Pod{eth0, {Ref: db}}, NodeSandboxes{}, nil, until, true, HoldReasonDeadline,
			v4s4([]string{"10.0.0.8", "10.0.0.9"}, []string{"10.99.0.8", "10.99.0.9"}), []PodRef{db, web}},
		{"deadline with the runtime: what a sandbox has stays held", []Pod{both}, NodeSandboxes{Known: true,
			Sandboxes: []RuntimeSandbox{{ID: "sb-attached", Pod: web, Ready: true, IPs: []netip.Addr{ip("10.0.0.8")}}}}, nil, until, false, HoldReasonDeadline,
			v4s4([]string{"10.0.0.9"}, []string{"10.99.0.8", "10.99.0.9"}), nil},
		{"deadline: a sandbox that predates the hold, its pod silent on storage, keeps the secondary pool held", []Pod{eth0}, NodeSandboxes{Known: true,
			Sandboxes: []RuntimeSandbox{{ID: "sb-old", Pod: web, Ready: true, IPs: []netip.Addr{ip("10.0.0.8")}}}}, nil, until, false, HoldReasonDeadline,
			v4("10.0.0.9"), []PodRef{web}},
		{"deadline: a predating sandbox of a host-network pod holds nothing", []Pod{{Ref: db, HostNetwork: true}}, NodeSandboxes{Known: true,
			Sandboxes: []RuntimeSandbox{{ID: "sb-host", Pod: db, Ready: true}}}, nil, until, true, HoldReasonDeadline,
			v4s4([]string{"10.0.0.8", "10.0.0.9"}, []string{"10.99.0.8", "10.99.0.9"}), nil},
		{"deadline: a predating sandbox of a pod the node does not list keeps it held", nil, NodeSandboxes{Known: true,
			Sandboxes: []RuntimeSandbox{{ID: "sb-gone", Pod: db, Ready: false}}}, nil, until, false, HoldReasonDeadline,
			v4("10.0.0.8", "10.0.0.9"), nil},
		{"deadline: a sandbox this agent attached (set up since) holds nothing", []Pod{{Ref: web, IPs: []netip.Addr{ip("10.0.0.8")}}}, NodeSandboxes{Known: true,
			Sandboxes: []RuntimeSandbox{{ID: "sb-attached", Pod: web, Ready: true}}}, nil, until, true, HoldReasonDeadline,
			v4s4([]string{"10.0.0.8", "10.0.0.9"}, []string{"10.99.0.8", "10.99.0.9"}), []PodRef{web}},
		{"the runtime configured but not answering: no pods, yet nothing leaves before the deadline", nil, NodeSandboxes{Unreadable: true}, nil, t0, false, "",
			map[string]addr.Set{}, nil},
		{"the runtime configured but not answering: reports release nothing", []Pod{both}, NodeSandboxes{Unreadable: true}, nil, t0, false, "",
			map[string]addr.Set{}, nil},
		{"the runtime configured but not answering: at the deadline everything leaves", []Pod{both}, NodeSandboxes{Unreadable: true}, nil, until, true, HoldReasonDeadline,
			v4s4([]string{"10.0.0.8", "10.0.0.9"}, []string{"10.99.0.8", "10.99.0.9"}), nil},
		{"just before the deadline", []Pod{{Ref: db}}, NodeSandboxes{}, nil, until.Add(-time.Nanosecond), false, "", map[string]addr.Set{}, []PodRef{db}},
		{"waiting sorted", []Pod{{Ref: db}, {Ref: PodRef{"a", "z", "u1"}}}, NodeSandboxes{}, nil, t0, false, "", map[string]addr.Set{},
			[]PodRef{{"a", "z", "u1"}, db}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			hasADD := func(uid, network string) bool { n, ok := tc.adds[uid]; return ok && n == network }
			d := DecideHold(pools, tc.pods, tc.ev, hasADD, func(cid string) bool { return cid == "sb-attached" }, tc.now, until)
			if d.Release != tc.release || d.Reason != tc.reason || !reflect.DeepEqual(d.Waiting, tc.waiting) || !equalFree(d.Free, tc.free) {
				t.Fatalf("DecideHold = %+v, want release %v reason %q free %v waiting %v", d, tc.release, tc.reason, tc.free, tc.waiting)
			}
		})
	}
}

func setOfStrings(as ...string) addr.Set {
	var out []netip.Addr
	for _, a := range as {
		out = append(out, netip.MustParseAddr(a))
	}
	return addr.SetOfAddrs(out...)
}

func equalFree(a, b map[string]addr.Set) bool {
	for k, v := range a {
		if !v.IsEmpty() && !v.Equal(b[k]) {
			return false
		}
	}
	for k, v := range b {
		if !v.IsEmpty() && !v.Equal(a[k]) {
			return false
		}
	}
	return true
}

// The lost-journal case: pod web's ADD was answered (10.0.0.8), the journal is lost before its
// status.podIPs is written. After the rebuild nothing records 10.0.0.8; the hold keeps every
// unattributed address out of use, counts it as demand (so the node asks for more), never
// releases it, serves new pods from addresses granted later, attributes web's address once web
// reports it, and frees the rest only then.
func TestHoldAfterLostJournal(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/30")
	web := PodRef{"ns", "web", "u-web"}
	// The journal is lost: a new state knows the pool and the holding, not the attachment.
	h.s = New("node-a")
	h.s.SetPools([]Pool{poolV4}, []string{"v4"})
	h.s.SetHolding("v4", set(t, "10.0.0.8/30"))
	pods := []Pod{{Ref: web}}
	h.s.SetPods(pods)
	if ch, _ := h.s.Rebuild(pods, h.now); !ch.IsEmpty() {
		t.Fatalf("rebuilt %+v from a pod without addresses", ch)
	}
	if n := h.s.StartHold(h.now.Add(5 * time.Minute)); n != 4 {
		t.Fatalf("StartHold held %d addresses, want 4", n)
	}
	if d := h.s.EvaluateHold(h.now); d.Release || !reflect.DeepEqual(d.Waiting, []PodRef{web}) {
		t.Fatalf("EvaluateHold = %+v", d)
	}
	var short *ShortError
	if _, err := h.add("other"); !errors.As(err, &short) {
		t.Fatalf("ADD during the hold: %v, want a ShortError", err)
	}
	st := h.s.Stats(h.now)[0]
	if st.Free != 0 || st.Unattributed != 4 || st.Demand < 5 {
		t.Fatalf("stats during the hold: %+v", st)
	}
	if plan := h.s.Release(h.now); len(plan.Marked) != 0 {
		t.Fatalf("released unattributed addresses: %+v", plan.Marked)
	}
	// The controller grants more: those are free at once.
	h.s.SetHolding("v4", set(t, "10.0.0.8/29"))
	if got := h.mustAdd("other"); got[0] != "10.0.0.12" {
		t.Fatalf("ADD from a new grant got %v", got)
	}
	// web reports its address: attributed, and the hold ends.
	pods = []Pod{{Ref: web, IPs: []netip.Addr{ip("10.0.0.8")}}, {Ref: PodRef{"ns", "other", "uid-other"}}}
	h.s.SetPods(pods)
	if ch, _ := h.s.Rebuild(pods, h.now); len(ch.PutAttachments) != 1 {
		t.Fatalf("rebuild after web reported: %+v", ch)
	}
	if d := h.s.EvaluateHold(h.now); !d.Release || d.Reason != HoldReasonAllReported {
		t.Fatalf("EvaluateHold = %+v", d)
	}
	if on, _ := h.s.Hold(); on {
		t.Fatal("hold still on")
	}
	for i := range 6 {
		a, err := h.add(fmt.Sprint("n", i))
		if err != nil {
			break
		}
		if a.Addresses[0].Addr == ip("10.0.0.8") {
			t.Fatal("handed out web's address")
		}
	}
}

func TestHoldEndsAtDeadlineAndNotWithoutAddresses(t *testing.T) {
	h := newHarness(t, poolV4)
	h.s.SetPods([]Pod{{Ref: PodRef{"ns", "web", "u-web"}}})
	if n := h.s.StartHold(h.now.Add(time.Minute)); n != 0 {
		t.Fatalf("held %d addresses before any holding", n)
	}
	if on, _ := h.s.Hold(); on {
		t.Fatal("a hold over nothing")
	}
	h.hold("v4", "10.0.0.8/30")
	h.s.StartHold(h.now.Add(time.Minute))
	if d := h.s.EvaluateHold(h.now.Add(59 * time.Second)); d.Release {
		t.Fatalf("released early: %+v", d)
	}
	if d := h.s.EvaluateHold(h.now.Add(time.Minute)); !d.Release || d.Reason != HoldReasonDeadline {
		t.Fatalf("at the deadline: %+v", d)
	}
	if got := h.mustAdd("a"); got[0] != "10.0.0.8" {
		t.Fatalf("after the hold got %v", got)
	}
}

package ipam

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/podinfo"
)

// poolS4 serves the secondary network "storage"; poolS4Overlap does too, over the pod network's
// addresses (pools on two networks may overlap).
var (
	poolS4 = Pool{Name: "s4", Network: "storage", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.99.0.0/24")},
		Scaling: poolV4.Scaling, Cooldown: 30 * time.Second}
	poolS4Overlap = Pool{Name: "s4o", Network: "storage", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")},
		Scaling: poolV4.Scaling, Cooldown: 30 * time.Second}
)

func withStorage(p Pod, ips ...string) Pod {
	n := podinfo.NetworkStatus{Name: "default/storage", Interface: "net1"}
	for _, s := range ips {
		n.IPs = append(n.IPs, ip(s))
	}
	p.Networks = append(slices.Clone(p.Networks), n)
	return p
}

func reporting(ref PodRef, ips ...string) Pod {
	p := Pod{Ref: ref}
	for _, s := range ips {
		p.IPs = append(p.IPs, ip(s))
	}
	return p
}

// attachedTo lists "pool=addr" of every attachment of the pod with uid, sorted.
func attachedTo(s *State, uid string) []string {
	var out []string
	for _, k := range s.PodAttachments(uid) {
		a, _ := s.Attachment(k)
		for _, ad := range a.Addresses {
			out = append(out, ad.Pool+"="+ad.Addr.String())
		}
	}
	slices.Sort(out)
	return out
}

// The rebuild reads a pod's addresses network by network, from the best evidence the node has,
// and never lets a report beat the journal on a network the journal attaches the pod.
func TestRebuildReadsEachNetworkFromItsOwnEvidence(t *testing.T) {
	web := PodRef{"ns", "web", "uid-web"}
	sandbox := func(ready bool, ips ...string) NodeSandboxes {
		sb := RuntimeSandbox{ID: "sb1", Pod: web, Ready: ready}
		for _, s := range ips {
			sb.IPs = append(sb.IPs, ip(s))
		}
		return NodeSandboxes{Known: true, Sandboxes: []RuntimeSandbox{sb}}
	}
	tests := []struct {
		name  string
		pools []Pool
		// journal sets up what the journal holds before the rebuild.
		journal func(h *harness)
		pod     Pod
		ev      NodeSandboxes
		want    []string // the pod's attachments after the rebuild, pool=addr
		claimed []string // addresses the node claims afterwards
	}{
		{name: "lost journal: eth0 from status.podIPs, net1 from network-status",
			pools: []Pool{poolV4, poolS4}, pod: withStorage(reporting(web, "10.0.0.8"), "10.99.0.8"),
			want: []string{"s4=10.99.0.8", "v4=10.0.0.8"}},
		{name: "lost journal without Multus' report: only eth0 is known",
			pools: []Pool{poolV4, poolS4}, pod: reporting(web, "10.0.0.8"),
			want: []string{"v4=10.0.0.8"}},
		{name: "overlapping pools on two networks: each address goes to its own network's pool",
			pools: []Pool{poolV4, poolS4Overlap}, pod: withStorage(reporting(web, "10.0.0.8"), "10.0.0.9"),
			want: []string{"s4o=10.0.0.9", "v4=10.0.0.8"}},
		{name: "the runtime's ready sandbox beats a stale status on the pod network",
			pools: []Pool{poolV4}, pod: reporting(web, "10.0.0.8"), ev: sandbox(true, "10.0.0.9"),
			want: []string{"v4=10.0.0.9"}},
		{name: "a sandbox that is not ready proves no address to attach",
			pools: []Pool{poolV4}, pod: reporting(web, "10.0.0.8"), ev: sandbox(false, "10.0.0.8")},
		{name: "a pod the runtime does not show is read from its status",
			pools: []Pool{poolV4}, pod: reporting(web, "10.0.0.8"), ev: NodeSandboxes{Known: true},
			want: []string{"v4=10.0.0.8"}},
		{name: "journal beats status: a re-created sandbox's stale status gets no second attachment, nor a claim",
			pools: []Pool{poolV4},
			journal: func(h *harness) {
				// The first sandbox got .2 and ended with its DEL; the new one got .3. The
				// controller then took .2 back (the node gave it back).
				h.mustAddPod("sb1", web)
				h.del("sb1")
				h.mustAddPod("sb2", web)
				h.now = h.now.Add(time.Minute) // past the cooldown
				h.hold("v4", "10.0.0.3-10.0.0.5")
				h.crash() // SIGKILL: the memory of the DEL is gone
			},
			pod: reporting(web, "10.0.0.2"), want: []string{"v4=10.0.0.3"}},
		{name: "journal beats status while the node still holds the old address past its cooldown",
			pools: []Pool{poolV4},
			journal: func(h *harness) {
				h.mustAddPod("sb1", web)
				h.del("sb1")
				h.mustAddPod("sb2", web)
				h.now = h.now.Add(time.Minute)
				h.crash()
			},
			pod: reporting(web, "10.0.0.2"), want: []string{"v4=10.0.0.3"}},
		{name: "journal beats status on its network only: net1 is still read from network-status",
			pools:   []Pool{poolV4, poolS4},
			journal: func(h *harness) { h.mustAddPod("sb1", web) },
			pod:     withStorage(reporting(web, "10.0.0.9"), "10.99.0.8"),
			want:    []string{"s4=10.99.0.8", "v4=10.0.0.2"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, tc.pools...)
			for _, p := range tc.pools {
				h.hold(p.Name, p.CIDRs[0].String())
			}
			if tc.journal != nil {
				tc.journal(h)
			}
			h.s.SetSandboxes(tc.ev)
			pods := []Pod{tc.pod}
			h.s.SetPods(pods)
			plan := h.s.PlanRebuild(pods, h.now, nil)
			h.s.Apply(plan)
			if got := attachedTo(h.s, web.UID); !slices.Equal(got, tc.want) {
				t.Fatalf("the pod's attachments = %v, want %v (problems %v)", got, tc.want, plan.Problems)
			}
			var claimed []string
			for _, r := range h.s.Spec() {
				for _, a := range r.Claimed.Addrs(16) {
					claimed = append(claimed, a.String())
				}
			}
			if !slices.Equal(claimed, tc.claimed) {
				t.Fatalf("claimed %v, want %v", claimed, tc.claimed)
			}
		})
	}
}

// A rebuilt address the pod's reports no longer name, on a network where it reports another,
// goes through the reuse cooldown once its write lands, never before; the pod's new address
// replaces it in the same plan. One a sandbox the runtime shows still uses stays.
func TestRebuildDropsAStaleRebuiltAddressThroughTheCooldown(t *testing.T) {
	web := PodRef{"ns", "web", "uid-web"}
	for _, tc := range []struct {
		name    string
		ev      NodeSandboxes
		dropped bool
	}{
		{"no runtime to ask", NodeSandboxes{}, true},
		{"the runtime shows no sandbox with it", NodeSandboxes{Known: true}, true},
		{"a sandbox still has it", NodeSandboxes{Known: true, Sandboxes: []RuntimeSandbox{{ID: "old", Pod: PodRef{"ns", "gone", "uid-gone"}, IPs: []netip.Addr{ip("10.0.0.8")}}}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, poolV4)
			h.hold("v4", "10.0.0.8/30")
			// Lost journal: recorded .8 from the status.
			pods := []Pod{reporting(web, "10.0.0.8")}
			h.s.SetPods(pods)
			h.s.Apply(h.s.PlanRebuild(pods, h.now, nil))
			// The status now shows .9 (the journal's loss hid the ADD that gave it).
			h.now = h.now.Add(time.Minute)
			h.s.SetSandboxes(tc.ev)
			pods = []Pod{reporting(web, "10.0.0.9")}
			h.s.SetPods(pods)
			plan := h.s.PlanRebuild(pods, h.now, nil)
			if !tc.dropped {
				h.s.Apply(plan)
				if got := attachedTo(h.s, web.UID); !slices.Equal(got, []string{"v4=10.0.0.8"}) {
					t.Fatalf("attachments %v: the address a sandbox uses must stay", got)
				}
				return
			}
			if got := attachedTo(h.s, web.UID); !slices.Equal(got, []string{"v4=10.0.0.9"}) {
				t.Fatalf("planned attachments %v, want the new address only", got)
			}
			// Until the write lands .8 is not free: an ADD cannot take it.
			for i := range 2 {
				if a, err := h.add(strings.Repeat("x", i+1)); err == nil && a.Addresses[0].Addr == ip("10.0.0.8") {
					t.Fatal("handed out the stale address before the rebuild's write landed")
				}
			}
			if !slices.ContainsFunc(plan.Change.PutCooling, func(c Cooling) bool { return c.Addr == ip("10.0.0.8") }) {
				t.Fatalf("the plan does not journal .8 as cooling: %+v", plan.Change)
			}
			h.s.Apply(plan)
			if st := h.s.Stats(h.now)[0]; st.Cooling != 1 {
				t.Fatalf("after the write .8 must cool: %+v", st)
			}
		})
	}
}

// A refused rebuild puts everything back, the stale address included.
func TestRebuildAbortKeepsTheStaleAddress(t *testing.T) {
	web := PodRef{"ns", "web", "uid-web"}
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/30")
	pods := []Pod{reporting(web, "10.0.0.8")}
	h.s.Apply(h.s.PlanRebuild(pods, h.now, nil))
	pods = []Pod{reporting(web, "10.0.0.9")}
	plan := h.s.PlanRebuild(pods, h.now, nil)
	h.s.Abort(plan)
	if got := attachedTo(h.s, web.UID); !slices.Equal(got, []string{"v4=10.0.0.8"}) {
		t.Fatalf("after the abort: %v", got)
	}
	if st := h.s.Stats(h.now)[0]; st.InUse != 1 || st.Cooling != 0 {
		t.Fatalf("after the abort: %+v", st)
	}
}

func (h *harness) mustAddPod(cid string, pod PodRef) {
	h.t.Helper()
	a, ch, err := h.s.Add(AddRequest{Key: key(cid), Network: "net", Pod: pod, Pools: []string{"v4"}}, h.now)
	if err != nil {
		h.t.Fatalf("add %s: %v (%v)", cid, err, a)
	}
	h.commit(ch)
	h.s.Apply(AddPlan{Key: key(cid), Change: ch})
}

// Proof beats another pod's report: an address recorded for a pod from its reports (a stale
// status, read before the runtime was, or while the runtime did not list the new sandbox yet)
// moves to the pod whose ready sandbox the runtime shows with it, unless the runtime shows a
// sandbox of the first pod with it too, or the journal (an ADD here) attaches it.
func TestRebuildProofBeatsAnotherPodsReport(t *testing.T) {
	web := PodRef{"ns", "web", "uid-web"}
	old := PodRef{"ns", "old", "uid-old"} // its sandbox ended; its status still names .8
	shows := func(sbs ...RuntimeSandbox) NodeSandboxes { return NodeSandboxes{Known: true, Sandboxes: sbs} }
	webReady := RuntimeSandbox{ID: "sb-web", Pod: web, Ready: true, IPs: []netip.Addr{ip("10.0.0.8")}}
	for _, tc := range []struct {
		name string
		// first is the reading of the rebuild that recorded .8 for old (none: before the runtime
		// was read).
		first   *NodeSandboxes
		journal bool // .8 is old's by an ADD here, not by a report
		ev      NodeSandboxes
		oldGets []string
		webGets []string
	}{
		{name: "recorded from the status before the runtime was read",
			ev: shows(webReady), webGets: []string{"v4=10.0.0.8"}},
		{name: "recorded while the runtime did not list the new sandbox yet", first: &NodeSandboxes{Known: true},
			ev: shows(webReady), webGets: []string{"v4=10.0.0.8"}},
		{name: "one plan: the report is read first, the proof takes it back", first: ptr(shows(webReady)),
			ev: shows(webReady), webGets: []string{"v4=10.0.0.8"}},
		{name: "a sandbox of the first pod still has it: a conflict, nothing moves",
			ev:      shows(webReady, RuntimeSandbox{ID: "sb-old", Pod: old, IPs: []netip.Addr{ip("10.0.0.8")}}),
			oldGets: []string{"v4=10.0.0.8"}},
		{name: "the journal attaches it: nothing moves", journal: true,
			ev: shows(webReady), oldGets: []string{"v4=10.0.0.2"}},
		{name: "no runtime to ask: reports against reports, nothing moves",
			ev: NodeSandboxes{}, oldGets: []string{"v4=10.0.0.8"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, poolV4)
			h.hold("v4", "10.0.0.0/24")
			oldPod := reporting(old, "10.0.0.8")
			if tc.journal {
				h.mustAddPod("sb-old", old) // .2, and its status says so
				oldPod = reporting(old, "10.0.0.2")
				tc.ev.Sandboxes[0].IPs = []netip.Addr{ip("10.0.0.2")}
			}
			pods := []Pod{oldPod, {Ref: web}}
			if tc.first != nil {
				h.s.SetSandboxes(*tc.first)
			}
			h.s.SetPods(pods)
			first := h.s.PlanRebuild(pods, h.now, nil)
			h.commit(first.Change)
			h.s.Apply(first)
			h.s.SetSandboxes(tc.ev)
			plan := h.s.PlanRebuild(pods, h.now, nil)
			h.commit(plan.Change)
			h.s.Apply(plan)
			if got := attachedTo(h.s, old.UID); !slices.Equal(got, tc.oldGets) {
				t.Fatalf("old's attachments = %v, want %v (problems %v)", got, tc.oldGets, plan.Problems)
			}
			if !tc.journal {
				if got := attachedTo(h.s, web.UID); !slices.Equal(got, tc.webGets) {
					t.Fatalf("web's attachments = %v, want %v (problems %v)", got, tc.webGets, plan.Problems)
				}
			}
			// The journal holds what memory holds.
			h.crash()
			if got := attachedTo(h.s, old.UID); !slices.Equal(got, tc.oldGets) {
				t.Fatalf("after a restart old's attachments = %v, want %v", got, tc.oldGets)
			}
		})
	}
}

func ptr[T any](v T) *T { return &v }

package ipam

import (
	"net/netip"
	"reflect"
	"slices"
	"testing"
	"time"
)

// One rule, one table: a reservation is re-created from its claim's status entry only while its
// pod may run, the address is the node's (a pool serving it, held, not moved on since the loss),
// no other evidence names it, the pod's own reports do not show it running with another address
// of the pool, and no other attachment than the pod's own uses it.
func TestDecideRecovery(t *testing.T) {
	a := ip("10.0.0.5")
	ok := RecoveryFacts{PodRuns: true, Served: true, Held: true}
	with := func(change func(f *RecoveryFacts)) RecoveryFacts { f := ok; change(&f); return f }
	for _, tc := range []struct {
		name string
		f    RecoveryFacts
		want string
	}{
		{"a free address of the node: recovered", ok, RecoveryRecovered},
		{"the pod's rebuilt attachment uses it (its sandbox runs with it): recovered", with(func(f *RecoveryFacts) { f.Owner = OwnerPodRebuilt }), RecoveryRecovered},
		{"the pod's own ADD on the claim's interface uses it: recovered, shared", with(func(f *RecoveryFacts) { f.Owner = OwnerPodAttachment }), RecoveryRecovered},
		{"reserved already with that address: nothing to do", with(func(f *RecoveryFacts) { f.Reserved, f.ReservedAddr = true, a }), RecoveryAlready},
		{"reserved already with another address: the journal's stays", with(func(f *RecoveryFacts) { f.Reserved, f.ReservedAddr = true, ip("10.0.0.6") }), RecoveryReservedOther},
		{"the pod is gone or done: nothing to recover", with(func(f *RecoveryFacts) { f.PodRuns = false }), RecoveryPodNotRunning},
		{"the pod is done, whatever else: nothing to recover", with(func(f *RecoveryFacts) { f.PodRuns, f.Served, f.Owner = false, false, OwnerOther }), RecoveryPodNotRunning},
		{"the device's pool no longer serves the node", with(func(f *RecoveryFacts) { f.Served = false }), RecoveryPoolNotServing},
		{"the node does not hold the address", with(func(f *RecoveryFacts) { f.Held = false }), RecoveryNotHeld},
		{"another entry names the address: neither", with(func(f *RecoveryFacts) { f.Duplicate = true }), RecoveryDuplicate},
		{"releasing, cooling or reserved ahead since the loss", with(func(f *RecoveryFacts) { f.OutOfUse = true }), RecoveryOutOfUse},
		{"the pod reports another address of the pool: the entry is older", with(func(f *RecoveryFacts) { f.PodReportsOther = true }), RecoveryPodReportsElse},
		{"another owner (another pod, a reservation, an IPAMClaim's shared address): kept", with(func(f *RecoveryFacts) { f.Owner = OwnerOther }), RecoveryInUse},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := DecideRecovery(tc.f, a); got != tc.want {
				t.Fatalf("DecideRecovery(%+v) = %s, want %s", tc.f, got, tc.want)
			}
			if got := IsRecoveryConflict(tc.want); got != (tc.want != RecoveryRecovered && tc.want != RecoveryAlready && tc.want != RecoveryPodNotRunning) {
				t.Fatalf("IsRecoveryConflict(%s) = %v", tc.want, got)
			}
		})
	}
}

func evidence(cid, ifname, pool, a string) ReservationEvidence {
	dev := pool + "-s0"
	return ReservationEvidence{Claim: ClaimDevice{Namespace: "ns", Name: "claim-" + cid, UID: "claim-" + cid, Request: "addr", Device: dev, Interface: ifname},
		Pod: PodRef{"ns", cid, "uid-" + cid}, Pool: pool, Addr: ip(a)}
}

// owner returns the key that uses address a of pool, or "" when none.
func owner(s *State, pool, a string) string {
	if k, ok := s.pools[pool].inUse[ip(a)]; ok {
		return k.String()
	}
	return ""
}

// The state's side of a recovery after a lost journal (the node holds 10.0.0.2-9, nothing is
// journaled but what the rebuild from the pods recorded): what each decision does to the
// attachments, and that the address is then exactly the reservation's: the pod's ADD on the
// claim's interface gets it, no other ADD does, a restart restores it, and the hold holds
// nothing the reservation owns. Pod web's claim names 10.0.0.5 on eth0 (pool v4); pod db is
// another pod.
func TestRecoverReservations(t *testing.T) {
	web := PodRef{"ns", "web", "uid-web"}
	db := PodRef{"ns", "db", "uid-db"}
	const x = "10.0.0.5"
	for _, tc := range []struct {
		name string
		pods []Pod
		evs  []ReservationEvidence
		// before: ADDs made before the recovery (cid -> pod); the ADD of "web" is on eth0.
		before []string
		want   string // the outcome of the first evidence
		// wantOwner is the user of x after the recovery; wantRebuilt the addresses left to the
		// rebuilt attachment of web (nil: none).
		wantOwner   string
		wantRebuilt []string
	}{
		{name: "no report: the free address is recovered", pods: []Pod{{Ref: web}}, evs: []ReservationEvidence{evidence("web", "eth0", "v4", x)},
			want: RecoveryRecovered, wantOwner: "dra:claim-web/addr/v4-s0"},
		{name: "the pod reports it: its rebuilt attachment gives it up", pods: []Pod{reporting(web, x)}, evs: []ReservationEvidence{evidence("web", "eth0", "v4", x)},
			want: RecoveryRecovered, wantOwner: "dra:claim-web/addr/v4-s0"},
		{name: "the rebuilt attachment keeps the pod's other addresses", pods: []Pod{withStorage(reporting(web, x), "10.99.0.7")},
			evs: []ReservationEvidence{evidence("web", "eth0", "v4", x)}, want: RecoveryRecovered, wantOwner: "dra:claim-web/addr/v4-s0",
			wantRebuilt: []string{"s4=10.99.0.7"}},
		{name: "another pod reports it: it keeps it, not recovered", pods: []Pod{{Ref: web}, reporting(db, x)},
			evs: []ReservationEvidence{evidence("web", "eth0", "v4", x)}, want: RecoveryInUse, wantOwner: RebuiltKey("uid-db").String()},
		{name: "the pod reports another address of the pool: not recovered", pods: []Pod{reporting(web, "10.0.0.6")},
			evs: []ReservationEvidence{evidence("web", "eth0", "v4", x)}, want: RecoveryPodReportsElse, wantRebuilt: []string{"v4=10.0.0.6"}},
		{name: "the pod is done: not recovered", pods: []Pod{{Ref: web, Finished: true}},
			evs: []ReservationEvidence{evidence("web", "eth0", "v4", x)}, want: RecoveryPodNotRunning},
		{name: "two claims name the address: neither", pods: []Pod{{Ref: web}, {Ref: db}},
			evs: []ReservationEvidence{evidence("web", "eth0", "v4", x), evidence("db", "eth0", "v4", x)}, want: RecoveryDuplicate},
		{name: "the pool no longer serves the node", pods: []Pod{{Ref: web}}, evs: []ReservationEvidence{evidence("web", "eth0", "", x)},
			want: RecoveryPoolNotServing},
		{name: "an address the node does not hold", pods: []Pod{{Ref: web}}, evs: []ReservationEvidence{evidence("web", "eth0", "v4", "10.0.0.20")},
			want: RecoveryNotHeld},
		{name: "the pod's own ADD on the claim's interface shares it", pods: []Pod{{Ref: web}}, before: []string{"web"},
			evs: []ReservationEvidence{evidence("web", "eth0", "v4", "10.0.0.2")}, want: RecoveryRecovered, wantOwner: "dra:claim-web/addr/v4-s0"},
		{name: "the pod's own ADD on another interface: kept, not recovered", pods: []Pod{{Ref: web}}, before: []string{"web"},
			evs: []ReservationEvidence{evidence("web", "net1", "v4", "10.0.0.2")}, want: RecoveryInUse, wantOwner: key("web").String()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, poolV4, poolS4)
			h.hold("v4", "10.0.0.2-10.0.0.9")
			h.hold("s4", "10.99.0.2-10.99.0.9")
			h.s.SetPods(tc.pods)
			ch, _ := h.s.Rebuild(tc.pods, h.now)
			h.commit(ch)
			for _, cid := range tc.before {
				h.mustAddPod(cid, PodRef{"ns", cid, "uid-" + cid})
			}
			before := h.s.Attachments()
			plan := h.s.PlanRecoverReservations(tc.evs, h.now)
			if got := plan.Outcomes[0].Reason; got != tc.want {
				t.Fatalf("outcome %s, want %s (%v)", got, tc.want, plan.Outcomes)
			}
			h.commit(plan.Changes())
			h.s.Apply(plan)
			if tc.want != RecoveryRecovered {
				if !reflect.DeepEqual(h.s.Attachments(), before) {
					t.Fatalf("not recovered, yet the attachments changed:\n%v\nwant\n%v", h.s.Attachments(), before)
				}
			}
			addr := tc.evs[0].Addr.String()
			if got := owner(h.s, "v4", addr); got != tc.wantOwner {
				t.Fatalf("%s is used by %q, want %q", addr, got, tc.wantOwner)
			}
			var rebuilt []string
			if a, ok := h.s.Attachment(RebuiltKey("uid-web")); ok {
				for _, ad := range a.Addresses {
					rebuilt = append(rebuilt, ad.Pool+"="+ad.Addr.String())
				}
			}
			if !slices.Equal(rebuilt, tc.wantRebuilt) {
				t.Fatalf("web's rebuilt attachment holds %v, want %v", rebuilt, tc.wantRebuilt)
			}
			if tc.want != RecoveryRecovered {
				return
			}
			h.crash() // fails on any restore problem
			h.s.SetPods(tc.pods)
			if got := owner(h.s, "v4", addr); got != "dra:claim-web/addr/v4-s0" {
				t.Fatalf("after a restart %s is used by %q", addr, got)
			}
			for _, other := range []string{"p", "q", "r", "s"} {
				if got := h.mustAdd(other, "v4"); slices.Contains(got, addr) {
					t.Fatalf("pod %s's ADD got the reserved %s", other, addr)
				}
			}
			if tc.before == nil {
				a, err := h.add("web", "v4")
				if err != nil || len(a.Addresses) != 1 || a.Addresses[0].Addr.String() != addr {
					t.Fatalf("the claim's pod's ADD on eth0: %v, %v; want %s", a.Addresses, err, addr)
				}
			}
			h.s.StartHold(h.now.Add(5 * time.Minute))
			if h.s.Unattributed("v4").Contains(ip(addr)) {
				t.Fatalf("the hold holds the reserved %s", addr)
			}
		})
	}
}

// A recovery the journal refuses leaves the state as it was: the rebuilt attachment has its
// address again, the hold holds what it held, nothing is reserved.
func TestRecoverReservationsAbort(t *testing.T) {
	web := PodRef{"ns", "web", "uid-web"}
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.2-10.0.0.9")
	pods := []Pod{reporting(web, "10.0.0.5"), {Ref: PodRef{"ns", "idle", "uid-idle"}}}
	h.s.SetPods(pods)
	ch, _ := h.s.Rebuild(pods, h.now)
	h.commit(ch)
	h.s.StartHold(h.now.Add(5 * time.Minute))
	before, held, stats := h.s.Attachments(), h.s.Unattributed("v4"), h.s.Stats(h.now)
	plan := h.s.PlanRecoverReservations([]ReservationEvidence{evidence("web", "eth0", "v4", "10.0.0.5"), evidence("idle", "eth0", "v4", "10.0.0.7")}, h.now)
	if plan.Recovered() != 2 {
		t.Fatalf("outcomes %v, want both recovered", plan.Outcomes)
	}
	if h.s.Unattributed("v4").Contains(ip("10.0.0.7")) {
		t.Fatal("the planned reservation's address is still held by the hold")
	}
	h.s.Abort(plan)
	if !reflect.DeepEqual(h.s.Attachments(), before) || !h.s.Unattributed("v4").Equal(held) || !reflect.DeepEqual(h.s.Stats(h.now), stats) {
		t.Fatalf("after the abort:\n%v %v %+v\nwant\n%v %v %+v", h.s.Attachments(), h.s.Unattributed("v4"), h.s.Stats(h.now), before, held, stats)
	}
	if owner(h.s, "v4", "10.0.0.5") != RebuiltKey("uid-web").String() || owner(h.s, "v4", "10.0.0.7") != "" {
		t.Fatalf("owners after the abort: %q %q", owner(h.s, "v4", "10.0.0.5"), owner(h.s, "v4", "10.0.0.7"))
	}
	for _, k := range []Key{RebuiltKey("uid-web"), evidence("web", "eth0", "v4", "10.0.0.5").Key()} {
		if h.s.Pending(k) {
			t.Fatalf("%s still pending", k)
		}
	}
}

// A reservation is no ADD: the hold still waits for the pod of a recovered reservation until its
// sandbox shows (the Prepare came before it, and a recovered one says nothing of it), and the
// rebuild still records the pod's other addresses on the reservation's network.
func TestReservationSettlesNothing(t *testing.T) {
	web := PodRef{"ns", "web", "uid-web"}
	poolV4b := poolV4
	poolV4b.Name, poolV4b.CIDRs = "v4b", []netip.Prefix{netip.MustParsePrefix("10.0.1.0/24")}
	poolV4b.Gateway = ip("10.0.1.1")
	h := newHarness(t, poolV4, poolV4b)
	h.hold("v4", "10.0.0.2-10.0.0.9")
	h.hold("v4b", "10.0.1.2-10.0.1.9")
	h.s.SetPods([]Pod{{Ref: web}})
	plan := h.s.PlanRecoverReservations([]ReservationEvidence{evidence("web", "eth0", "v4", "10.0.0.5")}, h.now)
	h.commit(plan.Changes())
	h.s.Apply(plan)
	h.s.StartHold(h.now.Add(5 * time.Minute))
	if w := h.s.HoldWaiting(); !slices.Equal(w, []PodRef{web}) {
		t.Fatalf("the hold waits for %v, want web", w)
	}
	reports := []Pod{reporting(web, "10.0.0.5", "10.0.1.4")}
	h.s.SetPods(reports)
	ch, _ := h.s.Rebuild(reports, h.now)
	h.commit(ch)
	if got := attachedTo(h.s, "uid-web"); !slices.Equal(got, []string{"v4=10.0.0.5", "v4b=10.0.1.4"}) {
		t.Fatalf("web's attachments hold %v", got)
	}
	if owner(h.s, "v4", "10.0.0.5") != "dra:claim-web/addr/v4-s0" {
		t.Fatalf("10.0.0.5 is used by %q", owner(h.s, "v4", "10.0.0.5"))
	}
}

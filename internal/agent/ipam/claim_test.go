package ipam

import (
	"time"

	"errors"
	"github.com/ipwarden/ipwarden/internal/addr"
	"net/netip"
	"slices"
	"strings"
	"testing"
)

// claimPool is poolV4 with bindings.
func claimPool(bindings ...ClaimBinding) Pool {
	p := poolV4
	p.Claims = bindings
	return p
}

var claimA = ClaimRef{Namespace: "ns", Name: "vm-a", UID: "uid-claim-a"}

func (h *harness) addClaim(cid, podUID string, c ClaimRef, ips ...netip.Addr) (Attachment, error) {
	h.t.Helper()
	cc := c
	a, ch, err := h.s.Add(AddRequest{Key: key(cid), Network: "net", Pod: PodRef{"ns", cid, podUID},
		Meta: PodMeta{Claim: &cc, ClaimIPs: ips}}, h.now)
	if err != nil {
		return a, err
	}
	h.commit(ch)
	h.s.Apply(AddPlan{Key: key(cid), Change: ch})
	return a, nil
}

// TestClaimAddDecisions: one claim ADD in one pool, table by table: the binding makes the bound
// address the ADD's; without one, or while the node does not hold it, the ADD waits; a refusal
// fails it; an address in use is shared only with an attachment of the same claim UID when one
// of the two is a migration target and no third holds it.
func TestClaimAddDecisions(t *testing.T) {
	bound := ClaimBinding{Namespace: "ns", Name: "vm-a", UID: claimA.UID, Addr: ip("10.0.0.9")}
	target := claimA
	target.MigrationTarget = true
	other := ClaimRef{Namespace: "ns", Name: "vm-b", UID: "uid-claim-b"}
	sameName := ClaimRef{Namespace: "ns", Name: "vm-a", UID: "uid-recreated"}
	cases := []struct {
		name    string
		binds   []ClaimBinding
		hold    string
		refused string           // the controller's claimRefused for claimA
		before  func(h *harness) // other attachments first
		claim   ClaimRef
		ips     []netip.Addr
		want    string // the address taken
		wait    string // "binding" or "bound": a ShortError with that wait
		waitIP  string // the wait's address
		err     string // a ClaimError containing this
		inFl    bool   // an InFlightError
	}{
		{name: "bound and held: the bound address", binds: []ClaimBinding{bound}, hold: "10.0.0.8/29", claim: claimA, want: "10.0.0.9"},
		{name: "no binding: waits, naming status.ips' address", hold: "10.0.0.8/29", claim: claimA, ips: []netip.Addr{ip("fd00::1"), ip("10.0.0.12")},
			wait: "binding", waitIP: "10.0.0.12"},
		{name: "no binding, status.ips outside the pool: waits for any", hold: "10.0.0.8/29", claim: claimA, ips: []netip.Addr{ip("192.168.0.1")}, wait: "binding"},
		{name: "no binding and refused: the reason", hold: "10.0.0.8/29", refused: "subnet exhausted", claim: claimA, err: "IPAMClaim ns/vm-a: subnet exhausted"},
		{name: "bound, not held: waits for the grant", binds: []ClaimBinding{bound}, hold: "10.0.0.16/29", claim: claimA, wait: "bound", waitIP: "10.0.0.9"},
		{name: "bound, not held, refused: the reason", binds: []ClaimBinding{bound}, hold: "10.0.0.16/29", refused: "IPAMClaim ns/vm-a is attached on node b", claim: claimA,
			err: "cannot move to node node-a: IPAMClaim ns/vm-a is attached on node b"},
		{name: "a re-created claim (new UID) is another claim", binds: []ClaimBinding{bound}, hold: "10.0.0.8/29", claim: sameName, wait: "binding"},
		{name: "in use by an ordinary attachment", binds: []ClaimBinding{bound}, hold: "10.0.0.8/29", claim: target,
			before: func(h *harness) {
				h.s.pools["v4"].inUse[ip("10.0.0.9")] = key("plain")
				h.s.putAttachment(&Attachment{Key: key("plain"), Pod: PodRef{"ns", "p", "u"}})
			},
			err: "references no IPAMClaim"},
		{name: "in use by another claim's attachment", binds: []ClaimBinding{bound, {Namespace: "ns", Name: "vm-b", UID: other.UID, Addr: ip("10.0.0.10")}}, hold: "10.0.0.8/29", claim: target,
			before: func(h *harness) {
				h.s.pools["v4"].inUse[ip("10.0.0.9")] = key("b")
				h.s.putAttachment(&Attachment{Key: key("b"), Pod: PodRef{"ns", "b", "u"}, Claim: &other})
			},
			err: "an attachment of IPAMClaim ns/vm-b"},
		{name: "restart: the old pod still holds it, neither a target", binds: []ClaimBinding{bound}, hold: "10.0.0.8/29", claim: claimA,
			before: func(h *harness) { mustClaim(h, "old", "uid-old", claimA) }, err: "neither pod is a live migration's target"},
		{name: "migration: the target shares the source's address", binds: []ClaimBinding{bound}, hold: "10.0.0.8/29", claim: target,
			before: func(h *harness) { mustClaim(h, "src", "uid-src", claimA) }, want: "10.0.0.9"},
		{name: "migration: the source holder is the target", binds: []ClaimBinding{bound}, hold: "10.0.0.8/29", claim: claimA,
			before: func(h *harness) { mustClaim(h, "tgt", "uid-tgt", target) }, want: "10.0.0.9"},
		{name: "a third holder waits", binds: []ClaimBinding{bound}, hold: "10.0.0.8/29", claim: target,
			before: func(h *harness) { mustClaim(h, "src", "uid-src", claimA); mustClaim(h, "tgt", "uid-tgt", target) }, err: "two attachments of the claim already"},
		{name: "the holder's write in flight: wait for it", binds: []ClaimBinding{bound}, hold: "10.0.0.8/29", claim: target,
			before: func(h *harness) {
				c := claimA
				if _, _, err := h.s.Add(AddRequest{Key: key("src"), Pod: PodRef{"ns", "src", "uid-src"}, Meta: PodMeta{Claim: &c}}, h.now); err != nil {
					h.t.Fatal(err)
				}
			}, inFl: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, claimPool(tc.binds...))
			h.hold("v4", tc.hold)
			if tc.refused != "" {
				h.s.SetClaimRefused(map[string]map[string]string{"v4": {claimA.UID: tc.refused}})
			}
			if tc.before != nil {
				tc.before(h)
			}
			att, err := h.addClaim("new", "uid-new", tc.claim, tc.ips...)
			var short *ShortError
			var ce *ClaimError
			var inf *InFlightError
			switch {
			case tc.want != "":
				if err != nil || len(att.Addresses) != 1 || att.Addresses[0].Addr != ip(tc.want) || att.Claim == nil || att.Claim.UID != tc.claim.UID {
					t.Fatalf("got %+v, %v; want %s with the claim", att, err, tc.want)
				}
			case tc.wait != "":
				if !errors.As(err, &short) || len(short.Claims) != 1 || short.Claims[0].Bound != (tc.wait == "bound") ||
					(tc.waitIP != "" && short.Claims[0].Addr != ip(tc.waitIP)) || (tc.waitIP == "" && short.Claims[0].Addr.IsValid()) {
					t.Fatalf("got %+v, %v; want a %s wait for %q", att, err, tc.wait, tc.waitIP)
				}
			case tc.inFl:
				if !errors.As(err, &inf) {
					t.Fatalf("got %v, want an InFlightError", err)
				}
			default:
				if !errors.As(err, &ce) || !strings.Contains(ce.Error(), tc.err) {
					t.Fatalf("got %+v, %v; want a ClaimError with %q", att, err, tc.err)
				}
			}
		})
	}
}

func mustClaim(h *harness, cid, uid string, c ClaimRef) {
	h.t.Helper()
	if _, err := h.addClaim(cid, uid, c); err != nil {
		h.t.Fatalf("claim add %s: %v", cid, err)
	}
}

// TestClaimAddressKeptOut: a bound address is never an ordinary ADD's, nor a static address
// another pod names, nor given back to meet the target; it goes back only when another node
// asks for it and nothing uses it, and never while a claim ADD here waits for it.
func TestClaimAddressKeptOut(t *testing.T) {
	bound := ClaimBinding{Namespace: "ns", Name: "vm-a", UID: claimA.UID, Addr: ip("10.0.0.8")}
	h := newHarness(t, claimPool(bound))
	h.hold("v4", "10.0.0.8/30") // 8..11
	for _, c := range []string{"a", "b", "c"} {
		if got := h.mustAdd(c); got[0] == "10.0.0.8" {
			t.Fatalf("ordinary ADD %s got the bound address", c)
		}
	}
	if _, err := h.add("d"); !errors.As(err, new(*ShortError)) {
		t.Fatalf("a fourth ordinary ADD: %v, want short (the bound address stays out)", err)
	}
	_, _, err := h.s.Add(AddRequest{Key: key("s"), Pod: PodRef{"ns", "s", "uid-s"}, Meta: PodMeta{IPAddresses: "10.0.0.8"}}, h.now)
	if !errors.As(err, new(*StaticUnavailableError)) || !strings.Contains(err.Error(), "bound to IPAMClaim ns/vm-a") {
		t.Fatalf("static ADD of the bound address: %v", err)
	}
	// The pods go; exhausted, the node gives back everything but the bound address.
	for _, c := range []string{"a", "b", "c"} {
		h.del(c)
	}
	h.now = h.now.Add(time.Minute)
	cfg := claimPool(bound)
	cfg.Exhausted = true
	h.commit(h.s.SetPools([]Pool{cfg}, []string{"v4"}))
	plan := h.s.Release(h.now)
	h.commit(plan.Change)
	if rel := plan.Marked["v4"]; rel.Contains(ip("10.0.0.8")) || count(rel) != 3 {
		t.Fatalf("released %v, want the three unbound addresses", rel)
	}
	// A claim ADD waits for it here while another node asks for it: kept.
	h.s.SetWantedElsewhere(map[string]addr.Set{"v4": set(t, "10.0.0.8")})
	h.s.AddWaiter(key("w"), "uid-w", []string{"v4"})
	h.s.SetWaiterClaims(key("w"), []ClaimWait{{Pool: "v4", Claim: claimA, Addr: ip("10.0.0.8"), Bound: true}})
	if plan := h.s.Release(h.now); plan.Marked["v4"].Contains(ip("10.0.0.8")) {
		t.Fatalf("gave back the address a claim ADD here waits for")
	}
	h.s.RemoveWaiter(key("w"))
	// Asked for elsewhere, unused: it goes back.
	plan = h.s.Release(h.now)
	if !plan.Marked["v4"].Contains(ip("10.0.0.8")) {
		t.Fatalf("released %v, want the bound address another node asks for", plan.Marked["v4"])
	}
}

// TestClaimMigrationOnOneNode: two attachments share the claim's address; a DEL of either leaves
// it with the other and does not cool it; the journal restores both; the last DEL cools it and
// it stays out of ordinary ADDs; the restarted pod takes it from the cooldown.
func TestClaimMigrationOnOneNode(t *testing.T) {
	bound := ClaimBinding{Namespace: "ns", Name: "vm-a", UID: claimA.UID, Addr: ip("10.0.0.9")}
	target := claimA
	target.MigrationTarget = true
	for _, first := range []string{"src", "tgt"} {
		t.Run("del "+first+" first", func(t *testing.T) {
			h := newHarness(t, claimPool(bound))
			h.hold("v4", "10.0.0.8/30")
			mustClaim(h, "src", "uid-src", claimA)
			mustClaim(h, "tgt", "uid-tgt", target)
			if hs := h.s.Holders("v4", ip("10.0.0.9")); len(hs) != 2 {
				t.Fatalf("holders %v, want two", hs)
			}
			if st := h.s.ClaimCounts(); st.Attachments != 2 || st.Shared != 1 {
				t.Fatalf("counts %+v", st)
			}
			spec := h.s.Spec()
			if n := len(spec[0].Claims); n != 2 || !spec[0].Claims[0].Attached {
				t.Fatalf("spec claims %+v, want two attached uses", spec[0].Claims)
			}
			h.crash()
			if hs := h.s.Holders("v4", ip("10.0.0.9")); len(hs) != 2 {
				t.Fatalf("holders after a restart %v, want two", hs)
			}
			plan, _ := h.s.PlanDel(key(first), h.now)
			if len(plan.Change.PutCooling) != 0 {
				t.Fatalf("the DEL of one side cools the shared address: %+v", plan.Change)
			}
			h.commit(plan.Change)
			h.s.Apply(plan)
			other := map[string]string{"src": "tgt", "tgt": "src"}[first]
			if hs := h.s.Holders("v4", ip("10.0.0.9")); len(hs) != 1 || hs[0] != key(other) {
				t.Fatalf("holders %v, want %s alone", hs, other)
			}
			h.crash()
			h.del(other)
			if hs := h.s.Holders("v4", ip("10.0.0.9")); len(hs) != 0 {
				t.Fatalf("holders %v after both DELs", hs)
			}
			h.now = h.now.Add(time.Hour)
			for _, c := range []string{"a", "b", "c"} {
				if got := h.mustAdd(c); got[0] == "10.0.0.9" {
					t.Fatalf("an ordinary ADD got the claim's cooled address")
				}
			}
			if a, err := h.addClaim("restart", "uid-restart", claimA); err != nil || a.Addresses[0].Addr != ip("10.0.0.9") {
				t.Fatalf("restarted VM: %+v, %v", a, err)
			}
		})
	}
}

// TestClaimAbortLeavesTheHolder: a target's ADD refused by the journal leaves the source alone.
func TestClaimAbortLeavesTheHolder(t *testing.T) {
	bound := ClaimBinding{Namespace: "ns", Name: "vm-a", UID: claimA.UID, Addr: ip("10.0.0.9")}
	target := claimA
	target.MigrationTarget = true
	h := newHarness(t, claimPool(bound))
	h.hold("v4", "10.0.0.8/30")
	mustClaim(h, "src", "uid-src", claimA)
	c := target
	if _, _, err := h.s.Add(AddRequest{Key: key("tgt"), Pod: PodRef{"ns", "tgt", "uid-tgt"}, Meta: PodMeta{Claim: &c}}, h.now); err != nil {
		t.Fatal(err)
	}
	h.s.AbortAdd(key("tgt"))
	if hs := h.s.Holders("v4", ip("10.0.0.9")); len(hs) != 1 || hs[0] != key("src") {
		t.Fatalf("holders %v after the abort, want src", hs)
	}
}

// TestClaimGrantSeenBeforeItsBinding: the grant (the node's status) may reach the agent before
// the binding (the pool's status): while a claim ADD waits for its binding, what the holding
// gains goes to no ordinary ADD; once the binding lands the claim takes its address and the rest
// is ordinary again.
func TestClaimGrantSeenBeforeItsBinding(t *testing.T) {
	h := newHarness(t, claimPool())
	h.hold("v4", "10.0.0.8")
	h.mustAdd("a") // 10.0.0.8
	if _, err := h.addClaim("vm", "uid-vm", claimA); !errors.As(err, new(*ShortError)) {
		t.Fatalf("claim ADD without a binding: %v", err)
	}
	h.s.AddWaiter(key("vm"), "uid-vm", []string{"v4"})
	h.s.SetWaiterClaims(key("vm"), []ClaimWait{{Pool: "v4", Claim: claimA}})
	h.hold("v4", "10.0.0.8/30") // the grant: 9 (the claim's) and 10, 11 (a batch)
	if _, err := h.add("b"); !errors.As(err, new(*ShortError)) {
		t.Fatalf("an ordinary ADD while the claim waits for its binding: %v, want short", err)
	}
	if plan := h.s.Release(h.now); !plan.Marked["v4"].IsEmpty() {
		t.Fatalf("gave back %v while the claim waits for its binding", plan.Marked["v4"])
	}
	h.commit(h.s.SetPools([]Pool{claimPool(ClaimBinding{Namespace: "ns", Name: "vm-a", UID: claimA.UID, Addr: ip("10.0.0.9")})}, []string{"v4"}))
	if a, err := h.addClaim("vm", "uid-vm", claimA); err != nil || a.Addresses[0].Addr != ip("10.0.0.9") {
		t.Fatalf("claim ADD once bound: %+v, %v", a, err)
	}
	if got := h.mustAdd("b"); got[0] != "10.0.0.10" {
		t.Fatalf("ordinary ADD after the claim was served: %v, want 10.0.0.10", got)
	}
}

// TestClaimNamedAddressKeptWhileItsADDWaits: a claim ADD waits for its binding while its claim's
// status.ips names an address the node already holds, idle. The controller binds exactly that
// address, and the binding may reach the agent after an ordinary ADD picks: so the named address
// never goes to an ordinary ADD while the claim ADD waits, and is ordinary again once it stops
// waiting (TestSim seed 17235105627894350811 once handed it out so).
func TestClaimNamedAddressKeptWhileItsADDWaits(t *testing.T) {
	cases := []struct {
		name    string
		wait    *ClaimWait
		wantOut bool
	}{
		{"no claim ADD waits", nil, false},
		{"a claim ADD waits for the binding of the address its status names", &ClaimWait{Pool: "v4", Claim: claimA, Addr: ip("10.0.0.8")}, true},
		{"a claim ADD waits for its bound address", &ClaimWait{Pool: "v4", Claim: claimA, Addr: ip("10.0.0.8"), Bound: true}, true},
		{"a claim ADD waits for a binding, its status names none", &ClaimWait{Pool: "v4", Claim: claimA}, false},
		{"a claim ADD waits in another pool", &ClaimWait{Pool: "v6", Claim: claimA, Addr: ip("10.0.0.8")}, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, claimPool())
			h.hold("v4", "10.0.0.8/31") // 8 and 9, both idle
			if tc.wait != nil {
				h.s.AddWaiter(key("vm"), "uid-vm", []string{"v4"})
				h.s.SetWaiterClaims(key("vm"), []ClaimWait{*tc.wait})
			}
			got := []string{h.mustAdd("a")[0]}
			if a, err := h.add("b"); err == nil {
				got = append(got, a.Addresses[0].Addr.String())
			} else if !errors.As(err, new(*ShortError)) {
				t.Fatal(err)
			}
			out := !slices.Contains(got, "10.0.0.8")
			if out != tc.wantOut {
				t.Fatalf("ordinary ADDs got %v: 10.0.0.8 kept out %v, want %v", got, out, tc.wantOut)
			}
		})
	}
}

package agent

import (
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// The machine's rules for VM addresses (docs/design.md, "VM addresses (IPAMClaim)"), one table
// each.

var testClaim = ipam.ClaimRef{Namespace: "ns", Name: "vm-a", UID: "uid-claim-a"}

// claimV4 is testV4 with the bindings of its status.ipamClaims.
func claimV4(bs ...ipam.ClaimBinding) ipam.Pool {
	p := testV4
	p.Claims = bs
	return p
}

// setPools journals the pools fact (the bindings arrive with the pool's status) and returns
// what the machine wanted done meanwhile (every write landed).
func (h *machineHarness) setPools(pools ...ipam.Pool) Ready {
	h.t.Helper()
	names := make([]string, len(pools))
	for i, p := range pools {
		names[i] = p.Name
	}
	id := h.m.Fact("pools", func(m *Machine) ipam.Plan { return m.st.PlanPools(pools, names) }, nil, h.now)
	rd := h.settle()
	if a := mustAnswer(h.t, rd, id); a.Err != nil {
		h.t.Fatalf("pools: %v", a.Err)
	}
	return rd
}

// claimAdd asks the ADD of cid, its pod read answered with meta; it returns the request's id
// and what the machine wants done after the read.
func (h *machineHarness) claimAdd(cid string, meta ipam.PodMeta) (uint64, Ready) {
	h.t.Helper()
	id := h.m.Request(addReq(cid), h.now)
	rd := h.ready()
	if len(rd.Reads) != 1 {
		h.t.Fatalf("the ADD of %s read no pod: %+v", cid, rd)
	}
	h.m.PodRead(rd.Reads[0].ID, meta, nil, h.now)
	return id, h.ready()
}

func claimMetaOf(c ipam.ClaimRef, ips ...string) ipam.PodMeta {
	m := ipam.PodMeta{Claim: &c}
	for _, s := range ips {
		m.ClaimIPs = append(m.ClaimIPs, netip.MustParseAddr(s))
	}
	return m
}

// specClaims is the node's spec.pools[].ipamClaims of pool as the monitor would publish it.
func specClaims(h *machineHarness, pool string) []ipam.ClaimUse {
	for _, r := range h.m.st.Spec() {
		if r.Pool == pool {
			return r.Claims
		}
	}
	return nil
}

// An ADD whose pod references an IPAMClaim gets only the claim's bound address: with the
// binding and the address held it is written at once; without them it waits, listed in the
// node's spec (the pool monitor asked for a round at once), until the binding and the grant
// land, the controller refuses the claim (code 11 with its reason, at once), or --address-wait
// passes (code 11 naming the claim). A claim that cannot be used fails at once, and so does an
// ADD whose configuration names a claim when its pod cannot be read. Nothing ever falls back to
// an ordinary address.
func TestMachineClaimAddTakesItsBoundAddressOrWaits(t *testing.T) {
	const wait = 10 * time.Second
	bound := ipam.ClaimBinding{Namespace: "ns", Name: "vm-a", UID: testClaim.UID, Addr: netip.MustParseAddr("10.1.0.9")}
	for _, tc := range []struct {
		name  string
		binds []ipam.ClaimBinding
		held  string
		meta  ipam.PodMeta
		// act happens 2 s after the ADD, while it waits (nil: nothing).
		act func(h *machineHarness) Ready
		// The ADD then writes wantAddrs, fails with code 11 and wantMsg, or waits with wantSpec
		// listing the claim (attached false, that address).
		wantAddrs string
		wantMsg   string
		wantSpec  string
	}{
		{name: "bound and held: written at once", binds: []ipam.ClaimBinding{bound}, held: "10.1.0.8/29", meta: claimMetaOf(testClaim),
			wantAddrs: "v4=10.1.0.9"},
		{name: "no binding: waits, listed with status.ips' address", held: "10.1.0.8/29", meta: claimMetaOf(testClaim, "10.1.0.12"),
			wantSpec: "10.1.0.12"},
		{name: "no binding: waits, listed without an address", held: "10.1.0.8/29", meta: claimMetaOf(testClaim),
			wantSpec: "invalid IP"},
		{name: "the binding lands: written", held: "10.1.0.8/29", meta: claimMetaOf(testClaim),
			act:       func(h *machineHarness) Ready { return h.setPools(claimV4(bound)) },
			wantAddrs: "v4=10.1.0.9"},
		{name: "bound, not held: waits, listed with the bound address", binds: []ipam.ClaimBinding{bound}, held: "10.1.0.16/29", meta: claimMetaOf(testClaim),
			wantSpec: "10.1.0.9"},
		{name: "bound, the grant lands: written", binds: []ipam.ClaimBinding{bound}, held: "10.1.0.16/29", meta: claimMetaOf(testClaim),
			act: func(h *machineHarness) Ready {
				h.holdings(map[string]string{"v4": "10.1.0.9"}, RecordOf{})
				return h.settle()
			},
			wantAddrs: "v4=10.1.0.9"},
		{name: "the controller refuses: the reason at once", held: "10.1.0.8/29", meta: claimMetaOf(testClaim),
			act: func(h *machineHarness) Ready {
				h.m.SetClaimRefused(map[string]map[string]string{"v4": {testClaim.UID: "IPAMClaim ns/vm-a: no free address in pool v4"}}, h.now)
				return h.ready()
			},
			wantMsg: "no free address in pool v4"},
		{name: "--address-wait passes", held: "10.1.0.8/29", meta: claimMetaOf(testClaim),
			act:     func(h *machineHarness) Ready { h.now = mt0.Add(time.Minute); h.m.Tick(h.now); return h.ready() },
			wantMsg: "waiting for IPAMClaim ns/vm-a's address to be recorded"},
		{name: "the claim cannot be used: at once", held: "10.1.0.8/29", meta: ipam.PodMeta{ClaimProblem: "IPAMClaim ns/vm-a does not exist"},
			wantMsg: "IPAMClaim ns/vm-a does not exist"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: wait, ReadsPods: true}, claimV4(tc.binds...))
			h.hold(map[string]string{"v4": tc.held})
			id, rd := h.claimAdd("c1", tc.meta)
			if tc.act != nil {
				if tc.wantMsg == "" || strings.Contains(tc.name, "refuses") || strings.Contains(tc.name, "wait passes") {
					noAnswer(t, rd, id, "the waiting claim ADD")
					if !rd.KickNow || len(rd.Writes) != 0 {
						t.Fatalf("the waiting claim ADD: writes %+v KickNow %v, want none and a round at once", rd.Writes, rd.KickNow)
					}
				}
				if h.now.Before(mt0.Add(2 * time.Second)) {
					h.now = mt0.Add(2 * time.Second)
				}
				rd = tc.act(h)
			}
			switch {
			case tc.wantAddrs != "":
				ws := writesOf(rd, "c1")
				if len(ws) != 1 || putAddresses(ws[0], "c1") != tc.wantAddrs {
					t.Fatalf("writes %+v, want c1's with %s", rd.Writes, tc.wantAddrs)
				}
				if a := ws[0].Change.PutAttachments[len(ws[0].Change.PutAttachments)-1]; a.Claim == nil || a.Claim.UID != testClaim.UID {
					t.Fatalf("the journal write does not record the claim: %+v", a)
				}
				if _, answered := answerOf(rd, id); !answered {
					h.m.Written(ws[0].ID, nil, h.now)
					rd = h.ready()
				}
				if a := mustAnswer(t, rd, id); code(a) != 0 {
					t.Fatalf("ADD answered %s", describeAnswer(a))
				}
				if cs := specClaims(h, "v4"); len(cs) != 1 || !cs[0].Attached || cs[0].Addr != bound.Addr {
					t.Fatalf("spec claims %+v, want the attached use", cs)
				}
			case tc.wantMsg != "":
				a := mustAnswer(t, rd, id)
				if code(a) != cniproto.CodeTryAgainLater || !strings.Contains(a.Resp.Error.Msg, tc.wantMsg) || len(rd.Writes) != 0 {
					t.Fatalf("ADD answered %s, writes %+v, want code 11 with %q", describeAnswer(a), rd.Writes, tc.wantMsg)
				}
				if cs := specClaims(h, "v4"); len(cs) != 0 {
					t.Fatalf("spec claims %+v after the ADD failed, want none", cs)
				}
			default:
				noAnswer(t, rd, id, "the waiting claim ADD")
				cs := specClaims(h, "v4")
				if len(cs) != 1 || cs[0].Attached || cs[0].Claim != testClaim || cs[0].Pod != "pod-c1" || cs[0].Addr.String() != tc.wantSpec {
					t.Fatalf("spec claims %+v, want the waiting use with address %s", cs, tc.wantSpec)
				}
				if len(writesOf(rd, "c1")) != 0 {
					t.Fatalf("a waiting claim ADD wrote: %+v", rd.Writes)
				}
			}
		})
	}

	t.Run("configuration names a claim, pod unreadable", func(t *testing.T) {
		h := newMachine(t, MachineConfig{AddressWait: wait, ReadsPods: true}, claimV4(bound))
		h.hold(map[string]string{"v4": "10.1.0.8/29"})
		h.add(func() cniproto.Request { r := addReq("c0"); r.Pod.UID = "uid-c1"; return r }()) // the pod's earlier sandbox
		req := addReq("c1")
		req.IPAMClaimReference = "vm-a"
		id := h.m.Request(req, h.now)
		rd := h.ready()
		h.m.PodRead(rd.Reads[0].ID, ipam.PodMeta{}, errors.New("API server away"), h.now)
		if a := mustAnswer(t, h.ready(), id); code(a) != cniproto.CodeTryAgainLater {
			t.Fatalf("ADD answered %s, want code 11", describeAnswer(a))
		}
	})
}

// Live migration on one node: an ADD of a claim whose bound address an attachment of the same
// claim UID uses takes the same address when one of the two pods is a migration target and no
// third attachment uses it; any other ADD of it fails with code 11 naming the claim and the pod
// that holds it. A DEL of either side leaves the address with the other; the last DEL leaves it
// bound (out of ordinary ADDs).
func TestMachineClaimSharedOnlyForAMigration(t *testing.T) {
	bound := ipam.ClaimBinding{Namespace: "ns", Name: "vm-a", UID: testClaim.UID, Addr: netip.MustParseAddr("10.1.0.9")}
	target := testClaim
	target.MigrationTarget = true
	other := ipam.ClaimRef{Namespace: "ns", Name: "vm-a", UID: "uid-recreated", MigrationTarget: true}
	for _, tc := range []struct {
		name    string
		holders []ipam.ClaimRef // attachments h0, h1 holding the address first
		claim   ipam.ClaimRef
		wantMsg string // "" : shared
	}{
		{name: "target of the source's claim: shared", holders: []ipam.ClaimRef{testClaim}, claim: target},
		{name: "source restarted beside its target: shared", holders: []ipam.ClaimRef{target}, claim: testClaim},
		{name: "neither a target: code 11 naming the holder", holders: []ipam.ClaimRef{testClaim}, claim: testClaim,
			wantMsg: "IPAMClaim ns/vm-a's address 10.1.0.9 is in use on node node-a by pod ns/pod-h0"},
		{name: "another claim's UID: code 11", holders: []ipam.ClaimRef{testClaim}, claim: other,
			wantMsg: "waiting for IPAMClaim ns/vm-a's address to be recorded"},
		{name: "a third holder: code 11", holders: []ipam.ClaimRef{testClaim, target}, claim: target,
			wantMsg: "two attachments of the claim already"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newMachine(t, MachineConfig{AddressWait: time.Second, ReadsPods: true}, claimV4(bound))
			h.hold(map[string]string{"v4": "10.1.0.8/29"})
			for i, c := range tc.holders {
				cid := []string{"h0", "h1"}[i]
				id, rd := h.claimAdd(cid, claimMetaOf(c))
				for _, w := range rd.Writes {
					h.m.Written(w.ID, nil, h.now)
				}
				if a := mustAnswer(t, h.ready(), id); ips(a.Resp) != "10.1.0.9/16" {
					t.Fatalf("holder %s: %s", cid, describeAnswer(a))
				}
			}
			id, rd := h.claimAdd("c1", claimMetaOf(tc.claim))
			if tc.wantMsg != "" {
				if tc.claim.UID != testClaim.UID {
					// A claim with no binding waits (its UID is another's): until --address-wait.
					h.now = h.now.Add(time.Minute)
					h.m.Tick(h.now)
					rd = h.ready()
				}
				a := mustAnswer(t, rd, id)
				if code(a) != cniproto.CodeTryAgainLater || !strings.Contains(a.Resp.Error.Msg, tc.wantMsg) {
					t.Fatalf("ADD answered %s, want code 11 with %q", describeAnswer(a), tc.wantMsg)
				}
				return
			}
			ws := writesOf(rd, "c1")
			if len(ws) != 1 || putAddresses(ws[0], "c1") != "v4=10.1.0.9" {
				t.Fatalf("writes %+v, want c1 sharing 10.1.0.9", rd.Writes)
			}
			h.m.Written(ws[0].ID, nil, h.now)
			if a := mustAnswer(t, h.ready(), id); ips(a.Resp) != "10.1.0.9/16" {
				t.Fatalf("ADD answered %s", describeAnswer(a))
			}
			if cs := specClaims(h, "v4"); len(cs) != 2 || !cs[0].Attached || !cs[1].Attached {
				t.Fatalf("spec claims %+v, want both attached uses", cs)
			}
			// The source's DEL: the address stays with the target, uncooled.
			did := h.m.Request(delReq("h0"), h.now)
			rd = h.settle()
			mustAnswer(t, rd, did)
			for _, w := range rd.Writes {
				if len(w.Change.PutCooling) != 0 {
					t.Fatalf("the DEL of one side cooled the shared address: %+v", w.Change)
				}
			}
			if hs := h.m.st.Holders("v4", bound.Addr); len(hs) != 1 || hs[0].ContainerID != "c1" {
				t.Fatalf("holders %v after the source's DEL, want c1", hs)
			}
			// The last DEL: the address cools, still bound: an ordinary ADD never gets it.
			h.m.Request(delReq("c1"), h.now)
			h.settle()
			h.now = h.now.Add(2 * time.Hour)
			for i := range 6 {
				cid := string(rune('p' + i))
				if r := h.add(addReq(cid)); ips(r) == "10.1.0.9/16" {
					t.Fatalf("ordinary ADD %s got the claim's address", cid)
				}
			}
		})
	}
}

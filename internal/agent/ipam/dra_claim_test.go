package ipam

import (
	"encoding/json"
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"
)

// The two ways one address is recorded by two keys, side by side on one node (dra.go, claim.go):
// a DRA reservation and its pod's attachment (inUse names the reservation), and a live
// migration's two attachments of one IPAMClaim (inUse and poolState.second). Each keeps its own
// rule, and a free of one sharer never frees an address the other still uses.

// bothSharings is a node with a DRA reservation shared by its pod's attachment ("r") and the
// address of claimA shared by a migration's source and target ("src", "tgt"). It returns the
// reservation and the two shared addresses.
func bothSharings(t *testing.T) (h *harness, res Attachment, resAddr, claimAddr netip.Addr) {
	t.Helper()
	claimAddr = ip("10.0.0.9")
	h = newHarness(t, claimPool(ClaimBinding{Namespace: "ns", Name: "vm-a", UID: claimA.UID, Addr: claimAddr}))
	h.hold("v4", "10.0.0.8/29")
	res = h.reserve("r", "eth0")
	resAddr = res.Addresses[0].Addr
	if resAddr == claimAddr {
		t.Fatalf("the reservation got the claim's bound address %s", claimAddr)
	}
	if got := h.mustAdd("r"); !slices.Equal(got, []string{resAddr.String()}) {
		t.Fatalf("the reservation's pod's ADD got %v, want %s", got, resAddr)
	}
	target := claimA
	target.MigrationTarget = true
	mustClaim(h, "src", "uid-src", claimA)
	mustClaim(h, "tgt", "uid-tgt", target)
	return h, res, resAddr, claimAddr
}

// inUse reports whether the node's state has a in use, and whether it cools.
func inUse(h *harness, a netip.Addr) (used, cooling bool) {
	p := h.s.pools["v4"]
	_, used = p.inUse[a]
	_, cooling = p.cooling[a]
	return used, cooling
}

// TestDRAAndClaimSharingsFreedInAnyOrder frees the four keys (the reservation's pod's attachment,
// the reservation, the migration's two sides) in every order the machine allows (the
// reservation after its pod's attachment), restarting from the journal after every step: each
// address stays in use, and out of cooling and ordinary ADDs, until its last user is freed, and
// then cools once.
func TestDRAAndClaimSharingsFreedInAnyOrder(t *testing.T) {
	keys := []string{"r", "res", "src", "tgt"}
	var orders [][]string
	var perm func(done []string)
	perm = func(done []string) {
		if len(done) == len(keys) {
			if slices.Index(done, "r") < slices.Index(done, "res") {
				orders = append(orders, slices.Clone(done))
			}
			return
		}
		for _, k := range keys {
			if !slices.Contains(done, k) {
				perm(append(done, k))
			}
		}
	}
	perm(nil)
	for _, order := range orders {
		t.Run(strings.Join(order, ","), func(t *testing.T) {
			h, res, resAddr, claimAddr := bothSharings(t)
			h.crash() // fails on any restore problem: both sharings restore as sharings
			if hs := h.s.Holders("v4", claimAddr); len(hs) != 2 {
				t.Fatalf("the claim's address is held by %v, want src and tgt", hs)
			}
			if hs := h.s.Holders("v4", resAddr); !slices.Equal(hs, []Key{res.Key}) {
				t.Fatalf("the reservation's address is held by %v, want the reservation alone", hs)
			}
			gone := map[string]bool{}
			for _, k := range order {
				kk := key(k)
				if k == "res" {
					kk = res.Key
				}
				plan, err := h.s.PlanDel(kk, h.now)
				if err != nil {
					t.Fatalf("free %s: %v", k, err)
				}
				gone[k] = true
				resLast := gone["r"] && gone["res"]
				claimLast := gone["src"] && gone["tgt"]
				for _, c := range plan.Change.PutCooling {
					if (c.Addr == resAddr && !resLast) || (c.Addr == claimAddr && !claimLast) {
						t.Fatalf("free %s cools %s while another key uses it", k, c.Addr)
					}
				}
				h.commit(plan.Changes())
				h.s.Apply(plan)
				h.crash()
				for _, c := range []struct {
					a    netip.Addr
					last bool
				}{{resAddr, resLast}, {claimAddr, claimLast}} {
					used, cooling := inUse(h, c.a)
					if used == c.last || cooling != c.last {
						t.Fatalf("after freeing %s: %s in use %v, cooling %v", k, c.a, used, cooling)
					}
				}
				// An ordinary ADD never gets either address (in use, cooling, or bound).
				if a, err := h.add("probe-" + k); err == nil {
					if slices.ContainsFunc(a.Addresses, func(ad Address) bool { return ad.Addr == resAddr || ad.Addr == claimAddr }) {
						t.Fatalf("after freeing %s an ordinary ADD got %v", k, a.Addresses)
					}
					h.del("probe-" + k)
				}
			}
		})
	}
}

// TestReservationFreeRefusedWhileShared: the state refuses to free a reservation while its pod's
// attachment uses the address (the machine asks first; every other caller is kept to it too).
func TestReservationFreeRefusedWhileShared(t *testing.T) {
	h, res, resAddr, _ := bothSharings(t)
	_, err := h.s.PlanDel(res.Key, h.now)
	var busy *ReservationBusyError
	if !errors.As(err, &busy) || !slices.Equal(busy.Users, []Key{key("r")}) {
		t.Fatalf("free of the shared reservation: %v, want a ReservationBusyError naming r", err)
	}
	if h.s.Pending(res.Key) {
		t.Fatalf("the refused free left the reservation pending")
	}
	if used, cooling := inUse(h, resAddr); !used || cooling {
		t.Fatalf("after the refusal %s in use %v, cooling %v", resAddr, used, cooling)
	}
}

// TestAbortOfASharingAdd: an ADD aborted after its journal write failed leaves the address with
// its holder, whichever sharing it was.
func TestAbortOfASharingAdd(t *testing.T) {
	h, res, resAddr, claimAddr := bothSharings(t)
	// The reservation's pod's next sandbox (its attachment of the first one still there).
	if _, _, err := h.s.Add(AddRequest{Key: key("r2"), Network: "net", Pod: PodRef{"ns", "r", "uid-r"}}, h.now); err != nil {
		t.Fatal(err)
	}
	h.s.AbortAdd(key("r2"))
	if hs := h.s.Holders("v4", resAddr); !slices.Equal(hs, []Key{res.Key}) {
		t.Fatalf("after the aborted ADD the reservation's address is held by %v", hs)
	}
	// A migration's source's DEL, then a new target that aborts: the remaining side keeps it.
	h.del("src")
	target := claimA
	target.MigrationTarget = true
	if _, _, err := h.s.Add(AddRequest{Key: key("tgt2"), Pod: PodRef{"ns", "tgt2", "uid-tgt2"}, Meta: PodMeta{Claim: &target}}, h.now); err != nil {
		t.Fatal(err)
	}
	h.s.AbortAdd(key("tgt2"))
	if hs := h.s.Holders("v4", claimAddr); !slices.Equal(hs, []Key{key("tgt")}) {
		t.Fatalf("after the aborted ADD the claim's address is held by %v, want tgt", hs)
	}
	if used, cooling := inUse(h, resAddr); !used || cooling {
		t.Fatalf("%s in use %v, cooling %v", resAddr, used, cooling)
	}
}

// TestClaimAndReservationNeverShare: a claim's ADD never shares a reservation's address (a
// reservation references no IPAMClaim), and an ADD whose pod both references an IPAMClaim and
// holds a DRA reservation for the interface is refused with nothing handed out.
func TestClaimAndReservationNeverShare(t *testing.T) {
	t.Run("the claim's address is a reservation's", func(t *testing.T) {
		h := newHarness(t, poolV4)
		h.hold("v4", "10.0.0.8/29")
		res := h.reserve("r", "eth0")
		// The controller binds the claim to the address the reservation holds (a binding the
		// agent did not choose: it must not share it).
		cfg := claimPool(ClaimBinding{Namespace: "ns", Name: "vm-a", UID: claimA.UID, Addr: res.Addresses[0].Addr})
		h.commit(h.s.SetPools([]Pool{cfg}, []string{"v4"}))
		target := claimA
		target.MigrationTarget = true
		_, err := h.addClaim("vm", "uid-vm", target)
		var ce *ClaimError
		if !errors.As(err, &ce) || !strings.Contains(ce.Error(), "references no IPAMClaim") {
			t.Fatalf("claim ADD of a reserved address: %v, want a ClaimError", err)
		}
		if hs := h.s.Holders("v4", res.Addresses[0].Addr); !slices.Equal(hs, []Key{res.Key}) {
			t.Fatalf("holders %v", hs)
		}
	})
	t.Run("one interface, both", func(t *testing.T) {
		bound := ip("10.0.0.9")
		h := newHarness(t, claimPool(ClaimBinding{Namespace: "ns", Name: "vm-a", UID: claimA.UID, Addr: bound}))
		h.hold("v4", "10.0.0.8/29")
		res := h.reserve("vm", "eth0") // pod uid-vm
		_, err := h.addClaim("vm", "uid-vm", claimA)
		var ce *ClaimError
		if !errors.As(err, &ce) || !strings.Contains(ce.Error(), "DRA reservation") {
			t.Fatalf("ADD with an IPAMClaim and a DRA reservation: %v, want a ClaimError", err)
		}
		if _, ok := h.s.Attachment(key("vm")); ok {
			t.Fatalf("the refused ADD left an attachment")
		}
		if used, _ := inUse(h, bound); used {
			t.Fatalf("the refused ADD took the claim's address")
		}
		if hs := h.s.Holders("v4", res.Addresses[0].Addr); !slices.Equal(hs, []Key{res.Key}) {
			t.Fatalf("holders %v", hs)
		}
		// The reservation on another interface leaves this one's claim ADD alone.
		h2 := newHarness(t, claimPool(ClaimBinding{Namespace: "ns", Name: "vm-a", UID: claimA.UID, Addr: bound}))
		h2.hold("v4", "10.0.0.8/29")
		h2.reserve("vm", "net1")
		if a, err := h2.addClaim("vm", "uid-vm", claimA); err != nil || a.Addresses[0].Addr != bound {
			t.Fatalf("claim ADD beside a reservation of another interface: %+v, %v", a, err)
		}
	})
}

// TestStaleLeavesOnlyReservations: CNI GC never frees a DRA reservation, and frees an IPAMClaim's
// attachment like any other.
func TestStaleLeavesOnlyReservations(t *testing.T) {
	h, res, _, _ := bothSharings(t)
	h.s.atts[res.Key].Network = "net" // as if it were on the GC's network
	got := h.s.Stale("net", nil, h.now.Add(time.Hour))
	if slices.Contains(got, res.Key) {
		t.Fatalf("Stale lists the reservation: %v", got)
	}
	for _, k := range []string{"src", "tgt", "r"} {
		if !slices.Contains(got, key(k)) {
			t.Fatalf("Stale %v lacks %s", got, k)
		}
	}
}

// TestJournalKeysOfClaimAndDRA: the two fields have their own JSON keys, and each survives the
// journal's round trip without the other.
func TestJournalKeysOfClaimAndDRA(t *testing.T) {
	h, res, _, _ := bothSharings(t)
	for _, tc := range []struct {
		k           Key
		has, hasNot string
	}{{res.Key, `"dra":`, `"claim":`}, {key("src"), `"claim":`, `"dra":`}, {key("r"), "", `"dra":`}} {
		a, _ := h.s.Attachment(tc.k)
		b, err := json.Marshal(a)
		if err != nil {
			t.Fatal(err)
		}
		if (tc.has != "" && !strings.Contains(string(b), tc.has)) || strings.Contains(string(b), tc.hasNot) {
			t.Fatalf("%s as JSON: %s", tc.k, b)
		}
		var back Attachment
		if err := json.Unmarshal(b, &back); err != nil {
			t.Fatal(err)
		}
		if (back.DRA == nil) != (a.DRA == nil) || (back.Claim == nil) != (a.Claim == nil) {
			t.Fatalf("%s round trip: %+v, was %+v", tc.k, back, a)
		}
	}
}

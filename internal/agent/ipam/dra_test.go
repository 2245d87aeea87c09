package ipam

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

func (h *harness) reserve(cid, ifname string) Attachment {
	h.t.Helper()
	a, ch, err := h.s.Reserve(ReserveRequest{
		Claim: ClaimDevice{Namespace: "ns", Name: "claim-" + cid, UID: "claim-" + cid, Request: "addr", Device: "s0", Interface: ifname},
		Pod:   PodRef{"ns", cid, "uid-" + cid}, Pool: "v4"}, h.now)
	if err != nil {
		h.t.Fatalf("reserve %s: %v", cid, err)
	}
	h.commit(ch)
	h.s.Apply(AddPlan{Key: a.Key, Change: ch})
	return a
}

// A reservation and the attachment that shares its address survive a restart as they were: the
// reservation owns the address (no conflict is reported), the attachment's DEL frees nothing of
// it, and the reservation's own free cools it.
func TestReservationSharedAcrossRestart(t *testing.T) {
	for _, tc := range []struct {
		name    string
		restart bool
	}{{name: "in one run"}, {name: "across a restart", restart: true}} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, poolV4)
			h.hold("v4", "10.0.0.2-10.0.0.5")
			r := h.reserve("a", "eth0")
			if got := h.mustAdd("a"); !slices.Equal(got, []string{"10.0.0.2"}) {
				t.Fatalf("the claimed pod's ADD got %v", got)
			}
			if tc.restart {
				h.crash() // fails on any restore problem
			}
			if got := h.mustAdd("b"); !slices.Equal(got, []string{"10.0.0.3"}) {
				t.Fatalf("another pod's ADD got %v", got)
			}
			plan, err := h.s.PlanDel(key("a"), h.now)
			if err != nil || len(plan.Change.PutCooling) != 0 {
				t.Fatalf("the DEL of the sharing attachment: %+v, %v; want no cooling", plan.Change, err)
			}
			h.commit(plan.Changes())
			h.s.Apply(plan)
			if users := h.s.ReservationUsers(r.Key); len(users) != 0 {
				t.Fatalf("users after the DEL: %v", users)
			}
			plan, err = h.s.PlanDel(r.Key, h.now)
			if err != nil || len(plan.Change.PutCooling) != 1 || plan.Change.PutCooling[0].Addr != ip("10.0.0.2") {
				t.Fatalf("the reservation's free: %+v, %v; want 10.0.0.2 cooling", plan.Change, err)
			}
			h.commit(plan.Changes())
			h.s.Apply(plan)
			if tc.restart {
				h.crash()
			}
			if got := h.mustAdd("c"); slices.Contains(got, "10.0.0.2") {
				t.Fatalf("an ADD got the address still cooling: %v", got)
			}
		})
	}
}

// A pool's headroom for claims is its maxPerNode less what other attachments use (reservations
// count within it), or, exhausted, the reserved addresses and what the node can hand out now.
func TestClaimCapacities(t *testing.T) {
	for _, tc := range []struct {
		name      string
		exhausted bool
		adds      int // other pods' attachments
		reserve   bool
		bound     string // an address the pool binds to an IPAMClaim, held idle
		want      ClaimCapacity
	}{
		{name: "empty node", want: ClaimCapacity{Pool: "v4", IPv4: true, Headroom: 16, MaxPerNode: 16}},
		{name: "two other pods", adds: 2, want: ClaimCapacity{Pool: "v4", IPv4: true, Headroom: 14, MaxPerNode: 16}},
		{name: "a reservation counts within", adds: 1, reserve: true, want: ClaimCapacity{Pool: "v4", IPv4: true, Reserved: 1, Headroom: 15, MaxPerNode: 16}},
		{name: "exhausted: what the node holds free", exhausted: true, adds: 1, reserve: true,
			want: ClaimCapacity{Pool: "v4", IPv4: true, Reserved: 1, Headroom: 3, MaxPerNode: 16}},
		{name: "a VM's idle address is not headroom", adds: 1, bound: "10.0.0.5",
			want: ClaimCapacity{Pool: "v4", IPv4: true, Headroom: 14, MaxPerNode: 16}},
		{name: "exhausted: a VM's idle address is not free for claims", exhausted: true, adds: 1, bound: "10.0.0.5",
			want: ClaimCapacity{Pool: "v4", IPv4: true, Headroom: 2, MaxPerNode: 16}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool := poolV4
			pool.Exhausted = tc.exhausted
			if tc.bound != "" {
				pool.Claims = []ClaimBinding{{Namespace: "ns", Name: "vm", UID: "vm-uid", Addr: ip(tc.bound)}}
			}
			h := newHarness(t, pool)
			h.hold("v4", "10.0.0.2-10.0.0.5")
			for i := range tc.adds {
				h.mustAdd(string(rune('p' + i)))
			}
			if tc.reserve {
				h.reserve("a", "eth0")
			}
			got := h.s.ClaimCapacities(h.now)
			if len(got) != 1 || got[0] != tc.want {
				t.Fatalf("ClaimCapacities = %+v, want %+v", got, tc.want)
			}
		})
	}
}

// A named ResourceClaim shared by two pods: the kubelet prepares it once per node, so the
// second pod's ADD is the first the agent hears of it. It is refused (code 11, naming the claim
// and the pod it is reserved for) instead of running with an ordinary address its claim's
// networkData does not name; the first pod keeps the claim's address. A pod that uses other
// claims, the reserved pod itself and another interface are not refused.
func TestReservedForAnotherPod(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.2-10.0.0.5")
	h.reserve("a", "eth0") // claim "claim-a", reserved for pod ns/a
	addAs := func(cid, ifname string, claims ...string) (Attachment, error) {
		return h.addReq(AddRequest{Key: Key{ContainerID: cid, IfName: ifname}, Network: "net", Pod: PodRef{"ns", cid, "uid-" + cid},
			Meta: PodMeta{ResourceClaims: claims}})
	}
	for _, tc := range []struct {
		name, cid, ifname string
		claims            []string
		refused           bool
	}{
		{"the second pod of the named claim", "b", "eth0", []string{"claim-a"}, true},
		{"a pod with other claims", "c", "eth0", []string{"claim-x", "claim-y"}, false},
		{"another interface", "d", "net1", []string{"claim-a"}, false},
		{"the reserved pod itself", "a", "eth0", []string{"claim-a"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, err := addAs(tc.cid, tc.ifname, tc.claims...)
			var ce *ClaimError
			if tc.refused != errors.As(err, &ce) {
				t.Fatalf("ADD: %v, %v; want refused %v", a.Addresses, err, tc.refused)
			}
			if tc.refused && (!strings.Contains(ce.Msg, "ns/claim-a") || !strings.Contains(ce.Msg, "pod ns/a")) {
				t.Fatalf("the refusal does not name the claim and its pod: %s", ce.Msg)
			}
			if tc.cid == "a" && (err != nil || len(a.Addresses) != 1 || a.Addresses[0].Addr != ip("10.0.0.2")) {
				t.Fatalf("the reserved pod's ADD: %v, %v; want 10.0.0.2", a.Addresses, err)
			}
		})
	}
}

func (h *harness) addReq(req AddRequest) (Attachment, error) {
	h.t.Helper()
	a, ch, err := h.s.Add(req, h.now)
	if err != nil {
		return a, err
	}
	h.commit(ch)
	h.s.Apply(AddPlan{Key: req.Key, Change: ch})
	return a, nil
}

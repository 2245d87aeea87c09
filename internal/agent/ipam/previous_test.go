package ipam

import (
	"errors"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
)

func TestPreviousOut(t *testing.T) {
	for _, tc := range []struct {
		name                         string
		reserved, held, inUse, other string
		want                         string
	}{
		{name: "nothing reserved", held: "10.0.0.8/29", want: ""},
		{name: "held and free: out of use", reserved: "10.0.0.10", held: "10.0.0.8/29", want: "10.0.0.10"},
		{name: "not held: nothing to keep out", reserved: "10.0.0.20", held: "10.0.0.8/29", want: ""},
		{name: "in use by an attachment (an adopted pod): already out of use", reserved: "10.0.0.10-10.0.0.11", held: "10.0.0.8/29",
			inUse: "10.0.0.10", want: "10.0.0.11"},
		{name: "already out of use for another reason", reserved: "10.0.0.10-10.0.0.12", held: "10.0.0.8/29", other: "10.0.0.12",
			want: "10.0.0.10-10.0.0.11"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := PreviousOut(set(t, split(tc.reserved)...), set(t, split(tc.held)...), set(t, split(tc.inUse)...), set(t, split(tc.other)...))
			if want := set(t, split(tc.want)...); !got.Equal(want) {
				t.Fatalf("PreviousOut = %v, want %v", got, want)
			}
		})
	}
}

func TestPreviousClaims(t *testing.T) {
	for _, tc := range []struct {
		name                string
		local, held, usable string
		usableKnown         bool
		want                string
	}{
		{name: "reserved, in the pool, not held: claimed", local: "10.0.0.10-10.0.0.11", held: "10.0.0.11", usable: "10.0.0.2-10.0.0.254",
			usableKnown: true, want: "10.0.0.10"},
		{name: "outside the pool (excluded): not claimed", local: "10.0.0.1", usable: "10.0.0.2-10.0.0.254", usableKnown: true, want: ""},
		{name: "pool spec unknown: not claimed", local: "10.0.0.10", want: ""},
		{name: "nothing reserved", usable: "10.0.0.0/24", usableKnown: true, want: ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := PreviousClaims(set(t, split(tc.local)...), set(t, split(tc.held)...), set(t, split(tc.usable)...), tc.usableKnown)
			if want := set(t, split(tc.want)...); !got.Equal(want) {
				t.Fatalf("PreviousClaims = %v, want %v", got, want)
			}
		})
	}
}

func split(s string) []string {
	if s == "" {
		return nil
	}
	return []string{s}
}

// The previous IPAM reserves an address the node holds (a pod whose ADD went through host-local
// just before the switch, its status not yet written): no ADD gets it;
// it counts as demand and is never given back; a node-local reservation the node does not hold
// is claimed. Once a reading no longer shows it (the pod's DEL went to host-local), it is free.
func TestPreviousReservedStaysOutOfUseUntilReleased(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/30") // 10.0.0.8-11
	inflight := ip("10.0.0.8")  // the lowest: the next ADD would take it
	h.s.SetPrevious("net", addr.SetOfAddrs(inflight, ip("10.0.0.40")), true)

	got := map[string]bool{}
	for _, cid := range []string{"a", "b", "c"} {
		for _, a := range h.mustAdd(cid) {
			if ip(a) == inflight {
				t.Fatalf("ADD %s got %s, which the previous IPAM reserves", cid, a)
			}
			got[a] = true
		}
	}
	if _, err := h.add("d"); err == nil {
		t.Fatal("a fourth ADD got an address: the only one left is the previous IPAM's")
	}
	st := h.s.Stats(h.now)[0]
	if st.PreviousReserved != 1 || st.Free != 0 || st.InUse != 3 {
		t.Fatalf("stats %+v: want 1 previous-reserved, none free, 3 in use", st)
	}
	if d := h.s.Demand("v4"); d < 4 {
		t.Fatalf("demand %d: the reserved address counts as in use (3 + 1)", d)
	}
	spec := h.s.Spec()[0]
	if !spec.Claimed.Equal(set(t, "10.0.0.40")) {
		t.Fatalf("claims %v: want the node-local reservation the node does not hold, 10.0.0.40", spec.Claimed)
	}

	// Whereabouts' reservations are the cluster's: not claimed.
	h.s.SetPrevious("net", addr.SetOfAddrs(inflight, ip("10.0.0.40")), false)
	if c := h.s.Spec()[0].Claimed; !c.IsEmpty() {
		t.Fatalf("claims %v of a reservation that is not the node's alone", c)
	}

	// The reading no longer shows it: the next ADD takes it (the only free address).
	h.s.SetPrevious("net", addr.Set{}, true)
	if a := h.mustAdd("d"); a[0] != inflight.String() {
		t.Fatalf("after the release the ADD got %v, want the only free address %s", a, inflight)
	}
	for _, cid := range []string{"a", "b", "c", "d"} {
		h.del(cid)
	}

	// A network whose configuration no longer names a previous IPAM forgets its reading; another
	// network's stays.
	h.s.SetPrevious("net", addr.SetOfAddrs(ip("10.0.0.2")), true)
	h.s.SetPrevious("other", addr.SetOfAddrs(ip("10.0.0.3")), true)
	h.s.ClearPrevious("net")
	if r := h.s.PreviousReserved(); !r.Equal(set(t, "10.0.0.3")) {
		t.Fatalf("after clearing net the readings hold %v, want other's 10.0.0.3", r)
	}

	// The node holds far more than it needs: the reserved address is never given back, though
	// it lies where the node gives back first (the high end of its run).
	inflight = ip("10.0.0.31")
	h.s.SetPrevious("net", addr.SetOfAddrs(inflight), true)
	h.hold("v4", "10.0.0.0/27")
	h.now = h.now.Add(poolV4.Cooldown + time.Minute)
	released := 0
	for range 3 {
		plan := h.s.Release(h.now)
		h.commit(plan.Change)
		rel := plan.Marked["v4"]
		if rel.Contains(inflight) {
			t.Fatalf("released %v, with the previous IPAM's reservation %s", rel, inflight)
		}
		released += count(rel)
		h.now = h.now.Add(time.Minute)
	}
	if released == 0 {
		t.Fatal("the node gave nothing back of 32 held with nothing in use: the test shows nothing")
	}
}

// A pod that asks for a static address the previous IPAM reserves waits for it (the ADD fails
// with the address wanted, and the runtime retries) until the previous IPAM releases it.
func TestPreviousReservedStaticAddressWaits(t *testing.T) {
	h := newHarness(t, poolV4)
	h.hold("v4", "10.0.0.8/30")
	h.s.SetPrevious("net", addr.SetOfAddrs(ip("10.0.0.9")), true)
	req := AddRequest{Key: key("s"), Pod: PodRef{"ns", "s", "uid-s"}, Meta: PodMeta{IPAddresses: "10.0.0.9", NamespaceKnown: true}}
	_, _, err := h.s.Add(req, h.now)
	var short *ShortError
	if !errors.As(err, &short) || len(short.Wanted) != 1 || short.Wanted[0].Addr != ip("10.0.0.9") {
		t.Fatalf("static ADD of a previous-reserved address: %v, want it to wait for 10.0.0.9", err)
	}
	h.s.SetPrevious("net", addr.Set{}, true)
	a, ch, err := h.s.Add(req, h.now)
	if err != nil || a.Addresses[0].Addr != ip("10.0.0.9") {
		t.Fatalf("static ADD once released: %+v, %v", a, err)
	}
	h.commit(ch)
}

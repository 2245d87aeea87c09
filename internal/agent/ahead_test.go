package agent

import (
	"context"
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// An ADD whose addresses were all reserved ahead is answered before its journal write, and until
// the write lands its addresses are on disk as reserved ahead: a DEL of it waits, LIST waits, and
// no other ADD gets them.
func TestAddAnsweredEarlyFromAddressesReservedAhead(t *testing.T) {
	h := newSvc(t, 50*time.Millisecond, testV4)
	h.hold(map[string]string{"v4": "10.1.0.5-10.1.0.9"})
	if r := h.do(addReq("c1")); r.Error != nil {
		t.Fatalf("ADD c1: %+v", r.Error)
	}
	if got := testutil.ToFloat64(h.svc.metrics.AddsEarly); got != 0 {
		t.Fatalf("the first ADD has nothing reserved ahead, yet adds_early_total = %v", got)
	}
	ahead := h.j.snapshot().Ahead
	if len(ahead) != ipam.AheadPerPool {
		t.Fatalf("journal after the first ADD reserves ahead %v, want %d addresses", ahead, ipam.AheadPerPool)
	}
	block := make(chan struct{})
	h.j.setBlock(block)
	add := make(chan *cniproto.Response, 1)
	go func() { add <- h.svc.Handle(context.Background(), addReq("c2")) }()
	var c2 netip.Addr
	select {
	case r := <-add:
		if r.Error != nil {
			t.Fatalf("early ADD c2: %v", r.Error)
		}
		c2 = netip.MustParsePrefix(r.IPs[0].Address).Addr()
	case <-time.After(10 * time.Second):
		t.Fatal("the ADD waited for its journal write though its address was reserved ahead")
	}
	if ad := (ipam.Address{Pool: "v4", Addr: c2}); ad != ahead[0] && ad != ahead[1] {
		t.Fatalf("early ADD got %s, not one of the addresses reserved ahead %v", c2, ahead)
	}
	if got := testutil.ToFloat64(h.svc.metrics.AddsInFlight); got != 1 {
		t.Fatalf("adds_in_flight = %v while the write is held, want 1", got)
	}
	// On disk the address is still reserved ahead, so a crash now cannot free it.
	snap := h.j.snapshot()
	if !containsAddress(snap.Ahead, c2) || len(snap.Attachments) != 1 {
		t.Fatalf("journal while the write is held: ahead %v, attachments %v; want %s reserved and c1 only", snap.Ahead, snap.Attachments, c2)
	}
	del := make(chan *cniproto.Response, 1)
	go func() {
		del <- h.svc.Handle(context.Background(), cniproto.Request{Op: cniproto.OpDel, ContainerID: "c2", IfName: "eth0"})
	}()
	list := make(chan *cniproto.Response, 1)
	go func() { list <- h.svc.Handle(context.Background(), cniproto.Request{Op: cniproto.OpList}) }()
	select {
	case r := <-del:
		t.Fatalf("DEL of c2 answered (%+v) before c2's ADD was journaled", r)
	case r := <-list:
		t.Fatalf("LIST answered (%+v) before an ADD answered earlier was journaled", r)
	case <-time.After(100 * time.Millisecond):
	}
	h.j.setBlock(nil)
	close(block)
	if r := <-del; r.Error != nil {
		t.Fatalf("DEL c2: %v", r.Error)
	}
	// LIST answered only once the ADD's write landed (above); the DEL of c2, released by the same
	// write, may land before LIST reads, so c2 may or may not be listed.
	if r := <-list; r.Error != nil || !listHas(r, "c1") {
		t.Fatalf("LIST after the write landed: %+v, want c1", r)
	}
	if err := h.svc.WaitReleases(context.Background()); err != nil {
		t.Fatal(err)
	}
	snap = h.j.snapshot()
	if containsAddress(snap.Ahead, c2) {
		t.Fatalf("journal still reserves %s ahead after the ADD that used it landed: %v", c2, snap.Ahead)
	}
	if got := testutil.ToFloat64(h.svc.metrics.AddsEarly); got != 1 {
		t.Fatalf("adds_early_total = %v, want 1", got)
	}
	h.j.neverTwice(t)
}

// When the journal refuses the write of an ADD answered early, its address stays out of use (the
// runtime has it; the journal still records it reserved ahead) until its pod reports it, which
// adopts it; the hold then ends and the record is forgotten.
func TestEarlyAddRefusedHoldsItsAddressUntilThePodReports(t *testing.T) {
	h := newSvc(t, 50*time.Millisecond, testV4)
	h.hold(map[string]string{"v4": "10.1.0.5-10.1.0.9"})
	if r := h.do(addReq("c1")); r.Error != nil {
		t.Fatalf("ADD c1: %+v", r.Error)
	}
	pods := []ipam.Pod{{Ref: ipam.PodRef{Namespace: "ns", Name: "pod-c1", UID: "uid-c1"}, IPs: []netip.Addr{netip.MustParseAddr("10.1.0.5")}},
		{Ref: ipam.PodRef{Namespace: "ns", Name: "pod-c2", UID: "uid-c2"}}}
	h.svc.SetPods(pods)
	refused := testutil.ToFloat64(h.svc.metrics.JournalRefused.WithLabelValues("add"))
	h.j.setFail(errors.New("disk full"))
	r := h.do(addReq("c2"))
	if r.Error != nil {
		t.Fatalf("early ADD c2: %v", r.Error)
	}
	c2 := netip.MustParsePrefix(r.IPs[0].Address).Addr()
	h.j.setFail(nil)
	if got := testutil.ToFloat64(h.svc.metrics.JournalRefused.WithLabelValues("add")); got != refused+1 {
		t.Fatalf("journal_refused_total{change=add} = %v, want %v", got, refused+1)
	}
	if got := testutil.ToFloat64(h.svc.metrics.HoldActive); got != 1 {
		t.Fatalf("hold_active = %v after a refused early ADD, want 1", got)
	}
	// Every other address goes before c2's comes back.
	for _, cid := range []string{"c3", "c4", "c5", "c6"} {
		r := h.do(addReq(cid))
		if r.Error != nil {
			break // the node is short: fine, as long as c2's address was not handed out
		}
		if got := netip.MustParsePrefix(r.IPs[0].Address).Addr(); got == c2 {
			t.Fatalf("ADD %s got %s, which the refused early ADD handed to c2's sandbox", cid, got)
		}
	}
	// c2's pod reports its address: it is adopted, the hold ends, the record is forgotten.
	pods[1].IPs = []netip.Addr{c2}
	h.svc.SetPods(pods)
	if got := testutil.ToFloat64(h.svc.metrics.HoldActive); got != 0 {
		t.Fatalf("hold_active = %v once every pod reported, want 0", got)
	}
	snap := h.j.snapshot()
	if containsAddress(snap.Ahead, c2) {
		t.Fatalf("the record of %s outlived the hold: %v", c2, snap.Ahead)
	}
	adopted := false
	for _, a := range snap.Attachments {
		if a.Key == ipam.RebuiltKey("uid-c2") && len(a.Addresses) == 1 && a.Addresses[0].Addr == c2 {
			adopted = true
		}
	}
	if !adopted {
		t.Fatalf("c2's address %s was not adopted from its pod's status: %+v", c2, snap.Attachments)
	}
}

func containsAddress(as []ipam.Address, a netip.Addr) bool {
	for _, x := range as {
		if x.Addr == a {
			return true
		}
	}
	return false
}

func listHas(r *cniproto.Response, cid string) bool {
	for _, a := range r.Attachments {
		if a.ContainerID == cid {
			return true
		}
	}
	return false
}

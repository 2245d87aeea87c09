package agent

import (
	"context"
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// TestAddAnsweredOnlyAfterItsJournalWrite: an address a runtime is told is on disk first. While
// the ADD's write is held the ADD is not answered; a refused write answers an error, hands
// nothing out, and the next ADD may take the same address (no runtime was told of it).
func TestAddAnsweredOnlyAfterItsJournalWrite(t *testing.T) {
	h := newSvc(t, 50*time.Millisecond, testV4)
	h.hold(map[string]string{"v4": "10.1.0.5-10.1.0.9"})
	if r := h.do(addReq("c1")); r.Error != nil {
		t.Fatalf("ADD c1: %+v", r.Error)
	}
	block := make(chan struct{})
	h.j.setBlock(block)
	add := make(chan *cniproto.Response, 1)
	go func() { add <- h.svc.Handle(context.Background(), addReq("c2")) }()
	// The write is held: whatever the ADD would answer is not on disk, so it must not answer.
	// (A bounded look, not a synchronization: the check below is what makes it fail.)
	select {
	case r := <-add:
		t.Fatalf("ADD c2 answered (%+v) while its journal write was held", r)
	case <-time.After(200 * time.Millisecond):
	}
	if n := len(h.j.snapshot().Attachments); n != 1 {
		t.Fatalf("journal has %d attachments while c2's write is held, want 1", n)
	}
	h.j.setBlock(nil)
	close(block)
	r := <-add
	if r.Error != nil {
		t.Fatalf("ADD c2: %+v", r.Error)
	}
	c2 := netip.MustParsePrefix(r.IPs[0].Address).Addr()
	if !journalAttaches(h, "c2", c2) {
		t.Fatalf("ADD c2 answered %s, which the journal does not attach to c2: %+v", c2, h.j.snapshot().Attachments)
	}

	// A refused write: an error, nothing handed out.
	h.j.setFail(errors.New("no space left on device"))
	r = h.do(addReq("c3"))
	if r.Error == nil || r.Error.Code != cniproto.CodeTryAgainLater || len(r.IPs) != 0 {
		t.Fatalf("ADD c3 with the journal refusing: %+v, want error code %d and no address", r, cniproto.CodeTryAgainLater)
	}
	h.j.setFail(nil)
	if r := h.do(addReq("c4")); r.Error != nil {
		t.Fatalf("ADD c4 after the disk came back: %+v", r.Error)
	}
	h.j.neverTwice(t)
}

func journalAttaches(h *svcHarness, cid string, a netip.Addr) bool {
	for _, att := range h.j.snapshot().Attachments {
		if att.Key.ContainerID != cid {
			continue
		}
		for _, ad := range att.Addresses {
			if ad.Addr == a {
				return true
			}
		}
	}
	return false
}

package agent

import (
	"context"
	"fmt"
	"testing"
	"testing/synctest"
	"time"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

func (p *fakePublisher) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.specs)
}

func boundPods(n int) []ipam.Pod {
	pods := make([]ipam.Pod, n)
	for i := range pods {
		pods[i] = ipam.Pod{Ref: ipam.PodRef{Namespace: "ns", Name: fmt.Sprintf("p%d", i), UID: fmt.Sprintf("u%d", i)}}
	}
	return pods
}

// TestMonitorCoalescesABurst: pods bound to the node 20 ms apart (a scheduler's burst) raise
// the request once with a 100 ms quiet time, where every kick was a round (and, with batch 4,
// a write per batch boundary) without it; the one write asks for the whole burst.
func TestMonitorCoalescesABurst(t *testing.T) {
	for _, tc := range []struct {
		quiet      time.Duration
		wantWrites int
	}{{0, 5}, {100 * time.Millisecond, 1}} {
		t.Run(tc.quiet.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				h := newSvc(t, 10*time.Second, testV4)
				h.mon.SetCoalesce(tc.quiet)
				ctx, cancel := context.WithCancel(context.Background())
				ran := make(chan struct{})
				go func() { h.mon.Run(ctx); close(ran) }()
				defer func() { cancel(); <-ran }()
				for n := 1; n <= 16; n++ {
					h.svc.SetPods(boundPods(n))
					synctest.Wait()
					time.Sleep(20 * time.Millisecond)
				}
				time.Sleep(tc.quiet)
				synctest.Wait()
				if got := h.pub.count(); got != tc.wantWrites {
					t.Fatalf("%d spec writes for 16 pods bound 20 ms apart, want %d", got, tc.wantWrites)
				}
				if spec := h.pub.last(); len(spec) != 1 || spec[0].Requested != 20 {
					t.Fatalf("last request %v, want 20 (batch 4 * ceil(0.5 + 16/4))", spec)
				}
			})
		})
	}
}

// TestMonitorCoalescingIsBounded: changes that never pause still get a round every ten quiet
// times, and an ADD waiting for an address (KickNow) gets one at once.
func TestMonitorCoalescingIsBounded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newSvc(t, 10*time.Second, testV4)
		h.mon.SetCoalesce(100 * time.Millisecond)
		ctx, cancel := context.WithCancel(context.Background())
		ran := make(chan struct{})
		go func() { h.mon.Run(ctx); close(ran) }()
		defer func() { cancel(); <-ran }()
		start := time.Now()
		for n := 1; h.pub.count() == 0; n++ {
			if time.Since(start) > 2*time.Second {
				t.Fatal("no round in 2 s of changes 50 ms apart")
			}
			h.svc.SetPods(boundPods(n))
			synctest.Wait()
			time.Sleep(50 * time.Millisecond)
		}
		if took := time.Since(start); took > time.Second+50*time.Millisecond {
			t.Fatalf("first round after %s of steady changes, want at most 1 s (ten quiet times)", took)
		}
		before := h.pub.count()
		h.svc.SetPods(boundPods(40))
		synctest.Wait()
		h.mon.KickNow()
		synctest.Wait()
		if h.pub.count() != before+1 {
			t.Fatalf("KickNow did not publish at once: %d writes, had %d", h.pub.count(), before)
		}
	})
}

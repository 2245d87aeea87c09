package controller

import (
	"context"
	"testing"
	"time"
)

var t0 = time.Unix(1_700_000_000, 0)

func newTestScheduler() *Scheduler {
	s := NewScheduler(time.Second, 100*time.Millisecond, 10*time.Second)
	s.Jitter = func() float64 { return 0 } // backoff = d/2 exactly
	return s
}

func mustNext(t *testing.T, s *Scheduler, now time.Time, want string) {
	t.Helper()
	key, ok, next := s.Next(now)
	if !ok || key != want {
		t.Fatalf("Next(%v) = %q, %v (next %v), want %q", now.Sub(t0), key, ok, next, want)
	}
}

func mustIdle(t *testing.T, s *Scheduler, now time.Time, wantNext time.Time) {
	t.Helper()
	key, ok, next := s.Next(now)
	if ok {
		t.Fatalf("Next(%v) = %q, want nothing ready", now.Sub(t0), key)
	}
	if !next.Equal(wantNext) {
		t.Fatalf("Next(%v): next ready at %v, want %v", now.Sub(t0), next.Sub(t0), wantNext.Sub(t0))
	}
}

func TestSchedulerServesGreatestNeedFirst(t *testing.T) {
	s := newTestScheduler()
	s.Add("surplus-small", Need{Surplus: 2}, t0)
	s.Add("deficit-small", Need{Deficit: 4}, t0)
	s.Add("idle", Need{}, t0)
	s.Add("deficit-large", Need{Deficit: 64}, t0)
	s.Add("surplus-large", Need{Surplus: 40}, t0)
	for _, want := range []string{"deficit-large", "deficit-small", "surplus-large", "surplus-small", "idle"} {
		mustNext(t, s, t0, want)
	}
	mustIdle(t, s, t0, time.Time{})
}

func TestSchedulerCoalescesAndPaces(t *testing.T) {
	s := newTestScheduler()
	for i := 0; i < 100; i++ {
		s.Add("n1", Need{Deficit: i}, t0)
	}
	if s.Len() != 1 {
		t.Fatalf("Len = %d after 100 adds of one key, want 1", s.Len())
	}
	mustNext(t, s, t0, "n1")
	mustIdle(t, s, t0, time.Time{})
	// Events during the sync queue exactly one more sync, not before MinInterval.
	s.Add("n1", Need{}, t0.Add(10*time.Millisecond))
	s.Add("n1", Need{}, t0.Add(20*time.Millisecond))
	mustIdle(t, s, t0.Add(30*time.Millisecond), time.Time{})
	s.Done("n1", false, t0.Add(50*time.Millisecond))
	mustIdle(t, s, t0.Add(500*time.Millisecond), t0.Add(time.Second))
	mustNext(t, s, t0.Add(time.Second), "n1")
	s.Done("n1", false, t0.Add(time.Second+time.Millisecond))
	mustIdle(t, s, t0.Add(5*time.Second), time.Time{})
	// A key added long after its last sync is ready at once.
	s.Add("n1", Need{}, t0.Add(5*time.Second))
	mustNext(t, s, t0.Add(5*time.Second), "n1")
}

func TestSchedulerBackoff(t *testing.T) {
	s := newTestScheduler()
	s.MinInterval = 0
	s.Add("n1", Need{Deficit: 1}, t0)
	now := t0
	// Jitter 0 gives d/2: 50ms, 100ms, 200ms, ... capped at 10s/2.
	for i, want := range []time.Duration{50, 100, 200, 400, 800, 1600, 3200, 5000, 5000} {
		mustNext(t, s, now, "n1")
		s.Done("n1", true, now)
		if s.Failures("n1") != i+1 {
			t.Fatalf("failures = %d, want %d", s.Failures("n1"), i+1)
		}
		mustIdle(t, s, now, now.Add(want*time.Millisecond))
		now = now.Add(want * time.Millisecond)
	}
	mustNext(t, s, now, "n1")
	s.Done("n1", false, now)
	if s.Failures("n1") != 0 {
		t.Fatal("success did not reset the backoff")
	}
	s.Add("n1", Need{}, now)
	mustNext(t, s, now, "n1")
}

func TestSchedulerJitterRange(t *testing.T) {
	s := newTestScheduler()
	for _, j := range []float64{0, 0.5, 0.999} {
		s.Jitter = func() float64 { return j }
		if d := s.backoff(3); d < 200*time.Millisecond || d >= 400*time.Millisecond {
			t.Fatalf("backoff(3) with jitter %v = %v, want in [200ms, 400ms)", j, d)
		}
	}
}

func TestSchedulerNeedUpdateWhileQueued(t *testing.T) {
	s := newTestScheduler()
	s.Add("a", Need{Deficit: 10}, t0)
	s.Add("b", Need{Deficit: 5}, t0)
	s.Add("c", Need{Deficit: 1}, t0)
	mustNext(t, s, t0, "a") // moves b and c into the ready heap
	s.Add("c", Need{Deficit: 50}, t0)
	mustNext(t, s, t0, "c")
	mustNext(t, s, t0, "b")
}

func TestSchedulerForget(t *testing.T) {
	s := newTestScheduler()
	s.Add("a", Need{}, t0)
	mustNext(t, s, t0, "a")
	s.Forget("a") // processing: kept
	s.Done("a", false, t0)
	s.Forget("a")
	s.Add("a", Need{}, t0.Add(time.Millisecond)) // history gone: no MinInterval wait
	mustNext(t, s, t0.Add(time.Millisecond), "a")
}

func TestSchedulerGetBlocksUntilReady(t *testing.T) {
	s := NewScheduler(0, time.Millisecond, time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	got := make(chan string, 1)
	go func() {
		k, _ := s.Get(ctx)
		got <- k
	}()
	s.Add("x", Need{}, time.Now())
	select {
	case k := <-got:
		if k != "x" {
			t.Fatalf("Get = %q", k)
		}
	case <-ctx.Done():
		t.Fatal("Get did not return a ready key")
	}
	done := make(chan bool, 1)
	go func() {
		_, ok := s.Get(ctx)
		done <- ok
	}()
	s.ShutDown()
	select {
	case ok := <-done:
		if ok {
			t.Fatal("Get after ShutDown returned a key")
		}
	case <-ctx.Done():
		t.Fatal("ShutDown did not wake Get")
	}
}

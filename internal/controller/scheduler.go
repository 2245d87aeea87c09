package controller

import (
	"container/heap"
	"context"
	"sync"
	"time"
)

// Scheduler is the controller's work queue of node names. Unlike a FIFO it serves the most urgent
// node first (MoreUrgent: deficit first, largest first, then largest surplus), and it coalesces:
//
//   - a key added while queued is queued once, with its newest need;
//   - a key added while a worker processes it is queued again when the worker is done;
//   - a key becomes ready no sooner than MinInterval after its previous sync started, so a burst
//     of events for one node makes one sync, not one per event;
//   - a failed sync is retried after an exponential backoff with jitter (BackoffBase doubling to
//     BackoffMax), reset by the next success.
//
// All decisions take the time as an argument (Next, Done); Get is the blocking wrapper workers use.
type Scheduler struct {
	MinInterval time.Duration
	BackoffBase time.Duration
	BackoffMax  time.Duration
	// Jitter returns a number in [0, 1); the backoff is scaled into [d/2, d).
	Jitter func() float64
	// Now is the clock of the blocking Get; time.Now when nil.
	Now func() time.Time

	mu       sync.Mutex
	seq      uint64
	items    map[string]*schedItem
	waiting  waitHeap
	ready    readyHeap
	changed  chan struct{} // closed and replaced on every change: a broadcast to blocked Gets
	shutdown bool
}

type itemState int

const (
	idle itemState = iota
	queued
	processing
	processingDirty
)

type schedItem struct {
	key          string
	need         Need
	state        itemState
	readyAt      time.Time
	lastStart    time.Time
	backoffUntil time.Time
	failures     int
	seq          uint64 // order of becoming ready, for FIFO among equal needs
	index        int    // position in waiting or ready heap
	inReady      bool
}

// NewScheduler returns a scheduler with the given pacing; Jitter defaults to a fixed 0.5.
func NewScheduler(minInterval, backoffBase, backoffMax time.Duration) *Scheduler {
	return &Scheduler{
		MinInterval: minInterval, BackoffBase: backoffBase, BackoffMax: backoffMax,
		items: map[string]*schedItem{}, changed: make(chan struct{}),
	}
}

// Add marks key dirty with its current need.
func (s *Scheduler) Add(key string, need Need, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	it, ok := s.items[key]
	if !ok {
		it = &schedItem{key: key, index: -1}
		s.items[key] = it
	}
	it.need = need
	switch it.state {
	case processing:
		it.state = processingDirty
	case processingDirty:
	case queued:
		if it.inReady {
			heap.Fix(&s.ready, it.index)
		}
	case idle:
		s.enqueue(it, now)
	}
	s.signalLocked()
}

func (s *Scheduler) enqueue(it *schedItem, now time.Time) {
	it.state = queued
	it.readyAt = now
	if !it.lastStart.IsZero() {
		if t := it.lastStart.Add(s.MinInterval); t.After(it.readyAt) {
			it.readyAt = t
		}
	}
	if it.backoffUntil.After(it.readyAt) {
		it.readyAt = it.backoffUntil
	}
	it.inReady = false
	heap.Push(&s.waiting, it)
}

// Next hands out the most urgent ready key, marking it processing. When none is ready it returns
// ok=false and the time the next one will be (zero when nothing is queued).
func (s *Scheduler) Next(now time.Time) (key string, ok bool, next time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.waiting.Len() > 0 && !s.waiting[0].readyAt.After(now) {
		it := heap.Pop(&s.waiting).(*schedItem)
		s.seq++
		it.seq = s.seq
		it.inReady = true
		heap.Push(&s.ready, it)
	}
	if s.ready.Len() == 0 {
		if s.waiting.Len() > 0 {
			return "", false, s.waiting[0].readyAt
		}
		return "", false, time.Time{}
	}
	it := heap.Pop(&s.ready).(*schedItem)
	it.inReady = false
	it.state = processing
	it.lastStart = now
	return it.key, true, time.Time{}
}

// Done ends processing of key. A failure schedules a retry after the backoff; a key added while
// it was processed is queued again.
func (s *Scheduler) Done(key string, failed bool, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	it, ok := s.items[key]
	if !ok || (it.state != processing && it.state != processingDirty) {
		return
	}
	dirty := it.state == processingDirty
	it.state = idle
	if failed {
		it.failures++
		it.backoffUntil = now.Add(s.backoff(it.failures))
	} else {
		it.failures = 0
		it.backoffUntil = time.Time{}
	}
	if dirty || failed {
		s.enqueue(it, now)
		s.signalLocked()
	}
}

// Failures is the number of consecutive failed syncs of key.
func (s *Scheduler) Failures(key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if it, ok := s.items[key]; ok {
		return it.failures
	}
	return 0
}

// Forget drops an idle key's history (its node is gone).
func (s *Scheduler) Forget(key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if it, ok := s.items[key]; ok && it.state == idle {
		delete(s.items, key)
	}
}

// Len is the number of queued keys (ready or waiting).
func (s *Scheduler) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.waiting.Len() + s.ready.Len()
}

// backoff is BackoffBase * 2^(failures-1), capped at BackoffMax, scaled by jitter into [d/2, d).
func (s *Scheduler) backoff(failures int) time.Duration {
	d := s.BackoffBase
	for i := 1; i < failures && d < s.BackoffMax; i++ {
		d *= 2
	}
	if s.BackoffMax > 0 && d > s.BackoffMax {
		d = s.BackoffMax
	}
	j := 0.5
	if s.Jitter != nil {
		j = s.Jitter()
	}
	return d/2 + time.Duration(j*float64(d/2))
}

// ShutDown wakes every blocked Get, which then returns false.
func (s *Scheduler) ShutDown() {
	s.mu.Lock()
	s.shutdown = true
	s.signalLocked()
	s.mu.Unlock()
}

// Get blocks until a key is ready, ctx ends or the scheduler shuts down.
func (s *Scheduler) Get(ctx context.Context) (string, bool) {
	now := s.Now
	if now == nil {
		now = time.Now
	}
	for {
		// Take the change channel before looking, so a change after the look wakes us.
		s.mu.Lock()
		changed, down := s.changed, s.shutdown
		s.mu.Unlock()
		if down || ctx.Err() != nil {
			return "", false
		}
		key, ok, next := s.Next(now())
		if ok {
			return key, true
		}
		var timer *time.Timer
		var fire <-chan time.Time
		if !next.IsZero() {
			timer = time.NewTimer(max(next.Sub(now()), time.Millisecond))
			fire = timer.C
		}
		select {
		case <-ctx.Done():
		case <-changed:
		case <-fire:
		}
		if timer != nil {
			timer.Stop()
		}
	}
}

// signalLocked wakes every blocked Get; s.mu must be held.
func (s *Scheduler) signalLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

type waitHeap []*schedItem

func (h waitHeap) Len() int           { return len(h) }
func (h waitHeap) Less(i, j int) bool { return h[i].readyAt.Before(h[j].readyAt) }
func (h waitHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i]; h[i].index = i; h[j].index = j }
func (h *waitHeap) Push(x any)        { it := x.(*schedItem); it.index = len(*h); *h = append(*h, it) }
func (h *waitHeap) Pop() any {
	old := *h
	it := old[len(old)-1]
	*h = old[:len(old)-1]
	it.index = -1
	return it
}

type readyHeap []*schedItem

func (h readyHeap) Len() int { return len(h) }
func (h readyHeap) Less(i, j int) bool {
	a, b := h[i], h[j]
	if MoreUrgent(a.need, b.need) {
		return true
	}
	if MoreUrgent(b.need, a.need) {
		return false
	}
	return a.seq < b.seq
}
func (h readyHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i]; h[i].index = i; h[j].index = j }
func (h *readyHeap) Push(x any)   { it := x.(*schedItem); it.index = len(*h); *h = append(*h, it) }
func (h *readyHeap) Pop() any {
	old := *h
	it := old[len(old)-1]
	*h = old[:len(old)-1]
	it.index = -1
	return it
}

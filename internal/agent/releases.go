package agent

import (
	"context"
	"sync"
)

// releases tracks the DELs answered before their journal write finished (Service.del). A DEL
// holds its attachment's lock until the write is done, so a request for the same attachment
// waits for it; a reader that must see every DEL already answered (LIST, the agent's stop)
// waits for the ones started before it with wait.
type releases struct {
	mu   sync.Mutex
	next uint64
	open map[uint64]struct{}
	done chan struct{} // closed and replaced whenever one finishes
}

// start registers a release and returns its ticket for finish.
func (r *releases) start() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.open == nil {
		r.open = map[uint64]struct{}{}
		r.done = make(chan struct{})
	}
	r.next++
	r.open[r.next] = struct{}{}
	return r.next
}

// finish ends the release of ticket id.
func (r *releases) finish(id uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.open, id)
	close(r.done)
	r.done = make(chan struct{})
}

// wait returns once every release started before the call has finished, or with ctx's error.
// Releases started later do not hold it up.
func (r *releases) wait(ctx context.Context) error {
	r.mu.Lock()
	upTo := r.next
	for r.anyUpTo(upTo) {
		done := r.done
		r.mu.Unlock()
		select {
		case <-done:
		case <-ctx.Done():
			return ctx.Err()
		}
		r.mu.Lock()
	}
	r.mu.Unlock()
	return nil
}

// anyUpTo reports whether a release with ticket upTo or lower is open; r.mu is held.
func (r *releases) anyUpTo(upTo uint64) bool {
	for id := range r.open {
		if id <= upTo {
			return true
		}
	}
	return false
}

package agent

import (
	"context"
	"testing"
	"testing/synctest"
)

// wait returns once the releases started before it have finished; one started later does not
// hold it up.
func TestReleasesWaitOnlyForEarlierOnes(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var r releases
		if err := r.wait(context.Background()); err != nil {
			t.Fatalf("wait with none open: %v", err)
		}
		first := r.start()
		done := make(chan error, 1)
		go func() { done <- r.wait(context.Background()) }()
		synctest.Wait()
		later := r.start()
		select {
		case err := <-done:
			t.Fatalf("wait returned (%v) while the release started before it is open", err)
		default:
		}
		r.finish(first)
		synctest.Wait()
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		default:
			t.Fatal("wait still waits for a release started after it")
		}
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if err := r.wait(ctx); err == nil {
			t.Fatal("wait with an earlier release open and its context done returned nil")
		}
		r.finish(later)
		if err := r.wait(context.Background()); err != nil {
			t.Fatal(err)
		}
	})
}

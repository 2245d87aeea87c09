package controller

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/tools/leaderelection/resourcelock"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
)

// FencePolicyName is the ValidatingAdmissionPolicy (deploy/kustomize/fence-policy.yaml) that
// rejects a status write whose fence does not match the controller's leader election Lease.
const FencePolicyName = "ipwarden-controller-fence"

// ErrFenced means the controller may no longer write: it lost its Lease, or the API server
// rejected a write as coming from a controller that is not the Lease holder. The controller
// stops at once and the process exits, so it restarts as a follower.
var ErrFenced = errors.New("fenced: this controller no longer holds the leader election Lease")

// ErrFenceLost means the controller may no longer write because the API server would no longer
// fence its writes: the fence policy or its binding went away or stopped denying a stale
// leader's write (JudgeFence). The leader stops writing at once and steps down; it may lead
// again once the fence holds.
var ErrFenceLost = errors.New("fence lost: the fence policy no longer denies a stale leader's writes")

// Fence is the controller's write permit (docs/design.md, "Fencing"). Leader election alone is
// not mutual exclusion: a leader paused past its lease (GC pause, VM stall, SIGSTOP) resumes
// believing it leads and would write from a stale record. Two checks close that:
//
//   - before each write, Allow checks that the lease this process last renewed has not run out
//     by its own clock (a standby takes over no earlier than LeaseDuration after it saw our last
//     renewal, so until then no one else can have written);
//   - every status the controller writes carries ipwardenv1.Fence{Holder, Epoch}, and the
//     API server itself rejects the write unless they match the Lease (FencePolicyName), which
//     covers a pause between the check and the write's arrival.
//
// Fence implements neither: LeaseObserver feeds it from the leader election lock.
type Fence struct {
	mu       sync.Mutex
	holder   string
	epoch    int64
	validTo  time.Time
	duration time.Duration
	disabled bool // no leader election: writes carry no fence
	now      func() time.Time
	// skipLocal turns off the local lease-expiry check (tests of the server-side fence only).
	skipLocal bool
	// lost is set (ErrFenceLost and why) once the fence policy stopped fencing this leader's
	// writes; lostCh is closed then. For good: the leader steps down.
	lost   error
	lostCh chan struct{}
}

// NewFence returns a fence for a controller with the given Lease duration. Until the leader
// election lock reports a successful acquisition, Allow refuses every write.
func NewFence(leaseDuration time.Duration, now func() time.Time) *Fence {
	if now == nil {
		now = time.Now
	}
	return &Fence{duration: leaseDuration, now: now, lostCh: make(chan struct{})}
}

// NoFence is the fence of a controller run without leader election: it allows every write and
// stamps none, so the fence policy (if installed) rejects its writes.
func NoFence() *Fence { return &Fence{disabled: true, now: time.Now} }

// SkipLocalCheck turns off the local lease-expiry check, leaving only the API server's fence.
// For tests that prove the server-side fence on its own.
func (f *Fence) SkipLocalCheck() { f.mu.Lock(); f.skipLocal = true; f.mu.Unlock() }

// Renewed records a successful write of the Lease by this process: attempt is when the write
// started (the lease runs from then, at the latest).
func (f *Fence) Renewed(rec resourcelock.LeaderElectionRecord, attempt time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if rec.HolderIdentity == "" {
		f.validTo = time.Time{} // released on shutdown
		return
	}
	f.holder, f.epoch = rec.HolderIdentity, int64(rec.LeaderTransitions)
	d := f.duration
	if rec.LeaseDurationSeconds > 0 {
		d = min(d, time.Duration(rec.LeaseDurationSeconds)*time.Second)
	}
	f.validTo = attempt.Add(d)
}

// Stamp is what every status write carries; nil without leader election.
func (f *Fence) Stamp() *ipwardenv1.Fence {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.disabled {
		return nil
	}
	return &ipwardenv1.Fence{Holder: f.holder, Epoch: f.epoch}
}

// Allow says whether the controller may attempt a write now: ErrFenced when its lease ran out
// by its own clock.
func (f *Fence) Allow() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.lost != nil {
		return f.lost
	}
	return FenceDecision(f.disabled || f.skipLocal, f.holder, f.validTo, f.now())
}

// Leading says whether this process holds the Lease as far as it knows (it acquired it and has
// neither released nor lost it), whatever its clock says of the lease's expiry.
func (f *Fence) Leading() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return !f.disabled && f.holder != "" && !f.validTo.IsZero() && f.lost == nil
}

// Lose takes the write permit for good because the fence policy no longer fences this
// controller's writes (detail says why): Allow returns ErrFenceLost from now on and Lost is
// closed. It says whether the fence was leading (false: nothing to lose).
func (f *Fence) Lose(detail string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.disabled || f.holder == "" || f.validTo.IsZero() || f.lost != nil {
		return false
	}
	f.lost = fmt.Errorf("%w (%s)", ErrFenceLost, detail)
	close(f.lostCh)
	return true
}

// Lost is closed once Lose took the permit (nil for NoFence: never).
func (f *Fence) Lost() <-chan struct{} { return f.lostCh }

// isLost says whether Lose took the permit.
func (f *Fence) isLost() bool { f.mu.Lock(); defer f.mu.Unlock(); return f.lost != nil }

// FenceDecision is Allow's rule: a write is allowed while the lease this process holds has not
// run out; never before it first acquired one.
func FenceDecision(unfenced bool, holder string, validTo, now time.Time) error {
	switch {
	case unfenced:
		return nil
	case holder == "" || validTo.IsZero():
		return fmt.Errorf("%w (no lease acquired)", ErrFenced)
	case !now.Before(validTo):
		return fmt.Errorf("%w (its lease ran out %s ago by its own clock)", ErrFenced, now.Sub(validTo).Round(time.Millisecond))
	}
	return nil
}

// Epoch is the fence's epoch (for logs and metrics).
func (f *Fence) Epoch() int64 { f.mu.Lock(); defer f.mu.Unlock(); return f.epoch }

// Holder is the fence's holder identity.
func (f *Fence) Holder() string { f.mu.Lock(); defer f.mu.Unlock(); return f.holder }

// IsFenceRejection says whether err is the API server refusing a write through the fence policy.
func IsFenceRejection(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, ErrFenced) {
		return true
	}
	return (apierrors.IsForbidden(err) || apierrors.IsInvalid(err)) && strings.Contains(err.Error(), FencePolicyName)
}

// Outranked is Outranked for this fence; never with the local checks off.
func (f *Fence) Outranked(seen *ipwardenv1.Fence) bool {
	return !f.localChecksOff() && Outranked(f.Stamp(), seen)
}

func (f *Fence) localChecksOff() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.skipLocal
}

// Outranked says whether a status written by another controller shows a newer epoch than
// ours: some other controller has led since we acquired our lease, so we must stop.
func Outranked(ours *ipwardenv1.Fence, seen *ipwardenv1.Fence) bool {
	return ours != nil && seen != nil && seen.Holder != ours.Holder && seen.Epoch > ours.Epoch
}

// LeaseObserver wraps the leader election lock and reports every successful write of the
// lease by this process to a Fence. With a Gate it takes or renews the Lease only while the fence
// policy fences its writes (FenceGate.Check, at every read and write of the Lease).
type LeaseObserver struct {
	resourcelock.Interface
	Fence *Fence
	Now   func() time.Time
	// Gate, if set, judges the fence policy at every lease operation [nil: not checked].
	Gate *FenceGate
}

// Get reads the lease. With a Gate it judges the fence first: a standby polls the Lease through
// Get, so it notices (and says) that its fence went away while it waits.
func (l *LeaseObserver) Get(ctx context.Context) (*resourcelock.LeaderElectionRecord, []byte, error) {
	if l.Gate != nil {
		_ = l.Gate.Check(ctx, l.Fence, l.Interface.Identity())
	}
	return l.Interface.Get(ctx)
}

// mayTake is the gate before this process writes itself into the Lease (acquire or renew): a
// fresh judgement of the fence, and never again once the fence was lost.
func (l *LeaseObserver) mayTake(ctx context.Context) error {
	if l.Fence.isLost() {
		return fmt.Errorf("not renewing the Lease: %w", ErrFenceLost)
	}
	if l.Gate == nil {
		return nil
	}
	return l.Gate.Check(ctx, l.Fence, l.Interface.Identity())
}

// Create creates the lease and reports it.
func (l *LeaseObserver) Create(ctx context.Context, rec resourcelock.LeaderElectionRecord) error {
	if err := l.mayTake(ctx); err != nil {
		return err
	}
	start := l.Now()
	err := l.Interface.Create(ctx, rec)
	if err == nil {
		l.Fence.Renewed(rec, start)
	}
	return err
}

// Update renews or takes over the lease and reports it. A release (an empty holder, written
// on shutdown) is refused unless this process still holds the lease: client-go's release checks
// the holder it last observed, not the one it just read, so a stale leader exiting would clear
// the new leader's lease and fence it too.
func (l *LeaseObserver) Update(ctx context.Context, rec resourcelock.LeaderElectionRecord) error {
	start := l.Now()
	if rec.HolderIdentity == "" {
		cur, _, err := l.Interface.Get(ctx)
		if err != nil {
			return err
		}
		if cur.HolderIdentity != l.Interface.Identity() {
			l.Fence.Renewed(rec, start) // ours ended all the same
			return fmt.Errorf("not releasing the lease: it is held by %q, not by this process", cur.HolderIdentity)
		}
	} else if err := l.mayTake(ctx); err != nil {
		return err
	}
	err := l.Interface.Update(ctx, rec)
	if err == nil {
		l.Fence.Renewed(rec, start)
	}
	return err
}

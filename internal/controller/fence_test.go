package controller

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/tools/leaderelection/resourcelock"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
)

func TestFenceDecision(t *testing.T) {
	now := t0
	cases := []struct {
		name     string
		unfenced bool
		holder   string
		validTo  time.Time
		allowed  bool
	}{
		{"no leader election", true, "", time.Time{}, true},
		{"never acquired", false, "", time.Time{}, false},
		{"lease running", false, "a", now.Add(time.Second), true},
		{"lease ran out exactly now", false, "a", now, false},
		{"lease ran out (paused past it)", false, "a", now.Add(-time.Minute), false},
	}
	for _, tc := range cases {
		err := FenceDecision(tc.unfenced, tc.holder, tc.validTo, now)
		if (err == nil) != tc.allowed {
			t.Errorf("%s: err = %v, want allowed=%v", tc.name, err, tc.allowed)
		}
		if err != nil && !errors.Is(err, ErrFenced) {
			t.Errorf("%s: %v is not ErrFenced", tc.name, err)
		}
	}
}

type fakeLock struct {
	resourcelock.Interface
	fail    error
	holder  string // what Get returns
	updates int
}

func (l *fakeLock) Create(context.Context, resourcelock.LeaderElectionRecord) error { return l.fail }
func (l *fakeLock) Update(context.Context, resourcelock.LeaderElectionRecord) error {
	l.updates++
	return l.fail
}
func (l *fakeLock) Get(context.Context) (*resourcelock.LeaderElectionRecord, []byte, error) {
	return &resourcelock.LeaderElectionRecord{HolderIdentity: l.holder}, nil, nil
}
func (l *fakeLock) Identity() string { return "ctrl-a" }

// A stale leader shutting down must not release a lease another process took over (client-go
// releases on the holder it last observed): the wrapper refuses, and the fence ends all the same.
func TestLeaseObserverNeverReleasesAnotherHoldersLease(t *testing.T) {
	f := NewFence(15*time.Second, func() time.Time { return t0 })
	lock := &fakeLock{holder: "ctrl-b"}
	obs := &LeaseObserver{Interface: lock, Fence: f, Now: func() time.Time { return t0 }}
	_ = obs.Create(context.Background(), resourcelock.LeaderElectionRecord{HolderIdentity: "ctrl-a", LeaseDurationSeconds: 15})
	if err := obs.Update(context.Background(), resourcelock.LeaderElectionRecord{}); err == nil || lock.updates != 0 {
		t.Fatalf("released a lease held by ctrl-b: err=%v updates=%d", err, lock.updates)
	}
	if f.Allow() == nil {
		t.Fatal("the fence still allows writes after shutdown")
	}
	lock.holder = "ctrl-a"
	if err := obs.Update(context.Background(), resourcelock.LeaderElectionRecord{}); err != nil || lock.updates != 1 {
		t.Fatalf("did not release its own lease: err=%v updates=%d", err, lock.updates)
	}
}

// The fence follows the lock: a successful renewal extends it by the lease from when the
// renewal started, a failed one does not, a release ends it, a takeover raises the epoch.
func TestLeaseObserverFeedsTheFence(t *testing.T) {
	clock := t0
	f := NewFence(15*time.Second, func() time.Time { return clock })
	lock := &fakeLock{}
	obs := &LeaseObserver{Interface: lock, Fence: f, Now: func() time.Time { return clock }}
	if f.Allow() == nil {
		t.Fatal("a fence with no lease allowed a write")
	}
	rec := resourcelock.LeaderElectionRecord{HolderIdentity: "ctrl-a", LeaseDurationSeconds: 15, LeaderTransitions: 3}
	if err := obs.Create(context.Background(), rec); err != nil {
		t.Fatal(err)
	}
	if err := f.Allow(); err != nil {
		t.Fatalf("fresh lease refused: %v", err)
	}
	if st := f.Stamp(); st.Holder != "ctrl-a" || st.Epoch != 3 {
		t.Fatalf("stamp %+v", st)
	}
	clock = t0.Add(14 * time.Second)
	lock.fail = errors.New("API server unreachable")
	_ = obs.Update(context.Background(), rec)
	clock = t0.Add(15 * time.Second)
	if f.Allow() == nil {
		t.Fatal("a lease whose renewal failed still allowed writes after it ran out")
	}
	lock.fail = nil
	rec.LeaderTransitions = 5
	if err := obs.Update(context.Background(), rec); err != nil {
		t.Fatal(err)
	}
	if f.Allow() != nil || f.Epoch() != 5 {
		t.Fatalf("after a renewal: allow=%v epoch=%d", f.Allow(), f.Epoch())
	}
	lock.holder = "ctrl-a"
	_ = obs.Update(context.Background(), resourcelock.LeaderElectionRecord{}) // released on shutdown
	if f.Allow() == nil {
		t.Fatal("a released lease still allowed writes")
	}
	if NoFence().Allow() != nil || NoFence().Stamp() != nil {
		t.Fatal("NoFence must allow and stamp nothing")
	}
}

func TestIsFenceRejectionAndOutranked(t *testing.T) {
	gr := schema.GroupResource{Group: "ipwarden.io", Resource: "nodeipallocations"}
	vap := apierrors.NewForbidden(gr, "n1", fmt.Errorf("ValidatingAdmissionPolicy '%s' with binding '%s' denied request: fenced", FencePolicyName, FencePolicyName))
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{vap, true},
		{fmt.Errorf("wrapped: %w", ErrFenced), true},
		{apierrors.NewForbidden(gr, "n1", errors.New("RBAC: no")), false},
		{apierrors.NewConflict(gr, "n1", errors.New("changed")), false},
		{nil, false},
	} {
		if got := IsFenceRejection(tc.err); got != tc.want {
			t.Errorf("IsFenceRejection(%v) = %v", tc.err, got)
		}
	}
	ours := &ipwardenv1.Fence{Holder: "a", Epoch: 4}
	if !Outranked(ours, &ipwardenv1.Fence{Holder: "b", Epoch: 5}) {
		t.Error("a newer epoch of another holder must outrank")
	}
	if Outranked(ours, &ipwardenv1.Fence{Holder: "b", Epoch: 3}) || Outranked(ours, &ipwardenv1.Fence{Holder: "a", Epoch: 9}) ||
		Outranked(nil, &ipwardenv1.Fence{Holder: "b", Epoch: 9}) || Outranked(ours, nil) {
		t.Error("outranked by an older epoch, itself, or with no fence")
	}
}

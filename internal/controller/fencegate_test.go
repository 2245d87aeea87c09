package controller

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus/testutil"
	admissionv1 "k8s.io/api/admissionregistration/v1"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

// gateRig is a LeaseObserver with a FenceGate over a fence the test edits.
type gateRig struct {
	policy  *admissionv1.ValidatingAdmissionPolicy
	binding *admissionv1.ValidatingAdmissionPolicyBinding
	readErr error
	reads   int
	events  []string
	metrics *Metrics
	gate    *FenceGate
}

func newGateRig(t *testing.T) *gateRig {
	r := &gateRig{metrics: NewMetrics(nil)}
	r.policy, r.binding = shippedFence(t)
	r.gate = &FenceGate{
		Read: func(context.Context) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding, error) {
			r.reads++
			return r.policy, r.binding, r.readErr
		},
		LeaseNamespace: "ipwarden-system", LeaseName: "ipwarden-controller",
		Metrics: r.metrics, Log: logr.Discard(),
		Event: func(reason, msg string) { r.events = append(r.events, reason+": "+msg) },
	}
	return r
}

func (r *gateRig) observer(f *Fence, lock *fakeLock) *LeaseObserver {
	return &LeaseObserver{Interface: lock, Fence: f, Now: func() time.Time { return t0 }, Gate: r.gate}
}

func (r *gateRig) ok() float64 { return testutil.ToFloat64(r.metrics.FencePolicyOK) }
func (r *gateRig) lost(reason FenceProblem) float64 {
	return testutil.ToFloat64(r.metrics.FenceLost.WithLabelValues(string(reason)))
}

// A standby started while the fence held, whose fence then goes away, never takes the Lease:
// every acquisition is refused while it does not hold, and it says so once (log, event, metric).
// When the fence is back, it takes the Lease.
func TestFenceGateStandby(t *testing.T) {
	r := newGateRig(t)
	f := NewFence(15*time.Second, func() time.Time { return t0 })
	lock := &fakeLock{holder: "ctrl-b"}
	obs := r.observer(f, lock)
	rec := resourcelock.LeaderElectionRecord{HolderIdentity: "ctrl-a", LeaseDurationSeconds: 15}

	if _, _, err := obs.Get(context.Background()); err != nil || r.ok() != 1 || r.reads != 1 {
		t.Fatalf("Get with the fence holding: err=%v fence_policy_ok=%v reads=%d", err, r.ok(), r.reads)
	}
	r.binding.Spec.ValidationActions = []admissionv1.ValidationAction{admissionv1.Warn}
	for range 3 { // the standby polls the Lease
		if _, _, err := obs.Get(context.Background()); err != nil {
			t.Fatalf("Get must read the Lease whatever the fence says: %v", err)
		}
	}
	if r.ok() != 0 || len(r.events) != 1 || !strings.HasPrefix(r.events[0], "FenceInvalid: ipwarden controller ctrl-a refuses to lead") {
		t.Fatalf("after the fence went: fence_policy_ok=%v events=%q", r.ok(), r.events)
	}
	lock.holder = "" // the leader went away
	if err := obs.Update(context.Background(), rec); err == nil || lock.updates != 0 || !strings.Contains(err.Error(), "validationActions") {
		t.Fatalf("took the Lease without a fence: err=%v updates=%d", err, lock.updates)
	}
	if err := obs.Create(context.Background(), rec); err == nil {
		t.Fatal("created the Lease without a fence")
	}
	if f.Leading() || f.Allow() == nil || len(r.events) != 1 || r.lost(FenceNotDenying) != 0 {
		t.Fatalf("a standby refused the Lease: leading=%v allow=%v events=%q lost=%v", f.Leading(), f.Allow(), r.events, r.lost(FenceNotDenying))
	}

	r.binding.Spec.ValidationActions = []admissionv1.ValidationAction{admissionv1.Deny}
	if err := obs.Update(context.Background(), rec); err != nil || lock.updates != 1 || !f.Leading() || f.Allow() != nil || r.ok() != 1 {
		t.Fatalf("fence back: err=%v updates=%d leading=%v allow=%v ok=%v", err, lock.updates, f.Leading(), f.Allow(), r.ok())
	}
}

// A leader whose fence goes away at a renewal loses its write permit at once, does not renew,
// says so (log, FenceLost event, metrics) and never renews again, even once the fence is back;
// a new campaign (a new Fence) may lead then.
func TestFenceGateLeaderStepsDown(t *testing.T) {
	for _, tc := range []struct {
		name       string
		breakFence func(r *gateRig)
		want       FenceProblem
	}{
		{"policy deleted", func(r *gateRig) { r.policy = nil }, FencePolicyMissing},
		{"binding deleted", func(r *gateRig) { r.binding = nil }, FenceBindingMissing},
		{"Warn-only binding", func(r *gateRig) {
			r.binding.Spec.ValidationActions = []admissionv1.ValidationAction{admissionv1.Warn}
		}, FenceNotDenying},
		{"Ignore policy", func(r *gateRig) { ig := admissionv1.Ignore; r.policy.Spec.FailurePolicy = &ig }, FenceFailsOpen},
		{"validation removed", func(r *gateRig) { r.policy.Spec.Validations = nil }, FenceCheckChanged},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newGateRig(t)
			f := NewFence(15*time.Second, func() time.Time { return t0 })
			lock := &fakeLock{}
			obs := r.observer(f, lock)
			rec := resourcelock.LeaderElectionRecord{HolderIdentity: "ctrl-a", LeaseDurationSeconds: 15, LeaderTransitions: 2}
			if err := obs.Create(context.Background(), rec); err != nil || !f.Leading() || f.Allow() != nil {
				t.Fatalf("leading: err=%v leading=%v allow=%v", err, f.Leading(), f.Allow())
			}
			select {
			case <-f.Lost():
				t.Fatal("Lost closed while the fence holds")
			default:
			}
			savedPolicy, savedBinding := r.policy.DeepCopy(), r.binding.DeepCopy()
			tc.breakFence(r)
			err := obs.Update(context.Background(), rec)
			if !errors.Is(err, ErrFenceLost) || lock.updates != 0 {
				t.Fatalf("renewed without a fence: err=%v updates=%d", err, lock.updates)
			}
			if err := f.Allow(); !errors.Is(err, ErrFenceLost) {
				t.Fatalf("Allow after the fence went = %v, want ErrFenceLost", err)
			}
			select {
			case <-f.Lost():
			default:
				t.Fatal("Lost not closed")
			}
			if r.ok() != 0 || r.lost(tc.want) != 1 || len(r.events) != 1 || !strings.HasPrefix(r.events[0], "FenceLost: ipwarden controller ctrl-a stopped writing and steps down") {
				t.Fatalf("not said: fence_policy_ok=%v fence_lost_total{%s}=%v events=%q", r.ok(), tc.want, r.lost(tc.want), r.events)
			}
			r.policy, r.binding = savedPolicy, savedBinding
			if err := obs.Update(context.Background(), rec); !errors.Is(err, ErrFenceLost) || lock.updates != 0 || f.Allow() == nil {
				t.Fatalf("a stepped-down leader renewed: err=%v updates=%d", err, lock.updates)
			}
			lock.holder = "ctrl-a"
			if err := obs.Update(context.Background(), resourcelock.LeaderElectionRecord{}); err != nil || lock.updates != 1 {
				t.Fatalf("a stepped-down leader must release its Lease: err=%v updates=%d", err, lock.updates)
			}
			next := NewFence(15*time.Second, func() time.Time { return t0 })
			if err := r.observer(next, lock).Update(context.Background(), resourcelock.LeaderElectionRecord{HolderIdentity: "ctrl-a2", LeaseDurationSeconds: 15}); err != nil || next.Allow() != nil || r.ok() != 1 {
				t.Fatalf("a new campaign with the fence back: err=%v allow=%v ok=%v", err, next.Allow(), r.ok())
			}
		})
	}
}

// A fence that cannot be read is no evidence it went away: the Lease is neither taken nor
// renewed, the leader keeps its permit until its lease runs out by its own clock.
func TestFenceGateUnreadable(t *testing.T) {
	r := newGateRig(t)
	clock := t0
	f := NewFence(15*time.Second, func() time.Time { return clock })
	lock := &fakeLock{}
	obs := &LeaseObserver{Interface: lock, Fence: f, Now: func() time.Time { return clock }, Gate: r.gate}
	rec := resourcelock.LeaderElectionRecord{HolderIdentity: "ctrl-a", LeaseDurationSeconds: 15}
	if err := obs.Create(context.Background(), rec); err != nil {
		t.Fatal(err)
	}
	r.readErr = errors.New("connection refused")
	clock = t0.Add(5 * time.Second)
	if err := obs.Update(context.Background(), rec); err == nil || lock.updates != 0 {
		t.Fatalf("renewed on an unreadable fence: err=%v", err)
	}
	if err := f.Allow(); err != nil || !f.Leading() || len(r.events) != 0 || r.ok() != 1 {
		t.Fatalf("an unreadable fence took the permit: allow=%v leading=%v events=%q ok=%v", err, f.Leading(), r.events, r.ok())
	}
	clock = t0.Add(15 * time.Second)
	if err := f.Allow(); !errors.Is(err, ErrFenced) {
		t.Fatalf("the lease ran out unrenewed, Allow = %v", err)
	}
}

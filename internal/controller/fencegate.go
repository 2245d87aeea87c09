package controller

import (
	"context"
	"fmt"
	"sync"

	"github.com/go-logr/logr"
	admissionv1 "k8s.io/api/admissionregistration/v1"
)

// FenceStep is what the leader election lock does with a judgement of the fence.
type FenceStep int

const (
	// FenceTake: the fence holds; the lock may take or renew the Lease.
	FenceTake FenceStep = iota
	// FenceWait: do not take or renew the Lease now (a standby whose fence does not hold, or the
	// fence could not be read); look again at the next lease operation.
	FenceWait
	// FenceStepDown: a leader whose fence stopped holding stops writing at once and steps down.
	FenceStepDown
)

func (s FenceStep) String() string {
	switch s {
	case FenceTake:
		return "take"
	case FenceWait:
		return "wait"
	case FenceStepDown:
		return "step-down"
	}
	return fmt.Sprintf("FenceStep(%d)", int(s))
}

// DecideFence is the gate's rule. A fence that holds lets the lock take or renew the Lease. One
// that does not makes a leader step down (a stale leader's writes would land from now on) and a
// standby wait. A fence that could not be read is no evidence that it went away: nobody takes or
// renews the Lease on it, but a leader keeps writing until its lease runs out by its own clock
// (Fence.Allow), as when the API server cannot be reached.
func DecideFence(v FenceVerdict, leading bool) FenceStep {
	switch {
	case v.OK():
		return FenceTake
	case leading && v.Problem != FenceUnreadable:
		return FenceStepDown
	}
	return FenceWait
}

// FenceGate judges the fence policy at every lease operation (LeaseObserver calls Check): the
// Lease is taken or renewed only while JudgeFence says the policy and its binding deny a stale
// leader's writes, and a leader whose fence stops doing so loses its write permit at once
// (Fence.Lose) and steps down. It says so when its judgement changes: a log line, a Warning event
// on the Lease (FenceInvalid while it refuses to lead, FenceLost when a leader steps down) and
// ipwarden_controller_fence_policy_ok; each step-down also counts in
// ipwarden_controller_fence_lost_total. One gate serves every campaign of a process.
type FenceGate struct {
	// Read reads the policy and binding (nil for one that does not exist): ReadFence.
	Read func(ctx context.Context) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding, error)
	// LeaseNamespace and LeaseName are the controller's leader election Lease.
	LeaseNamespace, LeaseName string
	Metrics                   *Metrics
	Log                       logr.Logger
	// Event raises a Warning event on the Lease and returns once it was sent (or failed): a
	// leader's FenceLost event is sent before it steps down.
	Event func(reason, message string)

	mu   sync.Mutex
	said string // the judgement last reported ("" once the fence held)
}

// Check reads and judges the fence for the process whose Lease holder identity is id and whose
// write permit is f, acts on it (DecideFence) and reports a change. It returns nil when the lock
// may take or renew the Lease, else why not.
func (g *FenceGate) Check(ctx context.Context, f *Fence, id string) error {
	v := g.judge(ctx)
	step := DecideFence(v, f.Leading())
	if step == FenceStepDown && !f.Lose(v.Detail) {
		step = FenceWait // it stopped leading meanwhile
	}
	g.report(v, step, f, id)
	if step == FenceTake {
		return nil
	}
	if step == FenceStepDown {
		return fmt.Errorf("not renewing the Lease: %w: %s", ErrFenceLost, v.Detail)
	}
	return fmt.Errorf("not taking the Lease: %s", v.Detail)
}

func (g *FenceGate) judge(ctx context.Context) FenceVerdict {
	p, b, err := g.Read(ctx)
	if err != nil {
		return verdict(FenceUnreadable, "cannot read the fence policy: %v", err)
	}
	return JudgeFence(p, b, g.LeaseNamespace, g.LeaseName)
}

// report says what Check found, once per change of judgement (every step-down).
func (g *FenceGate) report(v FenceVerdict, step FenceStep, f *Fence, id string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	lease := g.LeaseNamespace + "/" + g.LeaseName
	key := string(v.Problem) + ": " + v.Detail
	switch {
	case step == FenceTake:
		g.Metrics.FencePolicyOK.Set(1)
		if g.said != "" {
			g.Log.Info("the fence policy fences this controller's writes again: campaigning", "lease", lease)
		}
		g.said = ""
	case step == FenceStepDown:
		g.Metrics.FencePolicyOK.Set(0)
		g.Metrics.FenceLost.WithLabelValues(string(v.Problem)).Inc()
		g.Log.Error(ErrFenceLost, "fence lost: stopped writing, stepping down", "lease", lease,
			"reason", v.Problem, "detail", v.Detail, "holder", f.Holder(), "epoch", f.Epoch())
		g.Event("FenceLost", fmt.Sprintf("ipwarden controller %s stopped writing and steps down: %s", f.Holder(), v.Detail))
		g.said = key
	case key == g.said:
	case v.Problem == FenceUnreadable:
		g.Log.Error(nil, "cannot judge the fence policy: not taking or renewing the Lease", "lease", lease, "detail", v.Detail)
		g.said = key
	default:
		g.Metrics.FencePolicyOK.Set(0)
		g.Log.Error(nil, "refusing to lead: the fence policy would not deny a stale leader's writes", "lease", lease,
			"reason", v.Problem, "detail", v.Detail, "identity", id)
		g.Event("FenceInvalid", fmt.Sprintf("ipwarden controller %s refuses to lead: %s", id, v.Detail))
		g.said = key
	}
}

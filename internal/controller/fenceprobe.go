package controller

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
)

// The fence policy's objects can be right while the API server's fence is not: kube-apiserver
// (v1.34 here) freezes its view of a built-in parameter kind, the Lease, once no binding uses it,
// and keeps that view after the binding or policy is created again, until it restarts
// (kubernetes/kubernetes#130887). It then denies every write of a new leader and lets through
// the writes of whoever held the Lease when the fence was deleted. So a controller that starts
// leading asks the API server first, with two dry-run writes of one status: one carrying its own
// fence must be admitted, one carrying another holder's must be denied by the fence policy. Until
// both hold it writes nothing, says why, and asks again.

// FenceProbeHolder is the holder of the stale fence the probe sends (never a real identity:
// those are "<pod>_<uuid>").
const FenceProbeHolder = "ipwarden-fence-probe"

// fenceProbeInterval is how often a leader whose fence probe failed asks again.
const fenceProbeInterval = 2 * time.Second

// JudgeFenceProbe reads the outcomes of the probe's two dry-run writes: ours carried this
// leader's fence, stale another holder's. It says whether the API server fences this leader's
// writes, and if not, why.
func JudgeFenceProbe(ours, stale error) (ok bool, why string) {
	switch {
	case ours != nil && IsFenceRejection(ours):
		return false, fmt.Sprintf("the API server denies a write carrying this leader's own fence, so it does not see the Lease as it is "+
			"(kube-apiserver freezes its view of the Lease once the fence policy or its binding was deleted, even after they are "+
			"created again, until it restarts: kubernetes/kubernetes#130887; restart kube-apiserver): %v", ours)
	case ours != nil:
		return false, fmt.Sprintf("the fence probe (a dry-run status write) failed: %v", ours)
	case stale == nil:
		return false, "the API server admits a write carrying another holder's fence: it would not deny a stale leader's writes " +
			"(is the ValidatingAdmissionPolicy admission plugin enabled? is the policy as shipped?)"
	case !IsFenceRejection(stale):
		return false, fmt.Sprintf("the fence probe with another holder's fence failed, but not by the fence policy: %v", stale)
	}
	return true, ""
}

// awaitFence runs the probe when this controller starts leading (with leader election and a
// Lease to report on) until the API server fences its writes, the permit ends or ctx ends. While
// it fails the controller writes nothing; it says so once per reason (log, a Warning event
// FenceNotEnforced on the Lease, once the same reason held at two probes in a row) and shows
// ipwarden_controller_fence_unenforced 1.
func (c *Controller) awaitFence(ctx context.Context) error {
	if c.opts.Lease == nil || c.fence.Stamp() == nil {
		return nil
	}
	said, last := "", ""
	for {
		if err := c.fence.Allow(); err != nil {
			c.fenced("local", err)
			return err
		}
		ok, why := c.probeFence(ctx)
		if ok {
			c.metrics.FenceUnenforced.Set(0)
			if said != "" {
				c.log.Info("the API server fences this leader's writes now: serving", "holder", c.fence.Holder(), "epoch", c.fence.Epoch())
			}
			return nil
		}
		c.metrics.FenceUnenforced.Set(1)
		// A takeover may reach the API server's view of the Lease a moment after the new leader
		// (or a policy just created may not be loaded yet): say so only when the same reason
		// holds at two probes in a row.
		repeated := why == last
		last = why
		if repeated && why != said {
			c.log.Error(nil, "leading, but writing nothing: the API server's fence does not work for this leader", "why", why,
				"holder", c.fence.Holder(), "epoch", c.fence.Epoch())
			c.events.Event(c.opts.Lease, corev1.EventTypeWarning, "FenceNotEnforced",
				fmt.Sprintf("ipwarden controller %s leads but writes nothing: %s", c.fence.Holder(), why))
			said = why
		}
		select {
		case <-ctx.Done():
			return nil
		case <-c.fence.Lost():
		case <-time.After(fenceProbeInterval):
		}
	}
}

// probeFence sends the probe's two dry-run status patches to one IPPool (or NodeIPAllocation):
// nothing is stored. With neither there is nothing a stale leader could write yet: ok.
func (c *Controller) probeFence(ctx context.Context) (bool, string) {
	var target client.Object
	var pools ipwardenv1.IPPoolList
	if err := c.reader.List(ctx, &pools, client.Limit(1)); err != nil {
		return false, fmt.Sprintf("cannot list IPPools for the fence probe: %v", err)
	}
	if len(pools.Items) > 0 {
		target = &pools.Items[0]
	} else {
		var allocs ipwardenv1.NodeIPAllocationList
		if err := c.reader.List(ctx, &allocs, client.Limit(1)); err != nil {
			return false, fmt.Sprintf("cannot list NodeIPAllocations for the fence probe: %v", err)
		}
		if len(allocs.Items) == 0 {
			return true, ""
		}
		target = &allocs.Items[0]
	}
	ours := c.fence.Stamp()
	send := func(f *ipwardenv1.Fence) error {
		body, err := json.Marshal(map[string]any{"status": map[string]any{"fence": f}})
		if err != nil {
			return err
		}
		return c.writer.Status().Patch(ctx, target.DeepCopyObject().(client.Object), client.RawPatch(types.MergePatchType, body), client.DryRunAll)
	}
	return JudgeFenceProbe(send(ours), send(&ipwardenv1.Fence{Holder: FenceProbeHolder, Epoch: ours.Epoch}))
}

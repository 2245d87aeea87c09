package controller

import (
	"time"

	"github.com/ipwarden/ipwarden/internal/nodelease"
)

// A deleted Node is not a stopped machine (docs/design.md, "A deleted node"). Cloud autoscalers
// and node repair delete a Node object and re-create it under the same name while its pods keep
// running; returning its addresses to the pool at the deletion event would hand them to other
// nodes' pods while its own still use them. The fact that proves the machine's pods stopped using
// ipwarden's addresses is that the node's agent stopped: it no longer renews its Lease
// ipwarden-agent-<node>. So the controller keeps a deleted node's addresses until that Lease has
// gone unrenewed for its duration, judged on the controller's own clock from when it first saw
// the Lease's current version (nodelease.Observer), never from a renewTime another clock wrote.

// probeIdentity is the identity the controller asks nodelease.Decide about: no agent has it, so
// a Lease an agent holds is never "ours".
const probeIdentity = "ipwarden-controller (probe)"

// DecideAgentAlive says whether the agent of a deleted node still runs: rec is the node's agent
// Lease at a fresh read (nil: none exists), seen when the controller first saw its version, d its
// duration. An agent that holds a Lease renewed within d is alive until recheck (the Lease expires
// then unless it is renewed); no Lease, a released one (no holder) or an expired one means the
// agent stopped.
func DecideAgentAlive(rec *nodelease.Record, seen, now time.Time, d time.Duration) (alive bool, recheck time.Time) {
	a := nodelease.Decide(rec, probeIdentity, seen, now, d)
	if a.Kind != nodelease.Wait {
		return false, time.Time{}
	}
	return true, a.ExpiresAt
}

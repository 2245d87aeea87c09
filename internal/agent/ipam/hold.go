package ipam

import (
	"slices"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// The unattributed hold. After the journal is lost or damaged, the node's attachments are
// rebuilt from the pods' status.podIPs. A pod whose ADD was answered before the loss but whose
// status.podIPs the kubelet has not written yet uses an address no record shows. So after such a
// rebuild every address the node holds that no attachment accounts for (and that is not
// releasing) is "unattributed" and is not handed out, released or counted as free, until every
// pod bound to the node that may run has reported its addresses, has an ADD of its own on this
// agent, or is gone; or until the hold's deadline. Addresses the controller grants after the
// hold began were never handed out by this node and are free at once; unattributed addresses
// count as demand, so waiting pods are served from new grants meanwhile.

// Hold reasons (HoldDecision.Reason).
const (
	HoldReasonAllReported = "every pod on the node has reported its addresses or is gone"
	HoldReasonDeadline    = "the maximum hold (--rebuild-hold) ran out"
	HoldReasonNothingHeld = "no held address is unattributed"
)

// HoldDecision is what DecideHold decided.
type HoldDecision struct {
	// Release ends the hold: the unattributed addresses become free.
	Release bool
	Reason  string
	// Waiting lists the pods the hold still waits for (Release false), sorted.
	Waiting []PodRef
}

// DecideHold decides whether the unattributed hold ends at now. pods are the pods bound to the
// node; hasADD reports whether a pod UID has an attachment or a waiting ADD on this agent (its
// runtime asked for an address after the agent restarted, so the kubelet has stopped any earlier
// sandbox of the pod). A pod settles the hold when it cannot run (host network, Succeeded or
// Failed), has reported status.podIPs, or has an ADD here; a pod no longer listed is gone.
func DecideHold(pods []Pod, hasADD func(uid string) bool, now, until time.Time) HoldDecision {
	var waiting []PodRef
	for _, p := range pods {
		if !p.MayRun() || len(p.IPs) > 0 || (p.Ref.UID != "" && hasADD(p.Ref.UID)) {
			continue
		}
		waiting = append(waiting, p.Ref)
	}
	switch {
	case len(waiting) == 0:
		return HoldDecision{Release: true, Reason: HoldReasonAllReported}
	case !now.Before(until):
		return HoldDecision{Release: true, Reason: HoldReasonDeadline, Waiting: sortedRefs(waiting)}
	}
	return HoldDecision{Waiting: sortedRefs(waiting)}
}

func sortedRefs(refs []PodRef) []PodRef {
	slices.SortFunc(refs, func(a, b PodRef) int {
		if a.Namespace != b.Namespace {
			if a.Namespace < b.Namespace {
				return -1
			}
			return 1
		}
		if a.Name != b.Name {
			if a.Name < b.Name {
				return -1
			}
			return 1
		}
		if a.UID < b.UID {
			return -1
		} else if a.UID > b.UID {
			return 1
		}
		return 0
	})
	return refs
}

// StartHold begins the unattributed hold after a rebuild: every held address that no attachment
// uses and that is neither releasing nor cooling is held out of use until EvaluateHold releases
// it, at the latest at until. It returns how many addresses it holds; with none it starts no hold.
func (s *State) StartHold(until time.Time) int {
	n := 0
	for _, p := range s.pools {
		if !p.heldKnown {
			continue
		}
		p.unattributed = p.held.Subtract(p.relSet).Subtract(p.inUseSet()).Subtract(p.coolingSet())
		n += count(p.unattributed)
		p.recompute()
	}
	if n == 0 {
		s.endHold()
		return 0
	}
	s.holdUntil = until
	return n
}

// Hold reports whether the unattributed hold is on, and its deadline.
func (s *State) Hold() (on bool, until time.Time) { return !s.holdUntil.IsZero(), s.holdUntil }

// Unattributed returns the addresses of pool held out of use by the hold.
func (s *State) Unattributed(pool string) addr.Set {
	if p, ok := s.pools[pool]; ok {
		return p.unattributed
	}
	return addr.Set{}
}

// EvaluateHold decides, with the pods last set by SetPods, whether the hold ends at now, and
// ends it if so. Without a hold it returns a zero decision.
func (s *State) EvaluateHold(now time.Time) HoldDecision {
	if s.holdUntil.IsZero() {
		return HoldDecision{}
	}
	s.observe(now)
	d := DecideHold(s.pods, s.hasADD, now, s.holdUntil)
	if d.Release {
		s.endHold()
	}
	return d
}

// hasADD reports whether the pod with uid has an attachment (not a rebuilt one) or a waiting
// ADD on this agent.
func (s *State) hasADD(uid string) bool {
	for k := range s.byPod[uid] {
		if !k.IsRebuilt() {
			return true
		}
	}
	for _, w := range s.waiters {
		if w.uid == uid {
			return true
		}
	}
	return false
}

func (s *State) endHold() {
	s.holdUntil = time.Time{}
	for _, p := range s.pools {
		if !p.unattributed.IsEmpty() {
			p.unattributed = addr.Set{}
			p.recompute()
		}
	}
}

// HoldWaiting lists the pods the hold waits for (none without a hold).
func (s *State) HoldWaiting() []PodRef {
	if s.holdUntil.IsZero() {
		return nil
	}
	return DecideHold(s.pods, s.hasADD, s.clock, s.holdUntil).Waiting
}

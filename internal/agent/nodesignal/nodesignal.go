// Package nodesignal decides the agent's scheduler signal: whether its Node carries the
// condition ipwarden.io/AddressesExhausted (and, if the operator turned it on, the NoSchedule
// taint of the same name), so the scheduler places new pods elsewhere instead of leaving them in
// ContainerCreating on a node that can get no more addresses (docs/design.md, "Scheduler
// signal"). It is pure; the agent's IO shell reads the pools and writes the Node.
package nodesignal

import (
	"fmt"
	"sort"
	"strings"
	"time"
)

// The Node condition and taint.
const (
	ConditionType = "ipwarden.io/AddressesExhausted"
	TaintKey      = "ipwarden.io/addresses-exhausted"

	// Reasons of the condition.
	ReasonAtMaxPerNode       = "AtMaxPerNode"       // the node holds maxPerNode addresses of a pool and uses them all
	ReasonPoolExhausted      = "PoolExhausted"      // a pool the node draws from is exhausted and the node has none free
	ReasonAddressesAvailable = "AddressesAvailable" // cleared
	ReasonAddressesReturning = "AddressesReturning" // some came back, not yet ClearFree in every pool
)

// Pool is what the decision needs of one pool the node serves (the agent's pool stats).
type Pool struct {
	Name string
	// Held by the node; InUse by its attachments; Free to hand out now.
	Held, InUse, Free int
	// Requested is the node's target, which the agent clamps at maxPerNode.
	Requested int
	// Demand is in use plus the pods bound to the node and ADDs waiting for an address.
	Demand int
	// Exhausted is the pool's exhausted mark (set by the controller, with hysteresis).
	Exhausted bool
}

// Params tune the hysteresis.
type Params struct {
	// ClearFree: once set, the signal clears only when every pool has at least this many free
	// addresses (default 2), so one address freed and taken at once does not flap it.
	ClearFree int
}

// Decision is the signal to show.
type Decision struct {
	Exhausted bool
	// Reason and Message for the condition.
	Reason, Message string
}

// Decide returns the signal given the pools the node serves and whether it shows the signal now.
//
// It sets the signal when pods wait (demand above in use) on a pool with no free address that
// cannot give the node more: its target is clamped (requested no more than held: maxPerNode),
// or the pool is exhausted. It clears it only when every pool has ClearFree free addresses.
// Otherwise it keeps the current state.
func Decide(pools []Pool, current bool, p Params) Decision {
	if p.ClearFree <= 0 {
		p.ClearFree = 2
	}
	sorted := append([]Pool(nil), pools...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].Name < sorted[j].Name })
	var atMax, exhausted []string
	waiting := 0
	for _, pl := range sorted {
		if pl.Free > 0 || pl.Demand <= pl.InUse {
			continue
		}
		switch {
		case pl.Exhausted:
			exhausted = append(exhausted, pl.Name)
		case pl.Requested <= pl.Held:
			atMax = append(atMax, fmt.Sprintf("%s (%d held)", pl.Name, pl.Held))
		default:
			continue
		}
		waiting = max(waiting, pl.Demand-pl.InUse)
	}
	switch {
	case len(exhausted) > 0:
		return Decision{Exhausted: true, Reason: ReasonPoolExhausted, Message: fmt.Sprintf(
			"%d pods wait for an address and pool %s is exhausted: add CIDRs to the pool", waiting, strings.Join(exhausted, ", "))}
	case len(atMax) > 0:
		return Decision{Exhausted: true, Reason: ReasonAtMaxPerNode, Message: fmt.Sprintf(
			"%d pods wait for an address and the node holds maxPerNode of pool %s, all in use: raise maxPerNode or run fewer pods here", waiting, strings.Join(atMax, ", "))}
	}
	if !current {
		return Decision{Reason: ReasonAddressesAvailable, Message: "the node can get addresses"}
	}
	for _, pl := range sorted {
		if pl.Free < p.ClearFree {
			return Decision{Exhausted: true, Reason: ReasonAddressesReturning, Message: fmt.Sprintf(
				"pool %s has %d free addresses; the signal clears at %d", pl.Name, pl.Free, p.ClearFree)}
		}
	}
	return Decision{Reason: ReasonAddressesAvailable, Message: fmt.Sprintf("every pool has at least %d free addresses", p.ClearFree)}
}

// The Node condition that shows a takeover from the previous IPAM (docs/operations.md, "Moving
// from another IPAM").
const (
	TakeoverConditionType = "ipwarden.io/TakeoverComplete"

	// Reasons of the takeover condition.
	ReasonPreviousIPAMPods = "PreviousIPAMPods" // False: running pods use addresses ipwarden adopted
	ReasonTakeoverComplete = "TakeoverComplete" // True: none any more
)

// TakeoverDecision is the takeover condition to show; Write is false when the Node should be left
// as it is.
type TakeoverDecision struct {
	Write           bool
	Complete        bool
	Reason, Message string
}

// DecideTakeover returns the takeover condition given the addresses adopted per pool (addresses
// running pods use that ipwarden did not hand out: the previous IPAM's, or a lost journal's) and
// the condition the Node shows (shown: it has one; complete: its status is True; message: its
// message). A node that never adopted an address gets no condition at all (no write per node); one
// that did shows False with the counts until they are all gone, then True.
func DecideTakeover(adopted map[string]int, shown, complete bool, message string) TakeoverDecision {
	total := 0
	names := make([]string, 0, len(adopted))
	for name, n := range adopted {
		if n > 0 {
			total += n
			names = append(names, name)
		}
	}
	if total == 0 {
		if !shown || complete {
			return TakeoverDecision{}
		}
		return TakeoverDecision{Write: true, Complete: true, Reason: ReasonTakeoverComplete,
			Message: "no running pod on this node uses an address ipwarden did not hand out"}
	}
	sort.Strings(names)
	parts := make([]string, len(names))
	for i, name := range names {
		parts[i] = fmt.Sprintf("%s: %d", name, adopted[name])
	}
	msg := fmt.Sprintf("%d addresses of running pods were handed out before ipwarden (pools %s); ipwarden keeps them for their pods, and they leave as those pods end",
		total, strings.Join(parts, ", "))
	if shown && !complete && msg == message {
		return TakeoverDecision{}
	}
	return TakeoverDecision{Write: true, Reason: ReasonPreviousIPAMPods, Message: msg}
}

// The Node condition that shows a handback to host-local (docs/operations.md, "Going back to
// host-local"): True while the node is handed back and ipwarden refuses every ADD on it.
const (
	HandbackConditionType = "ipwarden.io/HandedBack"

	// Reasons of the handback condition.
	ReasonHandedBack     = "HandedBack"     // True: handed back, ADD refused
	ReasonHandbackUndone = "HandbackUndone" // False: the handback was undone
)

// Handback is the node's handback mark as the condition shows it.
type Handback struct {
	At          time.Time
	To, Network string
}

// HandbackDecision is the handback condition to show; Write is false when the Node should be left
// as it is.
type HandbackDecision struct {
	Write           bool
	On              bool
	Reason, Message string
}

// DecideHandback returns the handback condition given the node's mark (nil: not handed back) and
// the condition the Node shows (shown: it has one; on: its status is True; message: its
// message). A node never handed back gets no condition (no write per node); a handed-back one
// shows True, saying since when and how to undo it, and False once undone.
func DecideHandback(mark *Handback, shown, on bool, message string) HandbackDecision {
	if mark == nil {
		if !shown || !on {
			return HandbackDecision{}
		}
		return HandbackDecision{Write: true, Reason: ReasonHandbackUndone, Message: "the handback was undone: ipwarden serves ADD on this node"}
	}
	msg := fmt.Sprintf("handed back to %s at %s (network %s): ipwarden refuses every ADD on this node; its CNI configuration should name %s, "+
		"or undo with `ipwarden agent handback --undo` on the node", mark.To, mark.At.UTC().Format(time.RFC3339), mark.Network, mark.To)
	if shown && on && msg == message {
		return HandbackDecision{}
	}
	return HandbackDecision{Write: true, On: true, Reason: ReasonHandedBack, Message: msg}
}

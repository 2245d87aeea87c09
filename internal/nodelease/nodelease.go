// Package nodelease holds the pure decisions of the node agent's per-node Lease: one agent per
// node. Two agents for one node (a second, misconfigured DaemonSet) with separate journals would
// each hand out the node's addresses, so the agent holds the coordination.k8s.io Lease
// ipwarden-agent-<node> and serves ADD only while it holds it. The agent's shell reads the Lease,
// asks Decide what to do, and writes with the record's resourceVersion (a lost race is a
// conflict, read again).
//
// Expiry is judged on the local clock from when the agent last saw the record change, never from
// the renewTime another machine wrote, so clock skew between nodes cannot make a live holder look
// expired early.
//
// The identity is stable per journal (the agent keeps it in its state directory, which the
// journal's file lock gives to one process at a time): an agent restarted on the same journal,
// also in a new pod of another name, takes its own Lease back at once instead of waiting for it to
// expire. An agent with a new state directory (the old one lost) waits for the old holder's Lease
// to expire: it cannot tell a predecessor from a second agent.
package nodelease

import (
	"fmt"
	"strings"
	"time"
)

// Name returns the Lease name of node.
func Name(node string) string { return "ipwarden-agent-" + node }

// Record is what the agent read of the Lease.
type Record struct {
	Holder string
	// Version is the record's resourceVersion: a change of it is a renewal by the holder.
	Version string
}

// Kind is what Decide tells the agent to do.
type Kind int

// Kinds of Action.
const (
	// Create the Lease (none exists) with the agent as holder.
	Create Kind = iota
	// Take the Lease: it is free (no holder) or expired; write the agent as holder.
	Take
	// Renew the agent's own Lease.
	Renew
	// Wait: another agent holds a live Lease.
	Wait
)

func (k Kind) String() string {
	return [...]string{"create", "take", "renew", "wait"}[k]
}

// Action is Decide's answer.
type Action struct {
	Kind Kind
	// Holder is the other agent's identity when Kind is Wait.
	Holder string
	// ExpiresAt, for Wait, is when the other holder's Lease expires if it does not renew.
	ExpiresAt time.Time
}

// Decide says what the agent me does with the Lease rec (nil: none exists) at now, having first
// seen the record's current version at seen, with leases lasting d.
func Decide(rec *Record, me string, seen, now time.Time, d time.Duration) Action {
	switch {
	case rec == nil:
		return Action{Kind: Create}
	case rec.Holder == me:
		return Action{Kind: Renew}
	case SameJournal(rec.Holder, me):
		// The agent before this one on the same state directory (a replaced DaemonSet pod:
		// another pod name, the same journal): it is gone, since the journal's file lock gives
		// the directory to one process at a time.
		return Action{Kind: Take}
	case rec.Holder == "":
		return Action{Kind: Take}
	case !now.Before(seen.Add(d)):
		return Action{Kind: Take}
	}
	return Action{Kind: Wait, Holder: rec.Holder, ExpiresAt: seen.Add(d)}
}

// SameJournal says whether two holder identities (pod or host name, "-", the ID kept in the
// agent's state directory) name the same state directory.
func SameJournal(a, b string) bool {
	i, j := strings.LastIndexByte(a, '-'), strings.LastIndexByte(b, '-')
	return i >= 0 && j >= 0 && i+1 < len(a) && a[i+1:] == b[j+1:]
}

// Observer remembers when the agent first saw each version of the record (the local clock).
type Observer struct {
	version string
	seen    time.Time
}

// Observe returns when the agent first saw rec's version, at now for a new version.
func (o *Observer) Observe(rec *Record, now time.Time) time.Time {
	v := ""
	if rec != nil {
		v = rec.Version
	}
	if o.seen.IsZero() || v != o.version {
		o.version, o.seen = v, now
	}
	return o.seen
}

// HeldByOther is the error an agent answers ADD with while another agent holds the node's Lease.
type HeldByOther struct {
	Node, Holder, Namespace string
}

func (e *HeldByOther) Error() string {
	return fmt.Sprintf("another ipwarden agent holds node %s's Lease %s/%s (holder %s): this agent does not serve ADD; run one agent per node (is a second ipwarden DaemonSet selecting this node?)",
		e.Node, e.Namespace, Name(e.Node), e.Holder)
}

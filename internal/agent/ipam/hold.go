package ipam

import (
	"slices"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
)

// The unattributed hold. After the journal is lost or damaged, the node's attachments are
// rebuilt from what the node can tell: the container runtime's sandboxes (sandboxes.go) and the
// pods' own reports (status.podIPs, Multus' network-status). A pod whose ADD was answered before
// the loss may use an address none of them shows yet: its status not written, its sandbox still
// being set up, or an address on a secondary network that status.podIPs never shows. So after
// such a rebuild every address the node holds that no attachment accounts for (and that is not
// releasing or cooling) is "unattributed": not handed out, released or counted as free.
//
// The hold is decided pool by pool, because a pool serves one network and a pod's evidence is
// per network (DecideHold). Addresses the controller grants after the hold began were never
// handed out by this node and are free at once; unattributed addresses count as demand, so
// waiting pods are served from new grants meanwhile.

// Hold reasons (HoldDecision.Reason).
const (
	HoldReasonAllReported = "every pod on the node is accounted for on every network, or gone"
	HoldReasonDeadline    = "the maximum hold (--rebuild-hold) ran out"
	HoldReasonNothingHeld = "no held address is unattributed"
)

// HoldPool is one pool's part of the hold.
type HoldPool struct {
	Name string
	// Network is the pool's spec.network ("" for the pod network).
	Network      string
	Unattributed addr.Set
}

// HoldDecision is what DecideHold decided.
type HoldDecision struct {
	// Release ends the hold: nothing is left unattributed.
	Release bool
	Reason  string
	// Free are the addresses that leave the hold now, per pool.
	Free map[string]addr.Set
	// Waiting lists the pods the hold still waits for on some pool, sorted (with Release at
	// the deadline: those it waited for).
	Waiting []PodRef
}

// Freed counts the addresses the decision frees.
func (d HoldDecision) Freed() int {
	n := 0
	for _, s := range d.Free {
		n += count(s)
	}
	return n
}

// DecideHold decides which unattributed addresses leave the hold at now. pods are the pods bound
// to the node; ev is the last reading of the runtime's sandboxes; hasADD reports whether a pod
// UID has an attachment or a waiting ADD on this agent on network (its runtime asked for an
// address after the agent restarted, so the kubelet has stopped any earlier sandbox of the pod).
//
// A pod that may run settles a pool of network N when it has an ADD here on N, or:
//   - N is the pod network: the runtime shows a sandbox of the pod (its addresses are then
//     known), or, when the runtime could not be asked, the pod reports status.podIPs;
//   - N is a secondary network: the pod's network-status names N with an address. Nothing else
//     tells a secondary network's address: status.podIPs and the runtime show eth0 only.
//
// While the runtime is configured but does not answer (ev.Unreadable), nothing leaves before the
// deadline: a force-deleted pod's sandbox may still run, and only the runtime could show it.
//
// A pod bound to the node that the runtime does not show keeps the pod network's hold: the
// evidence may be incomplete (a sandbox still being set up), and that must not cost the pod its
// address. Once no pod is waiting on a pool, its unattributed addresses leave the hold except
// those something may still use: an address a sandbox the runtime shows has, or one a pod that
// may run reports on the pool's network (reports add protection; they never release it). Those
// leave once nothing names them any more. At until everything leaves, except what the runtime
// still proves may be in use (see predating).
func DecideHold(pools []HoldPool, pods []Pod, ev NodeSandboxes, hasADD func(uid, network string) bool, attached func(containerID string) bool, now, until time.Time) HoldDecision {
	d := HoldDecision{Free: map[string]addr.Set{}}
	if !now.Before(until) {
		waiting := map[PodRef]bool{}
		left := false
		for _, hp := range pools {
			if hp.Unattributed.IsEmpty() {
				continue
			}
			for _, p := range pods {
				if !settles(p, hp.Network, ev, hasADD) {
					waiting[p.Ref] = true
				}
			}
			free := hp.Unattributed
			if ev.Known {
				// Past the deadline the runtime's proof still stands: what a sandbox it shows has
				// stays held, and so does a secondary pool while a sandbox that predates the hold
				// runs unaccounted for on its network (predating).
				free = free.Subtract(ev.Uses())
				if hp.Network != "" && predating(hp.Network, pods, ev, attached) {
					free = addr.Set{}
				}
			}
			if !free.IsEmpty() {
				d.Free[hp.Name] = free
			}
			if !hp.Unattributed.Subtract(free).IsEmpty() {
				left = true
			}
		}
		d.Release, d.Reason, d.Waiting = !left, HoldReasonDeadline, sortedRefs(keysOf(waiting))
		return d
	}
	waiting := map[PodRef]bool{}
	left := false
	for _, hp := range pools {
		if hp.Unattributed.IsEmpty() {
			continue
		}
		settled := true
		protected := ev.Uses()
		for _, p := range pods {
			if !p.MayRun() {
				continue
			}
			if !settles(p, hp.Network, ev, hasADD) {
				waiting[p.Ref] = true
				settled = false
			}
			protected = protected.Union(addr.SetOfAddrs(p.Reported(hp.Network)...))
		}
		if !settled || ev.Unreadable {
			// Unreadable: the runtime could show a sandbox of a pod the API server no longer
			// has; until it answers (or the deadline), the pods' reports release nothing.
			left = true
			continue
		}
		free := hp.Unattributed.Subtract(protected)
		if !free.IsEmpty() {
			d.Free[hp.Name] = free
		}
		if !hp.Unattributed.Subtract(free).IsEmpty() {
			left = true
		}
	}
	d.Waiting = sortedRefs(keysOf(waiting))
	if !left {
		d.Release, d.Reason = true, HoldReasonAllReported
	}
	return d
}

// predating reports whether the runtime shows a sandbox that may have an address on secondary
// network without the node knowing which: a sandbox none of whose interfaces this agent attached
// (attached: by container ID, which is the sandbox ID; so it was set up before the journal was
// lost) and whose pod is not known not to run (host network, finished) and does not report the
// network. The runtime cannot say which address such a sandbox has on a secondary network, so the
// pool's addresses of unknown owner stay held for as long as it runs, past --rebuild-hold: the
// price is a few held addresses for the life of those pods, never a duplicate. With Multus'
// network-status on the pods, nothing is held past the deadline.
func predating(network string, pods []Pod, ev NodeSandboxes, attached func(string) bool) bool {
	byUID := make(map[string]Pod, len(pods))
	for _, p := range pods {
		byUID[p.Ref.UID] = p
	}
	for _, sb := range ev.Sandboxes {
		if attached != nil && attached(sb.ID) {
			continue
		}
		p, known := byUID[sb.Pod.UID]
		if known && (!p.MayRun() || len(p.Reported(network)) > 0) {
			continue
		}
		return true
	}
	return false
}

// settles reports whether pod p settles a pool of network (see DecideHold).
func settles(p Pod, network string, ev NodeSandboxes, hasADD func(uid, network string) bool) bool {
	if !p.MayRun() {
		return true
	}
	if p.Ref.UID != "" && hasADD(p.Ref.UID, network) {
		return true
	}
	if network == "" {
		if ev.Known {
			return ev.Shows(p.Ref.UID)
		}
		return len(p.IPs) > 0
	}
	return len(p.Reported(network)) > 0
}

func keysOf(m map[PodRef]bool) []PodRef {
	if len(m) == 0 {
		return nil
	}
	out := make([]PodRef, 0, len(m))
	for r := range m {
		out = append(out, r)
	}
	return out
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

// holdPools is the hold as DecideHold takes it.
func (s *State) holdPools() []HoldPool {
	var out []HoldPool
	for _, name := range s.poolNames() {
		p := s.pools[name]
		if !p.unattributed.IsEmpty() {
			out = append(out, HoldPool{Name: name, Network: p.cfg.Network, Unattributed: p.unattributed})
		}
	}
	return out
}

// EvaluateHold decides, with the pods last set by SetPods and the runtime's sandboxes last set
// by SetSandboxes, which held addresses leave the hold at now, frees them, and ends the hold
// when none is left. Without a hold it returns a zero decision.
func (s *State) EvaluateHold(now time.Time) HoldDecision {
	if s.holdUntil.IsZero() {
		return HoldDecision{}
	}
	s.observe(now)
	d := DecideHold(s.holdPools(), s.pods, s.sandboxes, s.hasADD, s.attachedContainer(), now, s.holdUntil)
	for name, free := range d.Free {
		if p := s.pools[name]; p != nil {
			p.unattributed = p.unattributed.Subtract(free)
			p.recompute()
		}
	}
	if d.Release {
		s.endHold()
	}
	return d
}

// hasADD reports whether the pod with uid has an attachment (not a rebuilt one, nor a DRA
// reservation: a Prepare comes before the sandbox, and a reservation recovered from its claim
// says nothing of the sandbox that runs) with an address of a pool of network, or a waiting ADD
// for such a pool, on this agent.
func (s *State) hasADD(uid, network string) bool {
	for k := range s.byPod[uid] {
		if k.IsRebuilt() {
			continue
		}
		if a := s.atts[k]; a != nil && a.DRA == nil && slices.ContainsFunc(a.Addresses, func(ad Address) bool { return s.networkOf(ad.Pool) == network }) {
			return true
		}
	}
	for _, w := range s.waiters {
		if w.uid != uid {
			continue
		}
		pools := w.pools
		if len(pools) == 0 {
			pools = s.served
		}
		if slices.ContainsFunc(pools, func(p string) bool { return s.networkOf(p) == network }) {
			return true
		}
	}
	return false
}

// attachedContainer reports whether a container (sandbox) ID has an attachment of this agent's
// own (not one rebuilt from reports).
func (s *State) attachedContainer() func(string) bool {
	ids := make(map[string]bool, len(s.atts))
	for k := range s.atts {
		if !k.IsRebuilt() {
			ids[k.ContainerID] = true
		}
	}
	return func(id string) bool { return ids[id] }
}

// networkOf is the network of pool ("" for the pod network, and for a pool the node does not
// know).
func (s *State) networkOf(pool string) string {
	if p := s.pools[pool]; p != nil {
		return p.cfg.Network
	}
	return ""
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
	return DecideHold(s.holdPools(), s.pods, s.sandboxes, s.hasADD, s.attachedContainer(), s.clock, s.holdUntil).Waiting
}

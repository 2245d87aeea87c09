package ipam

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"
)

// AddRequest is a CNI ADD as the agent sees it.
type AddRequest struct {
	Key     Key
	Network string
	// Netns is CNI_NETNS, recorded in the attachment.
	Netns string
	Pod   PodRef
	// Pools is the network configuration's "pools": one address each, in order; empty means the
	// pools that select the node. The pod's and its namespace's annotations in Meta come first.
	Pools []string
	// Meta is what the agent read of the pod and its namespace (choose.go).
	Meta PodMeta
	// PoolNetwork is the network the CNI configuration names ("network"; "" for the pod
	// network): only pools of that network serve the attachment.
	PoolNetwork string
	// Previous is the previous IPAM's store the attachment's addresses are reserved in before
	// the ADD is answered (recorded in the attachment); nil for none.
	Previous *PreviousStore
	// ClaimArg is the configuration's args.cni "ipam-claim-reference" (claim.go): the claim
	// the attachment references, ahead of the pod's annotations.
	ClaimArg string
}

// PrimaryIfName is the interface a runtime gives the pod network's attachment (CNI_IFNAME).
const PrimaryIfName = "eth0"

// ConfigError is a request that names something invalid (CNI code 7). Field is the network
// configuration key at fault.
type ConfigError struct {
	Field string
	Msg   string
}

func (e *ConfigError) Error() string { return e.Field + ": " + e.Msg }

// ShortError says that the named pools have no address to hand out right now (CNI code 11 once
// the agent has waited long enough). Nothing was taken from any pool.
type ShortError struct {
	Pools []string
	// Wanted are static addresses the node does not hold yet: it waits for the controller.
	Wanted []Address
	// Claims are a claim ADD's waits: for the claim's binding, or for its bound address.
	Claims []ClaimWait
}

func (e *ShortError) Error() string {
	var parts []string
	if len(e.Pools) > 0 {
		parts = append(parts, "no free address in pool "+strings.Join(e.Pools, ", "))
	}
	for _, w := range e.Wanted {
		parts = append(parts, fmt.Sprintf("address %s of pool %s is not on the node yet", w.Addr, w.Pool))
	}
	for _, c := range e.Claims {
		parts = append(parts, ClaimWaitMessage(c))
	}
	return strings.Join(parts, "; ")
}

// NoPoolsError says that no pool selects the node and the request named none.
type NoPoolsError struct{ Node string }

func (e *NoPoolsError) Error() string {
	return fmt.Sprintf("no IPPool selects node %s: give a pool a nodeSelector matching the node, or name pools in the CNI config", e.Node)
}

// UnknownAttachmentError is a CHECK for an attachment the agent does not know (CNI code 3).
type UnknownAttachmentError struct{ Key Key }

func (e *UnknownAttachmentError) Error() string {
	return fmt.Sprintf("attachment %s is unknown to the ipwarden agent", e.Key)
}

// InFlightError is returned for an operation on an attachment whose ADD is still being
// journaled; callers serialize per key, so it means a caller bug.
type InFlightError struct{ Key Key }

func (e *InFlightError) Error() string {
	return fmt.Sprintf("attachment %s: an ADD is still being recorded", e.Key)
}

// resolvePools returns the pools a request draws from.
func (s *State) resolvePools(names []string) ([]string, error) {
	if len(names) == 0 {
		if len(s.served) == 0 {
			return nil, &NoPoolsError{Node: s.node}
		}
		return slices.Clone(s.served), nil
	}
	seen := map[string]bool{}
	for _, n := range names {
		if seen[n] {
			return nil, &ConfigError{Field: "pools", Msg: fmt.Sprintf("pool %q is listed twice", n)}
		}
		seen[n] = true
		if !slices.Contains(s.served, n) {
			p, ok := s.pools[n]
			what := "is not an IPPool the agent knows"
			switch {
			case ok && p.gone:
				what = "was deleted (the IPPool no longer exists; running pods keep their addresses, new pods need another pool)"
			case ok && p.known:
				what = "is not served on node " + s.node + " (its nodeSelector does not select the node, or the agent runs with --pools)"
			}
			return nil, &ConfigError{Field: "pools", Msg: fmt.Sprintf("pool %q %s (pools serving this node: %s)",
				n, what, orNone(s.served))}
		}
	}
	return slices.Clone(names), nil
}

func orNone(names []string) string {
	if len(names) == 0 {
		return "none"
	}
	return strings.Join(names, ", ")
}

// Add hands the attachment one address from each requested pool, all or nothing. A repeated ADD
// for a known key returns the recorded attachment unchanged (and an empty Change). A new
// attachment is reserved in memory and pending: the caller journals the Change, then calls
// ConfirmAdd, or AbortAdd if the journal write failed. If a pool has no address now, Add returns
// a *ShortError and changes nothing.
//
// An ADD for a pod whose attachment was rebuilt from its status.podIPs (see Rebuild) adopts the
// rebuilt addresses of the pools it asks for: the pod keeps its address in its new sandbox.
func (s *State) Add(req AddRequest, now time.Time) (Attachment, Change, error) {
	s.observe(now)
	if err := s.HandedBackRefusal(); err != nil {
		return Attachment{}, Change{}, err
	}
	if _, inFlight := s.pending[req.Key]; inFlight {
		return Attachment{}, Change{}, &InFlightError{Key: req.Key}
	}
	if a, ok := s.atts[req.Key]; ok {
		return *a.clone(), Change{}, nil
	}
	pools, err := s.ResolvePools(req)
	if err != nil {
		return Attachment{}, Change{}, err
	}
	resPicks := s.reservationPicks(req) // the pod's DRA reservations for this interface (dra.go)
	if len(resPicks) == 0 {
		if err := s.reservedForAnother(req); err != nil {
			return Attachment{}, Change{}, err
		}
	}
	pools = withReservationPools(pools, resPicks)
	var ph *Attachment
	if uid := req.Pod.UID; uid != "" {
		for _, k := range s.PodAttachments(uid) {
			if a := s.atts[k]; a.Rebuilt {
				if s.pending[k] != nil {
					// A rebuild is recording the pod's addresses: adopt them once it is done.
					return Attachment{}, Change{}, &InFlightError{Key: k}
				}
				ph = a
				break
			}
		}
	}
	meta := req.Meta
	if meta.ClaimProblem != "" {
		return Attachment{}, Change{}, &ClaimError{Msg: meta.ClaimProblem}
	}
	claim := meta.Claim
	if claim != nil && len(resPicks) > 0 {
		// Each is the interface's address on its own terms: a reservation's stays the
		// reservation's, a claim's is bound to the claim (and an attached use of another address
		// would have the controller bind it). Neither is chosen over the other.
		return Attachment{}, Change{}, &ClaimError{Msg: fmt.Sprintf("pod %s references IPAMClaim %s and holds a DRA reservation for interface %s "+
			"(a ResourceClaim of the driver ipam.ipwarden.io): one interface takes its address from one of them", req.Pod, claim, req.Key.IfName)}
	}
	if req.PoolNetwork != "" || claim != nil {
		meta.IPAddresses = "" // static addresses are the pod network's; a claim's attachment has the claim's
	}
	statics, err := s.staticPicks(meta, pools)
	if err != nil {
		return Attachment{}, Change{}, err
	}
	if req.PoolNetwork == "" && claim == nil {
		for _, name := range pools {
			if _, ok := statics[name]; ok {
				continue
			}
			if a, ok := s.stickyFor(meta, name); ok {
				if statics == nil {
					statics = map[string]netip.Addr{}
				}
				statics[name] = a
			}
		}
	}
	picks := make([]Address, len(pools))
	adopted := make([]bool, len(pools))
	// Two ways to use an address another key holds, each with its own condition: reservation,
	// a DRA reservation's of the pod (it stays the reservation's: inUse names it, dra.go);
	// shared, a claim's address a live migration's other attachment holds (this one becomes
	// poolState.second, claim.go).
	reservation := make([]bool, len(pools))
	shared := make([]bool, len(pools))
	var short []string
	var waitFor []Address
	var claimWaits []ClaimWait
	for i, name := range pools {
		if ad, ok := resPicks[name]; ok {
			if s.prevAll.Contains(ad.Addr) {
				// A Prepare writes nothing into the previous IPAM's store, so it may have handed
				// the address to a pod of its own since. The pod may run with no other address
				// than its claim's status names, and the store would refuse this one again at
				// every pick: refused until the previous IPAM lets it go.
				return Attachment{}, Change{}, &ClaimError{Msg: fmt.Sprintf("address %s of pod %s's DRA reservation for interface %s is reserved by the previous IPAM "+
					"of the node as well (a pod started through it holds it); the runtime retries once that pod is gone", ad.Addr, req.Pod, req.Key.IfName)}
			}
			picks[i], reservation[i] = ad, true
			continue
		}
		if ph != nil {
			if j := slices.IndexFunc(ph.Addresses, func(a Address) bool { return a.Pool == name }); j >= 0 {
				if b, ok := s.pools[name].claims[uidOf(claim)]; claim == nil || (ok && b.Addr == ph.Addresses[j].Addr && !s.prevAll.Contains(b.Addr)) {
					// A claim's attachment adopts only the claim's own address, and not while
					// the previous IPAM reserves it (a stale report's: it waits).
					if q := s.pools[name]; q.heldKnown && !q.held.Contains(ph.Addresses[j].Addr) {
						// The node's record lacks it (given back since, the report it was rebuilt
						// from stale): the node claims it back first; the ADD waits for that.
						waitFor = append(waitFor, ph.Addresses[j])
						continue
					}
					picks[i], adopted[i] = ph.Addresses[j], true
					continue
				}
			}
		}
		if claim != nil {
			a, share, wait, err := s.claimPick(req, name)
			switch {
			case err != nil:
				return Attachment{}, Change{}, err
			case wait != nil:
				claimWaits = append(claimWaits, *wait)
			default:
				picks[i], shared[i] = Address{Pool: name, Addr: a}, share
			}
			continue
		}
		if a, ok := statics[name]; ok {
			p := s.pools[name]
			if k, used := p.inUse[a]; used {
				who := k.String()
				if att := s.atts[k]; att != nil && att.Pod.String() != "" {
					who = "pod " + att.Pod.String()
				}
				return Attachment{}, Change{}, &StaticUnavailableError{Msg: fmt.Sprintf("address %s is in use by %s on node %s", a, who, s.node)}
			}
			if b, bound := p.claimOf(a); bound {
				return Attachment{}, Change{}, &StaticUnavailableError{Msg: fmt.Sprintf("address %s of pool %s is bound to IPAMClaim %s/%s (uid %s); only that claim's pods get it",
					a, name, b.Namespace, b.Name, b.UID)}
			}
			if p.lost.Contains(a) {
				return Attachment{}, Change{}, &StaticUnavailableError{Msg: fmt.Sprintf("address %s of pool %s is recorded on node %s as possibly in use by a sandbox "+
					"the journal does not name (an older agent's reservation ahead, left by a crash); it stays out of use", a, name, s.node)}
			}
			_, rel := p.releasing[a]
			// An address the previous IPAM reserves (previous.go) waits like one not held yet.
			if rel || !p.heldKnown || !p.held.Contains(a) || p.unattributed.Contains(a) || s.prevAll.Contains(a) || s.recordMissing {
				if reason, ok := s.refused[name][a]; ok && !(p.heldKnown && p.held.Contains(a)) {
					return Attachment{}, Change{}, &StaticUnavailableError{Msg: fmt.Sprintf("address %s of pool %s cannot move to node %s: %s", a, name, s.node, reason)}
				}
				waitFor = append(waitFor, Address{Pool: name, Addr: a})
				continue
			}
			picks[i] = Address{Pool: name, Addr: a}
			continue
		}
		a, _, ok := s.pools[name].next(now, s.reserved(name))
		if !ok || s.recordMissing {
			short = append(short, name)
			continue
		}
		picks[i] = Address{Pool: name, Addr: a}
	}
	if len(short) > 0 || len(waitFor) > 0 || len(claimWaits) > 0 {
		return Attachment{}, Change{}, &ShortError{Pools: short, Wanted: waitFor, Claims: claimWaits}
	}

	var ch Change
	u := &undo{}
	for i, ad := range picks {
		p := s.pools[ad.Pool]
		if reservation[i] {
			continue
		}
		if adopted[i] {
			p.inUse[ad.Addr] = req.Key
			continue
		}
		if shared[i] {
			p.second[ad.Addr] = req.Key // a live migration: the holder keeps it too
			continue
		}
		if c := p.take(ad.Addr, req.Key); c != nil {
			u.fromCooling = append(u.fromCooling, *c)
			ch.DeleteCooling = append(ch.DeleteCooling, Address{Pool: c.Pool, Addr: c.Addr})
		}
	}
	if slices.Contains(adopted, true) {
		u.placeholder = ph.clone()
		rest := slices.DeleteFunc(slices.Clone(ph.Addresses), func(a Address) bool {
			return slices.Contains(picks, a)
		})
		s.dropAttachment(ph.Key)
		if len(rest) > 0 {
			left := ph.clone()
			left.Addresses = rest
			s.putAttachment(left)
			ch.PutAttachments = append(ch.PutAttachments, *left.clone())
		} else {
			ch.DeleteAttachments = append(ch.DeleteAttachments, ph.Key)
		}
	}
	att := &Attachment{Key: req.Key, Network: req.Network, Pod: req.Pod, Addresses: picks, Created: now, Netns: req.Netns, Previous: req.Previous}
	if claim != nil {
		c := *claim
		att.Claim = &c
	}
	s.putAttachment(att)
	s.pending[req.Key] = u
	delete(s.waiters, req.Key)
	ch.PutAttachments = append(ch.PutAttachments, *att.clone())
	if req.PoolNetwork == "" && req.Key.IfName == PrimaryIfName && !slices.Equal(s.configPools, req.Pools) {
		// The pod network's configuration "pools", for the demand of pods not yet added
		// (podWants); journaled with the attachment and taken on at ConfirmAdd.
		cp := slices.Clone(req.Pools)
		ch.PutConfigPools, u.configPools = &cp, &cp
	}
	return *att.clone(), ch, nil
}

// ConfirmAdd marks the pending ADD of k as journaled.
func (s *State) ConfirmAdd(k Key) {
	if u := s.pending[k]; u != nil {
		if u.configPools != nil {
			s.configPools = slices.Clone(*u.configPools)
		}
	}
	delete(s.pending, k)
}

// AbortAdd undoes the pending ADD of k after its journal write failed: its addresses go back
// where they came from, as if the ADD had never happened.
func (s *State) AbortAdd(k Key) {
	u, ok := s.pending[k]
	if !ok {
		return
	}
	delete(s.pending, k)
	att := s.atts[k]
	s.dropAttachment(k)
	for _, ad := range att.Addresses {
		p := s.pools[ad.Pool]
		if u.placeholder != nil && slices.Contains(u.placeholder.Addresses, ad) {
			p.inUse[ad.Addr] = u.placeholder.Key
			continue
		}
		if p.unshare(ad.Addr, k) {
			continue // the other attachment of the claim keeps it
		}
		if p.inUse[ad.Addr] != k {
			continue // another key's (a DRA reservation's): it stays as it is
		}
		delete(p.inUse, ad.Addr)
		if i := slices.IndexFunc(u.fromCooling, func(c Cooling) bool { return c.Addr == ad.Addr && c.Pool == ad.Pool }); i >= 0 {
			p.uncool(u.fromCooling[i])
			continue
		}
		if _, rel := p.releasing[ad.Addr]; !rel && p.held.Contains(ad.Addr) {
			p.fresh = p.fresh.Union(setOf(ad.Addr))
		}
	}
	if u.placeholder != nil {
		s.dropAttachment(u.placeholder.Key)
		s.putAttachment(u.placeholder)
	}
}

// DelPlan is a DEL decided but not yet applied; see PlanDel.
type DelPlan struct {
	Key    Key
	At     time.Time
	Change Change
	// Found is false for an attachment the agent does not know: DEL is then a no-op success.
	Found bool
}

// PlanDel decides the DEL of k at now without changing the state: the caller journals
// plan.Change and then calls ApplyDel. Unknown keys give an empty plan (DEL is idempotent).
func (s *State) PlanDel(k Key, now time.Time) (DelPlan, error) {
	s.observe(now)
	if _, inFlight := s.pending[k]; inFlight {
		return DelPlan{}, &InFlightError{Key: k}
	}
	a, ok := s.atts[k]
	if !ok {
		return DelPlan{Key: k, At: now}, nil
	}
	if a.DRA != nil {
		// A reservation is freed only once no attachment shares its address (the machine's
		// Unprepare and level reconcile ask first; this keeps every other caller to it too).
		if users := s.ReservationUsers(k); len(users) > 0 {
			return DelPlan{}, &ReservationBusyError{Key: k, Users: users}
		}
	}
	plan := DelPlan{Key: k, At: now, Found: true}
	// In flight until ApplyDel or Abort: a rebuild, CNI GC or sticky decision planned meanwhile
	// leaves the attachment alone, so the DEL's write (PutCooling of its addresses) never lands
	// after a change that moved one of them elsewhere.
	s.pending[k] = &undo{}
	plan.Change.DeleteAttachments = []Key{k}
	for _, ad := range a.Addresses {
		p := s.pools[ad.Pool]
		if owner, used := p.inUse[ad.Addr]; used && owner != k {
			// Another key owns it (a DRA reservation the attachment shares, or the first of
			// two conflicting records): freeing this attachment frees nothing of it.
			continue
		}
		if _, rel := p.releasing[ad.Addr]; rel || (p.heldKnown && !p.held.Contains(ad.Addr)) {
			continue
		}
		if p.sharedWith(ad.Addr, k) {
			continue // a live migration's other attachment keeps it
		}
		if !p.isUsable(ad.Addr) {
			// The pool's spec no longer covers it (shrunk, or a new exclusion): it drains, given
			// back to the controller instead of cooling for reuse.
			plan.Change.PutReleasing = append(plan.Change.PutReleasing, Releasing{Pool: ad.Pool, Addr: ad.Addr, Since: now})
			continue
		}
		plan.Change.PutCooling = append(plan.Change.PutCooling, Cooling{Pool: ad.Pool, Addr: ad.Addr, FreedAt: now})
	}
	return plan, nil
}

// ApplyDel frees the attachment of a journaled plan: its addresses go to the back of their
// pools' cooling queues.
func (s *State) ApplyDel(plan DelPlan) {
	if plan.Found {
		delete(s.pending, plan.Key)
	}
	a, ok := s.atts[plan.Key]
	if !ok || !plan.Found {
		return
	}
	for _, ad := range a.Addresses {
		p := s.pools[ad.Pool]
		if p.unshare(ad.Addr, plan.Key) {
			continue // a live migration's other attachment keeps it
		}
		if p.inUse[ad.Addr] != plan.Key {
			continue
		}
		if slices.ContainsFunc(plan.Change.PutReleasing, func(r Releasing) bool { return r.Pool == ad.Pool && r.Addr == ad.Addr }) {
			delete(p.inUse, ad.Addr)
			p.releasing[ad.Addr] = plan.At
			p.relSet = p.relSet.Union(setOf(ad.Addr))
			continue
		}
		p.free(ad.Addr, plan.At)
	}
	if uid := a.Pod.UID; uid != "" {
		s.delFreed[uid] = struct{}{}
	}
	s.dropAttachment(plan.Key)
	delete(s.waiters, plan.Key)
}

// Check returns the attachment k, or an *UnknownAttachmentError.
func (s *State) Check(k Key) (Attachment, error) {
	a, ok := s.atts[k]
	if !ok || s.pending[k] != nil {
		return Attachment{}, &UnknownAttachmentError{Key: k}
	}
	return *a.clone(), nil
}

// Stale returns the attachments of network that are not in valid and were created before
// bornBefore, sorted: what a CNI GC may free. Attachments of other networks and rebuilt ones
// (their container ID is unknown, so no runtime can list them) are never stale here.
func (s *State) Stale(network string, valid []Key, bornBefore time.Time) []Key {
	ok := make(map[Key]bool, len(valid))
	for _, k := range valid {
		ok[k] = true
	}
	var out []Key
	for k, a := range s.atts {
		if a.Network != network || a.Rebuilt || a.DRA != nil || ok[k] || s.pending[k] != nil || !a.Created.Before(bornBefore) {
			continue
		}
		out = append(out, k)
	}
	slices.SortFunc(out, func(a, b Key) int {
		return cmp.Or(cmp.Compare(a.ContainerID, b.ContainerID), cmp.Compare(a.IfName, b.IfName))
	})
	return out
}

// AddWaiter records that the ADD of k is waiting for addresses in pools, for the pod with uid
// (may be empty); it counts as demand until Add succeeds or RemoveWaiter.
func (s *State) AddWaiter(k Key, uid string, pools []string, static ...Address) {
	if len(pools) == 0 {
		pools = s.served
	}
	s.waiters[k] = waiter{uid: uid, pools: slices.Clone(pools), static: slices.Clone(static)}
}

// SetWaiterClaims records the waits of the claim ADD of k (claim.go): the node lists them in
// its spec until the ADD is served or gives up.
func (s *State) SetWaiterClaims(k Key, claims []ClaimWait) {
	if w, ok := s.waiters[k]; ok {
		w.claims = slices.Clone(claims)
		s.waiters[k] = w
	}
}

// RemoveWaiter forgets the waiting ADD of k.
func (s *State) RemoveWaiter(k Key) { delete(s.waiters, k) }

// Rebuild plans (PlanRebuild) and applies at once, for callers with no journal that could
// refuse the change (the simulator, tests); the agent journals the plan before it applies it. It
// returns the plan's Change and problems.
func (s *State) Rebuild(pods []Pod, now time.Time) (Change, []string) {
	plan := s.PlanRebuild(pods, now, nil)
	s.Apply(plan)
	return plan.Change, plan.Problems
}

// Sandbox is what the agent can tell of an attachment's sandbox from the network namespace path
// it recorded at ADD (the leak collector's reading, package gc).
type Sandbox int

// Sandbox readings.
const (
	// SandboxUnknown: no path recorded, or one the agent cannot look at.
	SandboxUnknown Sandbox = iota
	// SandboxGone: the path provably no longer exists.
	SandboxGone
	// SandboxExists: the path exists: the sandbox may still use the address.
	SandboxExists
)

// RebuildPlan is a rebuild planned by PlanRebuild: the attachments it records or changes are
// reserved (pending) until it is applied or aborted.
type RebuildPlan struct {
	Change Change
	// Problems are the pods' reports the rebuild could not record, and addresses it moved.
	Problems []string
	// keys are the attachments the plan records, changes or drops, in the order it touched
	// them; prior holds each as it was (nil: new).
	keys  []Key
	prior map[Key]*Attachment
	// fromCooling are the addresses the plan took from cooling; fromUnattributed those it took
	// from the unattributed hold.
	fromCooling      []Cooling
	fromUnattributed []Address
	observed         []ObservedPool
	// stale are the rebuilt addresses the plan drops: in use by their key until Apply frees them
	// (at at) through the cooldown.
	stale []staleAddress
	at    time.Time
}

// Changes implements Plan.
func (p RebuildPlan) Changes() Change { return p.Change }

// PlanRebuild plans recording, for pods bound to the node that use addresses of the node's
// pools no attachment accounts for, an attachment under RebuiltKey(uid), so those addresses are
// never handed out twice. It is meant for start-up, after Restore and the first holdings: with a
// lost journal it rebuilds everything; with an intact one it finds nothing; the agent also runs it
// on every change of the node's pods (adopting pods of a previous IPAM). Releasing addresses are
// skipped and reported. sandbox(netns) says what the caller can tell of the network namespace an
// attachment recorded at ADD (nil: nothing).
//
// What a pod uses is read network by network (reportedOn): on the pod network, the runtime's
// ready sandboxes of the pod when the last reading (SetSandboxes) shows it, else status.podIPs;
// on a secondary network, Multus' network-status entry naming it. An address is recorded only in
// a pool of the network it was reported on, one address per pool.
//
// The journal beats a pod's reports: a pod the journal attaches on a network (an ADD of this
// agent) gets no rebuilt address on that network, whatever its status still shows (a sandbox
// re-created since, whose status the kubelet has not updated yet). A rebuilt address a pod's
// reports no longer name, on a network where it reports another, and that no sandbox the runtime
// shows uses, is dropped through the reuse cooldown, like a DEL's (the status was stale when it
// was recorded, or the pod moved on): the pod's new address replaces it in the same plan.
//
// The journal may also have rewound (the node's disk restored from an older snapshot): then it
// records addresses for pods that ended since, and running pods report addresses it shows as
// cooling or as another pod's. A running pod's report is the runtime's word that its sandbox
// has the address; the journal's older record is not. So (see ReportWins):
//   - an address the journal attaches to another pod moves to the reporting pod when that pod
//     is gone or no longer reports it (and reports something), else it is a problem reported;
//   - a cooling address moves to a reporting pod that has no attachment at all (a pod whose
//     sandbox was deleted and whose status still shows its old address has its new attachment,
//     or gets the same address back at its next ADD).
//
// A pod an attachment of which a DEL freed (since it last left the node's pods) is skipped: its
// addresses came from this agent, and its status may still show the freed ones. An address of an
// attachment in flight (pending) is left alone: the next rebuild looks again.
//
// Like an ADD, the plan reserves what it touches in memory: every attachment it records, changes
// or drops is pending until Apply (journaled) or Abort (refused: everything is put back as it
// was), so no ADD hands out or adopts its addresses, no DEL or collector frees them meanwhile,
// and the pools it observed are published only once it is applied. A dropped stale address stays
// in use (by its attachment's key) until Apply moves it to the cooldown.
func (s *State) PlanRebuild(pods []Pod, now time.Time, sandbox func(netns string) Sandbox) RebuildPlan {
	s.observe(now)
	plan := RebuildPlan{prior: map[Key]*Attachment{}, at: now}
	touch := func(k Key) {
		if _, seen := plan.prior[k]; seen {
			return
		}
		plan.keys = append(plan.keys, k)
		if a := s.atts[k]; a != nil {
			plan.prior[k] = a.clone()
		} else {
			plan.prior[k] = nil
		}
	}
	ch := &plan.Change
	ev := s.sandboxes
	evUses := ev.Uses()
	bound := make(map[string]Pod, len(pods))
	for _, pod := range pods {
		if pod.Ref.UID != "" {
			bound[pod.Ref.UID] = pod
		}
	}
	networks := s.poolNetworks()
	changed := map[Key]bool{} // stale attachments that lost an address
	for _, pod := range pods {
		if !pod.MayRun() || pod.Ref.UID == "" {
			continue
		}
		if _, freed := s.delFreed[pod.Ref.UID]; freed {
			continue // its addresses came from this agent, and a DEL freed them: the status is stale
		}
		k := RebuiltKey(pod.Ref.UID)
		if _, inFlight := s.pending[k]; inFlight {
			continue
		}
		journaled := s.journaledNetworks(pod.Ref.UID)
		existing := s.atts[k]
		var keep []Address  // the rebuilt attachment's addresses that stay
		var stale []Address // those dropped through the cooldown
		if existing != nil {
			for _, ad := range existing.Addresses {
				net := s.networkOf(ad.Pool)
				rep := reportedOn(pod, net, ev)
				if len(rep) > 0 && !slices.Contains(rep, ad.Addr) && !evUses.Contains(ad.Addr) {
					stale = append(stale, ad)
					continue
				}
				keep = append(keep, ad)
			}
		}
		var picks []Address
		for _, net := range networks {
			if journaled[net] {
				continue // the journal attaches the pod on this network: its reports there may be stale
			}
			for _, ip := range reportedOn(pod, net, ev) {
				name := s.poolOfNetwork(ip, net)
				if name == "" {
					continue
				}
				has := func(a Address) bool { return a.Pool == name }
				if slices.ContainsFunc(keep, has) || slices.ContainsFunc(picks, has) {
					continue
				}
				p := s.pools[name]
				if owner, used := p.inUse[ip]; used {
					if _, sh := p.second[ip]; sh {
						continue // a claim's address two attachments share: never moved by a report
					}
					a := s.atts[owner]
					if a == nil || a.Pod.UID == pod.Ref.UID || a.Pod.UID == "" {
						continue
					}
					if _, inFlight := s.pending[owner]; inFlight {
						continue // an ADD or DEL in flight: the next rebuild looks again
					}
					ownerPod, ownerBound := bound[a.Pod.UID]
					sb := SandboxUnknown
					if sandbox != nil && a.Netns != "" {
						sb = sandbox(a.Netns)
					}
					if net == "" && a.Rebuilt && ev.Shows(pod.Ref.UID) && !ev.PodUses(a.Pod.UID, ip) {
						// Proof beats a report: the runtime shows this pod's ready sandbox with
						// ip and no sandbox of the owner with it, so the owner's record came from
						// a stale report (a status written for a sandbox that ended, read before
						// the runtime was, or while it did not list the new sandbox yet).
						plan.Problems = append(plan.Problems, fmt.Sprintf("the runtime shows pod %s's sandbox with address %s, recorded for pod %s from its reports, "+
							"whose sandboxes the runtime shows without it: the address moves to %s", pod.Ref, ip, a.Pod, pod.Ref))
						touch(owner)
						a.Addresses = slices.DeleteFunc(a.Addresses, func(ad Address) bool { return ad.Addr == ip })
						delete(p.inUse, ip)
						changed[owner] = true
						picks = append(picks, Address{Pool: name, Addr: ip})
						continue
					}
					if !ReportWins(ip, ownerPod, ownerBound, sb) {
						plan.Problems = append(plan.Problems, fmt.Sprintf("pod %s shows address %s, which the journal records for %s of pod %s",
							pod.Ref, ip, owner, a.Pod))
						continue
					}
					// The journal's owner ended or moved on: the journal is older than the pods.
					plan.Problems = append(plan.Problems, fmt.Sprintf("pod %s shows address %s, which the journal records for %s of pod %s, "+
						"which is gone or no longer shows it: the journal is older than the pods (a restored disk?); the address moves to %s",
						pod.Ref, ip, owner, a.Pod, pod.Ref))
					touch(owner)
					a.Addresses = slices.DeleteFunc(a.Addresses, func(ad Address) bool { return ad.Addr == ip })
					delete(p.inUse, ip)
					changed[owner] = true
				} else if _, rel := p.releasing[ip]; rel {
					plan.Problems = append(plan.Problems, fmt.Sprintf("pod %s shows address %s of pool %s, which the node is releasing; not recorded",
						pod.Ref, ip, name))
					continue
				} else if _, cool := p.cooling[ip]; cool && len(s.byPod[pod.Ref.UID]) > 0 {
					continue // its sandbox was deleted and it has its new attachment; the status is stale
				}
				picks = append(picks, Address{Pool: name, Addr: ip})
			}
		}
		if len(picks) == 0 && len(stale) == 0 {
			continue
		}
		touch(k)
		for _, ad := range stale {
			plan.stale = append(plan.stale, staleAddress{key: k, Address: ad})
			plan.Problems = append(plan.Problems, fmt.Sprintf("pod %s no longer reports address %s recorded from its earlier reports, and no sandbox the runtime shows uses it: "+
				"it is freed through the reuse cooldown", pod.Ref, ad.Addr))
			if p := s.pools[ad.Pool]; p != nil {
				if _, rel := p.releasing[ad.Addr]; !rel && (!p.heldKnown || p.held.Contains(ad.Addr)) {
					ch.PutCooling = append(ch.PutCooling, Cooling{Pool: ad.Pool, Addr: ad.Addr, FreedAt: now})
				}
			}
		}
		for _, ad := range picks {
			p := s.pools[ad.Pool]
			if p.unattributed.Contains(ad.Addr) {
				plan.fromUnattributed = append(plan.fromUnattributed, ad)
			}
			if c := p.take(ad.Addr, k); c != nil {
				plan.fromCooling = append(plan.fromCooling, *c)
				ch.DeleteCooling = append(ch.DeleteCooling, ad)
			}
		}
		addrs := append(slices.Clone(keep), picks...)
		if len(addrs) == 0 {
			// Every address went stale: the attachment goes (its addresses stay in use by its key
			// until Apply frees them).
			s.dropAttachment(k)
			ch.DeleteAttachments = append(ch.DeleteAttachments, k)
			continue
		}
		att := &Attachment{Key: k, Pod: pod.Ref, Addresses: addrs, Created: now, Rebuilt: true}
		if existing != nil {
			att.Created = existing.Created
		}
		s.putAttachment(att)
		ch.PutAttachments = append(ch.PutAttachments, *att.clone())
	}
	for _, k := range sortedKeys(changed) {
		a := s.atts[k]
		// An attachment this plan recorded before it lost the address: the journal applies
		// deletions before puts, so only its last form may be in the change.
		ch.PutAttachments = slices.DeleteFunc(ch.PutAttachments, func(x Attachment) bool { return x.Key == k })
		if len(a.Addresses) == 0 {
			s.dropAttachment(k)
			ch.DeleteAttachments = append(ch.DeleteAttachments, k)
			continue
		}
		ch.PutAttachments = append(ch.PutAttachments, *a.clone())
	}
	for _, k := range plan.keys {
		s.pending[k] = &undo{}
	}
	for _, name := range s.poolNames() {
		cfg := s.pools[name].cfg
		plan.observed = append(plan.observed, ObservedPool{Pool: name, UID: cfg.UID, Generation: cfg.Generation})
	}
	return plan
}

// staleAddress is a rebuilt address a plan drops through the cooldown once it is applied.
type staleAddress struct {
	key Key
	Address
}

// poolNetworks lists the networks of the node's pools, the pod network ("") first.
func (s *State) poolNetworks() []string {
	nets := []string{""}
	for _, name := range s.poolNames() {
		if n := s.pools[name].cfg.Network; !slices.Contains(nets, n) {
			nets = append(nets, n)
		}
	}
	return nets
}

// journaledNetworks returns the networks on which the pod with uid has an attachment of its own
// (an ADD of this agent, not one rebuilt from reports, nor a DRA reservation: a Prepare tells
// nothing of the pod's sandbox, and a reservation's address is its owner's whatever a report
// says).
func (s *State) journaledNetworks(uid string) map[string]bool {
	out := map[string]bool{}
	for k := range s.byPod[uid] {
		if k.IsRebuilt() {
			continue
		}
		if a := s.atts[k]; a != nil && a.DRA == nil {
			for _, ad := range a.Addresses {
				out[s.networkOf(ad.Pool)] = true
			}
		}
	}
	return out
}

func isUsed(p *poolState, a netip.Addr) bool { _, used := p.inUse[a]; return used }

// applyRebuild confirms a journaled rebuild: its attachments are no longer pending, and the
// pools it looked at are observed.
func (s *State) applyRebuild(plan RebuildPlan) {
	for _, k := range plan.keys {
		delete(s.pending, k)
	}
	for _, st := range plan.stale {
		if p := s.pools[st.Pool]; p != nil && p.inUse[st.Addr] == st.key {
			p.free(st.Addr, plan.at)
			p.recompute()
		}
	}
	s.observed = plan.observed
}

// dropRecorded takes the attachments a refused plan recorded under keys out of the state (their
// addresses out of use, their pending marks gone) and notes the pools they touched.
func (s *State) dropRecorded(keys []Key, pools map[string]bool) {
	for _, k := range keys {
		delete(s.pending, k)
		if a := s.atts[k]; a != nil {
			for _, ad := range a.Addresses {
				if p := s.pools[ad.Pool]; p.inUse[ad.Addr] == k {
					delete(p.inUse, ad.Addr)
				}
				pools[ad.Pool] = true
			}
			s.dropAttachment(k)
		}
	}
}

// abortRebuild undoes a rebuild the journal refused: the attachments it recorded are gone,
// those it changed or dropped are back, and the addresses it took from cooling or from the
// unattributed hold are there again.
func (s *State) abortRebuild(plan RebuildPlan) {
	pools := map[string]bool{}
	s.dropRecorded(plan.keys, pools)
	for _, k := range plan.keys {
		if a := plan.prior[k]; a != nil {
			s.putAttachment(a)
			for _, ad := range a.Addresses {
				s.pools[ad.Pool].inUse[ad.Addr] = k
				pools[ad.Pool] = true
			}
		}
	}
	for _, c := range plan.fromCooling {
		if p := s.pools[c.Pool]; !isUsed(p, c.Addr) {
			p.uncool(c)
		}
	}
	for _, ad := range plan.fromUnattributed {
		p := s.pools[ad.Pool]
		p.unattributed = p.unattributed.Union(setOf(ad.Addr))
	}
	for name := range pools {
		s.pools[name].recompute()
	}
}

// Observed lists the pools the last Rebuild looked at the pods' addresses with (sorted by name):
// every address a running pod reported inside them is in use on the node, and claimed unless the
// node holds it. A node acknowledges a new or grown pool only through this list, so the
// controller hands out none of its addresses before it knows which ones the node's pods use.
func (s *State) Observed() []ObservedPool { return slices.Clone(s.observed) }

// ReportWins decides whether a running pod that reports address ip in its status.podIPs takes
// it from the journal's attachment of another pod, owner (ownerBound: that pod is bound to the
// node; sb: what the agent can tell of that attachment's sandbox). The report wins only when the
// owner's sandbox is provably done with the address: its network namespace is gone and its pod is
// gone, finished, or reports addresses without ip (the journal recorded it before that); or its
// pod finished (the kubelet stopped its sandbox) where the namespace cannot be looked at. A
// sandbox that still exists keeps the address (a force-deleted pod the runtime has not stopped
// yet); so does a pod the agent's list lacks while its sandbox cannot be looked at (the list may
// lag a new pod), and one that may run and reports ip too, or nothing yet: a conflict for an
// operator.
func ReportWins(ip netip.Addr, owner Pod, ownerBound bool, sb Sandbox) bool {
	switch sb {
	case SandboxExists:
		return false
	case SandboxUnknown:
		return ownerBound && owner.Finished
	}
	if !ownerBound || !owner.MayRun() {
		return true
	}
	return len(owner.IPs) > 0 && !slices.Contains(owner.IPs, ip)
}

func sortedKeys(m map[Key]bool) []Key {
	keys := make([]Key, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b Key) int { return strings.Compare(a.String(), b.String()) })
	return keys
}

// poolOfNetwork returns the pool of network whose holding (else whose CIDRs) contain ip, or "".
func (s *State) poolOfNetwork(ip netip.Addr, network string) string {
	names := s.poolNames()
	for _, n := range names {
		if p := s.pools[n]; p.cfg.Network == network && p.held.Contains(ip) {
			return n
		}
	}
	for _, n := range names {
		if p := s.pools[n]; p.cfg.Network == network && slices.ContainsFunc(p.cfg.CIDRs, func(c netip.Prefix) bool { return c.Contains(ip) }) {
			return n
		}
	}
	return ""
}

package agent

// The agent's simulation of DRA pods (docs/design.md, "Addresses the scheduler can see (DRA)"):
// a pod with a ResourceClaim allocated one slot device of the driver on the node (pool "pod" on
// eth0, or pool "st" on net1 through the claim's AddressConfig), the kubelet's Prepare before the
// sandbox (retried when refused, cut off by a restart, or when the driver's status write failed),
// the driver's server-side apply of its status.devices entry as a step of its own (a restart may
// land between the journal write and it), the sandbox's ADD on the claim's interface, the DEL,
// the kubelet's Unprepare once the sandbox is gone (or never: a missed Unprepare), and the claim
// deleted, deallocated or allocated to another node once its pod is done, sometimes while the
// agent is down; the driver's level reconcile (ReconcileClaims) at start, as a step, and at
// every quiet point. The oracle (checkDRA, checkDRAExact):
//
//   - an ADD of a DRA pod on its claim's interface is answered the claim's reserved address;
//   - no reservation's address (the agent's, or a prepared claim's status) is on a live interface
//     other than its pod's on the claim's interface;
//   - a Prepare answered twice is answered the same address (within one journal);
//   - a claim has at most one status entry of the driver, exactly one once prepared, naming its
//     device, interface and the reservation's address;
//   - a prepared claim still allocated to the node, not unprepared, keeps its reservation;
//   - at a quiet point no reservation of a claim gone, deallocated or unprepared remains (no
//     leak), unless an attachment still uses its address.
//
// A journal lost or damaged after the kubelet saw a claim prepared: the kubelet never prepares
// it again, but its status entry (written only after the reservation's journal write, and only
// then is the Prepare answered) names the reservation, and the next start re-creates it from
// there (reconcileStart, dra.Evidence, ipam.DecideRecovery). The oracle (draRecovered): at that
// start a claim still allocated to the node whose pod may run has its reservation back, with its
// status's address and interface, unless another pod's attachment recorded from that pod's
// reports holds the address (kept: never two owners; the agent reports the conflict), or the
// claim lost its reservation at an earlier loss (then its entry may be stale). A claim whose pod
// is done, or that is no longer allocated to the node, needs none. A claim not recovered is
// marked lost and exempt from the checks that need the reservation. A claim whose status write
// had not landed when the journal was lost has no evidence, and needs none: the kubelet saw its
// Prepare fail and prepares it again (docs/simulate.md).

import (
	"fmt"
	"net/netip"
	"slices"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ipwarden/ipwarden/internal/agent/dra"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/previous"
)

const simDRARequest = "addr"

// simDRAStatus is one entry of a claim's status.devices.
type simDRAStatus struct {
	driver, pool, device, ifname string
	addr                         netip.Addr
}

// simDRAClaim is a ResourceClaim of the driver, reserved for one pod, and what the kubelet and
// the oracle know of it.
type simDRAClaim struct {
	name, uid string
	pod       *simPod
	pool      string // the IPPool the device is a slot of
	device    string
	ifname    string
	where     string // "node": allocated to the node; "": deallocated; "other": allocated to another node
	deleted   bool
	status    []simDRAStatus

	// The kubelet: it called Prepare (prepareSent), one is in flight (preparing, on agent
	// prepGen), a Prepare succeeded for it (prepared: the status write landed); it unprepares
	// once the pod's sandboxes are gone, unless missed. unprepCut: a restart cut an Unprepare
	// off, whose write may have landed (the kubelet retries; the reservation may be gone).
	prepareSent, preparing, prepared   bool
	prepGen                            int
	unpreparing, unprepared, unprepCut bool
	missed                             bool
	unprepGen                          int
	// pending: the agent answered the Prepare with this reservation, the status write is to come
	// (its own step); a restart before it fails the Prepare for the kubelet.
	pending    *ipam.Attachment
	pendingGen int
	cut        bool // a restart cut a Prepare or its status write off: the next answer is a retry's

	// The oracle: the address the agent answered a Prepare with (since the last lost journal);
	// forgot: the journal was lost or damaged after the kubelet saw the claim prepared, and no
	// agent has reconciled since (the next start's recovery decides, draRecovered); lost: that
	// start did not recover the reservation.
	answered netip.Addr
	forgot   bool
	lost     bool
}

func (c *simDRAClaim) key() ipam.Key { return ipam.ReservationKey(c.uid, simDRARequest, c.device) }

// live: the API server shows the claim allocated to the node.
func (c *simDRAClaim) live() bool { return !c.deleted && c.where == "node" }

// holds: the agent must hold the claim's reservation, as its status names it.
func (c *simDRAClaim) holds() bool {
	return c.live() && c.prepared && !c.lost && !c.forgot && !c.unpreparing && !c.unprepCut && !c.unprepared
}

// entries are the claim's status entries of the driver.
func (c *simDRAClaim) entries() []simDRAStatus {
	var out []simDRAStatus
	for _, e := range c.status {
		if e.driver == dra.DriverName {
			out = append(out, e)
		}
	}
	return out
}

func (c *simDRAClaim) String() string {
	return fmt.Sprintf("claim %s (%s, %s on %s, pod %s)", c.name, c.uid, c.device, c.ifname, c.pod.ref.Name)
}

// podDone: the claim's pod finished or left the API server.
func (c *simDRAClaim) podDone() bool { return !c.pod.inAPI || c.pod.phase != "" }

// draOf is pod p's claim, if it is a DRA pod.
func (s *sim) draOf(p *simPod) *simDRAClaim {
	for _, c := range s.dra {
		if c.pod == p {
			return c
		}
	}
	return nil
}

func (s *sim) draByUID(uid string) *simDRAClaim {
	for _, c := range s.dra {
		if c.uid == uid {
			return c
		}
	}
	return nil
}

func (s *sim) pickDRA(ok func(c *simDRAClaim) bool) *simDRAClaim {
	var cs []*simDRAClaim
	for _, c := range s.dra {
		if ok(c) {
			cs = append(cs, c)
		}
	}
	if len(cs) == 0 {
		return nil
	}
	return cs[s.rng.IntN(len(cs))]
}

// newDRAPod creates a pod whose claim the scheduler allocated a slot of the node, and the
// kubelet's first Prepare. The scheduler allocates a slot only while the node publishes a free
// one: the pool's headroom for claims (ClaimCapacities; with maxPerNode 12 its band is 1, so the
// published count is the headroom) above the claims allocated to the node.
func (s *sim) newDRAPod() {
	storage := s.chance(3)
	pool, ifname := "pod", "eth0"
	if storage && s.chance(2) {
		pool, ifname = "st", "net1" // the claim's AddressConfig names net1
	}
	allocated := 0
	for _, c := range s.dra {
		if c.live() && c.pool == pool {
			allocated++
		}
	}
	var headroom int
	for _, cp := range s.a.m.st.ClaimCapacities(s.now) {
		if cp.Pool == pool {
			headroom = cp.Headroom
		}
	}
	s.flush() // as Service.step does after the driver's look
	if allocated >= headroom {
		s.counts["DRA pod: no free slot"]++
		s.logf("DRA pod: pool %s has no free slot (%d allocated, headroom %d)", pool, allocated, headroom)
		return
	}
	n := len(s.pods)
	pod := &simPod{ref: ipam.PodRef{Namespace: "ns", Name: fmt.Sprintf("dra-p%d", n), UID: fmt.Sprintf("uid-%d", n)}, inAPI: true,
		visible: !s.chance(4), storage: storage}
	s.pods = append(s.pods, pod)
	c := &simDRAClaim{name: pod.ref.Name + "-addr", uid: fmt.Sprintf("rc-uid-%d", n), pod: pod, pool: pool, ifname: ifname, where: "node",
		device: fmt.Sprintf("%s-s%d", pool, len(s.dra)), missed: s.chance(4)}
	s.dra = append(s.dra, c)
	s.logf("DRA pod %s: %s allocated", pod.ref.Name, c)
	s.draPrepare(c)
}

// draPrepare is the kubelet's NodePrepareResources of claim c.
func (s *sim) draPrepare(c *simDRAClaim) {
	c.prepareSent = true
	if !s.a.synced || s.apiAway {
		// The plugin registers after the first reconciliation, and its helper reads the claim
		// from the API server: the kubelet's call fails, and it retries.
		s.counts["DRA prepare failed before the machine"]++
		s.logf("DRA Prepare of %s failed before the machine (synced %v, API away %v)", c, s.a.synced, s.apiAway)
		return
	}
	req := ipam.ReserveRequest{Claim: ipam.ClaimDevice{Namespace: "ns", Name: c.name, UID: c.uid, Request: simDRARequest, Device: c.device,
		Interface: c.ifname}, Pod: c.pod.ref, Pool: c.pool}
	gen := s.a.gen
	c.preparing, c.prepGen = true, gen
	id := s.a.m.Prepare(req, s.now)
	s.logf("DRA Prepare of %s sent", c)
	s.expect(id, func(ans Answer) { s.draPrepared(c, gen, ans) })
}

// draPrepared checks a Prepare's answer; a reservation goes on to the status write.
func (s *sim) draPrepared(c *simDRAClaim, gen int, ans Answer) {
	if !c.preparing || c.prepGen != gen {
		return
	}
	c.preparing = false
	if ans.Err != nil {
		s.counts["DRA prepare refused"]++
		s.logf("DRA Prepare of %s refused: %.100s", c, ans.Err.Error())
		return
	}
	att := ans.Att
	if att == nil || len(att.Addresses) != 1 || att.Key != c.key() || att.DRA == nil || att.DRA.Device != c.device ||
		att.DRA.Interface != c.ifname || att.Pod.UID != c.pod.ref.UID || att.Addresses[0].Pool != c.pool {
		s.fatalf("DRA Prepare of %s answered %+v: not the claim's reservation of one address of pool %s", c, att, c.pool)
	}
	got := att.Addresses[0].Addr
	if c.answered.IsValid() && got != c.answered {
		s.fatalf("DRA Prepare of %s answered %s; an earlier Prepare was answered %s", c, got, c.answered)
	}
	if c.answered.IsValid() {
		s.counts["DRA prepare answered again"]++
		if c.cut {
			s.counts["DRA prepare answered again after a restart"]++
		}
	}
	c.answered, c.cut = got, false
	s.counts["DRA prepare answered"]++
	s.logf("DRA Prepare of %s answered %s", c, got)
	a := *att
	c.pending, c.pendingGen = &a, s.a.gen // the status write is a later step
}

// draStatusWrite is the driver's server-side apply of its status.devices entry for the pending
// reservation: the Prepare succeeds for the kubelet only once it landed.
func (s *sim) draStatusWrite(c *simDRAClaim) {
	if s.apiAway || s.chance(8) {
		// Prepare fails; the reservation stays for the kubelet's retry.
		c.pending = nil
		s.counts["DRA status write failed"]++
		s.logf("DRA status write of %s failed: Prepare fails, the reservation stays", c)
		return
	}
	s.draStatusLands(c)
}

// draStatusLands applies claim c's pending status entry: a list map keyed by driver, pool and
// device, so the apply replaces the driver's own entry.
func (s *sim) draStatusLands(c *simDRAClaim) {
	p := c.pending
	c.pending = nil
	e := simDRAStatus{driver: dra.DriverName, pool: simNode, device: p.DRA.Device, ifname: p.DRA.Interface, addr: p.Addresses[0].Addr}
	i := slices.IndexFunc(c.status, func(o simDRAStatus) bool { return o.driver == e.driver && o.pool == e.pool && o.device == e.device })
	if i >= 0 {
		c.status[i] = e
	} else {
		c.status = append(c.status, e)
	}
	c.prepared = true
	s.counts["DRA status written"]++
	s.logf("DRA status of %s written: %s on %s", c, e.addr, e.ifname)
}

// draKillBeforeStatus kills the agent while a Prepare's reservation is journaled and its status
// write is still to come; the kubelet's retry of the cut Prepare follows the restart.
func (s *sim) draKillBeforeStatus() {
	if !slices.ContainsFunc(s.dra, func(c *simDRAClaim) bool { return c.pending != nil }) {
		return
	}
	s.kill()
	for _, c := range s.dra {
		if c.cut && c.live() && !c.podDone() && !c.prepared && !c.preparing {
			s.draPrepare(c)
		}
	}
}

// draSandbox is the kubelet's RunPodSandbox of a prepared claim's pod: its first sandbox, or a
// new one after the earlier stopped (StopPodSandbox, its DELs answered, comes first).
func (s *sim) draSandbox() {
	c := s.pickDRA(func(c *simDRAClaim) bool { return c.prepared && !c.podDone() && c.live() })
	if c == nil {
		return
	}
	p := c.pod
	for _, sb := range p.sbs {
		s.stopSandbox(sb, false)
	}
	for _, sb := range p.sbs {
		for _, f := range sb.ifs {
			if f.state == ifOwed {
				s.sendDel(f)
			}
		}
	}
	for _, sb := range p.sbs {
		for _, f := range sb.ifs {
			if f.state == ifAdding || f.state == ifDeleting {
				s.logf("DRA pod %s: the kubelet waits for sandbox %s's requests", p.ref.Name, sb.cid)
				return
			}
		}
	}
	s.startSandbox(p)
}

// draAnswered checks the ADD of a DRA pod on its claim's interface: exactly the claim's address.
func (s *sim) draAnswered(f *simIf, got netip.Addr) {
	c := s.draOf(f.sb.pod)
	if c == nil || f.key.IfName != c.ifname {
		return
	}
	if c.lost || c.forgot {
		s.counts["DRA ADD after its reservation was lost with the journal"]++
		return
	}
	if !c.holds() {
		return // the claim ended (or is being unprepared) while the ADD waited
	}
	es := c.entries()
	if len(es) != 1 || es[0].addr != got {
		s.fatalf("ADD %s of DRA pod %s answered %s; its claim's status names %+v", f.key, f.sb.pod.ref.Name, got, es)
	}
	s.counts["DRA ADD of the reserved address"]++
}

// draUnprepare is the kubelet's NodeUnprepareResources of claim c.
func (s *sim) draUnprepare(c *simDRAClaim) {
	if !s.a.synced {
		s.logf("DRA Unprepare of %s failed before the machine (the plugin is not registered)", c)
		return
	}
	gen := s.a.gen
	c.unpreparing, c.unprepGen = true, gen
	id := s.a.m.Unprepare(c.uid, simDRARequest, c.device, s.now)
	s.logf("DRA Unprepare of %s sent", c)
	s.expect(id, func(ans Answer) {
		if !c.unpreparing || c.unprepGen != gen {
			return
		}
		c.unpreparing = false
		if ans.Err != nil {
			s.counts["DRA unprepare refused"]++
			s.logf("DRA Unprepare of %s refused: %.100s", c, ans.Err.Error())
			return
		}
		c.unprepared = true
		if ans.Att != nil {
			s.counts["DRA unprepare freed"]++
		}
		s.logf("DRA Unprepare of %s answered (freed %v)", c, ans.Att != nil)
	})
}

// unprepareDue: the kubelet unprepares a claim it called Prepare for once the pod is done and
// its sandboxes are gone (their DELs answered, or vanished).
func (s *sim) unprepareDue(c *simDRAClaim) bool {
	if !c.prepareSent || c.unprepared || c.unpreparing || c.missed || c.preparing || c.pending != nil || !c.podDone() {
		return false
	}
	for _, sb := range c.pod.sbs {
		if sb.running() {
			return false
		}
	}
	return true
}

// draClaimEnd: the claim's pod is done, and the resource claim controller deletes the claim,
// or it is deallocated, or allocated to another node; the kubelet's Unprepare may never come.
func (s *sim) draClaimEnd(c *simDRAClaim) {
	switch s.rng.IntN(3) {
	case 0:
		c.deleted = true
	case 1:
		c.where = ""
	default:
		c.where = "other"
	}
	c.status = nil  // a deallocation clears status.devices; another node's driver writes its own
	c.pending = nil // the driver's apply of an entry the allocation no longer has is rejected
	if s.chance(2) {
		c.missed = true
	}
	s.counts["DRA claim ended"]++
	s.logf("DRA %s ended: deleted %v, allocated %q, Unprepare missed %v", c, c.deleted, c.where, c.missed)
}

func (s *sim) endableDRA(c *simDRAClaim) bool { return c.live() && c.podDone() }

// draReconcile is the driver's level reconcile: a GET of each claim the node holds a reservation
// for (the API server away: every GET fails, everything is kept).
func (s *sim) draReconcile() {
	if !s.a.synced || s.apiAway {
		return
	}
	allocated := func(cd ipam.ClaimDevice) bool {
		c := s.draByUID(cd.UID)
		return c != nil && c.live() && c.device == cd.Device && cd.Request == simDRARequest
	}
	ids := s.a.m.ReconcileClaims(allocated, s.now)
	s.logf("DRA reconcile: %d releases", len(ids))
	for _, id := range ids {
		s.expect(id, func(ans Answer) {
			if ans.Err == nil && ans.Att != nil {
				s.counts["DRA reconcile released"]++
				s.logf("DRA reconcile released %s (%s)", ans.Att.Key, fmtAddrs(ans.Att.Addresses))
			}
		})
	}
}

// draAgentEnded: the agent's process ends; the kubelet's calls in flight fail (it retries), and
// a Prepare whose status write had not come fails with it.
func (s *sim) draAgentEnded() {
	for _, c := range s.dra {
		if c.preparing && c.prepGen == s.a.gen {
			c.preparing, c.cut = false, true
		}
		if c.pending != nil {
			c.pending, c.cut = nil, true
			s.counts["DRA status write cut by a restart"]++
			s.logf("DRA status write of %s cut off by the restart", c)
		}
		if c.unpreparing && c.unprepGen == s.a.gen {
			c.unpreparing, c.unprepCut = false, true
		}
	}
}

// draForgotten: the journal was lost or damaged. A claim the kubelet saw prepared waits for the
// next start's recovery from its status (draRecovered); any other is prepared again from
// scratch.
func (s *sim) draForgotten() {
	for _, c := range s.dra {
		if c.prepared && !c.unprepared && c.live() && !c.forgot {
			c.forgot = true
			s.counts["DRA reservation lost with the journal"]++
		}
		c.answered = netip.Addr{}
	}
}

// draEvidence is the DRA driver's read of the claims at a start after a lost journal: what a
// LIST of the ResourceClaims shows (a deleted claim is gone; the allocation is the node's,
// another node's or none; the one consumer, the pod, stays in status.reservedFor; the status
// entries as written), through the driver's own reading (dra.Evidence).
func (s *sim) draEvidence() []ipam.ReservationEvidence {
	var claims []resourceapi.ResourceClaim
	for _, c := range s.dra {
		if c.deleted {
			continue
		}
		o := resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: c.name, UID: types.UID(c.uid)}}
		o.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: c.pod.ref.Name, UID: types.UID(c.pod.ref.UID)}}
		if c.where != "" {
			node := simNode
			if c.where == "other" {
				node = "node-o"
			}
			o.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{
				Results: []resourceapi.DeviceRequestAllocationResult{{Request: simDRARequest, Driver: dra.DriverName, Pool: node, Device: c.device}}}}
		}
		for _, e := range c.status {
			prefix := netip.PrefixFrom(e.addr, e.addr.BitLen())
			for _, p := range simPools {
				if p.CIDRs[0].Contains(e.addr) {
					prefix = p.Prefix(e.addr)
				}
			}
			o.Status.Devices = append(o.Status.Devices, resourceapi.AllocatedDeviceStatus{Driver: e.driver, Pool: e.pool, Device: e.device,
				NetworkData: &resourceapi.NetworkDeviceData{InterfaceName: e.ifname, IPs: []string{prefix.String()}}})
		}
		claims = append(claims, o)
	}
	evs, problems := dra.Evidence(claims, simNode, s.a.m.st.Served(), "eth0")
	if len(problems) > 0 {
		s.fatalf("the driver cannot read the claims' status entries: %v", problems)
	}
	s.logf("DRA: %d claims listed, %d status entries of the node", len(claims), len(evs))
	return evs
}

// draRecovered checks the start's recovery after a lost journal (reconcileStart): each claim
// whose journal was lost after the kubelet saw it prepared has its reservation back, with its
// status's address and interface, while it is allocated to the node and its pod may run. The
// exceptions, marked lost: its pod is done or the claim is gone (nothing to recover: its
// Unprepare finds none); another pod's attachment recorded from that pod's reports holds the
// address (a stale report; the agent keeps it and reports the conflict); the claim lost its
// reservation at an earlier loss, so its entry may be stale (any reported reason); or another
// entry naming the address is such a stale one (neither is recovered).
func (s *sim) draRecovered(outcomes []ipam.RecoveryOutcome) {
	st := s.a.m.st
	for _, c := range s.dra {
		if !c.forgot {
			continue
		}
		c.forgot = false
		wasLost := c.lost
		es := c.entries()
		if r, ok := st.Attachment(c.key()); ok {
			if len(es) != 1 || len(r.Addresses) != 1 || r.Addresses[0].Addr != es[0].addr || r.DRA == nil || r.DRA.Interface != c.ifname ||
				r.Pod.UID != c.pod.ref.UID || r.Addresses[0].Pool != c.pool {
				s.fatalf("%s was recovered as %+v; its status entries are %+v", c, r, es)
			}
			c.lost, c.answered = false, es[0].addr
			s.counts["DRA reservation recovered from its claim's status"]++
			s.logf("DRA %s recovered with %s", c, es[0].addr)
			continue
		}
		c.lost = true
		if !c.live() || c.podDone() || c.unprepared {
			s.counts["DRA reservation not recovered: its pod is done or its claim gone"]++
			continue
		}
		i := slices.IndexFunc(outcomes, func(o ipam.RecoveryOutcome) bool { return o.Evidence.Claim.UID == c.uid })
		if i < 0 {
			s.fatalf("%s: its journal was lost after the kubelet saw it prepared, it is still allocated to the node and its pod may run, "+
				"yet the start did not decide on its status entries %+v", c, es)
		}
		o := outcomes[i]
		staleOther := o.Reason == ipam.RecoveryDuplicate && slices.ContainsFunc(s.dra, func(d *simDRAClaim) bool {
			return d != c && d.lost && slices.ContainsFunc(d.entries(), func(e simDRAStatus) bool { return e.addr == o.Evidence.Addr })
		})
		switch {
		case o.Reason == ipam.RecoveryInUse && o.Owner.IsRebuilt() && o.Owner != ipam.RebuiltKey(c.pod.ref.UID):
			s.counts["DRA reservation not recovered: another pod's report holds its address"]++
		case wasLost:
			s.counts["DRA reservation not recovered: lost before, its status stale"]++
		case staleOther:
			s.counts["DRA reservation not recovered: a stale status names its address"]++
		default:
			s.fatalf("%s: its journal was lost after the kubelet saw it prepared, it is still allocated to the node and its pod may run, "+
				"yet its reservation was not recovered: %s", c, o)
		}
		s.logf("DRA %s not recovered: %s", c, o)
	}
}

// draFile: host-local's file of an address a DRA reservation holds may name another interface
// of the reservation's pod, or be missing. Each sandbox's ADD of the pod shares the address and
// writes its own file over the last (withoutShared sees one holder, the reservation), a DEL
// removes its own, and the reservation writes none (a Prepare knows no previous IPAM): the
// address is kept from host-local only while a sandbox's file names it (docs/simulate.md). The
// cross-IPAM oracle (checkPrevious) still holds it to one live sandbox.
func (s *sim) draFile(att ipam.Attachment, a netip.Addr, got string) bool {
	for _, r := range s.a.m.st.Reservations() {
		if r.Pod.UID != att.Pod.UID || !slices.ContainsFunc(r.Addresses, func(ad ipam.Address) bool { return ad.Addr == a }) {
			continue
		}
		if got == "" {
			s.counts["DRA: host-local has no file of the reserved address"]++
			return true
		}
		for _, f := range s.ifs {
			if f.sb.pod.ref.UID == r.Pod.UID && got == previous.OwnHostLocalContent(f.key.ContainerID, f.key.IfName) {
				s.counts["DRA: host-local's file names another sandbox of the pod"]++
				return true
			}
		}
	}
	return false
}

// checkDRA is the oracle's DRA part, after every step.
func (s *sim) checkDRA(live []*simIf) {
	s.t.Helper()
	st := s.a.m.st
	res := map[ipam.Key]ipam.Attachment{}
	for _, r := range st.Reservations() {
		res[r.Key] = r
		for _, f := range live {
			if slices.ContainsFunc(r.Addresses, func(a ipam.Address) bool { return a.Addr == f.addr }) &&
				(f.sb.pod.ref.UID != r.Pod.UID || f.key.IfName != r.DRA.Interface) {
				s.fatalf("reservation %s (pod %s, %s) holds %s, which live interface %s of pod %s has", r.Key, r.Pod.Name, r.DRA.Interface,
					fmtAddrs(r.Addresses), f.key, f.sb.pod.ref.Name)
			}
		}
	}
	for _, c := range s.dra {
		es := c.entries()
		if len(es) > 1 {
			s.fatalf("%s has %d status entries of the driver: %+v", c, len(es), es)
		}
		if !c.holds() {
			continue
		}
		if len(es) != 1 || es[0].device != c.device || es[0].pool != simNode || es[0].ifname != c.ifname {
			s.fatalf("%s is prepared; its status entries of the driver are %+v", c, es)
		}
		r, ok := res[c.key()]
		if !ok || len(r.Addresses) != 1 || r.Addresses[0].Addr != es[0].addr {
			s.fatalf("%s is prepared and allocated to the node with %s; the agent's reservation is %+v (found %v)", c, es[0].addr, r.Addresses, ok)
		}
		for _, f := range live {
			if f.addr == es[0].addr && (f.sb.pod != c.pod || f.key.IfName != c.ifname) {
				s.fatalf("%s's address %s is on live interface %s of pod %s", c, es[0].addr, f.key, f.sb.pod.ref.Name)
			}
		}
	}
}

// draSettle is the DRA side's part of a quiet point: status writes land, the kubelet prepares
// what it still must and unprepares what is due, claims of pods that are done end, and the
// driver reconciles.
func (s *sim) draSettle() {
	if !s.a.synced {
		return
	}
	for _, c := range s.dra {
		if c.pending != nil {
			s.draStatusLands(c) // the API server answers at a quiet point
		}
	}
	for _, c := range s.dra {
		switch {
		case c.live() && !c.podDone() && !c.prepared && !c.preparing && c.pending == nil:
			s.draPrepare(c)
		case s.unprepareDue(c):
			s.draUnprepare(c)
		}
	}
	for _, c := range s.dra {
		if s.endableDRA(c) && !c.pod.inAPI {
			s.draClaimEnd(c) // the resource claim controller acts once the pod is gone
		}
	}
	s.draReconcile()
}

// checkDRAExact: at a quiet point every reservation is of a claim allocated to the node that the
// kubelet has not unprepared (no leak), one an attachment still uses excepted; a running pod's
// reservation is its claim's status.
func (s *sim) checkDRAExact() {
	s.t.Helper()
	st := s.a.m.st
	for _, r := range st.Reservations() {
		c := s.draByUID(r.DRA.UID)
		if c == nil {
			s.fatalf("at a quiet point the agent holds reservation %s of a claim that never existed", r.Key)
		}
		if users := st.ReservationUsers(r.Key); len(users) > 0 {
			s.counts["DRA reservation kept while an attachment uses it"]++
			continue
		}
		switch {
		case !c.live():
			s.fatalf("at a quiet point %s is gone (deleted %v, allocated %q), yet reservation %s (%s) remains", c, c.deleted, c.where, r.Key, fmtAddrs(r.Addresses))
		case c.unprepared:
			s.fatalf("at a quiet point %s was unprepared, yet reservation %s (%s) remains", c, r.Key, fmtAddrs(r.Addresses))
		case !c.podDone():
			if es := c.entries(); !c.prepared || len(es) != 1 || es[0].addr != r.Addresses[0].Addr {
				s.fatalf("at a quiet point %s's reservation holds %s; prepared %v, status %+v", c, fmtAddrs(r.Addresses), c.prepared, es)
			}
		case !c.missed:
			s.fatalf("at a quiet point %s's pod is done and its sandboxes gone, yet its reservation %s remains", c, fmtAddrs(r.Addresses))
		default:
			s.counts["DRA reservation kept: Unprepare missed, claim still allocated"]++
		}
	}
}

package agent

// The agent's simulation of VM pods (docs/design.md, "VM addresses (IPAMClaim)"): pods whose
// eth0 references an IPAMClaim by name (the k8s.ovn.org/primary-udn-ipamclaim annotation, read
// through the driver's own claimMeta), their restarts (a new pod of the same claim, on the node
// while the old one may still run), live migrations (a second pod with the label
// kubevirt.io/migrationJobUID; either side's DEL may come first, or never), claims deleted and
// re-created under the same name (a new UID, status.ips naming the old address: an import), and
// the controller's side as the protocol says: it records a binding (the pool's status, pushed
// before the grant) for a claim the node's last published spec lists as waiting, grants the bound
// address, refuses (claimRefused) a claim whose address another claim's binding has or when the
// pool has nothing free, and drops the binding of a deleted claim once the node's last published
// spec lists no use of it. The oracle accepts exactly the legal double use: two live interfaces
// on one address only when the agent recorded both for the same claim UID and one is a migration
// target; a claim's interface has its claim's bound address; no other interface has a bound one.

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/ipamclaim"
	"github.com/ipwarden/ipwarden/internal/previous"
)

// simClaim is an IPAMClaim in the API server.
type simClaim struct {
	name, uid string
	ips       []string // status.ips (an import: preset when re-created)
	deleted   bool
}

// simClaims is the claims' side of the world.
type simClaims struct {
	all      []*simClaim
	next     int
	bindings map[string]netip.Addr // the pod pool's status.ipamClaims, by UID
	names    map[string]string     // UID -> name, for the bindings
	refused  map[string]string     // the node's status.pools[pod].claimRefused, by UID
	lastSpec []ipam.PoolRequest    // the node's spec as last published (s.published is consumed)
}

// current returns the claim of that name the API server has now.
func (c *simClaims) current(name string) *simClaim {
	for i := len(c.all) - 1; i >= 0; i-- {
		if cl := c.all[i]; cl.name == name && !cl.deleted {
			return cl
		}
	}
	return nil
}

// simPoolsNow is simPools with the pod pool's bindings.
func (s *sim) simPoolsNow() []ipam.Pool {
	out := slices.Clone(simPools)
	for uid, a := range s.claims.bindings {
		out[0].Claims = append(out[0].Claims, ipam.ClaimBinding{Namespace: "ns", Name: s.claims.names[uid], UID: uid, Addr: a})
	}
	slices.SortFunc(out[0].Claims, func(a, b ipam.ClaimBinding) int { return a.Addr.Compare(b.Addr) })
	return out
}

func (s *sim) claimRefusals() map[string]map[string]string {
	m := map[string]string{}
	for k, v := range s.claims.refused {
		m[k] = v
	}
	return map[string]map[string]string{"pod": m}
}

// claimPodMeta is the driver's pod read of a VM pod's eth0: its annotation and label, then the
// claim from the API server (claimMeta, as Service.readPod does).
func (s *sim) claimPodMeta(r PodRead, p *simPod) ipam.PodMeta {
	meta := ipam.PodMeta{NetworkAnnotations: map[string]string{ipamclaim.AnnotationPrimaryClaim: p.claim}, MigrationTarget: p.target}
	return claimMeta(context.Background(), r, meta, func(_ context.Context, _, name string) (ClaimObject, error) {
		c := s.claims.current(name)
		if c == nil {
			return ClaimObject{}, errClaimNotFound
		}
		return ClaimObject{UID: c.uid, Network: "podnet", IPs: c.ips}, nil
	})
}

// newVMPod starts a VM pod: a new claim's first pod, a restart of a claim's VM (a new pod), or
// a migration target beside a claim's running pod.
func (s *sim) newVMPod() {
	var c *simClaim
	var live []*simClaim
	for _, cl := range s.claims.all {
		if !cl.deleted {
			live = append(live, cl)
		}
	}
	if len(live) == 0 || (len(live) < 4 && s.chance(3)) {
		s.claims.next++
		c = &simClaim{name: fmt.Sprintf("vm%d", s.claims.next), uid: fmt.Sprintf("claim-uid-%d", s.claims.next)}
		s.claims.all = append(s.claims.all, c)
	} else {
		c = live[s.rng.IntN(len(live))]
	}
	running := false
	for _, p := range s.pods {
		if p.claim == c.name && p.inAPI && p.phase == "" {
			running = true
		}
	}
	target := running && !s.chance(3)
	n := len(s.pods)
	pod := &simPod{ref: ipam.PodRef{Namespace: "ns", Name: fmt.Sprintf("virt-launcher-%s-%d", c.name, n), UID: fmt.Sprintf("uid-%d", n)},
		inAPI: true, visible: !s.chance(4), claim: c.name, target: target}
	s.pods = append(s.pods, pod)
	what := map[bool]string{false: "restart", true: "migration target"}[target]
	if !running {
		what = "first start or restart"
	}
	s.logf("VM pod %s of IPAMClaim %s (%s)", pod.ref.Name, c.name, what)
	s.counts["VM pod: "+what]++
	s.startSandbox(pod)
	if s.chance(2) {
		// The ADD reads its pod at once, waits, and its KickNow has the pool monitor publish
		// the node's spec; the controller answers soon after (else later steps do, or not in
		// time: the ADD fails at --address-wait and the runtime retries with a new sandbox).
		for len(s.a.reads) > 0 {
			s.answerRead(0)
		}
		s.releaseRound()
		if s.chance(2) {
			s.controllerSync()
		}
	}
}

// claimDeleted deletes a claim; in one case in two it is re-created under its name (a new UID)
// with status.ips naming its address (an import).
func (s *sim) claimDeleted() {
	var live []*simClaim
	for _, cl := range s.claims.all {
		if !cl.deleted {
			live = append(live, cl)
		}
	}
	if len(live) == 0 {
		return
	}
	c := live[s.rng.IntN(len(live))]
	c.deleted = true
	s.logf("IPAMClaim %s (%s) deleted", c.name, c.uid)
	if s.chance(2) {
		s.claims.next++
		n := &simClaim{name: c.name, uid: fmt.Sprintf("claim-uid-%d", s.claims.next)}
		if a, ok := s.claims.bindings[c.uid]; ok {
			n.ips = []string{a.String()}
		}
		s.claims.all = append(s.claims.all, n)
		s.logf("IPAMClaim %s re-created (%s), status.ips %v", n.name, n.uid, n.ips)
		s.counts["IPAMClaim re-created"]++
	}
}

// claimController is the controller's side of the claims in a sync, before it pushes the
// node's holdings: bindings dropped and made, bound addresses granted, refusals. The agent's
// watch hands it the pools (with the bindings) before the holdings, as Kube.Push does: false
// when the pools' write was refused (Push returns; the next event retries), so the holdings are
// not pushed either.
func (s *sim) claimController() bool {
	cs := &s.claims
	var uses []ipam.ClaimUse
	for _, r := range cs.lastSpec {
		if r.Pool == "pod" {
			uses = r.Claims
		}
	}
	listed := map[string]bool{}
	for _, u := range uses {
		listed[u.Claim.UID] = true
	}
	byUID := func(uid string) *simClaim {
		for _, c := range cs.all {
			if c.uid == uid {
				return c
			}
		}
		return nil
	}
	uids := make([]string, 0, len(cs.bindings))
	for uid := range cs.bindings {
		uids = append(uids, uid)
	}
	slices.Sort(uids) // the event log is the same at every run of a seed
	for _, uid := range uids {
		if c := byUID(uid); (c == nil || c.deleted) && !listed[uid] {
			s.logf("controller: IPAMClaim %s (%s) gone and unused: binding of %s dropped", cs.names[uid], uid, cs.bindings[uid])
			delete(cs.bindings, uid)
			delete(cs.names, uid)
		}
	}
	for uid := range cs.refused {
		if !listed[uid] {
			delete(cs.refused, uid)
		}
	}
	free := addr.SetOfPrefixes(simPodPool.CIDRs[0]).Subtract(s.grants["pod"])
	for _, a := range cs.bindings {
		free = free.Subtract(addr.SetOfAddrs(a))
	}
	boundTo := func(a netip.Addr) string {
		for uid, b := range cs.bindings {
			if b == a {
				return uid
			}
		}
		return ""
	}
	for _, u := range uses {
		uid := u.Claim.UID
		if u.Attached {
			continue
		}
		if c := byUID(uid); c == nil || c.deleted {
			cs.refused[uid] = fmt.Sprintf("IPAMClaim %s no longer exists", u.Claim)
			continue
		}
		a, bound := cs.bindings[uid]
		if !bound {
			switch {
			case u.Addr.IsValid() && boundTo(u.Addr) != "":
				cs.refused[uid] = fmt.Sprintf("%s: address %s is bound to another IPAMClaim", "IPAddressConflict", u.Addr)
				continue
			case u.Addr.IsValid():
				a = u.Addr // an import: the node may hold it already
			default:
				var ok bool
				for _, c := range free.Addrs(64) {
					if t, rest := s.resting[c]; rest && s.now.Sub(t) < time.Minute {
						continue
					}
					a, ok = c, true
					break
				}
				if !ok {
					cs.refused[uid] = "SubnetExhausted: no free address in pool pod"
					continue
				}
			}
			cs.bindings[uid], cs.names[uid] = a, u.Claim.Name
			free = free.Subtract(addr.SetOfAddrs(a))
			s.logf("controller: IPAMClaim %s (%s) bound to %s", u.Claim.Name, uid, a)
		}
		if !s.grants["pod"].Contains(a) {
			s.grants["pod"] = s.grants["pod"].Union(addr.SetOfAddrs(a))
			s.logf("controller: %s granted for IPAMClaim %s", a, u.Claim.Name)
		}
	}
	if s.a.synced && !s.apiAway {
		// The record (the pool's status) first, then the node's status that grants.
		if ans, ok := s.await(s.a.m.SetPools(s.simPoolsNow(), []string{"pod", "st"}, s.now)); !ok || ans.Err != nil {
			s.logf("controller: the pools' write refused: the holdings wait for the next push")
			return false
		}
		s.a.m.SetClaimRefused(s.claimRefusals(), s.now)
		s.flush()
	}
	return true
}

// legalShare reports whether live interfaces f and o may hold one address: the agent recorded
// both for the same claim UID, and one of them is a migration target.
func legalShare(f, o *simIf) bool {
	return f.claimUID != "" && f.claimUID == o.claimUID && (f.target || o.target)
}

// claimAnswered checks a claim ADD's answer: the claim's bound address, recorded for the claim.
func (s *sim) claimAnswered(f *simIf, got netip.Addr, att *ipam.Attachment) {
	if att == nil || att.Claim == nil {
		if f.unread && f.sb.pod.claim != "" {
			// Its pod could not be read: the node handed back what the pod's earlier sandbox
			// had (recorded from its reports or the runtime's reading after a lost journal, so
			// without the claim). The oracle's other checks still hold it to one holder.
			s.counts["VM pod unreadable: its earlier address back"]++
			return
		}
		if f.sb.pod.claim != "" && f.key.IfName == "eth0" {
			s.fatalf("ADD %s of VM pod %s answered %s without its IPAMClaim %s", f.key, f.sb.pod.ref.Name, got, f.sb.pod.claim)
		}
		if uid := s.boundUID(got); uid != "" && !(att != nil && att.Key.IsRebuilt()) {
			s.fatalf("ADD %s (pod %s, no claim) answered %s, bound to IPAMClaim %s", f.key, f.sb.pod.ref.Name, got, uid)
		}
		return
	}
	f.claimUID, f.target = att.Claim.UID, att.Claim.MigrationTarget
	if b, ok := s.claims.bindings[f.claimUID]; !ok || b != got {
		s.fatalf("ADD %s of IPAMClaim %s (%s) answered %s; the claim's binding is %v (bound %v)", f.key, att.Claim.Name, f.claimUID, got, b, ok)
	}
	s.counts["claim ADD"]++
}

func (s *sim) boundUID(a netip.Addr) string {
	for uid, b := range s.claims.bindings {
		if b == a {
			return uid
		}
	}
	return ""
}

// claimFile: host-local's file of a claim attachment's address may name another interface of a
// pod of the same claim (a live migration's first holder reserved it; its answer may never have
// reached the runtime).
func (s *sim) claimFile(att ipam.Attachment, got string) bool {
	if att.Claim == nil {
		return false
	}
	for _, f := range s.ifs {
		if f.sb.pod.claim == att.Claim.Name && got == previous.OwnHostLocalContent(f.key.ContainerID, f.key.IfName) {
			return true
		}
	}
	return false
}

// claimCovered: a live migration's address, after a lost journal, is recorded (rebuilt from
// the reports) for one of its two pods: in use on the node while either runs.
func (s *sim) claimCovered(f *simIf, has func(ipam.Attachment) bool) bool {
	if f.claimUID == "" {
		return false
	}
	for _, att := range s.a.m.st.Attachments() {
		if p := s.podByUID(att.Pod.UID); p != nil && p.claim == f.sb.pod.claim && has(att) {
			s.counts["live migration's address recorded for the other pod"]++
			return true
		}
	}
	return false
}

package controller

import (
	"slices"
	"time"

	ipamclaimsv1 "github.com/k8snetworkplumbingwg/ipamclaims/pkg/crd/ipamclaims/v1alpha1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/ipamclaim"
)

// The machine's part of VM addresses (docs/design.md, "VM addresses (IPAMClaim)"): the claims
// the informer delivers, the claims' status writes (OpClaimStatus, after the binding and the
// grant landed, or after a refusal) and the release of bindings whose claim is gone, confirmed
// by a fresh LIST (OpListClaims) and never on a failed one.

// claimRun is the machine's view of one claim: the informer's object, the last answer a fill
// gave one of its uses, and its status write in flight.
type claimRun struct {
	obj   *ipamclaimsv1.IPAMClaim
	last  *ClaimAnswer
	op    uint64 // status write in flight
	again bool   // the answer or the object changed while it was in flight
}

// ClaimChanged: the IPAMClaim informer delivered obj (added or updated).
func (m *Machine) ClaimChanged(obj *ipamclaimsv1.IPAMClaim, now time.Time) {
	m.record(Input{Kind: InClaimChanged, At: now, Claim: obj})
	key := ClaimKey{obj.Namespace, obj.Name}
	r := m.claimRun(key)
	if r.obj != nil && r.obj.UID != obj.UID {
		r.last = nil // another claim under the same name
	}
	r.obj = obj
	ips, _ := ipamclaim.ParseIPs(obj.Status.IPs)
	if m.state.SetClaim(key, KnownClaim{UID: string(obj.UID), IPs: ips}) {
		m.enqueueEach(m.state.ClaimUsers(key), now)
	}
	m.syncClaim(key, now)
}

// ClaimDeleted: the IPAMClaim informer deleted namespace/name. Its bindings are released only
// once a fresh LIST confirms it and no node uses it.
func (m *Machine) ClaimDeleted(namespace, name string, now time.Time) {
	m.record(Input{Kind: InClaimDeleted, At: now, Namespace: namespace, Name: name})
	key := ClaimKey{namespace, name}
	m.state.DeleteClaim(key)
	if r := m.claims[key]; r != nil && r.op == 0 {
		delete(m.claims, key)
	} else if r != nil {
		r.obj, r.last = nil, nil
	}
	m.enqueueEach(m.state.ClaimUsers(key), now)
	m.claimCheck = true
}

func (m *Machine) claimRun(key ClaimKey) *claimRun {
	r := m.claims[key]
	if r == nil {
		r = &claimRun{}
		m.claims[key] = r
	}
	return r
}

// claimsAnswered records a fill's answers to claim uses (after its writes landed, or when it
// had nothing to write) and writes the claims' status where it differs.
func (m *Machine) claimsAnswered(alloc *ipwardenv1.NodeIPAllocation, f *Fill, now time.Time) {
	for _, pool := range sortedKeys(f.Pools) {
		for _, ans := range f.Pools[pool].ClaimAnswers {
			r := m.claimRun(ans.Key)
			if r.obj == nil || string(r.obj.UID) != ans.UID {
				continue // not this claim: never write another claim's status
			}
			if ans.Attached && r.last != nil {
				// The status follows the answers to waiting uses; an attached use may still
				// change its owner (a pod restarted on a node that kept the address: no wait).
				m.syncClaim(ans.Key, now)
				continue
			}
			if !ans.Granted && (r.last == nil || r.last.Reason != ans.Reason) {
				m.metrics.ClaimRefusals.WithLabelValues(ans.Code).Inc()
				m.event(r.obj, corev1.EventTypeWarning, ans.Code, "node %s, pod %s: %s", alloc.Name, ans.Pod, ans.Reason)
			}
			if ans.Granted && (r.last == nil || !r.last.Granted || r.last.Addr != ans.Addr) {
				m.log.Info("granted an IPAMClaim's address", "node", alloc.Name, "pod", ans.Pod, "claim", ans.Key.String(), "uid", ans.UID,
					"pool", ans.Pool, "address", ans.Addr.String(), "shared", ans.Shared)
			}
			a := ans
			r.last = &a
			m.syncClaim(ans.Key, now)
		}
	}
}

// syncClaim writes a claim's status when what the record says differs from its object.
func (m *Machine) syncClaim(key ClaimKey, now time.Time) {
	r := m.claims[key]
	if r == nil || r.obj == nil || r.last == nil || string(r.obj.UID) != r.last.UID {
		return
	}
	if r.op != 0 {
		r.again = true
		return
	}
	st := ClaimStatusFor(r.obj.Status, m.state.ClaimIPs(r.last.UID), m.state.ClaimOwner(r.last.UID, r.last.Pod), *r.last, now)
	if equality.Semantic.DeepEqual(st, r.obj.Status) {
		return
	}
	obj := r.obj.DeepCopy()
	obj.Status = st
	r.op = m.issue(opOwner{claim: key}, Op{Kind: OpClaimStatus, Claim: obj})
}

func (m *Machine) claimStatusDone(key ClaimKey, res OpResult, now time.Time) {
	r := m.claims[key]
	if r == nil {
		return
	}
	r.op = 0
	if res.Err != nil {
		// A conflict or a claim gone: the informer's next event brings the object to write
		// against; the binding in the pool is authoritative meanwhile.
		m.log.Error(res.Err, "could not write the IPAMClaim's status", "claim", key.String())
	} else if res.Claim != nil && r.obj != nil && res.Claim.UID == r.obj.UID {
		r.obj = res.Claim
	}
	if r.obj == nil && r.last == nil {
		delete(m.claims, key)
		return
	}
	if r.again && res.Err == nil {
		r.again = false
		m.syncClaim(key, now)
	}
}

// ClaimStatusFor is a claim's status after the controller's answer ans: granted, the claim's
// addresses in CIDR form (ips), the pod that uses it (owner) and IPsAllocated True; refused, the
// addresses it had (they still say what it asks for) and IPsAllocated False with the reason.
func ClaimStatusFor(prev ipamclaimsv1.IPAMClaimStatus, ips []string, owner string, ans ClaimAnswer, now time.Time) ipamclaimsv1.IPAMClaimStatus {
	st := *prev.DeepCopy()
	cond := metav1.Condition{Type: ipwardenv1.ClaimConditionIPsAllocated, LastTransitionTime: metav1.NewTime(now)}
	if ans.Granted {
		st.IPs = ips
		if owner != "" {
			st.OwnerPod = &ipamclaimsv1.OwnerPod{Name: owner}
		}
		cond.Status, cond.Reason = metav1.ConditionTrue, ipwardenv1.ClaimReasonAllocated
		cond.Message = "ipwarden bound the address to this claim in IPPool " + ans.Pool
	} else {
		cond.Status, cond.Reason, cond.Message = metav1.ConditionFalse, ans.Code, ans.Reason
	}
	if st.IPs == nil {
		st.IPs = []string{} // required by the CRD's schema
	}
	meta.SetStatusCondition(&st.Conditions, cond)
	return st
}

// requestClaimList asks for a fresh LIST of every IPAMClaim (one in flight at a time).
func (m *Machine) requestClaimList() {
	if m.claimList != 0 {
		m.claimListAgain = true
		return
	}
	m.claimList = m.issue(opOwner{claimList: true}, Op{Kind: OpListClaims})
}

// claimListDone releases the bindings of claims the LIST does not show and no node uses. A
// failed LIST releases nothing.
func (m *Machine) claimListDone(res OpResult, now time.Time) {
	m.claimList = 0
	if res.Err != nil {
		m.log.Error(res.Err, "could not list IPAMClaims; no claim binding is released until a list succeeds")
	} else {
		released := m.state.ReleaseClaims(res.ClaimUIDs)
		for _, pool := range sortedKeys(released) {
			m.log.Info("released claim bindings: the claims are gone and no node uses them; their addresses are ordinary ones now",
				"pool", pool, "uids", released[pool])
			m.poolWake = true
		}
	}
	if m.claimListAgain {
		m.claimListAgain = false
		m.requestClaimList()
	}
	_ = now
}

// checkClaims asks for a LIST when a binding's claim may be gone and no node uses it.
func (m *Machine) checkClaims() {
	m.claimCheck = false
	if m.state.ReleaseCandidates() {
		m.requestClaimList()
	}
}

// ClaimUsers lists the nodes whose spec lists a use of the claim namespace/name.
func (s *State) ClaimUsers(k ClaimKey) []string {
	var out []string
	for name, n := range s.nodes {
		for _, uses := range n.uses {
			if slices.ContainsFunc(uses, func(u ipwardenv1.ClaimUse) bool { return u.Namespace == k.Namespace && u.Name == k.Name }) {
				out = append(out, name)
				break
			}
		}
	}
	return out
}

// ClaimWaiters lists the nodes with a waiting use of a claim in pool.
func (s *State) ClaimWaiters(pool string) []string {
	p, ok := s.pools[pool]
	if !ok {
		return nil
	}
	var out []string
	for node, uses := range p.uses {
		if slices.ContainsFunc(uses, func(u ipwardenv1.ClaimUse) bool { return !u.Attached }) {
			out = append(out, node)
		}
	}
	return out
}

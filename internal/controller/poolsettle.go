package controller

import (
	"net/netip"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/ippool"
	"github.com/ipwarden/ipwarden/internal/podinfo"
)

// A pool's new addresses wait for the nodes whose pods may use them (docs/design.md, "Taking
// over from another IPAM").
//
// Running pods can use addresses ipwarden never handed out: pods of the IPAM the cluster ran
// before (host-local, Whereabouts, Calico), still running on a node whose CNI configuration was
// switched to ipwarden. Each agent records the addresses its node's running pods report inside
// any pool it knows, selected or not, and claims them (ipam.State.Rebuild, on every pod event),
// and lists the pools it did that with in spec.observedPools. A pool that appears, or gains
// addresses, while this controller leads is therefore not filled from its free part until the
// nodes that may use its new addresses have observed its new generation, or until --pool-settle
// passes (an agent that is down cannot report; the Warning event PoolSettleTimedOut names the
// nodes). Claims and take-backs are served meanwhile. Pools present when the controller starts
// leading wait for the leader's acknowledgements instead (claims.go), which the agents write with
// the same list.
//
// Which nodes (PoolWaits): a node's pods use an address of the pool's that ipwarden did not hand
// out only when the address is in its running pods' status.podIPs (the agent adopts from nothing
// else) or in its own record under another pool (a deleted pool whose addresses the new ones
// reuse). Every node that could have an agent (one some pool selects, or with a NodeIPAllocation)
// is waited for until it observed the pool; but one still silent once no node has reported the
// pool for podReadAfter (PodReadDue; its agent down or not started yet: nodes being added, a
// DaemonSet rolling out) has its pods read instead
// (one LIST of the pods bound to it), and it is waited for further only when they report an
// address the pool gained, which its agent would claim. So a node whose agent is down holds up a
// new or grown pool for podReadAfter, not --pool-settle, unless its pods use the pool's new
// addresses (a takeover from the previous IPAM); whether the pool selects it does not matter:
// the agents adopt in every pool they know.

// podReadAfter is how long a settling pool waits for a node to report before it reads that node's
// pods instead (an agent that runs reports within a second or two; reading every node's pods at
// once would cost a LIST per node for every new pool).
const podReadAfter = 2 * time.Second

// poolSettle is a pool waiting for the nodes to observe its generation.
type poolSettle struct {
	uid        string
	generation int64
	added      addr.Set // the addresses the new generation hands out that the last did not
	started    time.Time
	until      time.Time
}

// PoolSettle is one pool waiting for the nodes: its UID and generation, the addresses it gained,
// when it started waiting and until when at most.
type PoolSettle struct {
	Pool       string
	UID        string
	Generation int64
	Added      addr.Set
	Started    time.Time
	Until      time.Time
}

// PoolGrowth is the addresses obj would make its pool hand out that it does not hand out now:
// all of a pool this State does not know yet (or knows deleted or invalid), the addresses a new
// spec adds to a known one. A spec that cannot be parsed adds nothing.
func (s *State) PoolGrowth(obj *ipwardenv1.IPPool) addr.Set {
	cfg, err := ippool.Parse(obj.Spec)
	if err != nil {
		return addr.Set{}
	}
	p, known := s.pools[obj.Name]
	if !known || p.deleted || p.parseErr != nil {
		return cfg.Addresses
	}
	return cfg.Addresses.Subtract(p.cfg.Addresses)
}

// StartPoolSettle makes PlanFill hand out none of pool's free addresses until EndPoolSettle, or
// until until, whichever comes first; uid and generation are what the nodes must observe, added
// the addresses the nodes' pods may already use, started when the wait began. A pool that grows
// again while it settles waits for both growths, from the first start.
func (s *State) StartPoolSettle(pool, uid string, generation int64, added addr.Set, started, until time.Time) {
	p := s.pool(pool)
	if old := p.settle; old != nil && old.uid == uid {
		added, started = old.added.Union(added), old.started
	}
	p.settle = &poolSettle{uid: uid, generation: generation, added: added, started: started, until: until}
}

// EndPoolSettle lets PlanFill fill from pool's free addresses again.
func (s *State) EndPoolSettle(pool string) {
	if p, ok := s.pools[pool]; ok {
		p.settle = nil
	}
}

// PoolSettlingNow says whether pool has a settle that has not ended (its bound may have passed).
func (s *State) PoolSettlingNow(pool string) bool {
	p, ok := s.pools[pool]
	return ok && p.settle != nil
}

// PoolsSettling lists the pools waiting for the nodes, by name.
func (s *State) PoolsSettling() []PoolSettle {
	var out []PoolSettle
	for _, name := range sortedKeys(s.pools) {
		if st := s.pools[name].settle; st != nil {
			out = append(out, PoolSettle{Pool: name, UID: st.uid, Generation: st.generation, Added: st.added, Started: st.started, Until: st.until})
		}
	}
	return out
}

// settlingAt says whether the pool's free addresses wait for the nodes at now.
func (p *poolState) settlingAt(now time.Time) bool {
	return p.settle != nil && now.Before(p.settle.until)
}

// SettleNode is what PoolWaits knows of one existing Node.
type SettleNode struct {
	// Selected: some serving pool selects the node.
	Selected bool
	// Pods is what the node's running pods report in status.podIPs, read after the settle
	// started (nil: not read).
	Pods *addr.Set
}

// PoolWaits decides which nodes the free addresses of a settling pool (pool with uid at
// generation, added its new addresses) wait for, sorted, and which of those to read the pods of,
// sorted. allocs are the NodeIPAllocations, nodes every existing Node. A node whose
// NodeIPAllocation (not being deleted) lists the pool in spec.observedPools at that UID and
// generation or later waits for nothing: its agent claimed what its pods use. Otherwise a node
// that some serving pool selects or that has a NodeIPAllocation (an agent that may claim) is
// waited for when
//
//   - its NodeIPAllocation holds (status) or claims (spec) an address of added under another pool
//     (a deleted pool whose addresses the new ones reuse: its pods may still use them, and this
//     pool's record does not hold them; a pool deleted and created again under its own name
//     keeps its holders' addresses in its record);
//   - its pods have not been read since the settle started (read lists it);
//   - a running pod bound to it reports an address of added (a pod of the previous IPAM: its
//     agent claims it once it reports).
//
// A node no pool selects and that has no NodeIPAllocation has no agent that could claim, and a
// NodeIPAllocation without its Node waits for deletion, not for an agent: neither counts.
//
// observed counts the nodes that observed the pool: while it grows, running agents are still
// reporting, and the reads wait (PodReadDue).
func PoolWaits(allocs []ipwardenv1.NodeIPAllocation, nodes map[string]SettleNode, pool, uid string, generation int64, added addr.Set) (wait, read []string, observed int) {
	byName := make(map[string]*ipwardenv1.NodeIPAllocation, len(allocs))
	for i := range allocs {
		byName[allocs[i].Name] = &allocs[i]
	}
	for _, name := range sortedKeys(nodes) {
		n, a := nodes[name], byName[name]
		switch {
		case a == nil && !n.Selected:
		case a != nil && a.DeletionTimestamp == nil && slices.ContainsFunc(a.Spec.ObservedPools, func(o ipwardenv1.ObservedPool) bool {
			return o.Pool == pool && o.UID == uid && o.Generation >= generation
		}):
			observed++
		case a != nil && recordUses(a, pool, added):
			wait = append(wait, name)
		case n.Pods == nil:
			wait, read = append(wait, name), append(read, name)
		case n.Pods.Overlaps(added):
			wait = append(wait, name)
		}
	}
	return wait, read, observed
}

// PodReadDue is when the silent nodes of a pool settle that started at started get their pods
// read: podReadAfter after the start, or after the last time another node reported the pool
// (progress), whichever is later. While running agents are still reporting (a thousand of them
// write their specs at once), reading the pods of the nodes they have not reached yet would cost a
// LIST each and slow their reports and the fills down; once the reports have stopped for
// podReadAfter, the nodes left silent are the ones whose agents do not run.
func PodReadDue(started, progress time.Time) time.Time {
	if progress.After(started) {
		started = progress
	}
	return started.Add(podReadAfter)
}

// PodAddrs is every address the pods that may run report in status.podIPs (not finished, not on
// the host network: the pods whose addresses an agent adopts; podinfo, the one Pod conversion).
func PodAddrs(pods []corev1.Pod) addr.Set {
	var as []netip.Addr
	for i := range pods {
		if v := podinfo.Of(&pods[i]); !v.HostNetwork && !v.Finished {
			as = append(as, v.IPs...)
		}
	}
	return addr.SetOfAddrs(as...)
}

// recordUses says whether a holds or claims an address of added under a pool other than pool.
func recordUses(a *ipwardenv1.NodeIPAllocation, pool string, added addr.Set) bool {
	for _, st := range a.Status.Pools {
		if st.Pool == pool {
			continue
		}
		if held, err := addr.ParseSet(st.Addresses); err == nil && held.Overlaps(added) {
			return true
		}
	}
	for _, req := range a.Spec.Pools {
		if req.Pool == pool {
			continue
		}
		if c, err := addr.ParseSet(blocks(req.Claimed)); err == nil && c.Overlaps(added) {
			return true
		}
	}
	return false
}

package controller

import (
	"slices"
	"sort"
	"time"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/ippool"
)

// A pool's new addresses wait for the nodes (docs/design.md, "Taking over from another IPAM").
//
// Running pods can use addresses ipwarden never handed out: pods of the IPAM the cluster ran
// before (host-local, Whereabouts, Calico), still running on a node whose CNI configuration was
// switched to ipwarden. Each agent records the addresses its node's running pods report inside
// any pool it knows and claims them (ipam.State.Rebuild, on every pod event), and lists the pools
// it did that with in spec.observedPools. A pool that appears, or gains addresses, while this
// controller leads is therefore not filled from its free part until every node has observed its
// new generation, or until --pool-settle passes (an agent that is down cannot report; the Warning
// event PoolSettleTimedOut names the nodes). Claims and take-backs are served meanwhile. Pools
// present when the controller starts leading wait for the leader's acknowledgements instead
// (claims.go), which the agents write with the same list.

// poolSettle is a pool waiting for the nodes to observe its generation.
type poolSettle struct {
	uid        string
	generation int64
	until      time.Time
}

// PoolSettle is one pool waiting for the nodes: its UID and generation, and until when at most.
type PoolSettle struct {
	Pool       string
	UID        string
	Generation int64
	Until      time.Time
}

// PoolGrows says whether obj would make its pool hand out an address it does not hand out now:
// a pool this State does not know yet, or one whose new spec adds addresses. A spec that cannot
// be parsed adds nothing.
func (s *State) PoolGrows(obj *ipwardenv1.IPPool) bool {
	cfg, err := ippool.Parse(obj.Spec)
	if err != nil {
		return false
	}
	p, known := s.pools[obj.Name]
	if !known || p.deleted || p.parseErr != nil {
		return !cfg.Addresses.IsEmpty()
	}
	return !cfg.Addresses.Subtract(p.cfg.Addresses).IsEmpty()
}

// StartPoolSettle makes PlanFill hand out none of pool's free addresses until EndPoolSettle, or
// until until, whichever comes first; uid and generation are what the nodes must observe.
func (s *State) StartPoolSettle(pool, uid string, generation int64, until time.Time) {
	p := s.pool(pool)
	p.settle = &poolSettle{uid: uid, generation: generation, until: until}
}

// EndPoolSettle lets PlanFill fill from pool's free addresses again.
func (s *State) EndPoolSettle(pool string) {
	if p, ok := s.pools[pool]; ok {
		p.settle = nil
	}
}

// PoolsSettling lists the pools waiting for the nodes, by name.
func (s *State) PoolsSettling() []PoolSettle {
	var out []PoolSettle
	for _, name := range sortedKeys(s.pools) {
		if st := s.pools[name].settle; st != nil {
			out = append(out, PoolSettle{Pool: name, UID: st.uid, Generation: st.generation, Until: st.until})
		}
	}
	return out
}

// settlingAt says whether the pool's free addresses wait for the nodes at now.
func (p *poolState) settlingAt(now time.Time) bool {
	return p.settle != nil && now.Before(p.settle.until)
}

// PoolUnobserved lists, sorted, the nodes that have not observed generation of the pool with uid:
// nodes maps every existing Node to whether a serving pool selects it (as for Unacknowledged).
// A node counts when it exists and its NodeIPAllocation's spec.observedPools lacks the pool at
// that UID and generation or later, or when a pool selects it and its NodeIPAllocation is missing
// or being deleted (its agent has nowhere to report). A node no pool selects and that has no
// NodeIPAllocation has no agent that could report, and does not count.
func PoolUnobserved(allocs []ipwardenv1.NodeIPAllocation, nodes map[string]bool, pool, uid string, generation int64) []string {
	var out []string
	has := map[string]bool{}
	for i := range allocs {
		a := &allocs[i]
		if _, exists := nodes[a.Name]; !exists {
			continue
		}
		if a.DeletionTimestamp == nil {
			has[a.Name] = true
			if slices.ContainsFunc(a.Spec.ObservedPools, func(o ipwardenv1.ObservedPool) bool {
				return o.Pool == pool && o.UID == uid && o.Generation >= generation
			}) {
				continue
			}
		}
		out = append(out, a.Name)
	}
	for name, selected := range nodes {
		if selected && !has[name] && !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	sort.Strings(out)
	return out
}

// Package usage computes ipwarden's usage view (`ipwarden usage`, `ipwarden who`) from one
// snapshot of the API objects and, where asked, the agents' attachment lists (the snapshot
// package check collects). It is pure: the command reads, this package decides what to show.
package usage

import (
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"time"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/check"
	"github.com/ipwarden/ipwarden/internal/ippool"
)

// Where the in-use counts come from.
const (
	FromPods  = "pods"  // running pods' status.podIPs (what the kubelet reported)
	FromAgent = "agent" // the node agent's attachments (its journal)
)

// Pool is one row of the pool view. Capacity = Free + Allocated (of the pool's addresses) +
// addresses held outside the pool's current spec, which drain; Reserved are the addresses of the
// CIDRs that are never handed out (exclusions, network and broadcast, the gateway).
type Pool struct {
	Name string `json:"name"`
	// Capacity: addresses the pool can hand out (CIDRs minus exclusions and reserved addresses).
	Capacity int64 `json:"capacity"`
	// Allocated: held by nodes or cooling down.
	Allocated int64 `json:"allocated"`
	// Held: in some node's NodeIPAllocation status.
	Held int64 `json:"held"`
	// InUse: held addresses a pod uses (its status.podIPs, or its node agent's attachments).
	InUse int64 `json:"inUse"`
	// Free: neither held nor cooling.
	Free int64 `json:"free"`
	// Cooling: released addresses inside the reuse cooldown.
	Cooling int64 `json:"cooling"`
	// Reserved: never handed out (exclusions, network/broadcast, first IPv6 address, gateway).
	Reserved  int64 `json:"reserved"`
	Exhausted bool  `json:"exhausted"`
	// Nodes holding addresses of the pool.
	Nodes int `json:"nodes"`
	// Invalid says why the spec does not parse ("" when it does); the counts then cover its CIDRs.
	Invalid string `json:"invalid,omitempty"`
}

// Node is one row of the node view: a node's share of one pool.
type Node struct {
	Node string `json:"node"`
	Pool string `json:"pool"`
	// Held: in the node's status; Requested: its spec (the agent's scaling target).
	Held      int64 `json:"held"`
	InUse     int64 `json:"inUse"`
	Requested int32 `json:"requested"`
	Releasing int64 `json:"releasing"`
	// Runs: contiguous ranges the held addresses form (1 is one route per node; more is
	// fragmentation).
	Runs int `json:"runs"`
	// Source of InUse: FromPods or FromAgent.
	Source string `json:"source"`
}

// Holder is a pod (or an agent's attachment) using an address.
type Holder struct {
	Node        string `json:"node"`
	Pod         string `json:"pod,omitempty"` // namespace/name
	ContainerID string `json:"containerID,omitempty"`
	Source      string `json:"source"`
}

// States of an address, as `ipwarden who` reports them.
const (
	StateHeld     = "held"     // in a node's status
	StateFree     = "free"     // in a pool, neither held nor cooling
	StateCooling  = "cooling"  // released, inside the reuse cooldown
	StateExcluded = "excluded" // in a pool's spec.exclude
	StateReserved = "reserved" // network, broadcast, first IPv6 address or gateway
	StateNoPool   = "no-pool"  // in no IPPool's CIDRs
	// StateUnheld: a pod uses it but no node holds it (ipwarden check reports it).
	StateUnheld = "in-use-not-held"
)

// Who is the answer about one address.
type Who struct {
	Address string `json:"address"`
	Pool    string `json:"pool,omitempty"`
	State   string `json:"state"`
	// Nodes whose status holds it (more than one is a problem ipwarden check reports).
	Nodes        []string   `json:"nodes,omitempty"`
	Holders      []Holder   `json:"holders,omitempty"`
	CoolingUntil *time.Time `json:"coolingUntil,omitempty"`
	// Detail says it in words.
	Detail string `json:"detail"`
}

type poolInfo struct {
	obj      *ipwardenv1.IPPool
	cidrs    addr.Set
	usable   addr.Set // what it hands out
	excluded addr.Set
	reserved addr.Set
	invalid  string
}

func parsePools(pools []ipwardenv1.IPPool) []poolInfo {
	out := make([]poolInfo, 0, len(pools))
	for i := range pools {
		p := &pools[i]
		pi := poolInfo{obj: p}
		var prefixes []netip.Prefix
		for _, c := range p.Spec.CIDRs {
			if pr, err := netip.ParsePrefix(string(c)); err == nil {
				prefixes = append(prefixes, pr.Masked())
				pi.cidrs = pi.cidrs.Union(addr.SetOfPrefixes(pr.Masked()))
			}
		}
		for _, e := range p.Spec.Exclude {
			if s, err := addr.ParseSet([]string{string(e)}); err == nil {
				pi.excluded = pi.excluded.Union(s.Intersect(pi.cidrs))
			}
		}
		gw, _ := netip.ParseAddr(string(p.Spec.Gateway))
		pi.reserved = ippool.Reserved(prefixes, gw).Intersect(pi.cidrs).Subtract(pi.excluded)
		if cfg, err := ippool.Parse(p.Spec); err == nil {
			pi.usable = cfg.Addresses
		} else {
			pi.invalid = err.Error()
			pi.usable = pi.cidrs.Subtract(pi.excluded).Subtract(pi.reserved)
		}
		out = append(out, pi)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].obj.Name < out[j].obj.Name })
	return out
}

// cooling returns a pool's addresses still cooling at now, and until when each block cools.
func cooling(p *ipwardenv1.IPPool, now time.Time) (addr.Set, []coolBlock) {
	var all addr.Set
	var blocks []coolBlock
	for _, b := range p.Status.Cooling {
		if !b.Until.Time.After(now) {
			continue
		}
		s, err := addr.ParseSet(b.Addresses)
		if err != nil {
			continue
		}
		all = all.Union(s)
		blocks = append(blocks, coolBlock{s, b.Until.Time})
	}
	return all, blocks
}

type coolBlock struct {
	set   addr.Set
	until time.Time
}

func size(s addr.Set) int64 { return s.Size().Int64Sat() }

// nodeUse returns, per node, the addresses its pods use and where that came from: the node's
// agent's attachments when it was asked, else its running pods' status.podIPs.
func nodeUse(in check.Input) (map[string]addr.Set, map[string]string) {
	use, src := map[string]addr.Set{}, map[string]string{}
	for _, p := range in.Pods {
		if !p.Running {
			continue
		}
		if _, asked := in.Attachments[p.Node]; asked {
			continue
		}
		use[p.Node] = use[p.Node].Union(addr.SetOfAddrs(p.IPs...))
		src[p.Node] = FromPods
	}
	for node, atts := range in.Attachments {
		var s addr.Set
		for _, a := range atts {
			s = s.Union(addr.SetOfAddrs(a.Addrs...))
		}
		use[node], src[node] = s, FromAgent
	}
	return use, src
}

// heldBy returns each node's held addresses per pool, from the statuses.
func heldBy(allocs []ipwardenv1.NodeIPAllocation) map[string]map[string]addr.Set {
	out := map[string]map[string]addr.Set{}
	for _, a := range allocs {
		for _, ps := range a.Status.Pools {
			s, err := addr.ParseSet(ps.Addresses)
			if err != nil {
				continue
			}
			if out[a.Name] == nil {
				out[a.Name] = map[string]addr.Set{}
			}
			out[a.Name][ps.Pool] = out[a.Name][ps.Pool].Union(s)
		}
	}
	return out
}

// Pools computes the pool view.
func Pools(in check.Input) []Pool {
	held := heldBy(in.Allocs)
	use, _ := nodeUse(in)
	var rows []Pool
	for _, pi := range parsePools(in.Pools) {
		name := pi.obj.Name
		var h, inUse addr.Set
		nodes := 0
		for node, pools := range held {
			s, ok := pools[name]
			if !ok || s.IsEmpty() {
				continue
			}
			nodes++
			h = h.Union(s)
			inUse = inUse.Union(s.Intersect(use[node]))
		}
		cool, _ := cooling(pi.obj, in.Now)
		cool = cool.Subtract(h) // a claim granted back during its cooldown is held
		allocated := h.Union(cool)
		rows = append(rows, Pool{
			Name:      name,
			Capacity:  size(pi.usable),
			Allocated: size(allocated),
			Held:      size(h),
			InUse:     size(inUse),
			Free:      size(pi.usable.Subtract(allocated)),
			Cooling:   size(cool),
			Reserved:  size(pi.excluded.Union(pi.reserved)),
			Exhausted: pi.obj.Status.Exhausted,
			Nodes:     nodes,
			Invalid:   pi.invalid,
		})
	}
	return rows
}

// Nodes computes the node view: one row per node and pool it holds from or requests from,
// sorted by node then pool.
func Nodes(in check.Input) []Node {
	held := heldBy(in.Allocs)
	use, src := nodeUse(in)
	var rows []Node
	for _, a := range in.Allocs {
		type acc struct {
			held, releasing addr.Set
			requested       int32
		}
		pools := map[string]*acc{}
		get := func(p string) *acc {
			if pools[p] == nil {
				pools[p] = &acc{}
			}
			return pools[p]
		}
		for p, s := range held[a.Name] {
			get(p).held = s
		}
		for _, r := range a.Spec.Pools {
			x := get(r.Pool)
			x.requested = r.Requested
			items := make([]string, len(r.Releasing))
			for i, b := range r.Releasing {
				items[i] = string(b)
			}
			if s, err := addr.ParseSet(items); err == nil {
				x.releasing = s
			}
		}
		source := src[a.Name]
		if source == "" {
			source = FromPods
			if _, asked := in.Attachments[a.Name]; asked {
				source = FromAgent
			}
		}
		for p, x := range pools {
			rows = append(rows, Node{Node: a.Name, Pool: p, Held: size(x.held), InUse: size(x.held.Intersect(use[a.Name])),
				Requested: x.requested, Releasing: size(x.releasing), Runs: x.held.NumRanges(), Source: source})
		}
	}
	sort.Slice(rows, func(i, j int) bool {
		if rows[i].Node != rows[j].Node {
			return rows[i].Node < rows[j].Node
		}
		return rows[i].Pool < rows[j].Pool
	})
	return rows
}

// WhoHolds says who holds a, or why nobody does.
func WhoHolds(in check.Input, a netip.Addr) Who {
	a = a.Unmap()
	w := Who{Address: a.String()}
	one := addr.SetOfAddrs(a)
	for node, pools := range heldBy(in.Allocs) {
		for pool, s := range pools {
			if s.Contains(a) {
				w.Nodes = append(w.Nodes, node)
				w.Pool = pool
			}
		}
	}
	slices.Sort(w.Nodes)
	for _, p := range in.Pods {
		if _, asked := in.Attachments[p.Node]; asked || !p.Running || !slices.Contains(p.IPs, a) {
			continue
		}
		w.Holders = append(w.Holders, Holder{Node: p.Node, Pod: p.Namespace + "/" + p.Name, Source: FromPods})
	}
	for node, atts := range in.Attachments {
		for _, at := range atts {
			if slices.Contains(at.Addrs, a) {
				h := Holder{Node: node, ContainerID: at.ContainerID, Source: FromAgent}
				if at.PodName != "" {
					h.Pod = at.PodNamespace + "/" + at.PodName
				}
				w.Holders = append(w.Holders, h)
			}
		}
	}
	sort.Slice(w.Holders, func(i, j int) bool {
		if w.Holders[i].Node != w.Holders[j].Node {
			return w.Holders[i].Node < w.Holders[j].Node
		}
		return w.Holders[i].Pod+w.Holders[i].ContainerID < w.Holders[j].Pod+w.Holders[j].ContainerID
	})
	var pool *poolInfo
	pools := parsePools(in.Pools)
	for i := range pools {
		if pools[i].cidrs.Contains(a) {
			pool = &pools[i]
			break
		}
	}
	if pool != nil && w.Pool == "" {
		w.Pool = pool.obj.Name
	}
	pods := func() string {
		var s []string
		for _, h := range w.Holders {
			if h.Pod != "" {
				s = append(s, h.Pod)
			} else {
				s = append(s, "container "+h.ContainerID)
			}
		}
		return strings.Join(s, ", ")
	}
	switch {
	case len(w.Nodes) > 0:
		w.State = StateHeld
		switch {
		case len(w.Nodes) > 1:
			w.Detail = fmt.Sprintf("held by %d nodes at once (%s): run ipwarden check", len(w.Nodes), strings.Join(w.Nodes, ", "))
		case len(w.Holders) == 0:
			w.Detail = fmt.Sprintf("held by node %s, not used by any pod (the node's spare)", w.Nodes[0])
		default:
			w.Detail = fmt.Sprintf("held by node %s, used by %s", w.Nodes[0], pods())
		}
	case pool == nil:
		w.State = StateNoPool
		w.Detail = "in no IPPool's CIDRs"
		if len(w.Holders) > 0 {
			w.Detail += fmt.Sprintf(" (used by %s: another IPAM's address)", pods())
		}
	case len(w.Holders) > 0:
		w.State = StateUnheld
		w.Detail = fmt.Sprintf("used by %s but held by no node: run ipwarden check", pods())
	case pool.excluded.Contains(a):
		w.State = StateExcluded
		w.Detail = fmt.Sprintf("excluded by pool %s (spec.exclude)", pool.obj.Name)
	case pool.reserved.Contains(a):
		w.State = StateReserved
		w.Detail = fmt.Sprintf("reserved in pool %s (network, broadcast, first IPv6 address or gateway): never handed out", pool.obj.Name)
	default:
		_, blocks := cooling(pool.obj, in.Now)
		for _, b := range blocks {
			if b.set.ContainsSet(one) {
				until := b.until.UTC()
				if w.CoolingUntil == nil || until.After(*w.CoolingUntil) {
					w.CoolingUntil = &until
				}
			}
		}
		if w.CoolingUntil != nil {
			w.State = StateCooling
			w.Detail = fmt.Sprintf("released; cooling until %s (in %s)", w.CoolingUntil.Format(time.RFC3339),
				w.CoolingUntil.Sub(in.Now).Round(time.Second))
		} else {
			w.State = StateFree
			w.Detail = fmt.Sprintf("free in pool %s", pool.obj.Name)
		}
	}
	return w
}

// Package check is ipwarden's consistency checker: given a snapshot of the API objects (and, where
// reachable, the agents' attachment lists) it reports every violation of the invariants in
// docs/design.md. It is pure; `ipwarden check` and the chaos suite feed it.
package check

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"sort"
	"time"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/ippool"
)

// Pod is what the checker needs of a Pod.
type Pod struct {
	Namespace, Name, UID, Node string
	IPs                        []netip.Addr
	// Running: scheduled, not finished, not being deleted, not host-network (it owns its IPs).
	Running bool
}

// Attachment is one pod interface an agent has handed addresses to.
type Attachment struct {
	Node         string
	ContainerID  string
	IfName       string
	PodNamespace string
	PodName      string
	PodUID       string
	Addrs        []netip.Addr
	// Pool is the pool of the attachment's first address ("" when the agent does not say): its
	// spec.network says which network the addresses are on.
	Pool string
	// AddrPools is the pool of each address of Addrs where the agent says (a journal rebuilt
	// from the pods' reports attaches one pod's addresses on several networks under one key);
	// an address without one is in Pool.
	AddrPools []string
	Created   time.Time
	// Sandbox is what the agent sees of the network namespace recorded at ADD: "gone",
	// "exists", "unknown" or "unrecorded" ("" from an agent that does not say).
	Sandbox string
	Netns   string
	// Claims are the UIDs of the IPAMClaims the attachment's addresses are bound for (nil when
	// the agent does not say; empty when it uses none).
	Claims []string
}

// Input is one snapshot. List pods before NodeIPAllocations and NodeIPAllocations before Nodes,
// so that objects created during the snapshot cannot look inconsistent.
type Input struct {
	Pools  []ipwardenv1.IPPool
	Allocs []ipwardenv1.NodeIPAllocation
	Nodes  []string
	Pods   []Pod
	// Attachments by node, for the nodes whose agent answered; nil when none was asked.
	Attachments map[string][]Attachment
	// Now and Grace: an attachment younger than Grace is never reported as leaked (its pod may
	// be too new for the snapshot).
	Now   time.Time
	Grace time.Duration
	// Claims are the IPAMClaims (nil: not read, e.g. the CRD is not installed).
	Claims []ClaimRef
}

// Finding is one problem.
type Finding struct {
	Kind      string   `json:"kind"`
	Addresses string   `json:"addresses"`
	Nodes     []string `json:"nodes,omitempty"`
	Pool      string   `json:"pool,omitempty"`
	Pod       string   `json:"pod,omitempty"`
	Detail    string   `json:"detail"`
}

// Kinds of findings.
const (
	HeldTwice         = "HeldTwice"         // an address in two nodes' status (invariant 1)
	AttachedTwice     = "AttachedTwice"     // an address on two attachments or two running pods (invariant 1)
	OutsidePool       = "OutsidePool"       // a node holds addresses outside the pool's CIDRs minus exclusions
	PodAddressNotHeld = "PodAddressNotHeld" // a running pod's address is not held by its node (invariant 3)
	OrphanAllocation  = "OrphanAllocation"  // a NodeIPAllocation whose Node is gone (invariant 5)
	LeakedAttachment  = "LeakedAttachment"  // an attachment whose pod is gone (invariant 5)
	UnknownPool       = "UnknownPool"       // a node holds addresses of a pool that does not exist
	// PodAddressNotAttached: a running pod's address has no attachment on its node (its agent
	// would hand it out again: what comes before a duplicate).
	PodAddressNotAttached = "PodAddressNotAttached"
	// SandboxGone: an attachment whose sandbox's network namespace is gone (the runtime never
	// called DEL); its address is held for nothing.
	SandboxGone = "SandboxGone"
	// ClaimConflict (claims.go): a node's pods use an address another node holds.
)

// Report is the checker's result.
type Report struct {
	Pools        int            `json:"pools"`
	Nodes        int            `json:"nodes"`
	Held         int64          `json:"heldAddresses"`
	RunningPods  int            `json:"runningPods"`
	Attachments  int            `json:"attachments"`
	AgentsAsked  int            `json:"agentsAsked"`
	Findings     []Finding      `json:"findings"`
	CountsByKind map[string]int `json:"countsByKind"`
	// Sticky lists the addresses pools reserve for StatefulSet pod identities (status.sticky).
	Sticky []StickyReservation `json:"sticky,omitempty"`
	// OutsidePools counts running pods with an address outside every pool: another IPAM's
	// (a cluster moving to ipwarden), not ipwarden's to hand out or to check. Not a finding.
	OutsidePools int `json:"outsidePools,omitempty"`
	// OutsidePoolsExample is one of them, "namespace/name address".
	OutsidePoolsExample string `json:"outsidePoolsExample,omitempty"`
}

// StickyReservation is an address a pool reserves for a StatefulSet pod identity.
type StickyReservation struct {
	Pool     string `json:"pool"`
	Identity string `json:"identity"` // namespace/statefulset-ordinal
	Address  string `json:"address"`
}

// OK says whether the snapshot is consistent.
func (r Report) OK() bool { return len(r.Findings) == 0 }

// Check inspects one snapshot.
func Check(in Input) Report {
	r := Report{Pools: len(in.Pools), Nodes: len(in.Allocs), AgentsAsked: len(in.Attachments), CountsByKind: map[string]int{}}
	add := func(f Finding) {
		r.Findings = append(r.Findings, f)
		r.CountsByKind[f.Kind]++
	}

	pools := map[string]addr.Set{} // pool -> its addresses
	network := map[string]string{} // pool -> its spec.network: pools of different networks may share addresses
	var poolCIDRs addr.Set         // all pools' CIDRs: pod IPs outside them are another IPAM's
	for _, p := range in.Pools {
		var cidrs addr.Set
		for _, c := range p.Spec.CIDRs {
			if pr, err := netip.ParsePrefix(string(c)); err == nil {
				cidrs = cidrs.Union(addr.SetOfPrefixes(pr.Masked()))
			}
		}
		poolCIDRs = poolCIDRs.Union(cidrs)
		network[p.Name] = p.Spec.Network
		for _, e := range p.Status.Sticky {
			r.Sticky = append(r.Sticky, StickyReservation{Pool: p.Name, Address: string(e.Address),
				Identity: fmt.Sprintf("%s/%s-%d", e.Namespace, e.StatefulSet, e.Ordinal)})
		}
		// What the controller hands out: CIDRs minus exclusions and reserved addresses.
		if cfg, err := ippool.Parse(p.Spec); err == nil {
			pools[p.Name] = cfg.Addresses
		} else {
			pools[p.Name] = cidrs
		}
	}

	// Addresses bound to IPAMClaims, by network (ipamclaims.go).
	bound := claimIndex(in, network, add)

	// Who holds what, and twice-held addresses.
	nodeHeld := map[string]addr.Set{}
	all := map[string]addr.Set{}     // network -> every address held on it
	owner := map[string][]ownedSet{} // network -> who holds what
	allocs := append([]ipwardenv1.NodeIPAllocation(nil), in.Allocs...)
	sort.Slice(allocs, func(i, j int) bool { return allocs[i].Name < allocs[j].Name })
	for _, a := range allocs {
		for _, ps := range a.Status.Pools {
			s, err := addr.ParseSet(ps.Addresses)
			if err != nil {
				add(Finding{Kind: OutsidePool, Nodes: []string{a.Name}, Pool: ps.Pool, Addresses: fmt.Sprint(ps.Addresses),
					Detail: fmt.Sprintf("status does not parse: %v", err)})
				continue
			}
			n, _ := s.Size().Uint64()
			r.Held += int64(n)
			// An address is held twice only within one network (IPPool spec.network).
			net := network[ps.Pool]
			if dup := all[net].Intersect(s); !dup.IsEmpty() && !sharedHeld(bound[net], owner[net], a.Name, dup) {
				add(Finding{Kind: HeldTwice, Addresses: dup.String(), Nodes: append(holders(owner[net], dup), a.Name), Pool: ps.Pool,
					Detail: "held by two nodes"})
			}
			all[net] = all[net].Union(s)
			owner[net] = append(owner[net], ownedSet{a.Name, s})
			nodeHeld[a.Name] = nodeHeld[a.Name].Union(s)
			pool, ok := pools[ps.Pool]
			if !ok {
				add(Finding{Kind: UnknownPool, Addresses: s.String(), Nodes: []string{a.Name}, Pool: ps.Pool,
					Detail: "the node holds addresses of a pool that does not exist; they return when its agent releases them"})
				continue
			}
			if out := s.Subtract(pool); !out.IsEmpty() {
				add(Finding{Kind: OutsidePool, Addresses: out.String(), Nodes: []string{a.Name}, Pool: ps.Pool,
					Detail: "held outside the pool's cidrs minus exclusions and reserved addresses (after a shrink they drain as the node releases them)"})
			}
		}
	}

	// NodeIPAllocations of deleted Nodes.
	nodes := map[string]bool{}
	for _, n := range in.Nodes {
		nodes[n] = true
	}
	for _, a := range allocs {
		if !nodes[a.Name] {
			add(Finding{Kind: OrphanAllocation, Addresses: nodeHeld[a.Name].String(), Nodes: []string{a.Name},
				Detail: "the Node is gone but its NodeIPAllocation remains; the controller returns its addresses"})
		}
	}

	// Running pods: their addresses are held by their node, and no two share one.
	podUIDs := map[string]bool{}
	byIP := map[netip.Addr]string{}
	podsOn := map[netip.Addr]int{}
	for _, p := range in.Pods {
		podUIDs[p.UID] = true
		if !p.Running {
			continue
		}
		r.RunningPods++
		id := p.Namespace + "/" + p.Name
		outside := false
		for _, ip := range p.IPs {
			if !poolCIDRs.Contains(ip) {
				if !outside && r.OutsidePoolsExample == "" {
					r.OutsidePoolsExample = id + " " + ip.String()
				}
				outside = true
				continue
			}
			podsOn[ip]++
			if other, ok := byIP[ip]; ok {
				switch net := podNetwork(bound, ip); {
				case claimPair(bound, net, ip, podsOn[ip]):
					// a live migration's source and target
				case isBound(bound, ip):
					add(Finding{Kind: ClaimOverShared, Addresses: ip.String(), Pod: id, Nodes: []string{p.Node},
						Detail: "a claim's address used by a third running pod (also " + other + ")"})
				case !isBound(bound, ip):
					add(Finding{Kind: AttachedTwice, Addresses: ip.String(), Pod: id, Nodes: []string{p.Node},
						Detail: "also the address of running pod " + other})
				}
			}
			byIP[ip] = id
			if !nodeHeld[p.Node].Contains(ip) {
				add(Finding{Kind: PodAddressNotHeld, Addresses: ip.String(), Pod: id, Nodes: []string{p.Node},
					Detail: "the running pod's address is not in its node's NodeIPAllocation status"})
			}
		}
		if outside {
			r.OutsidePools++
		}
	}

	// Agents' attachments.
	attached := map[string]addr.Set{} // network -> addresses attached on it
	attachments := map[string]map[netip.Addr]int{}
	attachedOn := map[string]addr.Set{}
	nodesAsked := make([]string, 0, len(in.Attachments))
	for n := range in.Attachments {
		nodesAsked = append(nodesAsked, n)
	}
	sort.Strings(nodesAsked)
	for _, node := range nodesAsked {
		var shares claimShares // DRA reservations (dra.go)
		for _, at := range reservationsFirst(in.Attachments[node]) {
			r.Attachments++
			s := addr.SetOfAddrs(at.Addrs...)
			who := fmt.Sprintf("%s/%s (container %s, %s)", at.PodNamespace, at.PodName, short(at.ContainerID), at.IfName)
			byNet := map[string]addr.Set{}
			for i, a := range at.Addrs {
				if shares.exempt(at, a) {
					continue // its own reservation's address
				}
				pool := at.Pool
				if i < len(at.AddrPools) && at.AddrPools[i] != "" {
					pool = at.AddrPools[i]
				}
				byNet[network[pool]] = byNet[network[pool]].Union(addr.SetOfAddrs(a))
			}
			for _, net := range slices.Sorted(maps.Keys(byNet)) {
				on := byNet[net]
				if attachments[net] == nil {
					attachments[net] = map[netip.Addr]int{}
				}
				for _, a := range on.Addrs(1024) {
					attachments[net][a]++
				}
				if dup := attached[net].Intersect(on); !dup.IsEmpty() {
					var twice, over addr.Set
					for _, a := range dup.Addrs(1024) {
						switch n := attachments[net][a]; {
						case claimPair(bound, net, a, n):
						case isBoundOn(bound, net, a):
							over = over.Union(addr.SetOfAddrs(a))
						default:
							twice = twice.Union(addr.SetOfAddrs(a))
						}
					}
					if count(dup) > 1024 {
						twice = dup
					}
					if !twice.IsEmpty() {
						add(Finding{Kind: AttachedTwice, Addresses: twice.String(), Nodes: []string{node}, Pod: who, Detail: "on two attachments"})
					}
					if !over.IsEmpty() {
						add(Finding{Kind: ClaimOverShared, Addresses: over.String(), Nodes: []string{node}, Pod: who, Detail: "a claim's address on a third attachment"})
					}
				}
				misused(bound, net, at, on, node, who, add)
				attached[net] = attached[net].Union(on)
			}
			attachedOn[node] = attachedOn[node].Union(s)
			if at.Sandbox == "gone" && in.Now.Sub(at.Created) >= in.Grace {
				add(Finding{Kind: SandboxGone, Addresses: s.String(), Nodes: []string{node}, Pod: who,
					Detail: fmt.Sprintf("the sandbox's network namespace %s is gone but the address is still attached: the runtime never called DEL (leak collection frees it once the pod is gone)", at.Netns)})
			}
			if out := s.Subtract(nodeHeld[node]); !out.IsEmpty() {
				add(Finding{Kind: PodAddressNotHeld, Addresses: out.String(), Nodes: []string{node}, Pod: who,
					Detail: "attached but not in the node's NodeIPAllocation status"})
			}
			if at.PodUID != "" && !podUIDs[at.PodUID] && in.Now.Sub(at.Created) >= in.Grace {
				add(Finding{Kind: LeakedAttachment, Addresses: s.String(), Nodes: []string{node}, Pod: who,
					Detail: fmt.Sprintf("pod UID %s no longer exists", at.PodUID)})
			}
		}
	}
	// Running pods on the nodes whose agents answered: each address has an attachment there.
	for _, p := range in.Pods {
		_, asked := in.Attachments[p.Node]
		if !p.Running || !asked {
			continue
		}
		for _, ip := range p.IPs {
			if poolCIDRs.Contains(ip) && !attachedOn[p.Node].Contains(ip) {
				add(Finding{Kind: PodAddressNotAttached, Addresses: ip.String(), Pod: p.Namespace + "/" + p.Name, Nodes: []string{p.Node},
					Detail: "the running pod's address has no attachment on its node: the agent may hand it to another pod"})
			}
		}
	}
	for _, f := range claimConflicts(in, nodeHeld) {
		add(f)
	}
	claimChecks(in, bound, owner, add)
	return r
}

type ownedSet struct {
	node string
	set  addr.Set
}

func holders(owners []ownedSet, s addr.Set) []string {
	var out []string
	for _, o := range owners {
		if o.set.Overlaps(s) {
			out = append(out, o.node)
		}
	}
	return out
}

func short(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}

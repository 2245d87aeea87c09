package ipam

import (
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/ippool"
	"github.com/ipwarden/ipwarden/internal/podinfo"
	"github.com/ipwarden/ipwarden/internal/scaling"
	"github.com/ipwarden/ipwarden/internal/sticky"
)

// Key identifies one CNI attachment: a container's interface.
type Key struct {
	ContainerID string `json:"containerID"`
	IfName      string `json:"ifname"`
}

// String returns "containerID/ifname".
func (k Key) String() string { return k.ContainerID + "/" + k.IfName }

// rebuiltPrefix starts the container ID of attachments rebuilt from a pod's status.podIPs. The
// colon cannot appear in a CNI container ID, so no CNI request can name such a key.
const rebuiltPrefix = "rebuilt:"

// RebuiltKey is the key of the attachment rebuilt for the pod with uid, whose container ID is
// unknown.
func RebuiltKey(uid string) Key { return Key{ContainerID: rebuiltPrefix + uid, IfName: "-"} }

// IsRebuilt reports whether k is a RebuiltKey.
func (k Key) IsRebuilt() bool { return strings.HasPrefix(k.ContainerID, rebuiltPrefix) }

// PodRef names the pod an attachment belongs to (from CNI_ARGS K8S_POD_NAMESPACE, K8S_POD_NAME
// and K8S_POD_UID). Any field may be empty when the runtime did not pass it.
type PodRef struct {
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name,omitempty"`
	UID       string `json:"uid,omitempty"`
}

// String returns "namespace/name" or "" when the name is unknown.
func (p PodRef) String() string {
	if p.Name == "" {
		return ""
	}
	return p.Namespace + "/" + p.Name
}

// Address is one address of one pool.
type Address struct {
	Pool string     `json:"pool"`
	Addr netip.Addr `json:"addr"`
}

// Attachment is one CNI attachment and the addresses it holds, one per pool.
type Attachment struct {
	Key Key `json:"key"`
	// Network is the CNI network name the attachment was made for; GC only considers
	// attachments of its own network.
	Network string `json:"network,omitempty"`
	Pod     PodRef `json:"pod"`
	// Addresses holds one address per pool, in the order the pools were requested.
	Addresses []Address `json:"addresses"`
	// Created is when the attachment was recorded.
	Created time.Time `json:"created"`
	// Rebuilt is set for attachments recorded from a pod's status.podIPs because the journal
	// had lost them; their container ID is unknown (see RebuiltKey).
	Rebuilt bool `json:"rebuilt,omitempty"`
	// Netns is the network namespace path the runtime passed in CNI_NETNS: the leak collector
	// frees a gone pod's attachment at once only when this path no longer exists (package gc).
	// Empty in journals written before it was recorded.
	Netns string `json:"netns,omitempty"`
	// Previous is where the attachment's addresses were made unavailable in the previous IPAM's
	// own store before its ADD was answered (its configuration named "previous"); freeing the
	// attachment removes them there. Nil when none were.
	Previous *PreviousStore `json:"previous,omitempty"`
	// Claim is the IPAMClaim the attachment's pod referenced at ADD (claim.go): its addresses
	// are the claim's. Nil when none (and in journals written before claims).
	Claim *ClaimRef `json:"claim,omitempty"`
	// DRA is set on a DRA reservation (dra.go): the ResourceClaim, request and device it is
	// for. Nil on every other attachment (a pod's attachment that shares a reservation's
	// address included).
	DRA *ClaimDevice `json:"dra,omitempty"`
}

// PreviousStore is the store of a previous IPAM that ipwarden writes its own reservations into
// (package previous, reserve.go).
type PreviousStore struct {
	// Kind is "host-local" or "whereabouts".
	Kind string `json:"kind"`
	// Dir is host-local's directory of the network's reservations, <dataDir>/<network>.
	Dir string `json:"dir,omitempty"`
}

// clone returns a deep copy of a.
func (a *Attachment) clone() *Attachment {
	c := *a
	c.Addresses = slices.Clone(a.Addresses)
	if a.Claim != nil {
		cl := *a.Claim
		c.Claim = &cl
	}
	if a.DRA != nil {
		d := *a.DRA
		c.DRA = &d
	}
	return &c
}

// Route is a route returned to the pod.
type Route = ippool.Route

// Pool is the part of an IPPool the agent needs.
type Pool struct {
	Name string `json:"name"`
	// CIDRs give each address its prefix length in the CNI result.
	CIDRs   []netip.Prefix `json:"cidrs"`
	Gateway netip.Addr     `json:"gateway,omitzero"`
	// Exclude is spec.exclude: addresses never handed out.
	Exclude  []netip.Prefix `json:"exclude,omitempty"`
	Routes   []Route        `json:"routes,omitempty"`
	Scaling  scaling.Params `json:"scaling"`
	Cooldown time.Duration  `json:"cooldown"`
	// Exhausted mirrors the IPPool's status.exhausted.
	Exhausted bool `json:"exhausted,omitempty"`
	// NamespaceSelector is spec.namespaceSelector in label selector syntax ("" admits every
	// namespace), so an agent serving from its journal enforces it too.
	NamespaceSelector string `json:"namespaceSelector,omitempty"`
	// Network is spec.network ("" for the pod network): an attachment draws only from pools
	// of the network its CNI configuration names.
	Network string `json:"network,omitempty"`
	// Sticky is spec.sticky: StatefulSet pods keep their addresses (sticky.go).
	Sticky bool `json:"sticky,omitempty"`
	// Reserved is status.sticky, sorted by address: the address reserved for each StatefulSet
	// identity. It is journaled with the rest, so an agent restarted while the API server is
	// away still keeps reserved addresses out of ordinary ADDs and hands them to their pods.
	Reserved []StickyUse `json:"reserved,omitempty"`
	// Claims is status.ipamClaims, sorted by address: the address bound to each IPAMClaim UID
	// (claim.go). Journaled with the rest, like Reserved.
	Claims []ClaimBinding `json:"claims,omitempty"`
	// Served records that the pool selected the node when the agent last heard from the API
	// server, so an agent restarted while the API server is away serves ADD from the same pools.
	Served bool `json:"served,omitempty"`
	// UID and Generation identify the IPPool object this view was read from (ObservedPools).
	UID        string `json:"uid,omitempty"`
	Generation int64  `json:"generation,omitempty"`
}

// ObservedPool is a pool (by UID and generation) whose addresses the node's running pods report
// were recorded by the last Rebuild: the claims the node publishes account for them.
type ObservedPool struct {
	Pool       string
	UID        string
	Generation int64
}

// PoolOf is the agent's view of a pool whose spec ippool.Parse read; exhausted mirrors the
// IPPool's status.exhausted.
func PoolOf(name string, spec ippool.Pool, exhausted bool) Pool {
	return Pool{
		Name:      name,
		CIDRs:     spec.CIDRs,
		Gateway:   spec.Gateway,
		Exclude:   spec.Exclude,
		Routes:    spec.Routes,
		Scaling:   spec.Scaling,
		Cooldown:  spec.Cooldown,
		Exhausted: exhausted,
		// An unset selector is labels.Everything(), whose String() is "".
		NamespaceSelector: spec.NamespaceSelector.String(),
		Network:           spec.Network,
		Sticky:            spec.Sticky,
	}
}

// Is4 reports whether the pool is an IPv4 pool.
func (p Pool) Is4() bool { return len(p.CIDRs) > 0 && p.CIDRs[0].Addr().Is4() }

// Usable returns the addresses of the pool's current spec that may be handed out, and false when
// the spec names no CIDR (unknown: nothing is ruled out). They are its CIDRs less spec.exclude,
// the gateway, and the addresses the controller reserves: the network and broadcast address of
// each IPv4 CIDR up to /30 and the subnet-router anycast address of each IPv6 CIDR up to /126.
func (p Pool) Usable() (addr.Set, bool) {
	if len(p.CIDRs) == 0 {
		return addr.Set{}, false
	}
	return ippool.Usable(p.CIDRs, p.Exclude, p.Gateway), true
}

// Prefix returns a with the prefix length of the pool CIDR that contains it, or a single-address
// prefix if none does.
func (p Pool) Prefix(a netip.Addr) netip.Prefix {
	for _, c := range p.CIDRs {
		if c.Contains(a) {
			return netip.PrefixFrom(a, c.Bits())
		}
	}
	return netip.PrefixFrom(a, a.BitLen())
}

// Cooling is an address freed at FreedAt, resting for its pool's cooldown.
type Cooling struct {
	Pool    string     `json:"pool"`
	Addr    netip.Addr `json:"addr"`
	FreedAt time.Time  `json:"freedAt"`
}

// Releasing is an address the node gives back; it is never handed out again.
type Releasing struct {
	Pool  string     `json:"pool"`
	Addr  netip.Addr `json:"addr"`
	Since time.Time  `json:"since"`
}

// Holding is the set of addresses the node holds from a pool, as the controller last reported.
type Holding struct {
	Pool      string   `json:"pool"`
	Addresses addr.Set `json:"-"`
}

// Change is what the journal must record, atomically, for one step of the state machine.
type Change struct {
	PutAttachments    []Attachment
	DeleteAttachments []Key
	PutCooling        []Cooling
	DeleteCooling     []Address
	PutReleasing      []Releasing
	DeleteReleasing   []Address
	PutHoldings       []Holding
	DeleteHoldings    []string
	PutPools          []Pool
	DeletePools       []string
	// PutMark replaces the record mark (record.go) when set.
	PutMark *RecordMark
	// PutConfigPools replaces the pod network configuration's "pools" (podWants) when set.
	PutConfigPools *[]string
	// PutHandback sets the handback mark (handback.go); ClearHandback clears it.
	PutHandback   *HandbackMark
	ClearHandback bool
	// PutAhead and DeleteAhead write and delete records of addresses reserved ahead, the format
	// of an older agent (lost.go). This agent never plans either: they remain so that the
	// journal's format is whole and tests can write an older agent's journal.
	PutAhead    []Address
	DeleteAhead []Address
}

// IsEmpty reports whether c records nothing.
func (c *Change) IsEmpty() bool {
	return len(c.PutAttachments) == 0 && len(c.DeleteAttachments) == 0 && len(c.PutCooling) == 0 &&
		len(c.DeleteCooling) == 0 && len(c.PutReleasing) == 0 && len(c.DeleteReleasing) == 0 &&
		len(c.PutHoldings) == 0 && len(c.DeleteHoldings) == 0 && len(c.PutPools) == 0 && len(c.DeletePools) == 0 &&
		c.PutMark == nil && c.PutConfigPools == nil && c.PutHandback == nil && !c.ClearHandback &&
		len(c.PutAhead) == 0 && len(c.DeleteAhead) == 0
}

// Merge appends o to c.
func (c *Change) Merge(o Change) {
	c.PutAttachments = append(c.PutAttachments, o.PutAttachments...)
	c.DeleteAttachments = append(c.DeleteAttachments, o.DeleteAttachments...)
	c.PutCooling = append(c.PutCooling, o.PutCooling...)
	c.DeleteCooling = append(c.DeleteCooling, o.DeleteCooling...)
	c.PutReleasing = append(c.PutReleasing, o.PutReleasing...)
	c.DeleteReleasing = append(c.DeleteReleasing, o.DeleteReleasing...)
	c.PutHoldings = append(c.PutHoldings, o.PutHoldings...)
	c.DeleteHoldings = append(c.DeleteHoldings, o.DeleteHoldings...)
	c.PutPools = append(c.PutPools, o.PutPools...)
	c.DeletePools = append(c.DeletePools, o.DeletePools...)
	c.PutAhead = append(c.PutAhead, o.PutAhead...)
	c.DeleteAhead = append(c.DeleteAhead, o.DeleteAhead...)
	if o.PutMark != nil {
		c.PutMark = o.PutMark
	}
	if o.PutConfigPools != nil {
		c.PutConfigPools = o.PutConfigPools
	}
	if o.ClearHandback {
		c.PutHandback, c.ClearHandback = nil, true
	}
	if o.PutHandback != nil {
		c.PutHandback, c.ClearHandback = o.PutHandback, false
	}
}

// Snapshot is the durable part of a State, as the journal loads it.
type Snapshot struct {
	Attachments []Attachment
	Cooling     []Cooling
	Releasing   []Releasing
	Holdings    []Holding
	Pools       []Pool
	// Mark is the NodeIPAllocation the node last wrote (record.go); zero when never.
	Mark RecordMark
	// ConfigPools is the pod network configuration's "pools" the last ADD on eth0 brought.
	ConfigPools []string
	// Handback is the handback mark (handback.go); nil when the node was not handed back.
	Handback *HandbackMark
	// Ahead are the records of addresses reserved ahead by an older agent (lost.go).
	Ahead []Address
}

// IsEmpty reports whether s holds no record at all (a new or lost journal).
func (s *Snapshot) IsEmpty() bool {
	return len(s.Attachments) == 0 && len(s.Cooling) == 0 && len(s.Releasing) == 0 &&
		len(s.Holdings) == 0 && len(s.Pools) == 0
}

// Pod is a pod bound to the node, as the agent's pod watch sees it.
type Pod struct {
	Ref PodRef
	// IPs is the pod's status.podIPs.
	IPs []netip.Addr
	// HostNetwork pods get no address from ipwarden.
	HostNetwork bool
	// Finished is set for pods in phase Succeeded or Failed: their sandbox is gone.
	Finished bool
	// Deleting is set once the pod has a deletion timestamp; it may still run.
	Deleting bool
	// Pools and IPAddresses are the pod's ipwarden.io/pools and ipwarden.io/ip-addresses
	// annotations as written.
	Pools       string
	IPAddresses string
	// Identity is the pod's StatefulSet identity (StatefulSet "" when none); Sticky its
	// ipwarden.io/sticky opt-in.
	Identity sticky.Identity
	Sticky   bool
	// Networks is what Multus reports of the pod's interfaces (its network-status annotation):
	// the only report of a secondary network's addresses. A report, never a proof.
	Networks []podinfo.NetworkStatus
}

// Reported returns the addresses the pod's own reports name on network ("" is the pod network:
// status.podIPs; another, an IPPool's spec.network: the network-status entries naming it).
func (p Pod) Reported(network string) []netip.Addr {
	if network == "" {
		return p.IPs
	}
	var out []netip.Addr
	for _, n := range p.Networks {
		if n.Names(network) {
			out = append(out, n.IPs...)
		}
	}
	return out
}

// NeedsAddress reports whether the pod will need an address it may not have yet: it counts as
// demand until it has an attachment.
func (p Pod) NeedsAddress() bool { return !p.HostNetwork && !p.Finished && !p.Deleting }

// MayRun reports whether the pod's sandbox may be running with the addresses in its status.
func (p Pod) MayRun() bool { return !p.HostNetwork && !p.Finished }

// PoolRequest is the agent's request for one pool, as published in NodeIPAllocation spec.pools.
type PoolRequest struct {
	Pool      string
	Requested int
	Releasing addr.Set
	// ReleasingCooled is the part of Releasing past its reuse cooldown on the node (or never
	// used): the controller returns it to the free pool without another cooldown.
	ReleasingCooled addr.Set
	// Claimed are addresses the node's attachments use that its status lacks (record.go).
	Claimed addr.Set
	// Wanted are static addresses the node's pods ask for that it does not hold (static.go).
	Wanted addr.Set
	// Sticky are addresses the node's sticky pods use that the pool's record lacks (sticky.go).
	Sticky []StickyUse
	// Claims are the IPAMClaims the node's attachments use and its waiting ADDs ask for
	// (claim.go).
	Claims []ClaimUse
}

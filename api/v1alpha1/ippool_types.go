package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// CIDR is an IPv4 or IPv6 network in canonical form, such as 10.244.0.0/16 or fd00:10::/64.
//
// +kubebuilder:validation:MaxLength=43
// +kubebuilder:validation:XValidation:rule="isCIDR(self)",messageExpression="'\"' + self + '\" is not a CIDR: write a network such as 10.244.0.0/16 or fd00:10::/64'"
// +kubebuilder:validation:XValidation:rule="!isCIDR(self) || cidr(self) == cidr(self).masked()",messageExpression="'\"' + self + '\" has host bits set: write the network address (10.0.0.0/24, not 10.0.0.1/24)'"
type CIDR string

// IPOrCIDR is a single address (10.0.0.1, fd00::1) or a CIDR in canonical form.
//
// +kubebuilder:validation:MaxLength=43
// +kubebuilder:validation:XValidation:rule="isIP(self) || isCIDR(self)",messageExpression="'\"' + self + '\" is neither an IP address nor a CIDR'"
// +kubebuilder:validation:XValidation:rule="!isCIDR(self) || cidr(self) == cidr(self).masked()",messageExpression="'\"' + self + '\" has host bits set: write the network address (10.0.0.0/24, not 10.0.0.1/24)'"
type IPOrCIDR string

// IPAddress is a single IPv4 or IPv6 address.
//
// +kubebuilder:validation:MaxLength=39
// +kubebuilder:validation:XValidation:rule="isIP(self)",messageExpression="'\"' + self + '\" is not an IP address'"
type IPAddress string

// Route is a route returned to the container runtime in the CNI result.
type Route struct {
	// Dst is the destination network, such as 0.0.0.0/0.
	// +required
	Dst CIDR `json:"dst"`
	// GW is the next hop. Empty means the runtime's default (usually the gateway).
	// +optional
	GW IPAddress `json:"gw,omitempty"`
}

// Scaling sets how many addresses each node keeps ready for pods.
//
// The target a node holds for this pool is batchSize * ceil(bufferPercent/100 + demand/batchSize),
// clamped at maxPerNode, where demand is the addresses in use plus pods already bound to the node
// that will need one. A node gives addresses back only while it holds more than
// demand + batchSize*(bufferPercent+releaseSlackPercent)/100, and only after it has for
// releaseDelay. While the pool is exhausted, the batch is 1 address, there is no buffer, and
// spares go back at once.
//
// +kubebuilder:validation:XValidation:rule="self.maxPerNode >= self.batchSize",message="maxPerNode must be at least batchSize"
type Scaling struct {
	// BatchSize is the step in which a node's holding grows and shrinks.
	// +kubebuilder:default=16
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=65536
	// +optional
	BatchSize int32 `json:"batchSize"`
	// BufferPercent is the share of a batch kept free beyond demand, 0 to 100.
	// +kubebuilder:default=50
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=100
	// +optional
	BufferPercent int32 `json:"bufferPercent"`
	// MaxPerNode caps the addresses one node holds from this pool.
	// +kubebuilder:default=250
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=65536
	// +optional
	MaxPerNode int32 `json:"maxPerNode"`
	// ReleaseSlackPercent is the scale-down hysteresis in percent of a batch: a node gives
	// addresses back only while it holds more than demand + batchSize*(bufferPercent +
	// releaseSlackPercent)/100, so pods coming and going near a batch boundary cost no writes.
	// Default 100 (one batch).
	// +kubebuilder:default=100
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=1000
	// +optional
	ReleaseSlackPercent *int32 `json:"releaseSlackPercent,omitempty"`
	// ReleaseDelay is how long a node must hold more than that before it gives the excess back
	// (down to its target). Not applied while the pool is exhausted. Default 3m.
	// +kubebuilder:default="3m"
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:MaxLength=32
	// +kubebuilder:validation:XValidation:rule="self == '0' || self.matches('^([0-9]+([.][0-9]+)?(ns|us|ms|s|m|h))+$')",messageExpression="'releaseDelay \"' + self + '\" must be a non-negative duration such as 3m, 90s or 0s'"
	// +optional
	ReleaseDelay *metav1.Duration `json:"releaseDelay,omitempty"`
}

// IPPoolSpec describes a range of addresses and how nodes draw from it.
//
// +kubebuilder:validation:XValidation:rule="!isCIDR(self.cidrs[0]) || self.cidrs.all(c, !isCIDR(c) || cidr(c).ip().family() == cidr(self.cidrs[0]).ip().family())",message="all cidrs of a pool must be of one family: make one IPv4 pool and one IPv6 pool for dual-stack"
// +kubebuilder:validation:XValidation:rule="!has(self.exclude) || self.exclude.all(e, !(isIP(e) || isCIDR(e)) || self.cidrs.exists(c, isCIDR(c) && (isIP(e) ? cidr(c).containsIP(e) : cidr(c).containsCIDR(e))))",message="every exclude entry must lie inside one of the pool's cidrs"
// +kubebuilder:validation:XValidation:rule="!has(self.gateway) || !isIP(self.gateway) || !isCIDR(self.cidrs[0]) || ip(self.gateway).family() == cidr(self.cidrs[0]).ip().family()",message="gateway must be of the pool's address family"
type IPPoolSpec struct {
	// CIDRs are the networks addresses are drawn from, all of one family.
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=32
	// +listType=set
	// +required
	CIDRs []CIDR `json:"cidrs"`

	// Exclude lists addresses and networks inside the CIDRs that are never handed out. The
	// network and broadcast address of each IPv4 CIDR (up to /30), the first address of each
	// IPv6 CIDR (up to /126) and the gateway are never handed out either, without being listed.
	// +kubebuilder:validation:MaxItems=256
	// +listType=set
	// +optional
	Exclude []IPOrCIDR `json:"exclude,omitempty"`

	// Gateway is returned to pods as their gateway in the CNI result.
	// +optional
	Gateway IPAddress `json:"gateway,omitempty"`

	// Routes are returned to pods in the CNI result.
	// +kubebuilder:validation:MaxItems=64
	// +listType=atomic
	// +optional
	Routes []Route `json:"routes,omitempty"`

	// NodeSelector picks the nodes that draw from this pool. Empty selects every node.
	// +kubebuilder:validation:XValidation:rule="!has(self.matchExpressions) || self.matchExpressions.all(e, e.operator in ['In', 'NotIn', 'Exists', 'DoesNotExist'])",message="nodeSelector.matchExpressions operator must be In, NotIn, Exists or DoesNotExist"
	// +kubebuilder:validation:XValidation:rule="!has(self.matchExpressions) || self.matchExpressions.all(e, (e.operator in ['In', 'NotIn']) == (has(e.values) && size(e.values) > 0))",message="nodeSelector.matchExpressions: In and NotIn need values, Exists and DoesNotExist take none"
	// +optional
	NodeSelector *metav1.LabelSelector `json:"nodeSelector,omitempty"`

	// Network names the network the pool's addresses live on, for secondary networks (Multus
	// NetworkAttachmentDefinitions; like Whereabouts' network_name). Empty is the pod network.
	// Pools on different networks may share addresses; pools on one network may not. An
	// attachment draws only from pools of the network its CNI configuration names ("network").
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$`
	// +optional
	Network string `json:"network,omitempty"`
	// Sticky keeps each StatefulSet pod's address with its identity (namespace, StatefulSet,
	// ordinal) across restarts and moves to other nodes; a StatefulSet can opt in by itself with
	// the ipwarden.io/sticky: "true" annotation in its pod template.
	// +optional
	Sticky bool `json:"sticky,omitempty"`
	// NamespaceSelector picks the namespaces whose pods may draw from this pool. Unset lets every
	// namespace use it. A pod whose ipwarden.io/pools annotation (or its namespace's) names a pool
	// its namespace may not use gets a CNI error and no address; a pool that does not admit a
	// namespace is left out of that namespace's default pools.
	// +kubebuilder:validation:XValidation:rule="!has(self.matchExpressions) || self.matchExpressions.all(e, e.operator in ['In', 'NotIn', 'Exists', 'DoesNotExist'])",message="namespaceSelector.matchExpressions operator must be In, NotIn, Exists or DoesNotExist"
	// +kubebuilder:validation:XValidation:rule="!has(self.matchExpressions) || self.matchExpressions.all(e, (e.operator in ['In', 'NotIn']) == (has(e.values) && size(e.values) > 0))",message="namespaceSelector.matchExpressions: In and NotIn need values, Exists and DoesNotExist take none"
	// +optional
	NamespaceSelector *metav1.LabelSelector `json:"namespaceSelector,omitempty"`
	// Scaling sets how many addresses each node keeps ready.
	// +kubebuilder:default={batchSize: 16, bufferPercent: 50, maxPerNode: 250}
	// +optional
	Scaling Scaling `json:"scaling"`

	// ReuseCooldown is how long a freed address rests before it is handed out again,
	// so stale ARP, conntrack and DNS entries for the old pod expire first.
	// +kubebuilder:default="30s"
	// +kubebuilder:validation:Type=string
	// +kubebuilder:validation:MaxLength=32
	// +kubebuilder:validation:XValidation:rule="self == '0' || self.matches('^([0-9]+([.][0-9]+)?(ns|us|ms|s|m|h))+$')",messageExpression="'reuseCooldown \"' + self + '\" must be a non-negative duration such as 30s, 500ms or 2m'"
	// +optional
	ReuseCooldown metav1.Duration `json:"reuseCooldown"`
}

// CoolingBlock is a batch of released addresses resting until a time.
type CoolingBlock struct {
	// Addresses in the compact form of NodeIPAllocation status.
	// +kubebuilder:validation:items:MaxLength=80
	// +kubebuilder:validation:items:Pattern=`^[0-9a-fA-F.:/-]+$`
	// +listType=atomic
	Addresses []string `json:"addresses"`
	// Until is when the addresses may be handed out again.
	Until metav1.Time `json:"until"`
}

// IPPoolStatus is the pool's usage as the controller sees it.
type IPPoolStatus struct {
	// Fence names the controller that wrote this status.
	// +optional
	Fence *Fence `json:"fence,omitempty"`
	// ObservedGeneration is the spec generation this status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// Capacity is the number of addresses the pool can hand out (CIDRs minus exclusions).
	// It saturates at 2^63-1 for very large IPv6 pools.
	// +optional
	Capacity int64 `json:"capacity"`
	// Allocated is the number of addresses held by nodes or cooling down after release.
	// +optional
	Allocated int64 `json:"allocated"`
	// Free is Capacity minus Allocated.
	// +optional
	Free int64 `json:"free"`
	// Nodes is the number of nodes holding addresses from this pool.
	// +optional
	Nodes int32 `json:"nodes"`
	// Exhausted is set when free addresses fall below the controller's low mark and cleared
	// only when they rise above its high mark. Nodes scale in single addresses while it is set.
	// +optional
	Exhausted bool `json:"exhausted"`
	// Cooling lists addresses released by nodes that rest until a time before they are handed
	// out again. The controller writes an entry before it takes the addresses from the node, so a
	// controller restart cannot reuse them early.
	// +listType=atomic
	// +optional
	Cooling []CoolingBlock `json:"cooling,omitempty"`
	// Sticky lists the addresses reserved for StatefulSet pod identities: no other pod gets
	// one, and it follows its identity to another node once the old pod's sandbox is gone.
	// +kubebuilder:validation:MaxItems=4096
	// +listType=atomic
	// +optional
	Sticky []StickyAddress `json:"sticky,omitempty"`
	// IPAMClaims records the address bound to each IPAMClaim (k8s.cni.cncf.io), by the claim's
	// UID: no pod but the claim's gets it, and it follows the claim to any node. Written before
	// the address is granted to a node for the claim; dropped once the claim is gone and no
	// node reports an attachment for it.
	// +kubebuilder:validation:MaxItems=4096
	// +listType=atomic
	// +optional
	IPAMClaims []ClaimBinding `json:"ipamClaims,omitempty"`
	// Shared lists claim addresses a second node holds while the first still does: a live
	// migration's target (the one case of invariant 1's exception).
	// +kubebuilder:validation:MaxItems=1024
	// +listType=atomic
	// +optional
	Shared []SharedClaimAddress `json:"shared,omitempty"`
	// Conditions: Ready, Exhausted, Invalid.
	// +listType=map
	// +listMapKey=type
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// StickyAddress is an address reserved for a StatefulSet pod identity.
type StickyAddress struct {
	// +required
	Address IPAddress `json:"address"`
	// +kubebuilder:validation:MaxLength=63
	// +required
	Namespace string `json:"namespace"`
	// +kubebuilder:validation:MaxLength=253
	// +required
	StatefulSet string `json:"statefulSet"`
	// +kubebuilder:validation:Minimum=0
	// +required
	Ordinal int32 `json:"ordinal"`
}

// ClaimBinding is the address bound to one IPAMClaim.
type ClaimBinding struct {
	// +required
	Address IPAddress `json:"address"`
	// +kubebuilder:validation:MaxLength=63
	// +required
	Namespace string `json:"namespace"`
	// +kubebuilder:validation:MaxLength=253
	// +required
	Name string `json:"name"`
	// UID is the claim's metadata.uid.
	// +kubebuilder:validation:MaxLength=64
	// +required
	UID string `json:"uid"`
}

// SharedClaimAddress is a claim address granted to a second node for a live migration.
type SharedClaimAddress struct {
	// +required
	Address IPAddress `json:"address"`
	// UID is the claim's metadata.uid.
	// +kubebuilder:validation:MaxLength=64
	// +required
	UID string `json:"uid"`
	// Nodes are the two nodes that hold the address.
	// +kubebuilder:validation:MaxItems=2
	// +listType=atomic
	// +required
	Nodes []string `json:"nodes"`
}

// IPPool is a range of addresses pods draw from. It is cluster-scoped and of one address family.
//
// +genclient
// +genclient:nonNamespaced
// +k8s:deepcopy-gen:interfaces=k8s.io/apimachinery/pkg/runtime.Object
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Cluster,shortName=ipp,categories=ipwarden
// +kubebuilder:printcolumn:name="CIDRs",type=string,JSONPath=`.spec.cidrs`
// +kubebuilder:printcolumn:name="Capacity",type=integer,JSONPath=`.status.capacity`
// +kubebuilder:printcolumn:name="Allocated",type=integer,JSONPath=`.status.allocated`
// +kubebuilder:printcolumn:name="Free",type=integer,JSONPath=`.status.free`
// +kubebuilder:printcolumn:name="Nodes",type=integer,JSONPath=`.status.nodes`
// +kubebuilder:printcolumn:name="Exhausted",type=boolean,JSONPath=`.status.exhausted`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type IPPool struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +required
	Spec IPPoolSpec `json:"spec"`
	// +optional
	Status IPPoolStatus `json:"status,omitempty"`
}

// IPPoolList is a list of IPPools.
//
// +k8s:deepcopy-gen:interfaces=k8s.io/apimachinery/pkg/runtime.Object
// +kubebuilder:object:root=true
type IPPoolList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []IPPool `json:"items"`
}

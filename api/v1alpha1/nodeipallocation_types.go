package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// AddressBlock is one address (10.0.0.5), a CIDR (10.0.0.0/28) or an inclusive range
// (10.0.0.5-10.0.0.9). Lists of blocks keep a node's addresses compact in the API.
//
// +kubebuilder:validation:MaxLength=80
// +kubebuilder:validation:XValidation:rule="isIP(self) || isCIDR(self) || (self.split('-').size() == 2 && isIP(self.split('-')[0]) && isIP(self.split('-')[1]))",messageExpression="'\"' + self + '\" is not an address, a CIDR or a range such as 10.0.0.5-10.0.0.9'"
type AddressBlock string

// NodePoolRequest is what a node's agent asks of one pool.
type NodePoolRequest struct {
	// Pool is the name of the IPPool.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +required
	Pool string `json:"pool"`
	// Requested is the number of addresses the node wants to hold from the pool.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=65536
	// +optional
	Requested int32 `json:"requested"`
	// Releasing lists addresses the node gives back. The agent never hands them out again;
	// the controller removes them from the node's status and returns them to the pool after
	// the pool's reuse cooldown.
	// +kubebuilder:validation:MaxItems=1024
	// +listType=atomic
	// +optional
	Releasing []AddressBlock `json:"releasing,omitempty"`
	// ReleasingCooled lists the addresses of releasing that are past the pool's reuse cooldown
	// on the node (freed long enough ago, or never handed to a pod). The controller returns
	// them to the pool's free addresses at once instead of cooling them again; entries not in
	// releasing are ignored.
	// +kubebuilder:validation:MaxItems=1024
	// +listType=atomic
	// +optional
	ReleasingCooled []AddressBlock `json:"releasingCooled,omitempty"`
	// Claimed lists addresses the node's pods use that its status does not show (the record
	// rewound: etcd restored from a backup, the object deleted and re-created, or a controller
	// mistake). The controller grants a claimed address back when no other node holds it and
	// never grants it to another node; a claim it cannot grant is reported as a conflict.
	// +kubebuilder:validation:MaxItems=1024
	// +listType=atomic
	// +optional
	Claimed []AddressBlock `json:"claimed,omitempty"`
	// Wanted lists addresses pods on the node ask for by name (the ipwarden.io/ip-addresses
	// annotation) that the node does not hold. The controller moves a wanted address into the
	// node's holding when no other node holds it and the pool hands it out; it never takes one
	// from another node. One it refuses is listed in status.pools[].refused with the reason.
	// +kubebuilder:validation:MaxItems=64
	// +listType=atomic
	// +optional
	Wanted []AddressBlock `json:"wanted,omitempty"`
	// Sticky lists addresses the node's sticky StatefulSet pods use that the pool's
	// status.sticky does not list yet; the controller records them there.
	// +kubebuilder:validation:MaxItems=256
	// +listType=atomic
	// +optional
	Sticky []StickyAddress `json:"sticky,omitempty"`
	// IPAMClaims lists the IPAMClaims (k8s.cni.cncf.io/v1alpha1) the node's pods reference on
	// this pool: each one an attachment on the node uses (attached) and each one a waiting ADD
	// wants an address for. The controller records the claim's address in the pool's
	// status.ipamClaims before it grants it, grants it to a second node only for a live
	// migration, and drops the record only once the claim is gone and no node lists it here.
	// +kubebuilder:validation:MaxItems=256
	// +listType=atomic
	// +optional
	IPAMClaims []ClaimUse `json:"ipamClaims,omitempty"`
}

// ClaimUse is one IPAMClaim a node's pod references (docs/design.md, "VM addresses").
type ClaimUse struct {
	// Namespace and Name name the claim (always the pod's namespace).
	// +kubebuilder:validation:MaxLength=63
	// +required
	Namespace string `json:"namespace"`
	// +kubebuilder:validation:MaxLength=253
	// +required
	Name string `json:"name"`
	// UID is the claim's metadata.uid: its identity (a claim re-created under the same name is
	// another claim).
	// +kubebuilder:validation:MaxLength=64
	// +required
	UID string `json:"uid"`
	// Pod is the name of the (newest) pod on the node that references the claim.
	// +kubebuilder:validation:MaxLength=253
	// +optional
	Pod string `json:"pod,omitempty"`
	// Address is, when attached, the address the node's attachment uses; when waiting, the
	// address the claim's status.ips asks for (an import from another IPAM), or empty: the
	// controller picks one.
	// +optional
	Address IPAddress `json:"address,omitempty"`
	// Attached says an attachment on the node uses the claim's address (it lives until the
	// attachment is freed); otherwise an ADD waits for the address.
	// +optional
	Attached bool `json:"attached,omitempty"`
	// MigrationTarget says the pod carries the label kubevirt.io/migrationJobUID: the one case
	// in which a second node may hold the claim's address while the first still uses it.
	// +optional
	MigrationTarget bool `json:"migrationTarget,omitempty"`
}

// NodeIPAllocationSpec is written only by the node's agent.
type NodeIPAllocationSpec struct {
	// Pools holds one request per pool the node draws from.
	// +kubebuilder:validation:MaxItems=16
	// +listType=map
	// +listMapKey=pool
	// +optional
	Pools []NodePoolRequest `json:"pools,omitempty"`
	// AcknowledgedLeader is the controller (its leader election Lease holder identity) for which
	// the agent computed the claims above from a fresh read of this object: the agent writes it
	// with a precondition on the resource version it read, so the claims account for the status
	// as it stood. A controller that starts leading fills no node from the free pool until every
	// node has acknowledged it (or its --claim-settle bound passes), so addresses a rewound
	// record lost are claimed before they can be handed to another node.
	// +kubebuilder:validation:MaxLength=253
	// +optional
	AcknowledgedLeader string `json:"acknowledgedLeader,omitempty"`
	// ObservedPools lists every IPPool (by UID and generation) the agent knew when it computed
	// the claims above: the addresses its running pods report inside those pools, whoever gave
	// them out (a previous IPAM included), are in use on this node and claimed. A controller
	// fills no node from the free part of a new or grown pool until every node has observed
	// that pool's generation, or stayed silent and had its pods read with none reporting one of
	// the pool's new addresses (or its --pool-settle bound passes), so no address a running pod
	// uses is handed to another pod.
	// +kubebuilder:validation:MaxItems=256
	// +listType=map
	// +listMapKey=pool
	// +optional
	ObservedPools []ObservedPool `json:"observedPools,omitempty"`
}

// ObservedPool is one IPPool as a node's agent last knew it.
type ObservedPool struct {
	// Pool is the IPPool's name.
	// +kubebuilder:validation:MaxLength=253
	Pool string `json:"pool"`
	// UID is the IPPool's metadata.uid (a pool deleted and created again is another pool).
	// +kubebuilder:validation:MaxLength=64
	UID string `json:"uid"`
	// Generation is the IPPool's metadata.generation.
	Generation int64 `json:"generation"`
}

// NodePoolStatus is what a node holds from one pool.
type NodePoolStatus struct {
	// Pool is the name of the IPPool.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +required
	Pool string `json:"pool"`
	// Addresses the node holds, compact: addresses, CIDRs and ranges (10.0.0.5-10.0.0.9).
	// Only the controller writes them, so the API checks their shape, not their meaning.
	// +kubebuilder:validation:MaxItems=65536
	// +kubebuilder:validation:items:MaxLength=80
	// +kubebuilder:validation:items:Pattern=`^[0-9a-fA-F.:/-]+$`
	// +listType=atomic
	// +optional
	Addresses []string `json:"addresses,omitempty"`
	// Held is the number of addresses in Addresses.
	// +optional
	Held int32 `json:"held"`
	// Refused lists wanted addresses (spec.pools[].wanted) the controller cannot move to the
	// node, with the reason; the agent fails the ADD that wants one with that reason.
	// +kubebuilder:validation:MaxItems=64
	// +listType=atomic
	// +optional
	Refused []RefusedAddress `json:"refused,omitempty"`
	// WantedElsewhere lists addresses the node holds that a pod on another node asks for by
	// name (spec.pools[].wanted there). The agent gives back those no attachment uses (it lists
	// them in releasing), so the controller can move them; those in use stay.
	// +kubebuilder:validation:MaxItems=64
	// +listType=atomic
	// +optional
	WantedElsewhere []AddressBlock `json:"wantedElsewhere,omitempty"`
	// ClaimRefused lists the IPAMClaims (spec.pools[].ipamClaims) the controller cannot give
	// this node an address for, with the reason; the agent fails the ADD with it (CNI code 11).
	// +kubebuilder:validation:MaxItems=256
	// +listType=atomic
	// +optional
	ClaimRefused []ClaimRefusal `json:"claimRefused,omitempty"`
}

// ClaimRefusal is an IPAMClaim whose address the controller cannot give a node.
type ClaimRefusal struct {
	// UID is the claim's metadata.uid.
	// +kubebuilder:validation:MaxLength=64
	// +required
	UID string `json:"uid"`
	// Reason says why, such as "IPAMClaim ns/vm-a is attached on node b".
	// +kubebuilder:validation:MaxLength=256
	// +required
	Reason string `json:"reason"`
}

// RefusedAddress is a wanted address the controller cannot move to the node.
type RefusedAddress struct {
	// +required
	Address IPAddress `json:"address"`
	// Reason says why, such as "held by node b".
	// +kubebuilder:validation:MaxLength=256
	// +required
	Reason string `json:"reason"`
}

// Fence names the controller that wrote a status: the holder of the controller's leader
// election Lease and the Lease's leaderTransitions when it acquired it (its epoch). The
// ipwarden-controller-fence ValidatingAdmissionPolicy rejects a status write whose fence does
// not match the Lease as the API server sees it, so a controller that lost its lease (paused
// past it, partitioned) can never land a write.
type Fence struct {
	// Holder is the Lease holder identity of the writing controller.
	// +kubebuilder:validation:MaxLength=253
	// +required
	Holder string `json:"holder"`
	// Epoch is the Lease's leaderTransitions when the writer acquired it.
	// +kubebuilder:validation:Minimum=0
	// +required
	Epoch int64 `json:"epoch"`
}

// NodeIPAllocationStatus is written only by the controller.
type NodeIPAllocationStatus struct {
	// Fence names the controller that wrote this status.
	// +optional
	Fence *Fence `json:"fence,omitempty"`
	// ObservedGeneration is the spec generation this status answers.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// Pools holds what the node holds per pool.
	// +kubebuilder:validation:MaxItems=16
	// +listType=map
	// +listMapKey=pool
	// +optional
	Pools []NodePoolStatus `json:"pools,omitempty"`
	// Held is the number of addresses the node holds over all pools.
	// +optional
	Held int32 `json:"held"`
	// Summary shows each pool as "pool held/requested" for kubectl get; see Summarize.
	// +kubebuilder:validation:MaxLength=4096
	// +optional
	Summary string `json:"summary,omitempty"`
	// Conditions: Ready (the node holds what it requested) with a reason when it does not.
	// +listType=map
	// +listMapKey=type
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// NodeIPAllocation is one node's share of the pools: its agent writes the spec (how many
// addresses it wants, which it gives back), the controller writes the status (which it holds).
// There is one per Node, of the same name, owned by the Node.
//
// +genclient
// +genclient:nonNamespaced
// +k8s:deepcopy-gen:interfaces=k8s.io/apimachinery/pkg/runtime.Object
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Cluster,shortName=nipa,categories=ipwarden
// +kubebuilder:printcolumn:name="Held/Requested",type=string,JSONPath=`.status.summary`
// +kubebuilder:printcolumn:name="Held",type=integer,JSONPath=`.status.held`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type NodeIPAllocation struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +optional
	Spec NodeIPAllocationSpec `json:"spec,omitempty"`
	// +optional
	Status NodeIPAllocationStatus `json:"status,omitempty"`
}

// NodeIPAllocationList is a list of NodeIPAllocations.
//
// +k8s:deepcopy-gen:interfaces=k8s.io/apimachinery/pkg/runtime.Object
// +kubebuilder:object:root=true
type NodeIPAllocationList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []NodeIPAllocation `json:"items"`
}

// Condition types and reasons shared by the controller, the agent and the CLI.
const (
	ConditionReady     = "Ready"
	ConditionExhausted = "Exhausted"
	ConditionInvalid   = "Invalid"
	// ConditionAddressConflict is True on a NodeIPAllocation when the node's pods use an
	// address another node holds (both nodes get it); an operator must decide which pod keeps it.
	ConditionAddressConflict = "AddressConflict"
	// ConditionStickyFull is True on an IPPool whose status.sticky holds 90 % or more of the
	// MaxStickyReservations it may hold; once full, new StatefulSet pods get ordinary addresses.
	ConditionStickyFull = "StickyFull"
)

// MaxStickyReservations is how many sticky reservations one IPPool's status may hold (the
// API's maxItems of status.sticky).
const MaxStickyReservations = 4096

// MaxClaimBindings is how many IPAMClaim bindings one IPPool's status may hold (the API's
// maxItems of status.ipamClaims).
const MaxClaimBindings = 4096

// IPAMClaim (k8s.cni.cncf.io/v1alpha1) status conventions, as OVN-Kubernetes writes them.
const (
	ClaimConditionIPsAllocated = "IPsAllocated"
	ClaimReasonAllocated       = "SuccessfulAllocation"
	ClaimReasonSubnetExhausted = "SubnetExhausted"
	ClaimReasonAddressConflict = "IPAddressConflict"
	ClaimReasonNetworkMismatch = "NetworkMismatch"
	ClaimReasonInternalError   = "InternalError"
	MigrationTargetLabel       = "kubevirt.io/migrationJobUID"
)

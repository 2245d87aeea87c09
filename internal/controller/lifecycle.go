package controller

import "k8s.io/apimachinery/pkg/types"

// NodeFacts is what one sync knows about a node name.
type NodeFacts struct {
	// NodeExists: the Node is in the informer cache; NodeUID is its UID.
	NodeExists bool
	NodeUID    types.UID
	// Selected: some valid IPPool's nodeSelector selects the node.
	Selected bool
	// AllocationExists: the NodeIPAllocation is in the cache; OwnerUID is the UID of its Node
	// owner reference (empty when it has none).
	AllocationExists bool
	OwnerUID         types.UID
	// Holds: the controller's record says the node holds addresses.
	Holds bool
	// Asks: the node's spec requests or releases anything.
	Asks bool
}

// Lifecycle is what to do about a node's NodeIPAllocation object before filling it.
type Lifecycle struct {
	// ConfirmGone: the Node is not in the cache; ask the API server (not the cache) and, if it is
	// really gone, return everything the node held to its pools and delete the object.
	ConfirmGone bool
	// Create the NodeIPAllocation with an owner reference to the Node; RestoreStatus when the
	// controller's record says the node holds addresses (the object was deleted under a live
	// node: its pods still use them).
	Create, RestoreStatus bool
	// FixOwner: point the owner reference at the current Node (reuse a stale object by update).
	FixOwner bool
	// DeleteOrphan: the node is no longer selected and holds and asks nothing.
	DeleteOrphan bool
	// Fill: run the fill and take-back plan.
	Fill bool
}

// DecideLifecycle is the desired-versus-actual step of node lifecycle: one NodeIPAllocation per
// Node that some pool selects (or that still holds addresses), owned by that Node.
func DecideLifecycle(f NodeFacts) Lifecycle {
	switch {
	case !f.NodeExists:
		return Lifecycle{ConfirmGone: f.AllocationExists || f.Holds}
	case !f.AllocationExists:
		if f.Selected || f.Holds {
			return Lifecycle{Create: true, RestoreStatus: f.Holds}
		}
		return Lifecycle{}
	case !f.Selected && !f.Holds && !f.Asks:
		return Lifecycle{DeleteOrphan: true}
	default:
		return Lifecycle{FixOwner: f.OwnerUID != f.NodeUID, Fill: true}
	}
}

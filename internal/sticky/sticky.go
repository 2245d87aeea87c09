// Package sticky holds the pure decisions of sticky StatefulSet addresses (docs/design.md,
// "Sticky StatefulSet addresses"): which pod identity a reservation follows and when it goes back
// to its pool. Only the decisions are built so far; the reservation's record and the hand-back
// between nodes are designed, not built.
package sticky

import (
	"fmt"

	appsv1 "k8s.io/api/apps/v1"
)

// Identity is what a sticky address follows: a StatefulSet's pod by ordinal.
type Identity struct {
	Namespace   string
	StatefulSet string
	Ordinal     int
}

func (id Identity) String() string {
	return fmt.Sprintf("%s/%s-%d", id.Namespace, id.StatefulSet, id.Ordinal)
}

// StatefulSet is what the return decision reads of a StatefulSet (or, when it is gone, of its
// last version seen).
type StatefulSet struct {
	Exists bool
	// Start and Replicas: the ordinals in use are [Start, Start+Replicas).
	Start, Replicas int32
	// WhenScaled and WhenDeleted are spec.persistentVolumeClaimRetentionPolicy ("" means
	// Retain, the Kubernetes default).
	WhenScaled, WhenDeleted appsv1.PersistentVolumeClaimRetentionPolicyType
}

// Of reads a StatefulSet object.
func Of(s *appsv1.StatefulSet) StatefulSet {
	out := StatefulSet{Exists: s.DeletionTimestamp == nil, Replicas: 1}
	if s.Spec.Replicas != nil {
		out.Replicas = *s.Spec.Replicas
	}
	if s.Spec.Ordinals != nil {
		out.Start = s.Spec.Ordinals.Start
	}
	if p := s.Spec.PersistentVolumeClaimRetentionPolicy; p != nil {
		out.WhenScaled, out.WhenDeleted = p.WhenScaled, p.WhenDeleted
	}
	return out
}

// Keep decides whether the address reserved for id stays reserved, following the intent of the
// StatefulSet's PVC retention policy: the address lives as long as the identity's volume would.
// It says why, for the log and the event.
func Keep(id Identity, sts StatefulSet) (bool, string) {
	inRange := int64(id.Ordinal) >= int64(sts.Start) && int64(id.Ordinal) < int64(sts.Start)+int64(sts.Replicas)
	switch {
	case sts.Exists && inRange:
		return true, "the StatefulSet runs ordinal " + fmt.Sprint(id.Ordinal)
	case sts.Exists && sts.WhenScaled == appsv1.DeletePersistentVolumeClaimRetentionPolicyType:
		return false, "the StatefulSet scaled below the ordinal and deletes its volumes when scaled (whenScaled: Delete)"
	case sts.Exists:
		return true, "the StatefulSet scaled below the ordinal but keeps its volumes when scaled (whenScaled: Retain)"
	case sts.WhenDeleted == appsv1.DeletePersistentVolumeClaimRetentionPolicyType:
		return false, "the StatefulSet is deleted and deletes its volumes with it (whenDeleted: Delete)"
	default:
		return true, "the StatefulSet is deleted but keeps its volumes (whenDeleted: Retain)"
	}
}

package sticky

import (
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestKeep(t *testing.T) {
	del, ret := appsv1.DeletePersistentVolumeClaimRetentionPolicyType, appsv1.RetainPersistentVolumeClaimRetentionPolicyType
	id := Identity{"ns", "web", 3}
	for _, tc := range []struct {
		name string
		sts  StatefulSet
		keep bool
	}{
		{"running ordinal", StatefulSet{Exists: true, Replicas: 4}, true},
		{"scaled below, default retain", StatefulSet{Exists: true, Replicas: 3}, true},
		{"scaled below, whenScaled Retain", StatefulSet{Exists: true, Replicas: 3, WhenScaled: ret}, true},
		{"scaled below, whenScaled Delete", StatefulSet{Exists: true, Replicas: 3, WhenScaled: del}, false},
		{"scaled to zero, whenScaled Delete", StatefulSet{Exists: true, Replicas: 0, WhenScaled: del}, false},
		{"start ordinal above", StatefulSet{Exists: true, Start: 4, Replicas: 10, WhenScaled: del}, false},
		{"start ordinal covers", StatefulSet{Exists: true, Start: 2, Replicas: 2, WhenScaled: del}, true},
		{"deleted, default retain", StatefulSet{Replicas: 4}, true},
		{"deleted, whenDeleted Delete", StatefulSet{Replicas: 4, WhenDeleted: del}, false},
		{"deleted, whenScaled Delete only", StatefulSet{Replicas: 4, WhenScaled: del}, true},
	} {
		if got, why := Keep(id, tc.sts); got != tc.keep || why == "" {
			t.Errorf("%s: Keep = %v (%s), want %v", tc.name, got, why, tc.keep)
		}
	}
}

func TestOf(t *testing.T) {
	two := int32(2)
	now := metav1.Now()
	s := &appsv1.StatefulSet{Spec: appsv1.StatefulSetSpec{Replicas: &two, Ordinals: &appsv1.StatefulSetOrdinals{Start: 5},
		PersistentVolumeClaimRetentionPolicy: &appsv1.StatefulSetPersistentVolumeClaimRetentionPolicy{
			WhenScaled: appsv1.DeletePersistentVolumeClaimRetentionPolicyType}}}
	if got := Of(s); got != (StatefulSet{Exists: true, Start: 5, Replicas: 2, WhenScaled: appsv1.DeletePersistentVolumeClaimRetentionPolicyType}) {
		t.Fatalf("Of = %+v", got)
	}
	s.DeletionTimestamp = &now
	s.Spec.Replicas = nil
	if got := Of(s); got.Exists || got.Replicas != 1 {
		t.Fatalf("Of(deleting, default replicas) = %+v", got)
	}
}

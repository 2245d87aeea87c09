package controller

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation/field"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
)

// The controller's pure parts: how a write's error becomes an outcome, how the Node owner of a
// NodeIPAllocation is read and replaced, how an informer's object is read, and the fleet gauges.

func TestOutcomeOf(t *testing.T) {
	gr := schema.GroupResource{Group: "ipwarden.io", Resource: "nodeipallocations"}
	tests := []struct {
		name string
		err  error
		want Outcome
	}{
		{"nil", nil, Landed},
		{"conflict", apierrors.NewConflict(gr, "n", errors.New("changed")), Conflict},
		{"wrapped conflict", fmt.Errorf("write: %w", apierrors.NewConflict(gr, "n", errors.New("changed"))), Conflict},
		{"fenced", fmt.Errorf("status of n: %w", ErrFenced), Rejected},
		{"invalid", apierrors.NewInvalid(schema.GroupKind{Group: "ipwarden.io", Kind: "NodeIPAllocation"}, "n", field.ErrorList{field.Invalid(field.NewPath("status"), "x", "bad")}), Rejected},
		{"not found", apierrors.NewNotFound(gr, "n"), Rejected},
		{"forbidden (admission policy)", apierrors.NewForbidden(gr, "n", errors.New("fence does not match the Lease")), Rejected},
		{"bad request", apierrors.NewBadRequest("no"), Rejected},
		{"already exists", apierrors.NewAlreadyExists(gr, "n"), Rejected},
		{"timeout", apierrors.NewTimeoutError("slow", 1), Unknown},
		{"server error", apierrors.NewInternalError(errors.New("etcd")), Unknown},
		{"lost connection", errors.New("connection reset by peer"), Unknown},
		{"context deadline", context.DeadlineExceeded, Unknown},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := OutcomeOf(tc.err); got != tc.want {
				t.Fatalf("OutcomeOf(%v) = %v, want %v", tc.err, got, tc.want)
			}
		})
	}
}

func TestNodeOwner(t *testing.T) {
	node := metav1.OwnerReference{APIVersion: "v1", Kind: "Node", Name: "n", UID: "u-node"}
	other := metav1.OwnerReference{APIVersion: "apps/v1", Kind: "DaemonSet", Name: "d", UID: "u-ds"}
	wrongVersion := metav1.OwnerReference{APIVersion: "v2", Kind: "Node", Name: "n", UID: "u-v2"}
	tests := []struct {
		name string
		refs []metav1.OwnerReference
		want types.UID
	}{
		{"none", nil, ""},
		{"node", []metav1.OwnerReference{node}, "u-node"},
		{"node after another owner", []metav1.OwnerReference{other, node}, "u-node"},
		{"another owner only", []metav1.OwnerReference{other}, ""},
		{"a Node of another API version", []metav1.OwnerReference{wrongVersion}, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a := &ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{OwnerReferences: tc.refs}}
			if got := nodeOwner(a); got != tc.want {
				t.Fatalf("nodeOwner = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestReplaceNodeOwner(t *testing.T) {
	old := metav1.OwnerReference{APIVersion: "v1", Kind: "Node", Name: "n", UID: "u-old"}
	other := metav1.OwnerReference{APIVersion: "apps/v1", Kind: "DaemonSet", Name: "d", UID: "u-ds"}
	node := &metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Name: "n", UID: "u-new"}}
	tests := []struct {
		name string
		refs []metav1.OwnerReference
	}{
		{"none", nil},
		{"the old node", []metav1.OwnerReference{old}},
		{"the old node and another owner", []metav1.OwnerReference{other, old}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := replaceNodeOwner(tc.refs, node)
			a := &ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{OwnerReferences: got}}
			if nodeOwner(a) != "u-new" {
				t.Fatalf("owner after replace: %+v", got)
			}
			nodes, others := 0, 0
			for _, o := range got {
				if o.Kind == "Node" {
					nodes++
				} else {
					others++
				}
			}
			wantOthers := 0
			for _, o := range tc.refs {
				if o.Kind != "Node" {
					wantOthers++
				}
			}
			if nodes != 1 || others != wantOthers {
				t.Fatalf("refs %+v: %d Node owners, %d others (want 1, %d)", got, nodes, others, wantOthers)
			}
		})
	}
}

func TestMetaOf(t *testing.T) {
	pod := &metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Name: "n"}}
	tests := []struct {
		name string
		obj  any
		want string
	}{
		{"object", pod, "n"},
		{"tombstone", toolscache.DeletedFinalStateUnknown{Key: "n", Obj: pod}, "n"},
		{"tombstone without an object", toolscache.DeletedFinalStateUnknown{Key: "n"}, ""},
		{"not an object", "n", ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := metaOf(tc.obj)
			if got := ""; m != nil {
				got = m.GetName()
				if got != tc.want {
					t.Fatalf("metaOf = %q, want %q", got, tc.want)
				}
			} else if tc.want != "" {
				t.Fatalf("metaOf = nil, want %q", tc.want)
			}
		})
	}
}

// The fleet gauges are running counts: each node counts once, whatever order its flags change in.
func TestSetNodeFlagsKeepsFleetGauges(t *testing.T) {
	type step struct {
		node                 string
		deficit, atCap, gone bool
		nodes, inDeficit, at float64
	}
	steps := []step{
		{node: "a", deficit: true, nodes: 1, inDeficit: 1},
		{node: "a", deficit: true, nodes: 1, inDeficit: 1}, // the same flags again
		{node: "b", atCap: true, nodes: 2, inDeficit: 1, at: 1},
		{node: "a", nodes: 2, at: 1}, // a filled
		{node: "b", deficit: true, atCap: true, nodes: 2, inDeficit: 1, at: 1},
		{node: "b", gone: true, nodes: 1}, // b deleted
		{node: "b", gone: true, nodes: 1}, // deleted again: no change
		{node: "c", gone: true, nodes: 1}, // never seen
		{node: "a", deficit: true, atCap: true, nodes: 1, inDeficit: 1, at: 1},
	}
	c := New(nil, nil, nil, record.NewFakeRecorder(10), NewMetrics(nil), logr.Discard(), Options{})
	for i, s := range steps {
		c.m.setNodeFlags(s.node, s.deficit, s.atCap, s.gone)
		m := c.metrics
		if n, d, a := gauge(t, m.Nodes), gauge(t, m.NodesInDeficit), gauge(t, m.NodesAtCapacity); n != s.nodes || d != s.inDeficit || a != s.at {
			t.Fatalf("step %d (%+v): nodes %v, in deficit %v, at capacity %v", i, s, n, d, a)
		}
	}
}

func gauge(t *testing.T, g prometheus.Gauge) float64 {
	t.Helper()
	var m dto.Metric
	if err := g.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetGauge().GetValue()
}

// Zero options take the documented defaults; set ones are kept; a negative claim or pool settle
// is none.
func TestOptionsDefaults(t *testing.T) {
	var zero Options
	zero.setDefaults()
	if zero.Workers != 4 || zero.MinSyncInterval != 100*time.Millisecond || zero.ResyncPeriod != time.Minute ||
		zero.BackoffBase != 250*time.Millisecond || zero.BackoffMax != 2*time.Minute || zero.PoolStatusInterval != time.Second ||
		zero.AuditPeriod != 10*time.Minute || zero.Exhaustion != DefaultExhaustionMarks || zero.Now == nil || zero.Fence == nil ||
		zero.ClaimSettle != time.Minute || zero.AgentLeaseDuration != time.Minute || zero.PoolSettle != time.Minute {
		t.Fatalf("defaults: %+v", zero)
	}
	set := Options{Workers: 1, MinSyncInterval: time.Millisecond, ResyncPeriod: time.Hour, BackoffBase: time.Second,
		BackoffMax: time.Hour, PoolStatusInterval: time.Minute, AuditPeriod: time.Hour, ClaimSettle: 3 * time.Second, PerNodeMetrics: true,
		AgentLeaseNamespace: "ns", AgentLeaseDuration: 20 * time.Second, PoolSettle: 5 * time.Second}
	want := set
	set.setDefaults()
	set.Now, set.Fence, set.Exhaustion = nil, nil, ExhaustionMarks{}
	if fmt.Sprintf("%+v", set) != fmt.Sprintf("%+v", want) {
		t.Fatalf("set options changed: %+v, want %+v", set, want)
	}
	// Defaults apply more than once (New, NewMachine, a replaying machine): none stays none.
	none := Options{ClaimSettle: -time.Second, PoolSettle: -time.Second}
	none.setDefaults()
	none.setDefaults()
	if none.ClaimSettle >= 0 || none.PoolSettle >= 0 {
		t.Fatalf("a negative claim settle became %s, pool settle %s, want none", none.ClaimSettle, none.PoolSettle)
	}
	c := New(nil, nil, nil, record.NewFakeRecorder(1), NewMetrics(nil), logr.Discard(), Options{ClaimSettle: -1, PoolSettle: -1})
	if c.m.opts.ClaimSettle >= 0 || c.m.opts.PoolSettle >= 0 {
		t.Fatalf("New turned no settle into %s and %s", c.m.opts.ClaimSettle, c.m.opts.PoolSettle)
	}
}

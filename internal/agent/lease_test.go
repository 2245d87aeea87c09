package agent

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/nodelease"
)

// A renewal at rest is one write and no read: the agent writes over the Lease as its own last
// write left it. A write by anyone else in between makes the renewal conflict, and the round then
// reads the Lease and follows what it says (here: another agent holds it, so ADD is refused).
func TestLeaseRenewalWritesWithoutReading(t *testing.T) {
	scheme := k8sruntime.NewScheme()
	_ = clientgoscheme.AddToScheme(scheme)
	var gets, updates atomic.Int64
	api := fake.NewClientBuilder().WithScheme(scheme).WithInterceptorFuncs(interceptor.Funcs{
		Get: func(ctx context.Context, c client.WithWatch, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
			gets.Add(1)
			return c.Get(ctx, key, obj, opts...)
		},
		Update: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.UpdateOption) error {
			updates.Add(1)
			return c.Update(ctx, obj, opts...)
		},
	}).Build()
	svc := NewService(ipam.New("node-a"), nil, ServiceOptions{Node: "node-a", AddressWait: time.Second, Gated: true, Log: logr.Discard()})
	l := NewNodeLease(api, "ipwarden-system", "node-a", "agent-a-1", time.Minute, 15*time.Second, svc, logr.Discard())
	ctx := context.Background()

	l.round(ctx) // creates it
	if !l.held || gets.Load() != 1 {
		t.Fatalf("first round: held %v after %d reads, want held after 1", l.held, gets.Load())
	}
	for range 5 {
		l.round(ctx)
	}
	if !l.held || gets.Load() != 1 || updates.Load() != 5 {
		t.Fatalf("five renewals: held %v, %d reads and %d writes; want 1 read in all and 5 writes", l.held, gets.Load(), updates.Load())
	}

	// Another agent (another journal) takes the Lease: the next renewal conflicts, reads, and
	// stands down.
	var lease coordinationv1.Lease
	key := client.ObjectKey{Namespace: "ipwarden-system", Name: nodelease.Name("node-a")}
	if err := api.Get(ctx, key, &lease); err != nil {
		t.Fatal(err)
	}
	other := "agent-b-2"
	lease.Spec.HolderIdentity = &other
	if err := api.Update(ctx, &lease); err != nil {
		t.Fatal(err)
	}
	reads := gets.Load()
	l.round(ctx)
	if l.held || l.holder != other {
		t.Fatalf("after another agent took the Lease: held %v holder %q, want not held, holder %q", l.held, l.holder, other)
	}
	if gets.Load() != reads+1 {
		t.Fatalf("the conflicting renewal read the Lease %d times, want 1", gets.Load()-reads)
	}
	svc.SetReady(true)
	if r := svc.Handle(ctx, addReq("c1")); r.Error == nil || !strings.Contains(r.Error.Msg, other) {
		t.Fatalf("ADD while another agent holds the Lease: %+v, want a refusal naming %s", r.Error, other)
	}

	// Deleted by hand: the renewal over the last write finds nothing and the round creates it.
	l2 := NewNodeLease(api, "ipwarden-system", "node-b", "agent-b-1", time.Minute, 15*time.Second, svc, logr.Discard())
	l2.round(ctx)
	if err := api.Delete(ctx, &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: "ipwarden-system", Name: nodelease.Name("node-b")}}); err != nil {
		t.Fatal(err)
	}
	l2.round(ctx)
	if !l2.held {
		t.Fatal("a Lease deleted by hand is not created again")
	}
	if err := api.Get(ctx, client.ObjectKey{Namespace: "ipwarden-system", Name: nodelease.Name("node-b")}, &lease); err != nil {
		t.Fatalf("the Lease deleted by hand: %v", err)
	}
}

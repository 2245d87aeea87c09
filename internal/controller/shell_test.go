package controller

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/go-logr/logr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/client-go/tools/record"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
)

// readerCache serves the shell's cache reads from a client (the shell tests need no informers).
type readerCache struct {
	cache.Cache
	r client.Reader
}

func (c readerCache) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	return c.r.Get(ctx, key, obj, opts...)
}

func (c readerCache) List(ctx context.Context, list client.ObjectList, opts ...client.ListOption) error {
	return c.r.List(ctx, list, opts...)
}

// shell is a Controller over controller-runtime's fake client, with interceptors that make the
// API server answer the node status write with a conflict, a timeout or a refusal.
func shell(t *testing.T, nodeStatusUpdate func(ctx context.Context, c client.Client, obj client.Object) error) (*Controller, client.Client) {
	t.Helper()
	s := runtime.NewScheme()
	if err := ipwardenv1.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	pool := testPool("p", "10.0.0.0/26", time.Minute)
	alloc := allocWith("n", "p")
	alloc.Spec = spec("p", 8)
	base := fake.NewClientBuilder().WithScheme(s).WithObjects(&pool, &alloc).
		WithStatusSubresource(&ipwardenv1.IPPool{}, &ipwardenv1.NodeIPAllocation{}).Build()
	c := interceptor.NewClient(base, interceptor.Funcs{
		SubResourceUpdate: func(ctx context.Context, c client.Client, sub string, obj client.Object, opts ...client.SubResourceUpdateOption) error {
			if _, ok := obj.(*ipwardenv1.NodeIPAllocation); ok && nodeStatusUpdate != nil {
				return nodeStatusUpdate(ctx, c, obj)
			}
			return c.Status().Update(ctx, obj, opts...)
		},
	})
	ctl := New(readerCache{r: c}, c, c, record.NewFakeRecorder(100), NewMetrics(nil), logr.Discard(), Options{Now: func() time.Time { return t0 }, ClaimSettle: -1})
	ctl.m.Record()
	lead(t, ctl, pool)
	return ctl, c
}

// lead starts ctl's machine leading with pool and node n, unfenced.
func lead(t *testing.T, ctl *Controller, pool ipwardenv1.IPPool) {
	t.Helper()
	if err := ctl.m.Lead([]ipwardenv1.IPPool{pool}, nil, nil, t0); err != nil {
		t.Fatal(err)
	}
	ctl.m.PoolChanged(&pool, t0)
	ctl.m.NodeChanged(&metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Name: "n", UID: "u-n"}}, t0)
}

// syncOnce delivers node n's NodeIPAllocation as the API server has it (the informer's part) and
// runs the machine against the fake client, one operation at a time, until nothing is in
// flight; it reports whether n's sync failed. Each call runs later than the last by more than
// any backoff (round hours after t0), so a failed sync runs again.
func syncOnce(t *testing.T, ctl *Controller, c client.Client, round int) (failed bool) {
	t.Helper()
	clock := t0.Add(time.Duration(round) * time.Hour)
	before := ctl.m.sched.Failures("n")
	ctl.m.AllocChanged(getAlloc(t, c), clock)
	for range 100 {
		rd := ctl.m.Ready(clock)
		ctl.m.Advance()
		if len(rd.Ops) == 0 && ctl.m.Idle() {
			return ctl.m.sched.Failures("n") > before
		}
		for _, op := range rd.Ops {
			ctl.m.Done(ctl.perform(context.Background(), op), clock)
		}
	}
	t.Fatal("the machine did not come to rest in 100 rounds")
	return false
}

func statusHeld(t *testing.T, c client.Client) addr.Set {
	t.Helper()
	var a ipwardenv1.NodeIPAllocation
	if err := c.Get(context.Background(), client.ObjectKey{Name: "n"}, &a); err != nil {
		t.Fatal(err)
	}
	var out addr.Set
	for _, p := range a.Status.Pools {
		s, _ := addr.ParseSet(p.Addresses)
		out = out.Union(s)
	}
	return out
}

func getAlloc(t *testing.T, c client.Client) *ipwardenv1.NodeIPAllocation {
	t.Helper()
	var a ipwardenv1.NodeIPAllocation
	if err := c.Get(context.Background(), client.ObjectKey{Name: "n"}, &a); err != nil {
		t.Fatal(err)
	}
	return &a
}

var gr = schema.GroupResource{Group: "ipwarden.io", Resource: "nodeipallocations"}

func TestShellConflictRetriesFromAFreshRead(t *testing.T) {
	calls := 0
	ctl, c := shell(t, func(ctx context.Context, c client.Client, obj client.Object) error {
		calls++
		if calls == 1 {
			return apierrors.NewConflict(gr, "n", errors.New("the object has been modified"))
		}
		return c.Status().Update(ctx, obj)
	})
	if syncOnce(t, ctl, c, 1) {
		t.Fatal("the sync failed")
	}
	st := ctl.m.state
	if calls != 2 || count(statusHeld(t, c)) != 8 || count(st.HeldBy("n")["p"]) != 8 || st.HasPending("n") {
		t.Fatalf("calls %d, status %v, record %v", calls, statusHeld(t, c), st.HeldBy("n"))
	}
}

// A write that landed but whose answer was lost: its addresses stay reserved, and the next sync
// settles them from a fresh read instead of writing a status without them.
func TestShellUnknownOutcomeSettlesFromAFreshRead(t *testing.T) {
	lost := true
	ctl, c := shell(t, func(ctx context.Context, c client.Client, obj client.Object) error {
		if err := c.Status().Update(ctx, obj); err != nil {
			return err
		}
		if lost {
			lost = false
			return apierrors.NewTimeoutError("the answer was lost", 1)
		}
		return nil
	})
	st := ctl.m.state
	if !syncOnce(t, ctl, c, 1) {
		t.Fatal("a write with an unknown outcome reported success")
	}
	landed := statusHeld(t, c)
	if count(landed) != 8 || !st.HasPending("n") {
		t.Fatalf("status %v, pending %v", landed, st.HasPending("n"))
	}
	// The node's spec is unchanged; the next sync adopts what landed and writes nothing new.
	if syncOnce(t, ctl, c, 2) {
		t.Fatal("the second sync failed")
	}
	if got := st.HeldBy("n")["p"]; !got.Equal(landed) || st.HasPending("n") {
		t.Fatalf("record %v after settling, status %v", got, landed)
	}
	if n := count(st.pool("p").alloc.Allocated()); n != 8 {
		t.Fatalf("pool allocated %d, want 8 (no address reserved twice)", n)
	}
}

// A refused write (invalid, forbidden, fenced) published nothing: its addresses go straight back.
func TestShellRejectedWriteReturnsItsAddresses(t *testing.T) {
	ctl, c := shell(t, func(ctx context.Context, c client.Client, obj client.Object) error {
		return apierrors.NewInvalid(schema.GroupKind{Group: "ipwarden.io", Kind: "NodeIPAllocation"}, "n",
			field.ErrorList{field.Invalid(field.NewPath("status"), "x", "bad")})
	})
	st := ctl.m.state
	if !syncOnce(t, ctl, c, 1) {
		t.Fatal("a refused write reported success")
	}
	if st.Holds("n") || st.HasPending("n") || !st.pool("p").alloc.Allocated().IsEmpty() {
		t.Fatalf("a refused write left the record holding %v", st.HeldBy("n"))
	}
	if !statusHeld(t, c).IsEmpty() {
		t.Fatal("the status changed")
	}
}

// Every write the controller makes names its field manager: New wraps the writer it is given.
func TestShellWritesAsFieldManager(t *testing.T) {
	var managers []string
	ctl, c := shell(t, nil)
	recording := interceptor.NewClient(c.(client.WithWatch), interceptor.Funcs{
		SubResourceUpdate: func(ctx context.Context, c client.Client, sub string, obj client.Object, opts ...client.SubResourceUpdateOption) error {
			o := &client.SubResourceUpdateOptions{}
			o.ApplyOptions(opts)
			managers = append(managers, o.FieldManager)
			return c.Status().Update(ctx, obj, opts...)
		},
	})
	_ = ctl
	fresh := New(readerCache{r: c}, c, recording, record.NewFakeRecorder(100), NewMetrics(nil), logr.Discard(), Options{Now: func() time.Time { return t0 }, ClaimSettle: -1})
	lead(t, fresh, testPool("p", "10.0.0.0/26", time.Minute))
	if syncOnce(t, fresh, c, 1) {
		t.Fatal("the sync failed")
	}
	if len(managers) == 0 {
		t.Fatal("the fill wrote no status")
	}
	for _, m := range managers {
		if m != "ipwarden-controller" {
			t.Errorf("status written with field manager %q, want ipwarden-controller (all: %v)", m, managers)
		}
	}
}

// The driver decides nothing: the operations Controller.run performed are exactly those a bare
// machine asks for when fed the same inputs and outcomes (Replay). internal/sim checks the same
// of the simulator, the machine's other driver.
func TestDriverPerformsWhatTheMachineAsks(t *testing.T) {
	calls := 0
	ctl, c := shell(t, func(ctx context.Context, c client.Client, obj client.Object) error {
		if calls++; calls == 1 {
			return apierrors.NewConflict(gr, "n", errors.New("the object has been modified"))
		}
		return c.Status().Update(ctx, obj)
	})
	script := ctl.m
	ctl.inbox.push(func(m *Machine, now time.Time) { m.AllocChanged(getAlloc(t, c), now) })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { ctl.run(ctx); close(done) }()
	deadline := time.Now().Add(10 * time.Second)
	for count(statusHeld(t, c)) != 8 {
		if time.Now().After(deadline) {
			cancel()
			<-done
			var ops []string
			for _, op := range script.Issued() {
				ops = append(ops, opName(op))
			}
			for _, in := range script.Script() {
				if in.Kind == InDone && in.Result.Err != nil {
					ops = append(ops, in.Result.Err.Error())
				}
			}
			t.Fatalf("the driver did not fill the node: status %v, operations %v", statusHeld(t, c), ops)
		}
		time.Sleep(10 * time.Millisecond) // polling the fake API server, not synchronizing the driver
	}
	cancel()
	<-done
	issued := script.Issued()
	if len(issued) < 3 {
		t.Fatalf("the driver performed %d operations, want the owner patch, the conflicting write and its retry", len(issued))
	}
	replayed, err := Replay(NewMachine(ctl.opts, NewMetrics(nil), logr.Discard()), script.Script())
	if err != nil {
		t.Fatal(err)
	}
	if err := SameOps(issued, replayed); err != nil {
		t.Fatalf("the driver's operations and the machine's differ: %v", err)
	}
}

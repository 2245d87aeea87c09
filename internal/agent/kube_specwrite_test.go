package agent

import (
	"context"
	"encoding/json"
	"net/http"
	"net/netip"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// The spec write's patch tests the record the mark names before it replaces the spec.
func TestMarkedSpecPatch(t *testing.T) {
	raw, err := markedSpecPatch(ipam.RecordMark{UID: "u1", Generation: 7}, nil, []ipwardenv1.ObservedPool{{Pool: "v4", UID: "p1", Generation: 2}})
	if err != nil {
		t.Fatal(err)
	}
	want := `[{"op":"test","path":"/metadata/uid","value":"u1"},{"op":"test","path":"/metadata/generation","value":7},` +
		`{"op":"add","path":"/spec/pools","value":[]},{"op":"add","path":"/spec/observedPools","value":[{"pool":"v4","uid":"p1","generation":2}]}]`
	if string(raw) != want {
		t.Fatalf("patch\n%s\nwant\n%s", raw, want)
	}
}

// After a refused spec write the fresh read decides: the marked record itself (the patch could
// not apply) is written onto exactly; any other is handed over first; a conflict is retried.
func TestRefusedSpecWrite(t *testing.T) {
	mark := ipam.RecordMark{UID: "u1", Generation: 5}
	cases := []struct {
		name     string
		conflict bool
		uid      string
		gen      int64
		want     refusedStep
	}{
		{"a conflict of the unmarked write", true, "u1", 6, refusedRetry},
		{"the marked record: the patch itself was refused", false, "u1", 5, refusedWriteOnto},
		{"rewound", false, "u1", 4, refusedHandOver},
		{"written by someone else since", false, "u1", 6, refusedHandOver},
		{"re-created", false, "u2", 5, refusedHandOver},
	}
	for _, tc := range cases {
		if got := refusedSpecWrite(mark, tc.conflict, tc.uid, tc.gen); got != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, got, tc.want)
		}
	}
}

// staleCache is the agent's informer cache showing an older copy of the node's record.
type staleCache struct {
	cache.Cache
	nipa *ipwardenv1.NodeIPAllocation
}

func (c staleCache) Get(_ context.Context, _ client.ObjectKey, obj client.Object, _ ...client.GetOption) error {
	c.nipa.DeepCopyInto(obj.(*ipwardenv1.NodeIPAllocation))
	return nil
}

// apiLike is a fake API client with the two behaviours of the API server the spec write relies
// on (checked against the real one in test/integration TestSpecWriteFacts): a write that changes
// the spec increments metadata.generation and one that changes nothing keeps it, and a JSON
// patch whose test fails writes nothing and is answered 422. With noSpec every JSON patch is
// refused so, as on a real object created without a spec (its "add" has no parent).
func apiLike(t *testing.T, noSpec bool, objs ...client.Object) client.Client {
	t.Helper()
	s := runtime.NewScheme()
	if err := ipwardenv1.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	return fake.NewClientBuilder().WithScheme(s).WithObjects(objs...).WithStatusSubresource(&ipwardenv1.NodeIPAllocation{}).
		WithInterceptorFuncs(interceptor.Funcs{Patch: func(ctx context.Context, c client.WithWatch, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
			before := &ipwardenv1.NodeIPAllocation{}
			if err := c.Get(ctx, client.ObjectKeyFromObject(obj), before); err != nil {
				return err
			}
			if noSpec && patch.Type() == types.JSONPatchType {
				return apierrors.NewGenericServerResponse(http.StatusUnprocessableEntity, "", schema.GroupResource{}, "", "add operation does not apply: doc is missing path: \"/spec/pools\"", 0, false)
			}
			if err := c.Patch(ctx, obj, patch, opts...); err != nil {
				if _, ok := err.(apierrors.APIStatus); !ok && strings.Contains(err.Error(), "test") {
					return apierrors.NewGenericServerResponse(http.StatusUnprocessableEntity, "", schema.GroupResource{}, "", err.Error(), 0, false)
				}
				return err
			}
			after := obj.(*ipwardenv1.NodeIPAllocation)
			if equality.Semantic.DeepEqual(before.Spec, after.Spec) {
				return nil
			}
			after.Generation = before.Generation + 1
			return c.Update(ctx, after)
		}}).Build()
}

// The spec write lands only on the record the node's mark names, and judges it before writing:
//   - a write that changes nothing on the current record (the cache lagged behind the node's
//     own last write) keeps the mark's generation, and is no rewind: CI once saw the old rule
//     (judge after an unconditional write) release a live IPAMClaim's address so;
//   - a record restored from a backup the node wrote once after (k=1: its write would produce
//     the mark's generation) is distrusted before the write: what it shows beyond the node's
//     last holding is released;
//   - a re-created record is distrusted too.
func TestPublishSpecJudgesTheRecordBeforeItWrites(t *testing.T) {
	const mark = 5
	trusted, extra := "10.1.0.2-10.1.0.5", "10.1.0.6"
	cases := []struct {
		name        string
		uid         string
		gen         int64 // the record on the API server
		sameSpec    bool  // its spec is the one the node would write
		noSpec      bool  // it has no spec to add to
		wantRelease bool
		wantMark    ipam.RecordMark
	}{
		{"a write that changes nothing on the current record", "u1", mark, true, false, false, ipam.RecordMark{UID: "u1", Generation: mark}},
		{"the node's next write on the current record", "u1", mark, false, false, false, ipam.RecordMark{UID: "u1", Generation: mark + 1}},
		{"the current record without a spec to add to", "u1", mark, false, true, false, ipam.RecordMark{UID: "u1", Generation: mark + 1}},
		{"restored from a backup the node wrote once after", "u1", mark - 1, false, false, true, ipam.RecordMark{UID: "u1", Generation: mark}},
		{"restored from a backup the node wrote twice after", "u1", mark - 2, false, false, true, ipam.RecordMark{UID: "u1", Generation: mark - 1}},
		{"written by someone else since", "u1", mark + 1, false, false, false, ipam.RecordMark{UID: "u1", Generation: mark + 2}},
		{"re-created", "u2", 1, false, false, true, ipam.RecordMark{UID: "u2", Generation: 2}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newSvc(t, 0, testV4)
			if err := h.svc.SetHoldings(map[string]addr.Set{"v4": addr.MustParseSetString(trusted)}, RecordOf{UID: "u1", Generation: mark}); err != nil {
				t.Fatal(err)
			}
			if got := h.svc.Mark(); got != (ipam.RecordMark{UID: "u1", Generation: mark}) {
				t.Fatalf("mark %+v before the write", got)
			}
			desired := specPools(h.svc.Spec())
			server := &ipwardenv1.NodeIPAllocation{}
			server.Name, server.UID, server.Generation = "node-a", types.UID(tc.uid), tc.gen
			if tc.sameSpec {
				server.Spec.Pools = desired
			}
			server.Status.Pools = []ipwardenv1.NodePoolStatus{{Pool: "v4", Addresses: []string{trusted, extra}}}
			api := apiLike(t, tc.noSpec, server)
			// The cache shows an older copy whose spec differs, so the node writes.
			old := server.DeepCopy()
			old.Generation = tc.gen - 1
			old.ResourceVersion = "1"
			old.Spec.Pools = nil
			k := &Kube{node: "node-a", cache: staleCache{nipa: old}, api: api, svc: h.svc, log: h.svc.log}
			wrote, err := k.PublishSpec(context.Background(), h.svc.Spec())
			if err != nil {
				t.Fatal(err)
			}
			if !wrote {
				t.Fatal("PublishSpec wrote nothing")
			}
			released := false
			for _, r := range h.svc.Spec() {
				released = released || r.Releasing.Contains(netip.MustParseAddr(extra))
			}
			if released != tc.wantRelease {
				t.Errorf("%s released: %v, want %v", extra, released, tc.wantRelease)
			}
			if got := h.svc.Mark(); got != tc.wantMark {
				t.Errorf("mark %+v, want %+v", got, tc.wantMark)
			}
			var got ipwardenv1.NodeIPAllocation
			if err := api.Get(context.Background(), client.ObjectKey{Name: "node-a"}, &got); err != nil {
				t.Fatal(err)
			}
			if got.Generation != tc.wantMark.Generation {
				t.Errorf("the record's generation is %d, want the mark's %d", got.Generation, tc.wantMark.Generation)
			}
			if g, w := mustJSON(t, got.Spec.Pools), mustJSON(t, specPools(h.svc.Spec())); g != w {
				t.Errorf("the record's spec.pools %s, want %s", g, w)
			}
		})
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

package integration

import (
	"context"
	"fmt"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
)

// The agent's spec write (agent.Kube.PublishSpec) lands only on the record its mark names: a
// JSON patch that tests metadata.uid and metadata.generation. It relies on what the real API
// server does, which the unit test's fake copies (internal/agent
// TestPublishSpecJudgesTheRecordBeforeItWrites): a status write keeps the generation, a spec write
// that changes nothing keeps it, one that changes the spec increments it, and a patch whose test
// fails is answered 422 (Invalid) and writes nothing. An object created without a spec refuses
// the patch's "add" the same way, which the agent meets with a write preconditioned on a fresh
// read.
func TestSpecWriteFacts(t *testing.T) {
	ctx := context.Background()
	obj := &ipwardenv1.NodeIPAllocation{}
	obj.Name = "specwrite-facts"
	if err := k8s.Create(ctx, obj); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), obj) })
	gen := obj.Generation

	obj.Status.Pools = []ipwardenv1.NodePoolStatus{{Pool: "v4", Addresses: []string{"10.1.0.2"}}}
	if err := k8s.Status().Update(ctx, obj); err != nil {
		t.Fatal(err)
	}
	if obj.Generation != gen {
		t.Fatalf("a status write moved the generation from %d to %d", gen, obj.Generation)
	}
	marked := func(uid types.UID, gen int64, requested int) client.Patch {
		return client.RawPatch(types.JSONPatchType, fmt.Appendf(nil, `[{"op":"test","path":"/metadata/uid","value":%q},`+
			`{"op":"test","path":"/metadata/generation","value":%d},{"op":"add","path":"/spec/pools","value":[{"pool":"v4","requested":%d}]},`+
			`{"op":"add","path":"/spec/observedPools","value":[]}]`, uid, gen, requested))
	}
	if err := k8s.Patch(ctx, obj, marked(obj.UID, gen, 4)); err != nil {
		t.Fatalf("the write onto the marked record: %v", err)
	}
	if obj.Generation != gen+1 {
		t.Fatalf("a spec write that changes the spec: generation %d, want %d", obj.Generation, gen+1)
	}
	gen = obj.Generation
	if err := k8s.Patch(ctx, obj, marked(obj.UID, gen, 4)); err != nil {
		t.Fatal(err)
	}
	if obj.Generation != gen {
		t.Fatalf("a spec write that changes nothing: generation %d, want %d", obj.Generation, gen)
	}
	rv := obj.ResourceVersion
	for _, p := range []client.Patch{marked(obj.UID, gen-1, 8), marked(obj.UID, gen+1, 8), marked("another-uid", gen, 8)} {
		err := k8s.Patch(ctx, obj.DeepCopy(), p)
		if !apierrors.IsInvalid(err) {
			t.Fatalf("a write whose test fails: %v, want 422 Invalid", err)
		}
	}
	if err := k8s.Get(ctx, client.ObjectKeyFromObject(obj), obj); err != nil {
		t.Fatal(err)
	}
	if obj.ResourceVersion != rv || obj.Spec.Pools[0].Requested != 4 {
		t.Fatalf("refused writes changed the record: resourceVersion %s (was %s), spec %+v", obj.ResourceVersion, rv, obj.Spec.Pools)
	}

	bare := &unstructured.Unstructured{}
	bare.SetAPIVersion(ipwardenv1.SchemeGroupVersion.String())
	bare.SetKind("NodeIPAllocation")
	bare.SetName("specwrite-facts-bare")
	if err := k8s.Create(ctx, bare); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), bare) })
	if _, found, _ := unstructured.NestedMap(bare.Object, "spec"); found {
		t.Fatal("the object created without a spec has one: the case proves nothing")
	}
	err := k8s.Patch(ctx, bare, marked(bare.GetUID(), bare.GetGeneration(), 4))
	if !apierrors.IsInvalid(err) {
		t.Fatalf("the write onto an object without a spec: %v, want 422 Invalid", err)
	}
}

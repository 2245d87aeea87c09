package agent

import (
	"context"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/previous"
)

// whereaboutsPoolList is the list kind of Whereabouts' IPPool objects, whose allocations are its
// reservations (package previous).
var whereaboutsPoolList = schema.GroupVersionKind{Group: "whereabouts.cni.cncf.io", Version: "v1alpha1", Kind: "IPPoolList"}

// ListWhereaboutsPools lists Whereabouts' IPPool objects in every namespace (Whereabouts keeps
// them in its kubeconfig context's namespace, kube-system by default) from the API server, not a
// cache: an allocation committed a moment ago must be in the reading. One list per ADD whose
// "previous" IPAM is Whereabouts; Whereabouts has one IPPool per range (per node and range in its
// node-slice mode), so the list is small. RBAC: list ippools.whereabouts.cni.cncf.io.
func (k *Kube) ListWhereaboutsPools(ctx context.Context) ([]previous.WhereaboutsPool, error) {
	pools, _, err := k.listWhereaboutsPools(ctx)
	return pools, err
}

func (k *Kube) listWhereaboutsPools(ctx context.Context) ([]previous.WhereaboutsPool, map[string]*unstructured.Unstructured, error) {
	list := &unstructured.UnstructuredList{}
	list.SetGroupVersionKind(whereaboutsPoolList)
	if err := k.meta.List(ctx, list); err != nil {
		return nil, nil, fmt.Errorf("list Whereabouts' IPPools (whereabouts.cni.cncf.io/v1alpha1): %w", err)
	}
	out := make([]previous.WhereaboutsPool, 0, len(list.Items))
	objs := make(map[string]*unstructured.Unstructured, len(list.Items))
	for i := range list.Items {
		it := &list.Items[i]
		p := previous.WhereaboutsPoolOf(it.Object)
		p.Name = it.GetNamespace() + "/" + it.GetName()
		out = append(out, p)
		objs[p.Name] = it
	}
	return out, objs, nil
}

// EditWhereaboutsPools writes ipwarden's own allocations into Whereabouts' IPPools, or removes
// them (package previous, reserve.go): it lists the IPPools fresh, lets plan decide, and updates
// each IPPool plan edits with the resourceVersion it was listed at, so an update racing
// Whereabouts' own (which commits its allocations the same way) fails with a conflict instead of
// overwriting it; then it lists and plans again, after a pause of 5 to 50 ms, until ctx ends.
// One list and one update per IPPool edited. RBAC: list and update
// ippools.whereabouts.cni.cncf.io.
func (k *Kube) EditWhereaboutsPools(ctx context.Context, plan func([]previous.WhereaboutsPool) ([]previous.WhereaboutsEdit, addr.Set, error)) (addr.Set, error) {
	// The agent's own edits go one at a time: concurrent ADDs would otherwise conflict with
	// each other on the same IPPool and list again; only Whereabouts' updates remain to race.
	k.wbEditMu.Lock()
	defer k.wbEditMu.Unlock()
	pause := 5 * time.Millisecond
	for {
		pools, objs, err := k.listWhereaboutsPools(ctx)
		if err != nil {
			return addr.Set{}, err
		}
		edits, taken, err := plan(pools)
		if err != nil || !taken.IsEmpty() {
			return taken, err
		}
		conflict := false
		for _, e := range edits {
			obj := objs[e.Pool].DeepCopy()
			if err := applyWhereaboutsEdit(obj, e); err != nil {
				return addr.Set{}, err
			}
			if err := k.prevw.Update(ctx, obj); err != nil {
				if apierrors.IsConflict(err) {
					conflict = true
					break
				}
				return addr.Set{}, fmt.Errorf("update Whereabouts' IPPool %s: %w", e.Pool, err)
			}
		}
		if !conflict {
			return addr.Set{}, nil
		}
		select {
		case <-ctx.Done():
			return addr.Set{}, fmt.Errorf("the Whereabouts IPPools kept changing under ipwarden's update: %w", ctx.Err())
		case <-time.After(pause):
		}
		pause = min(2*pause, 50*time.Millisecond)
	}
}

// applyWhereaboutsEdit changes obj's spec.allocations as e says.
func applyWhereaboutsEdit(obj *unstructured.Unstructured, e previous.WhereaboutsEdit) error {
	allocs, _, err := unstructured.NestedMap(obj.Object, "spec", "allocations")
	if err != nil {
		return fmt.Errorf("the Whereabouts IPPool %s: spec.allocations: %w", e.Pool, err)
	}
	if allocs == nil {
		allocs = map[string]any{}
	}
	for off, a := range e.Add {
		v := map[string]any{"id": a.ID, "podref": a.PodRef}
		if a.IfName != "" {
			v["ifname"] = a.IfName
		}
		allocs[off] = v
	}
	for _, off := range e.Remove {
		delete(allocs, off)
	}
	return unstructured.SetNestedMap(obj.Object, allocs, "spec", "allocations")
}

package agent

import (
	"context"
	"fmt"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"

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
	list := &unstructured.UnstructuredList{}
	list.SetGroupVersionKind(whereaboutsPoolList)
	if err := k.meta.List(ctx, list); err != nil {
		return nil, fmt.Errorf("list Whereabouts' IPPools (whereabouts.cni.cncf.io/v1alpha1): %w", err)
	}
	out := make([]previous.WhereaboutsPool, 0, len(list.Items))
	for _, it := range list.Items {
		p := previous.WhereaboutsPoolOf(it.Object)
		p.Name = it.GetNamespace() + "/" + it.GetName()
		out = append(out, p)
	}
	return out, nil
}

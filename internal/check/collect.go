package check

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/ipamclaim"
	"github.com/ipwarden/ipwarden/internal/podinfo"
)

// Collect reads a snapshot from the API server in the order Input asks for (pools, pods,
// NodeIPAllocations, Nodes). It only lists: it takes no lock and blocks nothing. Pods are read a
// page at a time.
func Collect(ctx context.Context, c client.Reader) (Input, error) {
	in := Input{Now: time.Now()}
	var pools ipwardenv1.IPPoolList
	if err := c.List(ctx, &pools); err != nil {
		return in, fmt.Errorf("list IPPools: %w", err)
	}
	in.Pools = pools.Items
	opts := []client.ListOption{client.Limit(500)}
	for {
		var pods corev1.PodList
		if err := c.List(ctx, &pods, opts...); err != nil {
			return in, fmt.Errorf("list pods: %w", err)
		}
		for i := range pods.Items {
			in.Pods = append(in.Pods, PodOf(&pods.Items[i]))
		}
		if pods.Continue == "" {
			break
		}
		opts = []client.ListOption{client.Limit(500), client.Continue(pods.Continue)}
	}
	var allocs ipwardenv1.NodeIPAllocationList
	if err := c.List(ctx, &allocs); err != nil {
		return in, fmt.Errorf("list NodeIPAllocations: %w", err)
	}
	in.Allocs = allocs.Items
	nodes := &metav1.PartialObjectMetadataList{}
	nodes.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("NodeList"))
	if err := c.List(ctx, nodes); err != nil {
		return in, fmt.Errorf("list nodes: %w", err)
	}
	for _, n := range nodes.Items {
		in.Nodes = append(in.Nodes, n.Name)
	}
	// IPAMClaims, when the CRD is installed and readable (else their bindings are not checked
	// against them).
	claims := &unstructured.UnstructuredList{}
	claims.SetGroupVersionKind(ipamclaim.GroupVersionResource.GroupVersion().WithKind("IPAMClaimList"))
	if err := c.List(ctx, claims); err == nil {
		in.Claims = []ClaimRef{}
		for _, it := range claims.Items {
			in.Claims = append(in.Claims, ClaimRef{Namespace: it.GetNamespace(), Name: it.GetName(), UID: string(it.GetUID())})
		}
	}
	return in, nil
}

// PodOf extracts what the checker needs of a pod (through package podinfo, the one Pod
// conversion the agent uses too). A pod runs, for the checker, when it is bound, may run, is not
// being deleted and has addresses.
func PodOf(p *corev1.Pod) Pod {
	v := podinfo.Of(p)
	return Pod{Namespace: v.Namespace, Name: v.Name, UID: v.UID, Node: v.Node, IPs: v.IPs,
		Running: v.Node != "" && v.MayRun() && !v.Deleting && len(v.IPs) > 0}
}

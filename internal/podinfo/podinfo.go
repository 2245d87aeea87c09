// Package podinfo is the one conversion of a Pod object into what ipwarden reads of it: identity,
// node, addresses, and whether its sandbox may be running. The agent and `ipwarden check` both
// read pods through Of, so they agree on what a finished, deleting or host-network pod is.
package podinfo

import (
	"net/netip"

	corev1 "k8s.io/api/core/v1"
)

// Annotations a pod (and, for AnnotationPools, its namespace) sets to choose its addresses
// (docs/design.md, "Choosing pools and addresses").
const (
	// AnnotationPools names the IPPools a pod draws from, comma-separated, one per family.
	AnnotationPools = "ipwarden.io/pools"
	// AnnotationIPAddresses asks for exact addresses, comma-separated, one per family.
	AnnotationIPAddresses = "ipwarden.io/ip-addresses"
)

// Pod is what ipwarden reads of a Pod object.
type Pod struct {
	Namespace, Name, UID string
	// Node is spec.nodeName; empty while unscheduled.
	Node string
	// IPs are status.podIPs that parse as addresses.
	IPs []netip.Addr
	// HostNetwork pods get no address from ipwarden.
	HostNetwork bool
	// Finished is set for pods in phase Succeeded or Failed: their sandbox is gone.
	Finished bool
	// Deleting is set once the pod has a deletion timestamp; its sandbox may still run.
	Deleting bool
	// Pools is the ipwarden.io/pools annotation as written ("" when unset).
	Pools string
	// IPAddresses is the ipwarden.io/ip-addresses annotation as written ("" when unset).
	IPAddresses string
}

// Of converts a Pod object.
func Of(p *corev1.Pod) Pod {
	out := Pod{
		Namespace:   p.Namespace,
		Name:        p.Name,
		UID:         string(p.UID),
		Node:        p.Spec.NodeName,
		HostNetwork: p.Spec.HostNetwork,
		Finished:    p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed,
		Deleting:    p.DeletionTimestamp != nil,
		Pools:       p.Annotations[AnnotationPools],
		IPAddresses: p.Annotations[AnnotationIPAddresses],
	}
	for _, ip := range p.Status.PodIPs {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			out.IPs = append(out.IPs, a)
		}
	}
	return out
}

// MayRun reports whether the pod's sandbox may be running with ipwarden's addresses: it is not on
// the host network and has not finished. A deleting pod may still run.
func (p Pod) MayRun() bool { return !p.HostNetwork && !p.Finished }

// Package podinfo is the one conversion of a Pod object into what ipwarden reads of it: identity,
// node, addresses, and whether its sandbox may be running. The agent and `ipwarden check` both
// read pods through Of, so they agree on what a finished, deleting or host-network pod is.
package podinfo

import (
	"encoding/json"
	"net/netip"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// Annotations a pod (and, for AnnotationPools, its namespace) sets to choose its addresses
// (docs/design.md, "Choosing pools and addresses").
const (
	// AnnotationPools names the IPPools a pod draws from, comma-separated, one per family.
	AnnotationPools = "ipwarden.io/pools"
	// AnnotationIPAddresses asks for exact addresses, comma-separated, one per family.
	AnnotationIPAddresses = "ipwarden.io/ip-addresses"
	// AnnotationSticky: "true" in a StatefulSet's pod template keeps each pod's addresses with
	// its identity (docs/design.md, "Sticky StatefulSet addresses").
	AnnotationSticky = "ipwarden.io/sticky"
	// LabelPodIndex is the ordinal label the StatefulSet controller sets (Kubernetes 1.28+).
	LabelPodIndex = "apps.kubernetes.io/pod-index"
	// AnnotationNetworkStatus is what Multus writes after a pod's ADDs: every interface's network
	// and addresses (the NPWG network-status annotation). status.podIPs shows only the default
	// network's.
	AnnotationNetworkStatus = "k8s.v1.cni.cncf.io/network-status"
)

// NetworkStatus is one entry of the network-status annotation.
type NetworkStatus struct {
	// Name is the network's name as Multus writes it: "<namespace>/<attachment>" for a secondary
	// network, the cluster network's name for the default one.
	Name      string
	Interface string
	IPs       []netip.Addr
	// Default marks the pod's default network (the one status.podIPs shows).
	Default bool
}

// Names reports whether the entry is network (an IPPool's spec.network, a CNI network name): its
// name with or without the namespace Multus puts in front. The default network's entry names no
// secondary network.
func (n NetworkStatus) Names(network string) bool {
	if network == "" || n.Default {
		return false
	}
	if n.Name == network {
		return true
	}
	_, short, ok := strings.Cut(n.Name, "/")
	return ok && short == network
}

// maxNetworkStatus bounds the annotation the agent parses (the API server bounds all of a pod's
// annotations at 256 KiB; a pod has a handful of interfaces).
const maxNetworkStatus = 64 << 10

// ParseNetworkStatus reads the network-status annotation; a malformed or oversized one reads as
// none (it is a report that can only add protection, never a proof).
func ParseNetworkStatus(v string) []NetworkStatus {
	if v == "" || len(v) > maxNetworkStatus {
		return nil
	}
	var raw []struct {
		Name      string   `json:"name"`
		Interface string   `json:"interface"`
		IPs       []string `json:"ips"`
		Default   bool     `json:"default"`
	}
	if json.Unmarshal([]byte(v), &raw) != nil {
		return nil
	}
	out := make([]NetworkStatus, 0, len(raw))
	for _, r := range raw {
		n := NetworkStatus{Name: r.Name, Interface: r.Interface, Default: r.Default}
		for _, ip := range r.IPs {
			// Multus writes bare addresses; accept CIDR form too.
			if a, err := netip.ParseAddr(ip); err == nil {
				n.IPs = append(n.IPs, a)
			} else if p, err := netip.ParsePrefix(ip); err == nil {
				n.IPs = append(n.IPs, p.Addr())
			}
		}
		out = append(out, n)
	}
	return out
}

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
	// StatefulSet names the StatefulSet that controls the pod ("" when none) and Ordinal is the
	// pod's ordinal in it (-1 when unknown); Sticky is the ipwarden.io/sticky opt-in.
	StatefulSet string
	Ordinal     int
	Sticky      bool
	// Networks is the Multus network-status annotation (nil when absent or malformed).
	Networks []NetworkStatus
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
	out.StatefulSet, out.Ordinal = statefulSetIdentity(p)
	out.Sticky = p.Annotations[AnnotationSticky] == "true"
	out.Networks = ParseNetworkStatus(p.Annotations[AnnotationNetworkStatus])
	for _, ip := range p.Status.PodIPs {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			out.IPs = append(out.IPs, a)
		}
	}
	return out
}

// statefulSetIdentity returns the StatefulSet controlling p and p's ordinal: the pod-index
// label, else the suffix of the pod's name after "<statefulset>-". No controller of kind
// StatefulSet: "", -1.
func statefulSetIdentity(p *corev1.Pod) (string, int) {
	var sts string
	for _, o := range p.OwnerReferences {
		if o.Controller != nil && *o.Controller && o.Kind == "StatefulSet" && strings.HasPrefix(o.APIVersion, "apps/") {
			sts = o.Name
			break
		}
	}
	if sts == "" {
		return "", -1
	}
	if v, ok := p.Labels[LabelPodIndex]; ok {
		if n, err := strconv.Atoi(v); err == nil && n >= 0 {
			return sts, n
		}
	}
	if rest, ok := strings.CutPrefix(p.Name, sts+"-"); ok {
		if n, err := strconv.Atoi(rest); err == nil && n >= 0 && strconv.Itoa(n) == rest {
			return sts, n
		}
	}
	return sts, -1
}

// MayRun reports whether the pod's sandbox may be running with ipwarden's addresses: it is not on
// the host network and has not finished. A deleting pod may still run.
func (p Pod) MayRun() bool { return !p.HostNetwork && !p.Finished }

// Package ipamclaim reads what ipwarden needs of IPAMClaims (k8s.cni.cncf.io/v1alpha1, the
// k8snetworkplumbingwg/ipamclaims CRD) and of the pods that reference them: which claim an
// attachment references, whether the pod is a live migration's target, and the addresses a
// claim's status names (docs/design.md, "VM addresses"). Pure functions, no IO.
package ipamclaim

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// Annotations and labels that point a pod's attachment at its claim (multi-net-spec v1.3,
// kubevirt/ipam-extensions).
const (
	// AnnotationNetworks is Multus' network-selection annotation: a comma-separated list of
	// names or a JSON list of elements, which may carry "ipam-claim-reference".
	AnnotationNetworks = "k8s.v1.cni.cncf.io/networks"
	// AnnotationDefaultNetwork is Multus' default-network element (the pod network).
	AnnotationDefaultNetwork = "v1.multus-cni.io/default-network"
	// AnnotationPrimaryClaim is OVN-Kubernetes' legacy pod-network claim reference, which
	// ipam-extensions always sets.
	AnnotationPrimaryClaim = "k8s.ovn.org/primary-udn-ipamclaim"
	// LabelMigrationTarget marks a live migration's target pod (KubeVirt).
	LabelMigrationTarget = "kubevirt.io/migrationJobUID"
	// PodInterface is the pod network's interface name.
	PodInterface = "eth0"
)

// GroupVersionResource of IPAMClaims.
var GroupVersionResource = schema.GroupVersionResource{Group: "k8s.cni.cncf.io", Version: "v1alpha1", Resource: "ipamclaims"}

// maxAnnotation bounds what is parsed (the API server bounds all of a pod's annotations at
// 256 KiB).
const maxAnnotation = 64 << 10

// element is one network-selection element.
type element struct {
	Name      string `json:"name"`
	Namespace string `json:"namespace,omitempty"`
	Interface string `json:"interface,omitempty"`
	Claim     string `json:"ipam-claim-reference,omitempty"`
}

// parseElements reads a network-selection annotation: a JSON list, a JSON object (the
// default-network form), or a comma-separated list of names (which carry no claim).
func parseElements(key, v string) ([]element, error) {
	v = strings.TrimSpace(v)
	if v == "" {
		return nil, nil
	}
	if len(v) > maxAnnotation {
		return nil, fmt.Errorf("annotation %s is longer than %d bytes", key, maxAnnotation)
	}
	switch v[0] {
	case '[':
		var es []element
		if err := json.Unmarshal([]byte(v), &es); err != nil {
			return nil, fmt.Errorf("annotation %s is not a list of network-selection elements: %v", key, err)
		}
		return es, nil
	case '{':
		var e element
		if err := json.Unmarshal([]byte(v), &e); err != nil {
			return nil, fmt.Errorf("annotation %s is not a network-selection element: %v", key, err)
		}
		return []element{e}, nil
	}
	return nil, nil // names only: no claim
}

// Reference returns the name of the IPAMClaim an attachment references ("" when none), read
// from the pod's annotations as Whereabouts and OVN-Kubernetes do:
//   - argsRef (the configuration's args.cni "ipam-claim-reference", which Multus copies from an
//     element's cni-args) wins;
//   - the pod network (ifname eth0): the default-network element's reference, else the legacy
//     k8s.ovn.org/primary-udn-ipamclaim annotation;
//   - another interface: the networks element whose interface is ifname, else the one whose
//     name is network, else the only element that carries a reference.
//
// A malformed annotation is an error: a claim the pod asks for is never silently ignored.
func Reference(annotations map[string]string, ifname, network, argsRef string) (string, error) {
	if argsRef != "" {
		return argsRef, nil
	}
	if ifname == PodInterface {
		es, err := parseElements(AnnotationDefaultNetwork, annotations[AnnotationDefaultNetwork])
		if err != nil {
			return "", err
		}
		for _, e := range es {
			if e.Claim != "" {
				return e.Claim, nil
			}
		}
		return strings.TrimSpace(annotations[AnnotationPrimaryClaim]), nil
	}
	es, err := parseElements(AnnotationNetworks, annotations[AnnotationNetworks])
	if err != nil {
		return "", err
	}
	for _, e := range es {
		if e.Interface != "" && e.Interface == ifname {
			return e.Claim, nil
		}
	}
	for _, e := range es {
		if e.Interface == "" && network != "" && e.Name == network {
			return e.Claim, nil
		}
	}
	var only string
	n := 0
	for _, e := range es {
		if e.Claim != "" && e.Interface == "" {
			only, n = e.Claim, n+1
		}
	}
	if n == 1 {
		return only, nil
	}
	return "", nil
}

// MigrationTarget reports whether a pod's labels mark it as a live migration's target.
func MigrationTarget(labels map[string]string) bool { return labels[LabelMigrationTarget] != "" }

// ParseIPs reads a claim's status.ips: CIDR form (as OVN-Kubernetes and ipwarden write it) or
// bare addresses (as Whereabouts writes them). An entry that is neither is an error.
func ParseIPs(ips []string) ([]netip.Addr, error) {
	out := make([]netip.Addr, 0, len(ips))
	for _, s := range ips {
		if p, err := netip.ParsePrefix(s); err == nil {
			out = append(out, p.Addr())
			continue
		}
		a, err := netip.ParseAddr(s)
		if err != nil {
			return nil, fmt.Errorf("status.ips entry %q is neither an address nor a CIDR", s)
		}
		out = append(out, a)
	}
	return out, nil
}

// FormatIP writes an address in the claim's status.ips form: CIDR with the pool's prefix
// length, canonical (netip's form).
func FormatIP(a netip.Addr, bits int) string { return netip.PrefixFrom(a, bits).String() }

// Served decides from the API server's discovery answer for GroupVersionResource's group and
// version (ServerResourcesForGroupVersion's result) whether it serves ipamclaims: the CRD is
// installed.
func Served(res *metav1.APIResourceList, err error) bool {
	if err != nil || res == nil {
		return false
	}
	for _, r := range res.APIResources {
		if r.Name == GroupVersionResource.Resource {
			return true
		}
	}
	return false
}

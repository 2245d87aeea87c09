package ipam

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/ipwarden/ipwarden/internal/sticky"
)

// Pool choice (docs/design.md, "Choosing pools and addresses"): a pod's ipwarden.io/pools
// annotation, else its namespace's, else the CNI config's "pools", else the pools that select the
// node. A pool's namespaceSelector is enforced whatever named it. ADD and the node's demand both
// choose through choosePools, so the request counts each pod in the pools its ADD will draw from.

// Where a pod's pools come from, in order of precedence.
const (
	SourcePod       = "pod annotation ipwarden.io/pools"
	SourceNamespace = "namespace annotation ipwarden.io/pools"
	SourceConfig    = "network configuration field pools"
	SourceNode      = "pools that select the node"
)

// MaxPoolNames bounds the pools one annotation may name.
const MaxPoolNames = 8

// Namespace is what pool choice reads of a namespace.
type Namespace struct {
	Labels map[string]string
	// Pools is its ipwarden.io/pools annotation as written.
	Pools string
}

// PodMeta is what pool choice reads of a pod at ADD: its annotations and its namespace.
type PodMeta struct {
	// Pools and IPAddresses are the pod's annotations as written ("" when unset or unknown).
	Pools       string
	IPAddresses string
	// Namespace is the pod's namespace; NamespaceKnown is false when the agent could not read
	// it (then only pools without a namespaceSelector admit the pod).
	Namespace      Namespace
	NamespaceKnown bool
	// Identity is the pod's StatefulSet identity (StatefulSet "" when none); Sticky its
	// ipwarden.io/sticky opt-in.
	Identity sticky.Identity
	Sticky   bool
	// Claim is the IPAMClaim the attachment references (nil: none), read by the driver from
	// the pod's annotations and the claim itself (claim.go); ClaimIPs are the addresses the
	// claim's status.ips names. ClaimProblem, when set, is why the claim cannot be used (no
	// CRD, no such claim, another network): the ADD fails with it (CNI code 11).
	Claim        *ClaimRef
	ClaimIPs     []netip.Addr
	ClaimProblem string
	// NetworkAnnotations are the pod's annotations that may reference an IPAMClaim (package
	// ipamclaim), and MigrationTarget its kubevirt.io/migrationJobUID label: what the driver
	// reads the claim from.
	NetworkAnnotations map[string]string
	MigrationTarget    bool
	// ResourceClaims are the names of the ResourceClaims the pod uses (spec.resourceClaims'
	// named claims and status.resourceClaimStatuses' generated ones), in its namespace: a DRA
	// reservation of one of them made for another pod refuses the ADD (dra.go).
	ResourceClaims []string
}

// PoolChoiceError is a pod's choice of pools that the agent refuses (CNI code 7): a malformed
// annotation, a pool its namespace may not use, one that does not serve the node, or two of one
// family. Nothing was handed out.
type PoolChoiceError struct {
	Source string
	Msg    string
}

func (e *PoolChoiceError) Error() string { return e.Source + ": " + e.Msg }

// ParsePoolNames reads a comma-separated list of pool names (an ipwarden.io/pools annotation):
// spaces around names are ignored; empty entries, duplicates, invalid names and more than
// MaxPoolNames are errors.
func ParsePoolNames(s string) ([]string, error) {
	parts := strings.Split(s, ",")
	if len(parts) > MaxPoolNames {
		return nil, fmt.Errorf("names %d pools; at most %d (one per address family)", len(parts), MaxPoolNames)
	}
	var out []string
	for _, p := range parts {
		p = strings.TrimSpace(p)
		if p == "" {
			return nil, fmt.Errorf("%q has an empty pool name: write names separated by commas, such as \"blue-v4,blue-v6\"", trunc(s))
		}
		if errs := validation.IsDNS1123Subdomain(p); len(errs) > 0 {
			return nil, fmt.Errorf("%q is not an IPPool name: %s", trunc(p), errs[0])
		}
		if slices.Contains(out, p) {
			return nil, fmt.Errorf("pool %q is listed twice", p)
		}
		out = append(out, p)
	}
	return out, nil
}

func trunc(s string) string {
	if len(s) > 80 {
		return s[:80] + "..."
	}
	return s
}

// ChoosePools returns the pool names a pod asks for and where they come from: the pod's
// annotation, else its namespace's, else the CNI config's pools; nil names with SourceNode when
// none names any (the pools that select the node, filtered by namespace, are then the choice).
// An annotation that is set but malformed is an error, never skipped.
func ChoosePools(meta PodMeta, config []string) ([]string, string, error) {
	if strings.TrimSpace(meta.Pools) != "" {
		names, err := ParsePoolNames(meta.Pools)
		if err != nil {
			return nil, SourcePod, &PoolChoiceError{Source: SourcePod, Msg: err.Error()}
		}
		return names, SourcePod, nil
	}
	if meta.NamespaceKnown && strings.TrimSpace(meta.Namespace.Pools) != "" {
		names, err := ParsePoolNames(meta.Namespace.Pools)
		if err != nil {
			return nil, SourceNamespace, &PoolChoiceError{Source: SourceNamespace, Msg: err.Error()}
		}
		return names, SourceNamespace, nil
	}
	if len(config) > 0 {
		return slices.Clone(config), SourceConfig, nil
	}
	return nil, SourceNode, nil
}

// admits reports whether pool p lets a pod of the namespace in meta draw from it.
func (p *poolState) admits(meta PodMeta) bool {
	if p.nsSel == nil || p.nsSel.Empty() {
		return true
	}
	if !meta.NamespaceKnown {
		return false
	}
	return p.nsSel.Matches(labels.Set(meta.Namespace.Labels))
}

// choosePools resolves the pools an attachment of a pod draws from: the names ChoosePools gives,
// each a pool that serves the node and admits the pod's namespace, at most one per family; or,
// when nothing names any, the pools that serve the node and admit the namespace.
//
// Annotations choose pools of the pod network only: an attachment to a named network (a
// secondary network) draws from the pools its CNI configuration names, else from the pools of
// that network that serve the node.
func (s *State) choosePools(meta PodMeta, config []string, namespace, network string) ([]string, error) {
	if network != "" {
		meta.Pools, meta.Namespace.Pools = "", ""
	}
	names, src, err := ChoosePools(meta, config)
	if err != nil {
		return nil, err
	}
	if src == SourceNode {
		var out []string
		for _, n := range s.served {
			if p := s.pools[n]; p.cfg.Network == network && p.admits(meta) {
				out = append(out, n)
			}
		}
		if len(out) == 0 && network != "" {
			return nil, &PoolChoiceError{Source: SourceNode, Msg: fmt.Sprintf(
				"no pool of network %q serves node %s and admits namespace %q: give an IPPool spec.network %q, or name pools in the network configuration",
				network, s.node, namespace, network)}
		}
		if len(out) == 0 {
			if len(s.served) == 0 {
				return nil, &NoPoolsError{Node: s.node}
			}
			return nil, &PoolChoiceError{Source: SourceNode, Msg: fmt.Sprintf(
				"no pool serving node %s admits namespace %q (pools serving the node: %s); name a pool whose namespaceSelector selects the namespace, or label the namespace",
				s.node, namespace, strings.Join(s.served, ", "))}
		}
		return out, nil
	}
	if src == SourceConfig {
		// The network configuration's list keeps its own checks and error (field "pools").
		if _, err := s.resolvePools(names); err != nil {
			return nil, err
		}
	}
	v4, v6 := "", ""
	for _, n := range names {
		p, ok := s.pools[n]
		if !slices.Contains(s.served, n) {
			what := "is not an IPPool the agent knows"
			switch {
			case ok && p.gone:
				what = "was deleted"
			case ok && p.known:
				what = "does not serve node " + s.node + " (its nodeSelector does not select the node, or the agent runs with --pools)"
			}
			return nil, &PoolChoiceError{Source: src, Msg: fmt.Sprintf("pool %q %s (pools serving this node: %s)", n, what, orNone(s.served))}
		}
		if p.cfg.Network != network {
			return nil, &PoolChoiceError{Source: src, Msg: fmt.Sprintf("pool %q is on network %q, this attachment on network %q (the network configuration's \"network\")",
				n, p.cfg.Network, network)}
		}
		if !p.admits(meta) {
			return nil, &PoolChoiceError{Source: src, Msg: fmt.Sprintf(
				"pool %q may not be used by namespace %q: its namespaceSelector %q does not select the namespace", n, namespace, p.cfg.NamespaceSelector)}
		}
		fam := &v4
		if !p.cfg.Is4() {
			fam = &v6
		}
		if *fam != "" {
			return nil, &PoolChoiceError{Source: src, Msg: fmt.Sprintf(
				"pools %q and %q are of one address family: name at most one IPv4 and one IPv6 pool", *fam, n)}
		}
		*fam = n
	}
	return names, nil
}

// podMeta is what the state knows of a pod bound to the node and its namespace, for demand.
func (s *State) podMeta(pod Pod) PodMeta {
	ns, ok := s.namespaces[pod.Ref.Namespace]
	return PodMeta{Pools: pod.Pools, IPAddresses: pod.IPAddresses, Namespace: ns, NamespaceKnown: ok, Identity: pod.Identity, Sticky: pod.Sticky}
}

// SetNamespaces records the namespaces the agent knows (labels and pool annotations), for pool
// choice of the pods bound to the node.
func (s *State) SetNamespaces(ns map[string]Namespace) { s.namespaces = ns }

// ResolvePools returns the pools the ADD req draws from (see choosePools).
func (s *State) ResolvePools(req AddRequest) ([]string, error) {
	return s.choosePools(req.Meta, req.Pools, req.Pod.Namespace, req.PoolNetwork)
}

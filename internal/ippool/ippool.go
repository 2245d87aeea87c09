// Package ippool is the one conversion of an IPPool into values: its CIDRs and the address set
// it may hand out, gateway, routes, node selector, scaling and reuse cooldown. The controller,
// the agent, `ipwarden check` and `ipwarden simulate` all read pools through Parse, so they
// agree on every spec (docs/design.md, "API objects").
package ippool

import (
	"errors"
	"fmt"
	"net/netip"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/scaling"
)

// Route is a route returned to pods of the pool.
type Route struct {
	Dst netip.Prefix `json:"dst"`
	GW  netip.Addr   `json:"gw,omitzero"`
}

// Pool is an IPPool spec as values.
type Pool struct {
	// CIDRs are spec.cidrs, all of one family.
	CIDRs []netip.Prefix
	Is6   bool
	// Exclude is spec.exclude, each entry as a prefix (an address is a /32 or /128).
	Exclude []netip.Prefix
	Gateway netip.Addr
	Routes  []Route
	Scaling scaling.Params
	// Cooldown is spec.reuseCooldown.
	Cooldown time.Duration
	// NodeSelector is spec.nodeSelector; labels.Everything() when unset.
	NodeSelector labels.Selector
	// Network is spec.network: "" for the pod network.
	Network string
	// Sticky is spec.sticky: StatefulSet pods keep their addresses.
	Sticky bool
	// NamespaceSelector is spec.namespaceSelector: the namespaces whose pods may draw from the
	// pool; labels.Everything() when unset.
	NamespaceSelector labels.Selector
	// Addresses is what the pool hands out: the CIDRs less exclusions and Reserved.
	Addresses addr.Set
}

// Parse checks and converts a pool spec. The API server's validation rejects most bad specs; this
// also guards objects stored before a CRD upgrade and says what is wrong in the same words.
//
// A scaling block that is all zero (an object stored before the CRD defaulted it) means the
// defaults, for every reader alike.
func Parse(spec ipwardenv1.IPPoolSpec) (Pool, error) {
	var p Pool
	if len(spec.CIDRs) == 0 {
		return p, errors.New("spec.cidrs is empty")
	}
	var cidrs addr.Set
	for i, c := range spec.CIDRs {
		pfx, err := netip.ParsePrefix(string(c))
		if err != nil {
			return p, fmt.Errorf("spec.cidrs[%d] %q is not a CIDR", i, c)
		}
		if pfx != pfx.Masked() {
			return p, fmt.Errorf("spec.cidrs[%d] %q has host bits set: write %s", i, c, pfx.Masked())
		}
		if i == 0 {
			p.Is6 = pfx.Addr().Is6()
		} else if pfx.Addr().Is6() != p.Is6 {
			return p, errors.New("all cidrs of a pool must be of one family")
		}
		p.CIDRs = append(p.CIDRs, pfx)
		cidrs = cidrs.Union(addr.SetOfPrefixes(pfx))
	}
	for i, e := range spec.Exclude {
		pfx, err := prefixOrAddr(string(e))
		if err != nil {
			return p, fmt.Errorf("spec.exclude[%d] %q is neither an address nor a CIDR", i, e)
		}
		if !cidrs.ContainsSet(addr.SetOfPrefixes(pfx)) {
			return p, fmt.Errorf("spec.exclude[%d] %q lies outside the pool's cidrs", i, e)
		}
		p.Exclude = append(p.Exclude, pfx)
	}
	if spec.Gateway != "" {
		gw, err := netip.ParseAddr(string(spec.Gateway))
		if err != nil {
			return p, fmt.Errorf("spec.gateway %q is not an address", spec.Gateway)
		}
		p.Gateway = gw
	}
	for i, r := range spec.Routes {
		dst, err := netip.ParsePrefix(string(r.Dst))
		if err != nil {
			return p, fmt.Errorf("spec.routes[%d].dst %q is not a CIDR", i, r.Dst)
		}
		rt := Route{Dst: dst}
		if r.GW != "" {
			if rt.GW, err = netip.ParseAddr(string(r.GW)); err != nil {
				return p, fmt.Errorf("spec.routes[%d].gw %q is not an address", i, r.GW)
			}
		}
		p.Routes = append(p.Routes, rt)
	}
	p.Scaling = scaling.Params{
		BatchSize:     int(spec.Scaling.BatchSize),
		BufferPercent: int(spec.Scaling.BufferPercent),
		MaxPerNode:    int(spec.Scaling.MaxPerNode),
	}
	if p.Scaling == (scaling.Params{}) {
		p.Scaling = scaling.DefaultParams
	}
	// The give-back settings are optional; absent means the defaults.
	p.Scaling.ReleaseSlackPercent = scaling.DefaultParams.ReleaseSlackPercent
	if v := spec.Scaling.ReleaseSlackPercent; v != nil {
		p.Scaling.ReleaseSlackPercent = int(*v)
	}
	p.Scaling.ReleaseDelay = scaling.DefaultParams.ReleaseDelay
	if v := spec.Scaling.ReleaseDelay; v != nil {
		p.Scaling.ReleaseDelay = v.Duration
	}
	if err := p.Scaling.Validate(); err != nil {
		return p, fmt.Errorf("spec.scaling: %w", err)
	}
	p.Cooldown = spec.ReuseCooldown.Duration
	if p.Cooldown < 0 {
		return p, fmt.Errorf("spec.reuseCooldown %s is negative", p.Cooldown)
	}
	p.NodeSelector = labels.Everything()
	if spec.NodeSelector != nil {
		sel, err := metav1.LabelSelectorAsSelector(spec.NodeSelector)
		if err != nil {
			return p, fmt.Errorf("spec.nodeSelector: %w", err)
		}
		p.NodeSelector = sel
	}
	p.Network = spec.Network
	p.Sticky = spec.Sticky
	p.NamespaceSelector = labels.Everything()
	if spec.NamespaceSelector != nil {
		sel, err := metav1.LabelSelectorAsSelector(spec.NamespaceSelector)
		if err != nil {
			return p, fmt.Errorf("spec.namespaceSelector: %w", err)
		}
		p.NamespaceSelector = sel
	}
	p.Addresses = Usable(p.CIDRs, p.Exclude, p.Gateway)
	return p, nil
}

// Admits reports whether the pool's namespace selector admits a namespace with these labels.
func (p Pool) Admits(namespaceLabels map[string]string) bool {
	if p.NamespaceSelector == nil {
		return true
	}
	return p.NamespaceSelector.Matches(labels.Set(namespaceLabels))
}

// Selects reports whether the pool's node selector selects a node with these labels.
func (p Pool) Selects(nodeLabels map[string]string) bool {
	if p.NodeSelector == nil {
		return true
	}
	return p.NodeSelector.Matches(labels.Set(nodeLabels))
}

// Usable is what a pool with these CIDRs, exclusions and gateway hands out: the CIDRs less the
// exclusions and Reserved.
func Usable(cidrs, exclude []netip.Prefix, gateway netip.Addr) addr.Set {
	masked := make([]netip.Prefix, len(cidrs))
	for i, c := range cidrs {
		masked[i] = c.Masked()
	}
	ex := make([]netip.Prefix, len(exclude))
	for i, e := range exclude {
		ex[i] = e.Masked()
	}
	return addr.SetOfPrefixes(masked...).Subtract(addr.SetOfPrefixes(ex...)).Subtract(Reserved(cidrs, gateway))
}

// Reserved are the addresses of a pool's CIDRs that are never handed out even when not excluded:
// the network and broadcast address of every IPv4 CIDR up to /30, the subnet-router anycast
// address (the first) of every IPv6 CIDR up to /126, and the gateway.
func Reserved(cidrs []netip.Prefix, gateway netip.Addr) addr.Set {
	var out []netip.Addr
	for _, c := range cidrs {
		c = c.Masked()
		r := addr.PrefixRange(c)
		switch {
		case c.Addr().Is4() && c.Bits() <= 30:
			out = append(out, r.First, r.Last)
		case c.Addr().Is6() && c.Bits() <= 126:
			out = append(out, r.First)
		}
	}
	if gateway.IsValid() {
		out = append(out, gateway)
	}
	return addr.SetOfAddrs(out...)
}

// prefixOrAddr reads an address or a CIDR (spec.exclude) as a prefix.
func prefixOrAddr(s string) (netip.Prefix, error) {
	if a, err := netip.ParseAddr(s); err == nil {
		return netip.PrefixFrom(a, a.BitLen()), nil
	}
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return netip.Prefix{}, err
	}
	return p.Masked(), nil
}

package controller

import (
	"errors"
	"fmt"
	"net/netip"
	"sort"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/scaling"
)

// PoolConfig is an IPPool spec parsed into values the controller computes with.
type PoolConfig struct {
	// Addresses are the CIDRs minus the exclusions: what the pool can hand out.
	Addresses addr.Set
	Is6       bool
	Scaling   scaling.Params
	Cooldown  time.Duration
	Selector  labels.Selector
}

// ParsePool checks and converts a pool spec. The API server's validation rejects most bad specs;
// this also guards objects stored before a CRD upgrade and says what is wrong in the same words.
func ParsePool(spec ipwardenv1.IPPoolSpec) (PoolConfig, error) {
	var cfg PoolConfig
	if len(spec.CIDRs) == 0 {
		return cfg, errors.New("spec.cidrs is empty")
	}
	var cidrs addr.Set
	for i, c := range spec.CIDRs {
		p, err := netip.ParsePrefix(string(c))
		if err != nil {
			return cfg, fmt.Errorf("spec.cidrs[%d] %q is not a CIDR", i, c)
		}
		if p != p.Masked() {
			return cfg, fmt.Errorf("spec.cidrs[%d] %q has host bits set: write %s", i, c, p.Masked())
		}
		if i == 0 {
			cfg.Is6 = p.Addr().Is6()
		} else if p.Addr().Is6() != cfg.Is6 {
			return cfg, errors.New("all cidrs of a pool must be of one family")
		}
		cidrs = cidrs.Union(addr.SetOfPrefixes(p))
	}
	var excl addr.Set
	for i, e := range spec.Exclude {
		s, err := addr.ParseSet([]string{string(e)})
		if err != nil {
			return cfg, fmt.Errorf("spec.exclude[%d]: %w", i, err)
		}
		if !cidrs.ContainsSet(s) {
			return cfg, fmt.Errorf("spec.exclude[%d] %q lies outside the pool's cidrs", i, e)
		}
		excl = excl.Union(s)
	}
	cfg.Addresses = cidrs.Subtract(excl).Subtract(Reserved(spec))
	cfg.Scaling = scaling.Params{
		BatchSize:     int(spec.Scaling.BatchSize),
		BufferPercent: int(spec.Scaling.BufferPercent),
		MaxPerNode:    int(spec.Scaling.MaxPerNode),
	}
	if cfg.Scaling == (scaling.Params{}) {
		cfg.Scaling = scaling.DefaultParams
	}
	if err := cfg.Scaling.Validate(); err != nil {
		return cfg, fmt.Errorf("spec.scaling: %w", err)
	}
	cfg.Cooldown = spec.ReuseCooldown.Duration
	if cfg.Cooldown < 0 {
		return cfg, fmt.Errorf("spec.reuseCooldown %s is negative", cfg.Cooldown)
	}
	cfg.Selector = labels.Everything()
	if spec.NodeSelector != nil {
		sel, err := metav1.LabelSelectorAsSelector(spec.NodeSelector)
		if err != nil {
			return cfg, fmt.Errorf("spec.nodeSelector: %w", err)
		}
		cfg.Selector = sel
	}
	return cfg, nil
}

// Reserved are the addresses of a pool's CIDRs that are never handed out even when not excluded:
// the network and broadcast address of every IPv4 CIDR up to /30, the subnet-router anycast
// address (the first) of every IPv6 CIDR up to /126, and the gateway.
func Reserved(spec ipwardenv1.IPPoolSpec) addr.Set {
	var out []netip.Addr
	for _, c := range spec.CIDRs {
		p, err := netip.ParsePrefix(string(c))
		if err != nil {
			continue
		}
		p = p.Masked()
		r := addr.PrefixRange(p)
		switch {
		case p.Addr().Is4() && p.Bits() <= 30:
			out = append(out, r.First, r.Last)
		case p.Addr().Is6() && p.Bits() <= 126:
			out = append(out, r.First)
		}
	}
	if gw, err := netip.ParseAddr(string(spec.Gateway)); err == nil {
		out = append(out, gw)
	}
	return addr.SetOfAddrs(out...)
}

// PoolAddresses names a pool's address set with its creation order.
type PoolAddresses struct {
	Name      string
	Created   time.Time
	Addresses addr.Set
}

// Overlaps finds pools that share addresses with an older pool. The older pool keeps serving; the
// younger one is invalid until the overlap is removed. Ties in age go by name. The result maps
// each invalid pool to the pool it overlaps.
func Overlaps(pools []PoolAddresses) map[string]string {
	sorted := append([]PoolAddresses(nil), pools...)
	sort.Slice(sorted, func(i, j int) bool {
		if !sorted[i].Created.Equal(sorted[j].Created) {
			return sorted[i].Created.Before(sorted[j].Created)
		}
		return sorted[i].Name < sorted[j].Name
	})
	out := map[string]string{}
	for i, p := range sorted {
		for _, q := range sorted[:i] {
			if _, bad := out[q.Name]; bad {
				continue
			}
			if p.Addresses.Overlaps(q.Addresses) {
				out[p.Name] = q.Name
				break
			}
		}
	}
	return out
}

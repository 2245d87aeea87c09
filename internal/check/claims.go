package check

import (
	"fmt"
	"sort"
	"strings"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
)

// ClaimConflict is an address a node's pods use (its spec claims it) while another node's
// status holds it: two nodes' pods may use one address, and only an operator can say which keeps
// it (docs/design.md, "Claims and rewinds").
const ClaimConflict = "ClaimConflict"

// claimConflicts finds every claimed address another node holds, naming the pods on both nodes
// whose status shows it.
func claimConflicts(in Input, nodeHeld map[string]addr.Set) []Finding {
	var out []Finding
	allocs := append([]ipwardenv1.NodeIPAllocation(nil), in.Allocs...)
	sort.Slice(allocs, func(i, j int) bool { return allocs[i].Name < allocs[j].Name })
	holders := make([]string, 0, len(nodeHeld))
	for n := range nodeHeld {
		holders = append(holders, n)
	}
	sort.Strings(holders)
	for _, a := range allocs {
		for _, req := range a.Spec.Pools {
			claimed, err := addr.ParseSet(blockStrings(req.Claimed))
			if err != nil || claimed.IsEmpty() {
				continue
			}
			for _, holder := range holders {
				if holder == a.Name {
					continue
				}
				both := claimed.Intersect(nodeHeld[holder])
				if both.IsEmpty() {
					continue
				}
				pods := podsUsing(in.Pods, both, a.Name, holder)
				out = append(out, Finding{Kind: ClaimConflict, Addresses: both.String(), Nodes: []string{a.Name, holder}, Pool: req.Pool,
					Pod: strings.Join(pods, ", "),
					Detail: fmt.Sprintf("node %s's pods use these addresses (its spec claims them) but node %s holds them; pods: %s. "+
						"Decide which pod keeps the address and delete the other", a.Name, holder, orNone(pods))})
			}
		}
	}
	return out
}

func podsUsing(pods []Pod, s addr.Set, nodes ...string) []string {
	var out []string
	for _, p := range pods {
		if !p.Running {
			continue
		}
		on := false
		for _, n := range nodes {
			on = on || p.Node == n
		}
		if !on {
			continue
		}
		for _, ip := range p.IPs {
			if s.Contains(ip) {
				out = append(out, fmt.Sprintf("%s/%s on %s", p.Namespace, p.Name, p.Node))
				break
			}
		}
	}
	sort.Strings(out)
	return out
}

func orNone(s []string) string {
	if len(s) == 0 {
		return "none shows it in status.podIPs yet"
	}
	return strings.Join(s, ", ")
}

func blockStrings(bs []ipwardenv1.AddressBlock) []string {
	out := make([]string, len(bs))
	for i, b := range bs {
		out[i] = string(b)
	}
	return out
}

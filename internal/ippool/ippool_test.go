package ippool

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/scaling"
)

func set(t *testing.T, items ...string) addr.Set {
	t.Helper()
	s, err := addr.ParseSet(items)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestParse(t *testing.T) {
	good := ipwardenv1.IPPoolSpec{
		CIDRs:         []ipwardenv1.CIDR{"10.0.0.0/24", "10.0.2.0/25"},
		Exclude:       []ipwardenv1.IPOrCIDR{"10.0.0.1", "10.0.0.128/25"},
		Gateway:       "10.0.0.2",
		Routes:        []ipwardenv1.Route{{Dst: "0.0.0.0/0"}, {Dst: "192.168.0.0/16", GW: "10.0.0.3"}},
		Scaling:       ipwardenv1.Scaling{BatchSize: 8, BufferPercent: 25, MaxPerNode: 64},
		ReuseCooldown: metav1.Duration{Duration: time.Minute},
		NodeSelector:  &metav1.LabelSelector{MatchLabels: map[string]string{"pool": "a"}},
	}
	p, err := Parse(good)
	if err != nil {
		t.Fatal(err)
	}
	// Network and broadcast addresses of each CIDR are reserved, and the gateway.
	if want := set(t, "10.0.0.3-10.0.0.127", "10.0.2.1-10.0.2.126"); !p.Addresses.Equal(want) {
		t.Errorf("addresses = %v, want %v", p.Addresses, want)
	}
	if p.Scaling != (scaling.Params{BatchSize: 8, BufferPercent: 25, MaxPerNode: 64, ReleaseSlackPercent: 100, ReleaseDelay: 3 * time.Minute}) ||
		p.Cooldown != time.Minute || p.Is6 {
		t.Errorf("pool = %+v", p)
	}
	// Give-back settings given are taken; out of range they are an error.
	withRel := *good.DeepCopy()
	slack, delay := int32(250), metav1.Duration{Duration: 90 * time.Second}
	withRel.Scaling.ReleaseSlackPercent, withRel.Scaling.ReleaseDelay = &slack, &delay
	if p, err := Parse(withRel); err != nil || p.Scaling.ReleaseSlackPercent != 250 || p.Scaling.ReleaseDelay != 90*time.Second {
		t.Errorf("give-back settings: %+v, %v", p.Scaling, err)
	}
	bad := int32(1001)
	withRel.Scaling.ReleaseSlackPercent = &bad
	if _, err := Parse(withRel); err == nil || !strings.Contains(err.Error(), "releaseSlackPercent 1001") {
		t.Errorf("slack 1001: %v", err)
	}
	if p.Gateway != netip.MustParseAddr("10.0.0.2") || len(p.Routes) != 2 || p.Routes[1].GW != netip.MustParseAddr("10.0.0.3") {
		t.Errorf("gateway %v routes %v", p.Gateway, p.Routes)
	}
	if len(p.Exclude) != 2 || p.Exclude[0] != netip.MustParsePrefix("10.0.0.1/32") {
		t.Errorf("exclude %v", p.Exclude)
	}
	if !p.Selects(map[string]string{"pool": "a"}) || p.Selects(map[string]string{"pool": "b"}) {
		t.Errorf("selector %v", p.NodeSelector)
	}
	// No namespace selector admits every namespace; one admits the namespaces it selects.
	if !p.Admits(nil) || !p.Admits(map[string]string{"team": "x"}) {
		t.Errorf("no namespace selector: %v", p.NamespaceSelector)
	}
	blue := *good.DeepCopy()
	blue.NamespaceSelector = &metav1.LabelSelector{MatchLabels: map[string]string{"team": "blue"}}
	if p, err := Parse(blue); err != nil || !p.Admits(map[string]string{"team": "blue"}) || p.Admits(map[string]string{"team": "red"}) || p.Admits(nil) {
		t.Errorf("namespace selector team=blue: %v, %v", p.NamespaceSelector, err)
	}

	// An all-zero scaling block (stored before the CRD defaulted it) means the defaults.
	zero := *good.DeepCopy()
	zero.Scaling = ipwardenv1.Scaling{}
	if p, err := Parse(zero); err != nil || p.Scaling != scaling.DefaultParams {
		t.Errorf("zero scaling: %+v, %v; want the defaults", p.Scaling, err)
	}
	// No selector selects every node.
	zero.NodeSelector = nil
	if p, err := Parse(zero); err != nil || !p.Selects(map[string]string{"x": "y"}) || !p.Selects(nil) {
		t.Errorf("no selector: %v", err)
	}

	for _, tc := range []struct {
		name string
		mod  func(*ipwardenv1.IPPoolSpec)
		want string
	}{
		{"no cidrs", func(s *ipwardenv1.IPPoolSpec) { s.CIDRs = nil }, "spec.cidrs is empty"},
		{"bad cidr", func(s *ipwardenv1.IPPoolSpec) { s.CIDRs = []ipwardenv1.CIDR{"x"} }, `"x" is not a CIDR`},
		{"host bits", func(s *ipwardenv1.IPPoolSpec) { s.CIDRs = []ipwardenv1.CIDR{"10.0.0.1/24"} }, "write 10.0.0.0/24"},
		{"mixed", func(s *ipwardenv1.IPPoolSpec) { s.CIDRs = append(s.CIDRs, "fd00::/64") }, "one family"},
		{"bad exclude", func(s *ipwardenv1.IPPoolSpec) { s.Exclude = []ipwardenv1.IPOrCIDR{"10.0.0.1-10.0.0.5"} }, "neither an address nor a CIDR"},
		{"exclude outside", func(s *ipwardenv1.IPPoolSpec) { s.Exclude = []ipwardenv1.IPOrCIDR{"10.9.0.0/24"} }, "outside the pool"},
		{"bad gateway", func(s *ipwardenv1.IPPoolSpec) { s.Gateway = "10.0.0" }, "spec.gateway"},
		{"bad route", func(s *ipwardenv1.IPPoolSpec) { s.Routes = []ipwardenv1.Route{{Dst: "x"}} }, "spec.routes[0].dst"},
		{"bad route gw", func(s *ipwardenv1.IPPoolSpec) { s.Routes = []ipwardenv1.Route{{Dst: "0.0.0.0/0", GW: "y"}} }, "spec.routes[0].gw"},
		{"bad scaling", func(s *ipwardenv1.IPPoolSpec) { s.Scaling.MaxPerNode = 4 }, "maxPerNode 4"},
		{"negative cooldown", func(s *ipwardenv1.IPPoolSpec) { s.ReuseCooldown.Duration = -time.Second }, "negative"},
		{"bad selector", func(s *ipwardenv1.IPPoolSpec) {
			s.NodeSelector = &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "a", Operator: "Bogus"}}}
		}, "spec.nodeSelector"},
		{"bad namespace selector", func(s *ipwardenv1.IPPoolSpec) {
			s.NamespaceSelector = &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "a", Operator: "Bogus"}}}
		}, "spec.namespaceSelector"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := *good.DeepCopy()
			tc.mod(&s)
			_, err := Parse(s)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Parse error = %v, want containing %q", err, tc.want)
			}
		})
	}
}

func TestReserved(t *testing.T) {
	for _, tc := range []struct {
		name  string
		cidrs []string
		gw    string
		want  []string
	}{
		{"v4 /24", []string{"10.0.0.0/24"}, "", []string{"10.0.0.0", "10.0.0.255"}},
		{"v4 /30", []string{"10.0.0.0/30"}, "", []string{"10.0.0.0", "10.0.0.3"}},
		{"v4 /31 keeps both", []string{"10.0.0.0/31"}, "", nil},
		{"v4 /32 keeps it", []string{"10.0.0.7/32"}, "", nil},
		{"v6 /64", []string{"fd00::/64"}, "", []string{"fd00::"}},
		{"v6 /127 keeps both", []string{"fd00::/127"}, "", nil},
		{"gateway", []string{"10.0.0.0/24"}, "10.0.0.1", []string{"10.0.0.0-10.0.0.1", "10.0.0.255"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var cidrs []netip.Prefix
			for _, c := range tc.cidrs {
				cidrs = append(cidrs, netip.MustParsePrefix(c))
			}
			var gw netip.Addr
			if tc.gw != "" {
				gw = netip.MustParseAddr(tc.gw)
			}
			if got := Reserved(cidrs, gw); !got.Equal(set(t, tc.want...)) {
				t.Errorf("Reserved = %v, want %v", got, tc.want)
			}
		})
	}
}

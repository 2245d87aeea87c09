package controller

import (
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/scaling"
)

func TestParsePool(t *testing.T) {
	good := ipwardenv1.IPPoolSpec{
		CIDRs:         []ipwardenv1.CIDR{"10.0.0.0/24", "10.0.2.0/25"},
		Exclude:       []ipwardenv1.IPOrCIDR{"10.0.0.1", "10.0.0.128/25"},
		Scaling:       ipwardenv1.Scaling{BatchSize: 8, BufferPercent: 25, MaxPerNode: 64},
		ReuseCooldown: metav1.Duration{Duration: time.Minute},
		NodeSelector:  &metav1.LabelSelector{MatchLabels: map[string]string{"pool": "a"}},
	}
	cfg, err := ParsePool(good)
	if err != nil {
		t.Fatal(err)
	}
	// Network and broadcast addresses of each CIDR are reserved too.
	if want := set(t, "10.0.0.2-10.0.0.127", "10.0.2.1-10.0.2.126"); !cfg.Addresses.Equal(want) {
		t.Errorf("addresses = %v, want %v", cfg.Addresses, want)
	}
	if cfg.Scaling != (scaling.Params{BatchSize: 8, BufferPercent: 25, MaxPerNode: 64}) || cfg.Cooldown != time.Minute || cfg.Is6 {
		t.Errorf("cfg = %+v", cfg)
	}
	if !cfg.Selector.Matches(labels.Set{"pool": "a"}) || cfg.Selector.Matches(labels.Set{"pool": "b"}) {
		t.Errorf("selector %v", cfg.Selector)
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
		{"exclude outside", func(s *ipwardenv1.IPPoolSpec) { s.Exclude = []ipwardenv1.IPOrCIDR{"10.9.0.0/24"} }, "outside the pool"},
		{"bad scaling", func(s *ipwardenv1.IPPoolSpec) { s.Scaling.MaxPerNode = 4 }, "maxPerNode 4"},
		{"negative cooldown", func(s *ipwardenv1.IPPoolSpec) { s.ReuseCooldown.Duration = -time.Second }, "negative"},
		{"bad selector", func(s *ipwardenv1.IPPoolSpec) {
			s.NodeSelector = &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "a", Operator: "Bogus"}}}
		}, "spec.nodeSelector"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := *good.DeepCopy()
			tc.mod(&s)
			_, err := ParsePool(s)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("ParsePool error = %v, want containing %q", err, tc.want)
			}
		})
	}
}

func TestOverlaps(t *testing.T) {
	t0 := time.Unix(1000, 0)
	got := Overlaps([]PoolAddresses{
		{"young", t0.Add(2 * time.Second), set(t, "10.0.0.128/25")},
		{"old", t0, set(t, "10.0.0.0/24")},
		{"apart", t0.Add(time.Second), set(t, "10.1.0.0/24")},
		{"v6", t0, set(t, "fd00::/64")},
		{"also-young", t0.Add(3 * time.Second), set(t, "10.0.0.200")},
	})
	want := map[string]string{"young": "old", "also-young": "old"}
	if len(got) != len(want) {
		t.Fatalf("Overlaps = %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Fatalf("Overlaps = %v, want %v", got, want)
		}
	}
}

func TestReserved(t *testing.T) {
	for _, tc := range []struct {
		name string
		spec ipwardenv1.IPPoolSpec
		want []string
	}{
		{"v4 /24", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.0.0.0/24"}}, []string{"10.0.0.0", "10.0.0.255"}},
		{"v4 /30 keeps two usable", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.0.0.0/30"}}, []string{"10.0.0.0", "10.0.0.3"}},
		{"v4 /31 and /32 reserve nothing", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.0.0.0/31", "10.0.1.1/32"}}, nil},
		{"v6 /64 reserves the anycast address", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"fd00::/64"}}, []string{"fd00::"}},
		{"v6 /127 reserves nothing", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"fd00::/127"}}, nil},
		{"gateway", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.0.0.0/24"}, Gateway: "10.0.0.1"}, []string{"10.0.0.0-10.0.0.1", "10.0.0.255"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Reserved(tc.spec); !got.Equal(set(t, tc.want...)) {
				t.Fatalf("Reserved = %v, want %v", got, tc.want)
			}
		})
	}
}

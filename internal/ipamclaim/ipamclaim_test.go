package ipamclaim

import (
	"errors"
	"net/netip"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestReference(t *testing.T) {
	for _, tc := range []struct {
		name        string
		ann         map[string]string
		ifname, net string
		args        string
		want        string
		err         bool
	}{
		{name: "none", ifname: "eth0"},
		{name: "legacy primary", ann: map[string]string{AnnotationPrimaryClaim: "vm-a.pod"}, ifname: "eth0", want: "vm-a.pod"},
		{name: "default-network element wins over legacy", ann: map[string]string{
			AnnotationPrimaryClaim:   "old",
			AnnotationDefaultNetwork: `[{"name":"default","namespace":"x","ipam-claim-reference":"new"}]`}, ifname: "eth0", want: "new"},
		{name: "default-network as an object", ann: map[string]string{AnnotationDefaultNetwork: `{"name":"default","ipam-claim-reference":"o"}`}, ifname: "eth0", want: "o"},
		{name: "default-network by name only falls back to legacy", ann: map[string]string{AnnotationDefaultNetwork: "kube-system/default", AnnotationPrimaryClaim: "l"}, ifname: "eth0", want: "l"},
		{name: "secondary ignores the primary annotation", ann: map[string]string{AnnotationPrimaryClaim: "p"}, ifname: "net1"},
		{name: "by interface", ann: map[string]string{AnnotationNetworks: `[{"name":"blue","interface":"net2","ipam-claim-reference":"b2"},{"name":"blue","interface":"net1","ipam-claim-reference":"b1"}]`}, ifname: "net1", net: "blue", want: "b1"},
		{name: "by network name", ann: map[string]string{AnnotationNetworks: `[{"name":"red","ipam-claim-reference":"r"},{"name":"blue","ipam-claim-reference":"b"}]`}, ifname: "net1", net: "blue", want: "b"},
		{name: "the only element with a claim", ann: map[string]string{AnnotationNetworks: `[{"name":"red"},{"name":"blue","ipam-claim-reference":"b"}]`}, ifname: "net1", net: "green", want: "b"},
		{name: "two claims and no match: none", ann: map[string]string{AnnotationNetworks: `[{"name":"red","ipam-claim-reference":"r"},{"name":"blue","ipam-claim-reference":"b"}]`}, ifname: "net1", net: "green"},
		{name: "element for another interface is not taken", ann: map[string]string{AnnotationNetworks: `[{"name":"blue","interface":"net2","ipam-claim-reference":"b2"}]`}, ifname: "net1", net: "blue"},
		{name: "names list carries no claim", ann: map[string]string{AnnotationNetworks: "blue,red@net3"}, ifname: "net1", net: "blue"},
		{name: "args win", ann: map[string]string{AnnotationNetworks: `[{"name":"blue","ipam-claim-reference":"b"}]`}, ifname: "net1", net: "blue", args: "a", want: "a"},
		{name: "malformed networks", ann: map[string]string{AnnotationNetworks: `[{"name":`}, ifname: "net1", err: true},
		{name: "malformed default-network", ann: map[string]string{AnnotationDefaultNetwork: `{"name":`}, ifname: "eth0", err: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Reference(tc.ann, tc.ifname, tc.net, tc.args)
			if (err != nil) != tc.err || got != tc.want {
				t.Fatalf("Reference = %q, %v; want %q, error %v", got, err, tc.want, tc.err)
			}
		})
	}
}

func TestParseIPs(t *testing.T) {
	got, err := ParseIPs([]string{"10.0.0.5/24", "10.0.0.6", "fd00::7/64"})
	if err != nil {
		t.Fatal(err)
	}
	want := []netip.Addr{netip.MustParseAddr("10.0.0.5"), netip.MustParseAddr("10.0.0.6"), netip.MustParseAddr("fd00::7")}
	if len(got) != len(want) {
		t.Fatalf("got %v", got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("got %v, want %v", got, want)
		}
	}
	if _, err := ParseIPs([]string{"nope"}); err == nil {
		t.Fatal("a malformed entry parsed")
	}
	if s := FormatIP(netip.MustParseAddr("2001:0db8::1"), 64); s != "2001:db8::1/64" {
		t.Fatalf("FormatIP = %s", s)
	}
	if !MigrationTarget(map[string]string{LabelMigrationTarget: "u1"}) || MigrationTarget(nil) {
		t.Fatal("MigrationTarget")
	}
}

// The CRD counts as installed only when discovery answers and lists ipamclaims.
func TestServed(t *testing.T) {
	list := func(names ...string) *metav1.APIResourceList {
		l := &metav1.APIResourceList{GroupVersion: "k8s.cni.cncf.io/v1alpha1"}
		for _, n := range names {
			l.APIResources = append(l.APIResources, metav1.APIResource{Name: n})
		}
		return l
	}
	for _, tc := range []struct {
		name string
		res  *metav1.APIResourceList
		err  error
		want bool
	}{
		{"served", list("ipamclaims", "ipamclaims/status"), nil, true},
		{"the group without ipamclaims", list("network-attachment-definitions"), nil, false},
		{"discovery failed (404: the group is not served)", nil, errors.New("the server could not find the requested resource"), false},
		{"an answer with an error", list("ipamclaims"), errors.New("partial"), false},
	} {
		if got := Served(tc.res, tc.err); got != tc.want {
			t.Errorf("%s: Served = %v, want %v", tc.name, got, tc.want)
		}
	}
}

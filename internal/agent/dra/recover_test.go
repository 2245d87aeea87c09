package dra

import (
	"context"
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// The entry Prepare writes is the evidence a lost journal is recovered from: read back through
// the API, it names the claim, request, device, interface, pod, pool and address of the
// reservation the driver journaled.
func TestEvidenceReadsWhatPrepareWrote(t *testing.T) {
	c := claim(1, "v4-s0")
	cs := fake.NewClientset(c.DeepCopy())
	core := &fakeCore{res: map[ipam.Key]ipam.Attachment{}}
	ctx := context.Background()
	res, err := New(core, cs, Options{Node: "node-a", Log: logr.Discard()}).PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{c})
	if err != nil || res[c.UID].Err != nil {
		t.Fatalf("Prepare: %v %v", err, res[c.UID].Err)
	}
	claims, err := ListClaims(ctx, cs)
	if err != nil {
		t.Fatal(err)
	}
	evs, problems := Evidence(claims, "node-a", []string{"v4"}, "eth0")
	var r ipam.Attachment
	for _, a := range core.res {
		r = a
	}
	want := []ipam.ReservationEvidence{{Claim: *r.DRA, Pod: r.Pod, Pool: "v4", Addr: r.Addresses[0].Addr}}
	if len(problems) != 0 || !reflect.DeepEqual(evs, want) {
		t.Fatalf("Evidence = %+v, %v; want %+v", evs, problems, want)
	}
}

// One rule, one table: a device's status entry is evidence only while the claim is allocated
// the device on this node, reserved for one pod; it must name one address; the interface is the
// entry's (else the claim's configuration's, else the default), the pool the device's among
// those serving the node ("" when none does).
func TestEvidence(t *testing.T) {
	entry := func(device, ifname string, ips ...string) resourceapi.AllocatedDeviceStatus {
		return resourceapi.AllocatedDeviceStatus{Driver: DriverName, Pool: "node-a", Device: device,
			NetworkData: &resourceapi.NetworkDeviceData{InterfaceName: ifname, IPs: ips}}
	}
	prepared := func(edit func(c *resourceapi.ResourceClaim)) *resourceapi.ResourceClaim {
		c := claim(1, "v4-s0")
		c.Status.Devices = []resourceapi.AllocatedDeviceStatus{entry("v4-s0", "eth0", "10.1.0.9/16")}
		if edit != nil {
			edit(c)
		}
		return c
	}
	ok := func(ifname, pool, a string) []ipam.ReservationEvidence {
		return []ipam.ReservationEvidence{{Claim: ipam.ClaimDevice{Namespace: "ns", Name: "c", UID: "claim-uid", Request: "addr", Device: "v4-s0", Interface: ifname},
			Pod: ipam.PodRef{Namespace: "ns", Name: "pod", UID: "pod-uid-a"}, Pool: pool, Addr: netip.MustParseAddr(a)}}
	}
	for _, tc := range []struct {
		name    string
		claim   *resourceapi.ResourceClaim
		served  []string
		want    []ipam.ReservationEvidence
		problem string
	}{
		{name: "prepared here: evidence", claim: prepared(nil), want: ok("eth0", "v4", "10.1.0.9")},
		{name: "no entry (never prepared, or its status write did not land): none", claim: claim(1, "v4-s0")},
		{name: "another driver's entry, another node's entry: none", claim: prepared(func(c *resourceapi.ResourceClaim) {
			c.Status.Devices[0].Driver = "dranet.example"
			c.Status.Devices = append(c.Status.Devices, entry("v4-s0", "eth0", "10.1.0.9/16"))
			c.Status.Devices[1].Pool = "node-b"
		})},
		{name: "deallocated: none", claim: prepared(func(c *resourceapi.ResourceClaim) { c.Status.Allocation = nil })},
		{name: "allocated to another node: none", claim: prepared(func(c *resourceapi.ResourceClaim) { c.Status.Allocation.Devices.Results[0].Pool = "node-b" })},
		{name: "its pod is done (no consumer left): none", claim: prepared(func(c *resourceapi.ResourceClaim) { c.Status.ReservedFor = nil })},
		{name: "being deleted, still reserved: evidence", claim: prepared(func(c *resourceapi.ResourceClaim) {
			c.DeletionTimestamp = &metav1.Time{Time: time.Unix(1700000000, 0)}
		}), want: ok("eth0", "v4", "10.1.0.9")},
		{name: "the pool no longer serves the node: evidence without a pool", claim: prepared(nil), served: []string{"v6"}, want: ok("eth0", "", "10.1.0.9")},
		{name: "no interface in the entry: the default", claim: prepared(func(c *resourceapi.ResourceClaim) { c.Status.Devices[0].NetworkData.InterfaceName = "" }),
			want: ok("eth1", "v4", "10.1.0.9")},
		{name: "two addresses: a problem", claim: prepared(func(c *resourceapi.ResourceClaim) {
			c.Status.Devices[0].NetworkData.IPs = append(c.Status.Devices[0].NetworkData.IPs, "10.1.0.10/16")
		}), problem: "no single address"},
		{name: "an unreadable address: a problem", claim: prepared(func(c *resourceapi.ResourceClaim) { c.Status.Devices[0].NetworkData.IPs = []string{"10.1.0.9"} }),
			problem: "address"},
		{name: "two consumers: a problem", claim: prepared(func(c *resourceapi.ResourceClaim) {
			c.Status.ReservedFor = append(c.Status.ReservedFor, c.Status.ReservedFor[0])
		}), problem: "reserved for 2 consumers"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			served := tc.served
			if served == nil {
				served = []string{"v4"}
			}
			evs, problems := Evidence([]resourceapi.ResourceClaim{*tc.claim}, "node-a", served, "eth1")
			if !reflect.DeepEqual(evs, tc.want) {
				t.Fatalf("Evidence = %+v, want %+v", evs, tc.want)
			}
			if (tc.problem == "") != (len(problems) == 0) || tc.problem != "" && !strings.Contains(problems[0], tc.problem) {
				t.Fatalf("problems %v, want %q", problems, tc.problem)
			}
		})
	}
}

// ListClaims reads the claims of every namespace; a cluster that does not serve
// resource.k8s.io/v1 has none; any other error is the caller's to retry.
func TestListClaims(t *testing.T) {
	a, b := claim(1, "v4-s0"), claim(1, "v4-s1")
	b.Namespace, b.UID = "other", "claim-uid-b"
	cs := fake.NewClientset(a, b)
	got, err := ListClaims(context.Background(), cs)
	if err != nil || len(got) != 2 {
		t.Fatalf("ListClaims = %d claims, %v; want 2", len(got), err)
	}
	for _, tc := range []struct {
		name    string
		err     error
		wantErr bool
	}{
		{"not served: none", apierrors.NewNotFound(schema.GroupResource{Group: "resource.k8s.io", Resource: "resourceclaims"}, ""), false},
		{"forbidden: an error", apierrors.NewForbidden(schema.GroupResource{Group: "resource.k8s.io", Resource: "resourceclaims"}, "", nil), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cs := fake.NewClientset(a)
			cs.PrependReactor("list", "resourceclaims", func(k8stesting.Action) (bool, runtime.Object, error) { return true, nil, tc.err })
			got, err := ListClaims(context.Background(), cs)
			if len(got) != 0 || (err != nil) != tc.wantErr {
				t.Fatalf("ListClaims = %v, %v", got, err)
			}
		})
	}
}

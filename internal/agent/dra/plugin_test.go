package dra

import (
	"context"
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// fakeCore reserves 10.1.0.<n> in order, keyed as the machine keys them.
type fakeCore struct {
	res        map[ipam.Key]ipam.Attachment
	unprepared []string
}

func (f *fakeCore) Prepare(_ context.Context, req ipam.ReserveRequest) (ipam.Attachment, []netip.Prefix, error) {
	k := ipam.ReservationKey(req.Claim.UID, req.Claim.Request, req.Claim.Device)
	a, ok := f.res[k]
	if !ok {
		c := req.Claim
		a = ipam.Attachment{Key: k, Pod: req.Pod, DRA: &c, Created: time.Unix(1700000000, 0),
			Addresses: []ipam.Address{{Pool: req.Pool, Addr: netip.AddrFrom4([4]byte{10, 1, 0, byte(8 + len(f.res))})}}}
		f.res[k] = a
	}
	return a, []netip.Prefix{netip.PrefixFrom(a.Addresses[0].Addr, 16)}, nil
}

func (f *fakeCore) Unprepare(_ context.Context, uid, request, device string) error {
	delete(f.res, ipam.ReservationKey(uid, request, device))
	f.unprepared = append(f.unprepared, device)
	return nil
}

func (f *fakeCore) Reservations() []ipam.Attachment {
	var out []ipam.Attachment
	for _, a := range f.res {
		out = append(out, a)
	}
	return out
}
func (f *fakeCore) Served() []string                 { return []string{"v4"} }
func (f *fakeCore) Capacities() []ipam.ClaimCapacity { return nil }
func (f *fakeCore) Reconcile(_ context.Context, allocated func(ipam.ClaimDevice) bool) error {
	for k, a := range f.res {
		if !allocated(*a.DRA) {
			delete(f.res, k)
			f.unprepared = append(f.unprepared, a.DRA.Device)
		}
	}
	return nil
}

func claim(consumers int, devices ...string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "c", UID: "claim-uid"}}
	for i := range consumers {
		c.Status.ReservedFor = append(c.Status.ReservedFor, resourceapi.ResourceClaimConsumerReference{Resource: "pods", Name: "pod", UID: types.UID("pod-uid-" + string(rune('a'+i)))})
	}
	c.Status.Allocation = &resourceapi.AllocationResult{}
	for _, d := range devices {
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results,
			resourceapi.DeviceRequestAllocationResult{Request: "addr", Driver: DriverName, Pool: "node-a", Device: d})
	}
	// Another driver's device: left alone.
	c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results,
		resourceapi.DeviceRequestAllocationResult{Request: "nic", Driver: "dranet.example", Pool: "node-a", Device: "eth1"})
	return c
}

// Prepare refuses a claim that is not reserved for exactly one pod; it reserves, then writes the
// driver's own status entries; a failed status write fails it and keeps the reservation, and the
// retry gets the same address.
func TestPrepare(t *testing.T) {
	for _, tc := range []struct {
		name        string
		claim       *resourceapi.ResourceClaim
		failWrites  int
		wantErr     string
		wantIPs     []string
		reservation bool
	}{
		{name: "two consumers: refused", claim: claim(2, "v4-s0"), wantErr: "reserved for 2 consumers"},
		{name: "no consumer: refused", claim: claim(0, "v4-s0"), wantErr: "reserved for 0 consumers"},
		{name: "not a slot: refused", claim: claim(1, "gpu-0"), wantErr: "no slot"},
		{name: "one pod: reserved and written", claim: claim(1, "v4-s0"), wantIPs: []string{"10.1.0.8/16"}, reservation: true},
		{name: "status write fails: failed, reservation kept, the retry writes the same", claim: claim(1, "v4-s0"), failWrites: 1,
			wantErr: "reservation is kept", wantIPs: []string{"10.1.0.8/16"}, reservation: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cs := fake.NewClientset(tc.claim.DeepCopy())
			fails := tc.failWrites
			cs.PrependReactor("patch", "resourceclaims", func(a k8stesting.Action) (bool, runtime.Object, error) {
				if a.GetSubresource() == "status" && fails > 0 {
					fails--
					return true, nil, errors.New("forbidden: resourceclaims/status")
				}
				return false, nil, nil
			})
			core := &fakeCore{res: map[ipam.Key]ipam.Attachment{}}
			d := New(core, cs, Options{Node: "node-a", Log: logr.Discard()})
			ctx := context.Background()
			res, err := d.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{tc.claim})
			if err != nil {
				t.Fatal(err)
			}
			r := res[tc.claim.UID]
			if tc.wantErr != "" {
				if r.Err == nil || !strings.Contains(r.Err.Error(), tc.wantErr) {
					t.Fatalf("Prepare: %v, want %q", r.Err, tc.wantErr)
				}
				if (len(core.res) > 0) != tc.reservation {
					t.Fatalf("reservations after the failure: %v", core.res)
				}
				if tc.failWrites == 0 {
					return
				}
				res, _ = d.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{tc.claim})
				r = res[tc.claim.UID]
			}
			if r.Err != nil || len(r.Devices) != 1 || r.Devices[0].DeviceName != "v4-s0" || len(r.Devices[0].CDIDeviceIDs) != 0 {
				t.Fatalf("Prepare: %+v", r)
			}
			got, err := cs.ResourceV1().ResourceClaims("ns").Get(ctx, "c", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if len(got.Status.Devices) != 1 {
				t.Fatalf("status.devices %+v, want one entry", got.Status.Devices)
			}
			e := got.Status.Devices[0]
			if e.Driver != DriverName || e.Pool != "node-a" || e.Device != "v4-s0" || e.NetworkData == nil ||
				e.NetworkData.InterfaceName != "eth0" || strings.Join(e.NetworkData.IPs, ",") != strings.Join(tc.wantIPs, ",") ||
				len(e.Conditions) != 1 || e.Conditions[0].Type != ConditionReady || e.Conditions[0].Status != metav1.ConditionTrue {
				t.Fatalf("status entry %+v", e)
			}
			if len(core.res) != 1 {
				t.Fatalf("reservations %v, want one", core.res)
			}
		})
	}
}

// Unprepare frees every reservation of the claim, and succeeds for a claim with none.
func TestUnprepare(t *testing.T) {
	core := &fakeCore{res: map[ipam.Key]ipam.Attachment{}}
	d := New(core, fake.NewClientset(), Options{Node: "node-a", Log: logr.Discard()})
	c := claim(1, "v4-s0", "v4-s1")
	ctx := context.Background()
	if _, err := d.PrepareResourceClaims(ctx, []*resourceapi.ResourceClaim{c}); err != nil {
		t.Fatal(err)
	}
	res, err := d.UnprepareResourceClaims(ctx, []kubeletplugin.NamespacedObject{
		{UID: c.UID, NamespacedName: types.NamespacedName{Namespace: "ns", Name: "c"}},
		{UID: "other", NamespacedName: types.NamespacedName{Namespace: "ns", Name: "d"}}})
	if err != nil || res[c.UID] != nil || res["other"] != nil || len(core.res) != 0 || len(core.unprepared) != 2 {
		t.Fatalf("Unprepare: %v %v; left %v, unprepared %v", res, err, core.res, core.unprepared)
	}
}

// allocatedHere follows the claim's allocation: the driver's device on this node.
func TestAllocatedHere(t *testing.T) {
	c := claim(1, "v4-s0")
	for _, tc := range []struct {
		name string
		edit func(c *resourceapi.ResourceClaim)
		dev  string
		want bool
	}{
		{"allocated", nil, "v4-s0", true},
		{"another device", nil, "v4-s1", false},
		{"deallocated", func(c *resourceapi.ResourceClaim) { c.Status.Allocation = nil }, "v4-s0", false},
		{"another node", func(c *resourceapi.ResourceClaim) { c.Status.Allocation.Devices.Results[0].Pool = "node-b" }, "v4-s0", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := c.DeepCopy()
			if tc.edit != nil {
				tc.edit(c)
			}
			if got := allocatedHere(c, "node-a", "addr", tc.dev); got != tc.want {
				t.Fatalf("allocatedHere = %v, want %v", got, tc.want)
			}
		})
	}
}

// The interface is the last opaque configuration of the driver that applies to the request,
// else the agent's default.
func TestInterfaceOf(t *testing.T) {
	opaque := func(driver, ifname string, reqs ...string) resourceapi.DeviceAllocationConfiguration {
		return resourceapi.DeviceAllocationConfiguration{Requests: reqs, DeviceConfiguration: resourceapi.DeviceConfiguration{
			Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: driver,
				Parameters: runtime.RawExtension{Raw: []byte(`{"apiVersion":"ipwarden.io/v1alpha1","kind":"AddressConfig","ifName":"` + ifname + `"}`)}}}}
	}
	for _, tc := range []struct {
		name string
		cfg  []resourceapi.DeviceAllocationConfiguration
		want string
	}{
		{"none: the default", nil, "eth0"},
		{"the driver's, for every request", []resourceapi.DeviceAllocationConfiguration{opaque(DriverName, "net1")}, "net1"},
		{"for another request: the default", []resourceapi.DeviceAllocationConfiguration{opaque(DriverName, "net1", "other")}, "eth0"},
		{"another driver's: the default", []resourceapi.DeviceAllocationConfiguration{opaque("dranet.example", "net1")}, "eth0"},
		{"the last wins", []resourceapi.DeviceAllocationConfiguration{opaque(DriverName, "net1"), opaque(DriverName, "net2", "addr")}, "net2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := claim(1, "v4-s0")
			c.Status.Allocation.Devices.Config = tc.cfg
			got, err := interfaceOf(c, "addr", "eth0")
			if err != nil || got != tc.want {
				t.Fatalf("interfaceOf = %q, %v; want %q", got, err, tc.want)
			}
		})
	}
}

// The level reconcile reads each claim the node holds a reservation for: gone, re-created under
// its name, or deallocated, it is released; still allocated, or unreadable, it is kept.
func TestReconcile(t *testing.T) {
	for _, tc := range []struct {
		name     string
		objects  func(c *resourceapi.ResourceClaim) []runtime.Object
		failGets bool
		released bool
	}{
		{"allocated: kept", func(c *resourceapi.ResourceClaim) []runtime.Object { return []runtime.Object{c} }, false, false},
		{"gone: released", func(*resourceapi.ResourceClaim) []runtime.Object { return nil }, false, true},
		{"its name re-created: released", func(c *resourceapi.ResourceClaim) []runtime.Object {
			c = c.DeepCopy()
			c.UID = "another"
			return []runtime.Object{c}
		}, false, true},
		{"deallocated: released", func(c *resourceapi.ResourceClaim) []runtime.Object {
			c = c.DeepCopy()
			c.Status.Allocation = nil
			return []runtime.Object{c}
		}, false, true},
		{"unreadable: kept", func(*resourceapi.ResourceClaim) []runtime.Object { return nil }, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := claim(1, "v4-s0")
			core := &fakeCore{res: map[ipam.Key]ipam.Attachment{}}
			if _, err := New(core, fake.NewClientset(), Options{Node: "node-a", Log: logr.Discard()}).PrepareResourceClaims(context.Background(), []*resourceapi.ResourceClaim{c}); err != nil {
				t.Fatal(err)
			}
			if len(core.res) != 1 {
				t.Fatalf("reservations %v, want one", core.res)
			}
			cs := fake.NewClientset(tc.objects(c)...)
			if tc.failGets {
				cs.PrependReactor("get", "resourceclaims", func(k8stesting.Action) (bool, runtime.Object, error) {
					return true, nil, errors.New("the API server is away")
				})
			}
			New(core, cs, Options{Node: "node-a", Log: logr.Discard()}).reconcile(context.Background())
			if released := len(core.res) == 0; released != tc.released {
				t.Fatalf("released %v, want %v", released, tc.released)
			}
		})
	}
}

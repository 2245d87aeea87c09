package dra

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// DriverName is the DRA driver ipwarden's agent registers.
const DriverName = "ipam.ipwarden.io"

// The attributes of a slot device (qualified by the driver's domain when a DeviceClass or a
// claim's CEL selector names them: device.attributes["ipam.ipwarden.io"].ippool).
const (
	AttrPool    = "ippool"
	AttrNetwork = "network"
	AttrFamily  = "family"
)

// MaxDevicesPerSlice is the API server's limit on the devices of one ResourceSlice (1.34).
const MaxDevicesPerSlice = 128

// slotPrefix is the device name prefix of a pool's slots: the pool's name when it is a DNS label
// short enough for "-s<n>" to follow, else "p" and a hash of it.
func slotPrefix(pool string) string {
	if len(pool) <= 50 && len(validation.IsDNS1123Label(pool)) == 0 {
		return pool
	}
	h := sha256.Sum256([]byte(pool))
	return "p" + hex.EncodeToString(h[:6])
}

// SlotName is the name of slot i of pool.
func SlotName(pool string, i int) string { return slotPrefix(pool) + "-s" + strconv.Itoa(i) }

// PoolOfSlot returns the pool among pools whose slot device is, and false when none.
func PoolOfSlot(device string, pools []string) (string, bool) {
	i := strings.LastIndex(device, "-s")
	if i < 0 {
		return "", false
	}
	if _, err := strconv.Atoi(device[i+2:]); err != nil {
		return "", false
	}
	prefix := device[:i]
	for _, p := range pools {
		if slotPrefix(p) == prefix {
			return p, true
		}
	}
	return "", false
}

// SlotState is what the hysteresis of one pool's slot count remembers.
type SlotState struct {
	// Published is the count published; negative: nothing yet.
	Published int
	// GrowSince is when the headroom first allowed more slots without a break (zero: it does
	// not now).
	GrowSince time.Time
}

// GrowAfter is how long the headroom must allow more slots before they are published.
const GrowAfter = 30 * time.Second

// NextSlots is the hysteresis of a pool's slot count: the number of slot devices published
// changes only when the node's headroom moved by a band, and grows only after it held for
// GrowAfter, so pods that start and end do not rewrite the node's ResourceSlice. band =
// max(1, limit/16); target = the headroom (at most limit) rounded down to a band. With P
// published:
//   - nothing published yet: the target;
//   - target below P: shrink to it at once (a slot the node cannot fill would let the scheduler
//     place a pod whose Prepare then fails);
//   - headroom at least P + band: grow to the target once that held for GrowAfter;
//   - otherwise P stays.
//
// The count is never below reserved (slots allocated to claims stay published). So at rest
// nothing is written, and a headroom that swings across a band's edge costs at most one shrink
// and one grow per GrowAfter.
func NextSlots(prev SlotState, headroom, reserved, limit int, now time.Time) SlotState {
	band := max(1, limit/16)
	h := min(max(headroom, 0), limit)
	target := h / band * band
	next := SlotState{Published: prev.Published}
	switch {
	case prev.Published < 0:
		next.Published = target
	case target < prev.Published:
		next.Published = target
	case h >= prev.Published+band:
		next.GrowSince = prev.GrowSince
		if next.GrowSince.IsZero() {
			next.GrowSince = now
		}
		if !now.Before(next.GrowSince.Add(GrowAfter)) {
			next.Published, next.GrowSince = target, time.Time{}
		}
	}
	next.Published = max(next.Published, reserved, 0)
	return next
}

// Resources returns the ResourceSlices of the node's one pool (named after the node): slots[pool]
// slot devices for each pool of caps, at most MaxDevicesPerSlice per slice. Pools whose name is
// longer than an attribute may be are left out.
func Resources(node string, caps []ipam.ClaimCapacity, slots map[string]int) resourceslice.DriverResources {
	var devices []resourceapi.Device
	for _, c := range caps {
		if len(c.Pool) > resourceapi.DeviceAttributeMaxValueLength || len(c.Network) > resourceapi.DeviceAttributeMaxValueLength {
			continue
		}
		family := "ipv6"
		if c.IPv4 {
			family = "ipv4"
		}
		for i := range slots[c.Pool] {
			devices = append(devices, resourceapi.Device{
				Name: SlotName(c.Pool, i),
				Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
					AttrPool:    {StringValue: ptr.To(c.Pool)},
					AttrNetwork: {StringValue: ptr.To(c.Network)},
					AttrFamily:  {StringValue: ptr.To(family)},
				},
			})
		}
	}
	var slices_ []resourceslice.Slice
	for chunk := range slices.Chunk(devices, MaxDevicesPerSlice) {
		slices_ = append(slices_, resourceslice.Slice{Devices: chunk})
	}
	if len(slices_) == 0 {
		slices_ = []resourceslice.Slice{{Devices: []resourceapi.Device{}}}
	}
	return resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{node: {Slices: slices_}}}
}

// describe is a short description of the slots, for logs.
func describe(slots map[string]int) string {
	var parts []string
	for p, n := range slots {
		parts = append(parts, fmt.Sprintf("%s=%d", p, n))
	}
	slices.Sort(parts)
	return strings.Join(parts, ",")
}

package dra

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strconv"
	"strings"

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

// Slots is the hysteresis of a pool's slot count: the number of slot devices published changes
// only when the node's headroom moved by a band, so a pod that starts or ends does not rewrite
// the node's ResourceSlice. band = max(1, maxSlots/16). With published P (negative: nothing
// published yet) and headroom H (at most maxSlots):
//   - nothing published yet: H rounded down to a band;
//   - H < P: shrink at once to H rounded down to a band (never below reserved): a slot the node
//     cannot fill would let the scheduler place a pod whose Prepare then fails;
//   - H >= P + 2*band: grow to H rounded down to a band, less one band (so that a headroom that
//     swings by less than a band around a band's edge never rewrites the slice);
//   - otherwise P stays.
//
// The result is never below reserved (slots allocated to claims stay published).
func Slots(published, headroom, reserved, maxSlots int) int {
	band := max(1, maxSlots/16)
	h := min(max(headroom, 0), maxSlots)
	next := published
	switch {
	case published < 0:
		next = h / band * band
	case h < published:
		next = h / band * band
	case h >= published+2*band:
		next = h/band*band - band
	}
	return min(max(next, reserved, 0), max(maxSlots, reserved))
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

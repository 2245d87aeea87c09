package dra

import (
	"context"
	"fmt"
	"net/netip"

	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// Recovery after a lost journal (docs/design.md, "Addresses the scheduler can see (DRA)"; the
// argument is ipam's, dra_recover.go): prepare writes a claim's status.devices entry only after
// the reservation's journal write landed, so the driver's entries of devices allocated to the
// node are the node's own evidence of the reservations a lost journal forgot. The agent reads
// them once, when it rebuilds its journal, and the machine decides what to re-create.

// Evidence returns what claims show of node's reservations: for each device of the driver
// allocated on node to a claim that is still allocated there (allocatedHere) and reserved for
// exactly one pod (none: its pod is done, and nothing is to be recovered), the driver's status.devices entry of
// that device (pool node) naming one address in networkData.ips. The interface is the entry's
// networkData.interfaceName (def, the driver's --dra-interface, through the claim's
// configuration, when it names none), the pool the device's among served ("" when none serves
// the node: the machine decides). A device with no entry of the driver has no evidence (never
// prepared, or its status write did not land: the kubelet prepares it again); an entry it cannot
// read is a problem, returned with the claim's name.
func Evidence(claims []resourceapi.ResourceClaim, node string, served []string, def string) (evs []ipam.ReservationEvidence, problems []string) {
	for i := range claims {
		c := &claims[i]
		if c.Status.Allocation == nil || len(c.Status.ReservedFor) == 0 {
			continue // deallocated, or its pod is done: no reservation to recover
		}
		for _, r := range c.Status.Allocation.Devices.Results {
			if r.Driver != DriverName || r.Pool != node || !allocatedHere(c, node, r.Request, r.Device) {
				continue
			}
			e := entryOf(c, node, r.Device)
			if e == nil {
				continue
			}
			ev, err := evidenceOf(c, r, e, served, def)
			if err != nil {
				problems = append(problems, fmt.Sprintf("claim %s/%s (%s) device %s: %v", c.Namespace, c.Name, c.UID, r.Device, err))
				continue
			}
			evs = append(evs, ev)
		}
	}
	return evs, problems
}

// entryOf returns the driver's status entry of device on node, or nil.
func entryOf(c *resourceapi.ResourceClaim, node, device string) *resourceapi.AllocatedDeviceStatus {
	for i := range c.Status.Devices {
		if e := &c.Status.Devices[i]; e.Driver == DriverName && e.Pool == node && e.Device == device {
			return e
		}
	}
	return nil
}

func evidenceOf(c *resourceapi.ResourceClaim, r resourceapi.DeviceRequestAllocationResult, e *resourceapi.AllocatedDeviceStatus,
	served []string, def string) (ipam.ReservationEvidence, error) {
	pod, err := onePod(c)
	if err != nil {
		return ipam.ReservationEvidence{}, err
	}
	if e.NetworkData == nil || len(e.NetworkData.IPs) != 1 {
		return ipam.ReservationEvidence{}, fmt.Errorf("its status entry names no single address (networkData %+v)", e.NetworkData)
	}
	p, err := netip.ParsePrefix(e.NetworkData.IPs[0])
	if err != nil {
		return ipam.ReservationEvidence{}, fmt.Errorf("its status entry's address: %w", err)
	}
	ifname := e.NetworkData.InterfaceName
	if ifname == "" {
		if ifname, err = interfaceOf(c, r.Request, def); err != nil {
			return ipam.ReservationEvidence{}, err
		}
	}
	pool, _ := PoolOfSlot(r.Device, served)
	return ipam.ReservationEvidence{
		Claim: ipam.ClaimDevice{Namespace: c.Namespace, Name: c.Name, UID: string(c.UID), Request: r.Request, Device: r.Device, Interface: ifname},
		Pod:   pod,
		Pool:  pool,
		Addr:  p.Addr(),
	}, nil
}

// ListClaims lists every ResourceClaim in the cluster, a page at a time. Its cost: there is no
// field selector for the node a claim is allocated to, so it reads every claim of every
// namespace to keep those of one node; the agent does it once, when it rebuilds a lost or
// damaged journal, never in its steady state (the level reconcile GETs only the claims the node
// holds reservations for). A cluster that does not serve resource.k8s.io/v1 has no claims.
func ListClaims(ctx context.Context, client kubernetes.Interface) ([]resourceapi.ResourceClaim, error) {
	var out []resourceapi.ResourceClaim
	opts := metav1.ListOptions{Limit: 500}
	for {
		l, err := client.ResourceV1().ResourceClaims("").List(ctx, opts)
		if apierrors.IsNotFound(err) {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		out = append(out, l.Items...)
		if l.Continue == "" {
			return out, nil
		}
		opts.Continue = l.Continue
	}
}

// Package dra is the agent's DRA driver ipam.ipwarden.io (docs/design.md, "Addresses the
// scheduler can see (DRA)"): a kubelet plugin that reserves an address for each device a claim
// was allocated (Prepare) and writes it into the claim's status, releases it (Unprepare), releases
// what a missed Unprepare left (the level reconcile), and publishes the node's address slots as a
// ResourceSlice so the scheduler places a pod that claims an address only where one is free. The
// decisions are the agent machine's (machine_dra.go) and package ipam's; this package is the
// shell between them and the kubelet and the API server.
package dra

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	metaapply "k8s.io/client-go/applyconfigurations/meta/v1"
	resourceapply "k8s.io/client-go/applyconfigurations/resource/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// FieldManager is the field manager of the agent's status.devices entries.
const FieldManager = "ipwarden-agent"

// ConditionReady is the condition of a device entry whose address is reserved.
const ConditionReady = "Ready"

// Core is what the driver needs of the agent: the machine's DRA inputs and what the state says.
type Core interface {
	// Prepare reserves the device's address (journal first; idempotent) and returns the
	// reservation and its addresses as canonical CIDRs.
	Prepare(ctx context.Context, req ipam.ReserveRequest) (ipam.Attachment, []netip.Prefix, error)
	// Unprepare frees the device's reservation (nothing to free is no error).
	Unprepare(ctx context.Context, claimUID, request, device string) error
	// Reservations returns the reservations the node holds.
	Reservations() []ipam.Attachment
	// Served returns the pools that serve the node.
	Served() []string
	// Capacities returns what each pool serving the node lets it promise claims.
	Capacities() []ipam.ClaimCapacity
	// Reconcile releases the reservations whose claim allocated says is not the node's any
	// more, once no attachment uses them.
	Reconcile(ctx context.Context, allocated func(ipam.ClaimDevice) bool) error
}

// Options configure the driver.
type Options struct {
	Node string
	// Interface is the CNI interface a claim's address goes to, unless the claim's opaque
	// configuration names another (ifName).
	Interface string
	// MaxSlots caps the slot devices published per pool (default 128).
	MaxSlots int
	// PublishEvery is how often the slot counts are looked at (default 5s); ReconcileEvery how
	// often the reservations are checked against their claims (default 1m).
	PublishEvery, ReconcileEvery time.Duration
	// RegistrarDir and PluginDir are the kubelet's plugin registration and plugins directories
	// (empty: the kubelet's defaults).
	RegistrarDir, PluginDir string
	Log                     logr.Logger
}

// Driver is the kubelet plugin of ipam.ipwarden.io.
type Driver struct {
	opts   Options
	core   Core
	client kubernetes.Interface
	log    logr.Logger
	helper *kubeletplugin.Helper

	mu        sync.Mutex
	published map[string]int       // slots per pool last published; nil: nothing yet
	grow      map[string]time.Time // per pool: since when it may grow (NextSlots)
	writes    int                  // publishes that changed the slots (a measure of the API writes)
}

// New returns a driver; Run starts it.
func New(core Core, client kubernetes.Interface, opts Options) *Driver {
	if opts.Interface == "" {
		opts.Interface = ipam.PrimaryIfName
	}
	if opts.MaxSlots <= 0 || opts.MaxSlots > 4*MaxDevicesPerSlice {
		opts.MaxSlots = MaxDevicesPerSlice
	}
	if opts.PublishEvery <= 0 {
		opts.PublishEvery = 5 * time.Second
	}
	if opts.ReconcileEvery <= 0 {
		opts.ReconcileEvery = time.Minute
	}
	return &Driver{opts: opts, core: core, client: client, log: opts.Log}
}

// Run registers the plugin with the kubelet, publishes the node's slots and reconciles the
// reservations until ctx ends.
func (d *Driver) Run(ctx context.Context) error {
	kopts := []kubeletplugin.Option{
		kubeletplugin.DriverName(DriverName),
		kubeletplugin.NodeName(d.opts.Node),
		kubeletplugin.KubeClient(d.client),
	}
	reg, plug := d.opts.RegistrarDir, d.opts.PluginDir
	if reg == "" {
		reg = kubeletplugin.KubeletRegistryDir
	}
	if plug == "" {
		plug = filepath.Join(kubeletplugin.KubeletPluginsDir, DriverName)
	}
	// The helper listens in them but does not make them; the kubelet makes only its own.
	for _, dir := range []string{reg, plug} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return fmt.Errorf("the DRA kubelet plugin's directory: %w", err)
		}
	}
	kopts = append(kopts, kubeletplugin.RegistrarDirectoryPath(reg), kubeletplugin.PluginDataDirectoryPath(plug))
	hctx := klog.NewContext(ctx, d.log.WithName("kubeletplugin"))
	h, err := kubeletplugin.Start(hctx, d, kopts...)
	if err != nil {
		return fmt.Errorf("start the DRA kubelet plugin %s: %w", DriverName, err)
	}
	d.helper = h
	defer h.Stop()
	d.log.Info("DRA kubelet plugin registered", "driver", DriverName, "interface", d.opts.Interface, "maxSlots", d.opts.MaxSlots)
	d.reconcile(ctx)
	pub := time.NewTicker(d.opts.PublishEvery)
	defer pub.Stop()
	rec := time.NewTicker(d.opts.ReconcileEvery)
	defer rec.Stop()
	for {
		d.publish(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-pub.C:
		case <-rec.C:
			d.reconcile(ctx)
		}
	}
}

// publish publishes the node's slots when the hysteresis (Slots) says they changed.
func (d *Driver) publish(ctx context.Context) {
	caps := d.core.Capacities()
	now := time.Now()
	d.mu.Lock()
	next := make(map[string]int, len(caps))
	grow := make(map[string]time.Time, len(caps))
	for _, c := range caps {
		prev, ok := d.published[c.Pool]
		if !ok {
			prev = -1
		}
		limit := d.opts.MaxSlots
		if c.MaxPerNode > 0 {
			limit = min(limit, c.MaxPerNode) // the band follows the pool's own scale
		}
		st := NextSlots(SlotState{Published: prev, GrowSince: d.grow[c.Pool]}, c.Headroom, c.Reserved, limit, now)
		next[c.Pool], grow[c.Pool] = st.Published, st.GrowSince
	}
	d.grow = grow
	same := d.published != nil && maps.Equal(next, d.published)
	d.mu.Unlock()
	if same {
		return
	}
	if err := d.helper.PublishResources(ctx, Resources(d.opts.Node, caps, next)); err != nil {
		d.log.Error(err, "cannot publish the node's address slots")
		return
	}
	d.mu.Lock()
	d.published = next
	d.writes++
	d.mu.Unlock()
	d.log.Info("published the node's address slots", "slots", describe(next))
}

// Published returns the slots per pool last published and how many times they changed.
func (d *Driver) Published() (map[string]int, int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return maps.Clone(d.published), d.writes
}

// reconcile releases the reservations whose claim is gone or no longer allocated to the node
// (a missed Unprepare, an agent that was down). A claim that cannot be read counts as allocated.
func (d *Driver) reconcile(ctx context.Context) {
	res := d.core.Reservations()
	if len(res) == 0 {
		return
	}
	claims := map[types.UID]*resourceapi.ResourceClaim{}
	gone := map[types.UID]bool{}
	for _, r := range res {
		uid := types.UID(r.DRA.UID)
		if _, ok := claims[uid]; ok || gone[uid] {
			continue
		}
		c, err := d.client.ResourceV1().ResourceClaims(r.DRA.Namespace).Get(ctx, r.DRA.Name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			gone[uid] = true
		case err != nil:
			d.log.Error(err, "cannot read a claim the node holds a reservation for; keeping it", "claim", r.DRA.String())
			claims[uid] = nil
		case c.UID != uid:
			gone[uid] = true // the name now belongs to another claim
		default:
			claims[uid] = c
		}
	}
	allocated := func(cd ipam.ClaimDevice) bool {
		uid := types.UID(cd.UID)
		if gone[uid] {
			return false
		}
		c := claims[uid]
		if c == nil {
			return true // unreadable: kept
		}
		return allocatedHere(c, d.opts.Node, cd.Request, cd.Device)
	}
	if err := d.core.Reconcile(ctx, allocated); err != nil {
		d.log.Error(err, "cannot release the reservations of claims no longer allocated to the node")
	}
}

// allocatedHere reports whether claim c is allocated the device of the driver on node for
// request.
func allocatedHere(c *resourceapi.ResourceClaim, node, request, device string) bool {
	if c.Status.Allocation == nil || c.DeletionTimestamp != nil && len(c.Status.ReservedFor) == 0 {
		return false
	}
	for _, r := range c.Status.Allocation.Devices.Results {
		if r.Driver == DriverName && r.Pool == node && r.Device == device && r.Request == request {
			return true
		}
	}
	return false
}

// HandleError implements kubeletplugin.DRAPlugin: errors of the background (slice publishing).
func (d *Driver) HandleError(_ context.Context, err error, msg string) {
	d.log.Error(err, msg)
}

// PrepareResourceClaims implements kubeletplugin.DRAPlugin.
func (d *Driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, c := range claims {
		devs, err := d.prepare(ctx, c)
		if err != nil {
			d.log.Error(err, "DRA prepare failed", "claim", c.Namespace+"/"+c.Name, "uid", c.UID)
		}
		out[c.UID] = kubeletplugin.PrepareResult{Devices: devs, Err: err}
	}
	return out, nil
}

// prepare reserves an address for each device of the driver the claim was allocated on the node,
// then writes the claim's status entries for them. A failed status write fails it; the
// reservations are kept, and the kubelet's retry finds them (Reserve is idempotent).
func (d *Driver) prepare(ctx context.Context, c *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	pod, err := onePod(c)
	if err != nil {
		return nil, err
	}
	if c.Status.Allocation == nil {
		return nil, fmt.Errorf("claim %s/%s is not allocated", c.Namespace, c.Name)
	}
	served := d.core.Served()
	var devs []kubeletplugin.Device
	var entries []*resourceapply.AllocatedDeviceStatusApplyConfiguration
	for _, r := range c.Status.Allocation.Devices.Results {
		if r.Driver != DriverName || r.Pool != d.opts.Node {
			continue
		}
		pool, ok := PoolOfSlot(r.Device, served)
		if !ok {
			return nil, fmt.Errorf("device %s of claim %s/%s is no slot of a pool serving node %s (pools: %s); was the pool's node selector changed?",
				r.Device, c.Namespace, c.Name, d.opts.Node, strings.Join(served, ", "))
		}
		ifname, err := interfaceOf(c, r.Request, d.opts.Interface)
		if err != nil {
			return nil, err
		}
		req := ipam.ReserveRequest{
			Claim: ipam.ClaimDevice{Namespace: c.Namespace, Name: c.Name, UID: string(c.UID), Request: r.Request, Device: r.Device, Interface: ifname},
			Pod:   pod,
			Pool:  pool,
		}
		res, prefixes, err := d.core.Prepare(ctx, req)
		if err != nil {
			return nil, fmt.Errorf("reserve an address for device %s of claim %s/%s: %w", r.Device, c.Namespace, c.Name, err)
		}
		entries = append(entries, statusEntry(d.opts.Node, r.Device, ifname, prefixes, res.Created, c.Generation))
		devs = append(devs, kubeletplugin.Device{Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device})
	}
	if len(entries) == 0 {
		return devs, nil
	}
	ac := resourceapply.ResourceClaim(c.Name, c.Namespace).WithUID(c.UID).
		WithStatus(resourceapply.ResourceClaimStatus().WithDevices(entries...))
	if _, err := d.client.ResourceV1().ResourceClaims(c.Namespace).ApplyStatus(ctx, ac, metav1.ApplyOptions{FieldManager: FieldManager, Force: true}); err != nil {
		return nil, fmt.Errorf("write the address into the status of claim %s/%s (the reservation is kept for the kubelet's retry): %w", c.Namespace, c.Name, err)
	}
	return devs, nil
}

// statusEntry is the agent's status.devices entry of one device: Ready, and the address in
// networkData in canonical CIDR form (the API server accepts no other).
func statusEntry(node, device, ifname string, prefixes []netip.Prefix, since time.Time, gen int64) *resourceapply.AllocatedDeviceStatusApplyConfiguration {
	ips := make([]string, len(prefixes))
	for i, p := range prefixes {
		ips[i] = p.String() // netip's form is the canonical one: lowercase, compressed
	}
	return resourceapply.AllocatedDeviceStatus().WithDriver(DriverName).WithPool(node).WithDevice(device).
		WithConditions(metaapply.Condition().WithType(ConditionReady).WithStatus(metav1.ConditionTrue).
			WithReason("AddressReserved").WithMessage("the address is reserved for the pod's " + ifname).
			WithObservedGeneration(gen).WithLastTransitionTime(metav1.NewTime(since.Truncate(time.Second)))).
		WithNetworkData(resourceapply.NetworkDeviceData().WithInterfaceName(ifname).WithIPs(ips...))
}

// onePod returns the claim's one consumer, a pod; anything else is refused: an address serves
// one pod's sandbox.
func onePod(c *resourceapi.ResourceClaim) (ipam.PodRef, error) {
	if n := len(c.Status.ReservedFor); n != 1 {
		return ipam.PodRef{}, fmt.Errorf("claim %s/%s is reserved for %d consumers; an ipwarden address serves exactly one pod (use a ResourceClaimTemplate, or one named claim per pod)",
			c.Namespace, c.Name, n)
	}
	r := c.Status.ReservedFor[0]
	if r.APIGroup != "" || r.Resource != "pods" {
		return ipam.PodRef{}, fmt.Errorf("claim %s/%s is reserved for %s %s, not a pod", c.Namespace, c.Name, r.Resource, r.Name)
	}
	return ipam.PodRef{Namespace: c.Namespace, Name: r.Name, UID: string(r.UID)}, nil
}

// AddressConfig is the opaque configuration of the driver in a claim or a DeviceClass
// (apiVersion ipwarden.io/v1alpha1, kind AddressConfig).
type AddressConfig struct {
	APIVersion string `json:"apiVersion,omitempty"`
	Kind       string `json:"kind,omitempty"`
	// IfName is the CNI interface whose ADD gets the address (default: the agent's
	// --dra-interface).
	IfName string `json:"ifName,omitempty"`
}

// interfaceOf returns the interface the address of request goes to: the last opaque
// configuration of the driver that applies to the request (the claim's come after the class's),
// else def.
func interfaceOf(c *resourceapi.ResourceClaim, request, def string) (string, error) {
	ifname := def
	for _, cfg := range c.Status.Allocation.Devices.Config {
		if cfg.Opaque == nil || cfg.Opaque.Driver != DriverName {
			continue
		}
		if len(cfg.Requests) > 0 && !containsRequest(cfg.Requests, request) {
			continue
		}
		var ac AddressConfig
		if err := json.Unmarshal(cfg.Opaque.Parameters.Raw, &ac); err != nil {
			return "", fmt.Errorf("claim %s/%s: the configuration of driver %s: %w", c.Namespace, c.Name, DriverName, err)
		}
		if ac.IfName != "" {
			ifname = ac.IfName
		}
	}
	return ifname, nil
}

func containsRequest(reqs []string, request string) bool {
	parent, _, _ := strings.Cut(request, "/") // a subrequest's result names "request/subrequest"
	for _, r := range reqs {
		if r == request || r == parent {
			return true
		}
	}
	return false
}

// UnprepareResourceClaims implements kubeletplugin.DRAPlugin: every reservation of each claim is
// freed through the cooldown; a claim with none succeeds.
func (d *Driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	res := d.core.Reservations()
	out := make(map[types.UID]error, len(claims))
	for _, c := range claims {
		var errs []error
		for _, r := range res {
			if r.DRA.UID != string(c.UID) {
				continue
			}
			if err := d.core.Unprepare(ctx, r.DRA.UID, r.DRA.Request, r.DRA.Device); err != nil {
				errs = append(errs, err)
			}
		}
		out[c.UID] = errors.Join(errs...)
	}
	return out, nil
}

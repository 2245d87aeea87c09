package agent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/client-go/kubernetes"

	"github.com/ipwarden/ipwarden/internal/agent/dra"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// The agent's side of the DRA driver (package dra): the machine's DRA inputs (machine_dra.go)
// served to the kubelet plugin, and what the state says of reservations and slots.

// DRAConfig turns the DRA kubelet plugin on (Config.DRA).
type DRAConfig struct {
	Enabled bool
	// Interface is the CNI interface a claim's address goes to by default (--dra-interface).
	Interface string
	// MaxSlots caps the slot devices published per pool (--dra-max-slots).
	MaxSlots int
	// RegistrarDir and PluginDir override the kubelet's directories (tests).
	RegistrarDir, PluginDir string
}

// draCore serves package dra from the Service.
type draCore struct{ s *Service }

// DRACore returns what the DRA driver needs of the agent.
func (s *Service) DRACore() dra.Core { return draCore{s} }

func (c draCore) Prepare(ctx context.Context, req ipam.ReserveRequest) (ipam.Attachment, []netip.Prefix, error) {
	a, err := c.s.call(ctx, false, func(m *Machine, now time.Time) uint64 { return m.Prepare(req, now) })
	if err != nil {
		return ipam.Attachment{}, nil, err
	}
	if a.Err != nil {
		return ipam.Attachment{}, nil, a.Err
	}
	if a.Att == nil {
		return ipam.Attachment{}, nil, errors.New("ipwarden: the machine answered a Prepare with no reservation")
	}
	var prefixes []netip.Prefix
	c.s.read(func(m *Machine) { prefixes = m.st.ClaimPrefixes(*a.Att) })
	return *a.Att, prefixes, nil
}

func (c draCore) Unprepare(ctx context.Context, claimUID, request, device string) error {
	a, err := c.s.call(ctx, false, func(m *Machine, now time.Time) uint64 { return m.Unprepare(claimUID, request, device, now) })
	if err != nil {
		return err
	}
	if a.Err != nil {
		return fmt.Errorf("release the reservation of device %s: %w", device, a.Err)
	}
	return nil
}

func (c draCore) Reservations() []ipam.Attachment {
	var out []ipam.Attachment
	c.s.read(func(m *Machine) { out = m.st.Reservations() })
	return out
}

func (c draCore) Served() []string {
	var out []string
	c.s.read(func(m *Machine) { out = m.st.Served() })
	return out
}

func (c draCore) Capacities() []ipam.ClaimCapacity {
	var out []ipam.ClaimCapacity
	c.s.step(func(m *Machine, now time.Time) { out = m.st.ClaimCapacities(now) })
	return out
}

func (c draCore) Reconcile(ctx context.Context, allocated func(ipam.ClaimDevice) bool) error {
	var ids []uint64
	c.s.step(func(m *Machine, now time.Time) { ids = m.ReconcileClaims(allocated, now) })
	_ = ids // each release is logged by the machine; a refused one is tried again next round
	return nil
}

// runDRA runs the DRA kubelet plugin until ctx ends (after the first reconciliation: the state
// knows the pools and holdings it promises slots of).
func runDRA(ctx context.Context, cfg Config, svc *Service, log logr.Logger) {
	cs, err := kubernetes.NewForConfig(cfg.RestConfig)
	if err != nil {
		log.Error(err, "DRA: cannot create the API client; the kubelet plugin does not run")
		return
	}
	d := dra.New(svc.DRACore(), cs, dra.Options{Node: cfg.Node, Interface: cfg.DRA.Interface, MaxSlots: cfg.DRA.MaxSlots,
		RegistrarDir: cfg.DRA.RegistrarDir, PluginDir: cfg.DRA.PluginDir, Log: log})
	for ctx.Err() == nil {
		if err := d.Run(ctx); err != nil {
			log.Error(err, "DRA kubelet plugin stopped; restarting it in 10s")
			select {
			case <-ctx.Done():
			case <-time.After(10 * time.Second):
			}
		}
	}
}

package agent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/kubernetes"

	"github.com/ipwarden/ipwarden/internal/agent/dra"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/cniproto"
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

// recoveryEvidence returns how the start-up reads, after a lost or damaged journal, the claims'
// evidence of the DRA reservations the journal forgot (dra.ListClaims, dra.Evidence; the machine
// decides what to re-create), or nil without --dra. The read is one LIST of every ResourceClaim
// in the cluster (no field selector names the allocation's node), made only then. A failure the
// API server may get over is retried, with backoff, for as long as it lasts: the start serves no
// ADD until it succeeds, because every address of a claim prepared before the loss would
// otherwise count as free once the hold ends. One it will not get over (the agent may not list
// ResourceClaims: RBAC) recovers nothing, and says so in the log and an event on the node's
// NodeIPAllocation: the reservations are then lost as before recovery existed.
func recoveryEvidence(ctx context.Context, cfg Config, svc *Service, log logr.Logger) func() []ipam.ReservationEvidence {
	if !cfg.DRA.Enabled {
		return nil
	}
	return func() []ipam.ReservationEvidence {
		notRecovered := func(err error) []ipam.ReservationEvidence {
			log.Error(err, "cannot list ResourceClaims: the DRA reservations of claims prepared before the journal was lost are not recovered; their pods' next sandboxes get other addresses than their claims' status names",
				"remedy", "give the agent list on resourceclaims (ClusterRole ipwarden-agent-dra)")
			svc.nodeEvent(corev1.EventTypeWarning, ReasonDRAReservationNotRecovered, fmt.Sprintf(
				"the journal was lost and the ResourceClaims cannot be listed (%s): the DRA reservations of claims prepared before the loss are not recovered",
				cniproto.Truncate(err.Error(), 300)))
			return nil
		}
		cs, err := kubernetes.NewForConfig(cfg.RestConfig)
		if err != nil {
			return notRecovered(err)
		}
		ifname := cfg.DRA.Interface
		if ifname == "" {
			ifname = ipam.PrimaryIfName
		}
		backoff := time.Second
		for {
			claims, err := dra.ListClaims(ctx, cs)
			if err == nil {
				var served []string
				svc.read(func(m *Machine) { served = m.st.Served() })
				evs, problems := dra.Evidence(claims, cfg.Node, served, ifname)
				for _, p := range problems {
					log.Error(nil, "a DRA claim's status entry of this node cannot be read as a reservation; not recovered", "problem", p)
				}
				log.Info("read the ResourceClaims to recover the DRA reservations the lost journal held", "claims", len(claims), "entries", len(evs))
				return evs
			}
			if ctx.Err() != nil {
				return nil
			}
			if apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err) || apierrors.IsMethodNotSupported(err) {
				return notRecovered(err)
			}
			log.Error(err, "cannot list ResourceClaims to recover the DRA reservations the lost journal held; retrying (ADD waits)", "retryIn", backoff.String())
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 30*time.Second)
		}
	}
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

package agent

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/previous"
)

// previousReadTimeout bounds the reading of the previous IPAM's reservations at an ADD: a list of
// Whereabouts' IPPools from the API server (host-local's files take microseconds, but wait for
// host-local's lock, which its own ADD and DEL hold for milliseconds).
const previousReadTimeout = 5 * time.Second

// previousReads reads, at every ADD whose CNI configuration names a "previous" IPAM, what that
// IPAM reserved, and hands it to the state before the ADD picks (docs/design.md, "Taking over
// from another IPAM"; the state's side is ipam/previous.go, the reading package previous).
type previousReads struct {
	// mu serializes each reading with handing it to the state, so readings land in the order
	// they were made and the state always holds the newest: an older reading landing after a
	// newer one could lack a reservation made between them.
	mu sync.Mutex
	// any: some network's reading is recorded; an ADD without "previous" then clears its
	// network's. Without any an ADD without "previous" costs nothing.
	any atomic.Bool
	// last is each network's last reading, to log changes only; warned: networks whose
	// previous IPAM cannot be read, logged once.
	last   map[string]addr.Set
	warned map[string]string
	// known is, per host-local directory, what the readings found of each file: ipwarden's
	// own or not (previous.ReadHostLocalKnown), so a file is opened once, not at every ADD.
	known map[string]map[string]bool
	// whereabouts lists Whereabouts' IPPools from the API server (Kube.ListWhereaboutsPools);
	// nil until the agent has an API client.
	whereabouts atomic.Pointer[func(context.Context) ([]previous.WhereaboutsPool, error)]
	// editWhereabouts writes ipwarden's allocations into Whereabouts' IPPools
	// (Kube.EditWhereaboutsPools); nil until the agent has an API client.
	editWhereabouts atomic.Pointer[WhereaboutsEditor]
}

// WhereaboutsEditor lists Whereabouts' IPPools fresh, hands them to plan and applies the edits it
// returns, each an update carrying the object's resourceVersion; on a conflict (Whereabouts, or
// another writer, updated the IPPool since the list) it lists and plans again, until ctx ends.
// The taken addresses plan reports refuse the whole change: nothing is updated.
type WhereaboutsEditor func(ctx context.Context, plan func([]previous.WhereaboutsPool) ([]previous.WhereaboutsEdit, addr.Set, error)) (taken addr.Set, err error)

// SetWhereaboutsEditor sets how the agent writes its own allocations into Whereabouts' IPPools
// (Kube.EditWhereaboutsPools), for ADDs whose "previous" IPAM is Whereabouts.
func (s *Service) SetWhereaboutsEditor(f WhereaboutsEditor) {
	s.prev.editWhereabouts.Store(&f)
}

// SetWhereaboutsLister sets how the agent lists Whereabouts' IPPool objects from the API server
// (Kube.ListWhereaboutsPools), for ADDs whose "previous" IPAM is Whereabouts.
func (s *Service) SetWhereaboutsLister(f func(context.Context) ([]previous.WhereaboutsPool, error)) {
	s.prev.whereabouts.Store(&f)
}

// readPrevious reads what the previous IPAM named by the ADD's configuration has reserved and
// records it in the state, before the ADD picks; an ADD without one forgets its network's
// reading. A reading that fails fails the ADD with code 11 (the runtime retries): picking without
// it could hand out the address of a pod that started through the previous IPAM a moment ago.
// A previous IPAM whose reservations ipwarden cannot read (neither host-local nor Whereabouts)
// keeps nothing out of use, as before, and is logged once per network.
func (s *Service) readPrevious(ctx context.Context, req cniproto.Request) *cniproto.Response {
	pr := &s.prev
	if len(req.Previous) == 0 {
		if pr.any.Load() {
			pr.mu.Lock()
			s.forgetPrevious(req.Network)
			pr.mu.Unlock()
		}
		return nil
	}
	src, err := previous.Parse(req.Previous, req.Network)
	if err != nil {
		return errResp(cniproto.CodeInvalidConfig, fmt.Sprintf("ipwarden: the network configuration's \"previous\" object: %v", err),
			"fix the CNI network configuration (see ipwarden's docs/configuration.md, \"The CNI plugin\")")
	}
	pr.mu.Lock()
	defer pr.mu.Unlock()
	if src.Kind == previous.Unreadable {
		if pr.warned == nil {
			pr.warned = map[string]string{}
		}
		if pr.warned[req.Network] != src.Type {
			pr.warned[req.Network] = src.Type
			s.log.Info("the previous IPAM's reservations cannot be read: a pod that starts through it while the node switches may get an address ipwarden hands out too; see docs/operations.md, \"Moving from another IPAM\"",
				"network", req.Network, "type", src.Type)
		}
		s.metrics.PreviousReads.WithLabelValues(src.Type, "unreadable").Inc()
		s.forgetPrevious(req.Network) // the network's previous IPAM changed to one not read
		return nil
	}
	rctx, cancel := context.WithTimeout(ctx, previousReadTimeout)
	reserved, err := s.readReservations(rctx, src)
	cancel()
	if err != nil {
		s.metrics.PreviousReads.WithLabelValues(src.Type, "error").Inc()
		s.log.Error(err, "cannot read the previous IPAM's reservations; the ADD fails and the runtime retries", "network", req.Network, "type", src.Type)
		return errResp(cniproto.CodeTryAgainLater,
			fmt.Sprintf("ipwarden: the agent on node %s cannot read what the previous IPAM %q of network %q has reserved: %s",
				s.node, src.Type, req.Network, cniproto.Truncate(err.Error(), 300)),
			"without it a new pod could get the address of a pod that started through the previous IPAM; the runtime retries")
	}
	s.metrics.PreviousReads.WithLabelValues(src.Type, "ok").Inc()
	s.read(func(m *Machine) { m.st.SetPrevious(req.Network, reserved, src.NodeLocal()) })
	if pr.last == nil {
		pr.last = map[string]addr.Set{}
	}
	if old, ok := pr.last[req.Network]; !ok || !old.Equal(reserved) {
		s.log.Info("the previous IPAM's reservations are kept out of use", "network", req.Network, "type", src.Type,
			"reserved", reserved.Size().String(), "addresses", cniproto.Truncate(reserved.String(), 300))
	}
	pr.last[req.Network] = reserved
	pr.any.Store(true)
	return nil
}

// forgetPrevious drops network's reading, in the state and here. The caller holds s.prev.mu.
func (s *Service) forgetPrevious(network string) {
	pr := &s.prev
	if _, ok := pr.last[network]; !ok {
		return
	}
	s.read(func(m *Machine) {
		m.st.ClearPrevious(network)
		m.changed()
	})
	delete(pr.last, network)
	pr.any.Store(len(pr.last) > 0)
}

// readReservations reads src's reservations: host-local's files under its lock, or Whereabouts'
// IPPools from the API server. The caller holds s.prev.mu.
func (s *Service) readReservations(ctx context.Context, src previous.Source) (addr.Set, error) {
	switch src.Kind {
	case previous.HostLocal:
		if s.prev.known == nil {
			s.prev.known = map[string]map[string]bool{}
		}
		known := s.prev.known[src.Dir]
		if known == nil {
			known = map[string]bool{}
			s.prev.known[src.Dir] = known
		}
		return previous.ReadHostLocalKnown(ctx, src.Dir, known)
	case previous.Whereabouts:
		list := s.prev.whereabouts.Load()
		if list == nil {
			return addr.Set{}, fmt.Errorf("the agent has no API client yet to read Whereabouts' IPPools")
		}
		pools, err := (*list)(ctx)
		if err != nil {
			return addr.Set{}, err
		}
		return previous.WhereaboutsReserved(pools)
	}
	return addr.Set{}, fmt.Errorf("the previous IPAM %q cannot be read", src.Type)
}

// reservePrevious makes a write's addresses unavailable in the previous IPAM's store
// (Write.Reserve), bounded by previousReadTimeout: nil, a *previous.TakenError (the previous IPAM
// reserved one itself; nothing written), or a *ReserveError.
func (s *Service) reservePrevious(rv Reserve) error {
	ctx, cancel := context.WithTimeout(context.Background(), previousReadTimeout)
	defer cancel()
	var err error
	switch rv.Store.Kind {
	case previous.HostLocal.String():
		err = previous.ReserveHostLocal(ctx, rv.Store.Dir, rv.Reservations)
	case previous.Whereabouts.String():
		edit := s.prev.editWhereabouts.Load()
		if edit == nil {
			err = errors.New("the agent has no API client yet to write Whereabouts' IPPools")
			break
		}
		var taken addr.Set
		taken, err = (*edit)(ctx, func(pools []previous.WhereaboutsPool) ([]previous.WhereaboutsEdit, addr.Set, error) {
			return previous.PlanWhereabouts(rv.Reservations, pools)
		})
		if err == nil && !taken.IsEmpty() {
			err = &previous.TakenError{Kind: previous.Whereabouts, Addrs: taken}
		}
	default:
		err = fmt.Errorf("ipwarden does not write the store of IPAM %q", rv.Store.Kind)
	}
	var taken *previous.TakenError
	switch {
	case err == nil:
		s.metrics.PreviousWrites.WithLabelValues(rv.Store.Kind, "reserve", "ok").Inc()
		return nil
	case errors.As(err, &taken):
		s.metrics.PreviousWrites.WithLabelValues(rv.Store.Kind, "reserve", "taken").Inc()
		return err
	}
	s.metrics.PreviousWrites.WithLabelValues(rv.Store.Kind, "reserve", "error").Inc()
	s.log.Error(err, "cannot make an ADD's addresses unavailable in the previous IPAM's store; the ADD fails and the runtime retries",
		"ipam", rv.Store.Kind, "addresses", reservationAddrs(rv))
	return &ReserveError{Kind: rv.Store.Kind, Err: err}
}

// releasePrevious removes ipwarden's reservations of a freed attachment (or of an ADD whose
// journal write failed) from the previous IPAM's store. A failure leaves them there: they keep
// only the previous IPAM off those addresses (ipwarden's readings skip its own), and the next
// ADD of ipwarden that picks one of them replaces it.
func (s *Service) releasePrevious(rv Reserve) {
	ctx, cancel := context.WithTimeout(context.Background(), previousReadTimeout)
	defer cancel()
	var err error
	switch rv.Store.Kind {
	case previous.HostLocal.String():
		_, err = previous.UnreserveHostLocal(ctx, rv.Store.Dir, rv.Reservations)
	case previous.Whereabouts.String():
		edit := s.prev.editWhereabouts.Load()
		if edit == nil {
			err = errors.New("the agent has no API client yet to write Whereabouts' IPPools")
			break
		}
		_, err = (*edit)(ctx, func(pools []previous.WhereaboutsPool) ([]previous.WhereaboutsEdit, addr.Set, error) {
			edits, err := previous.PlanWhereaboutsRelease(rv.Reservations, pools)
			return edits, addr.Set{}, err
		})
	default:
		return
	}
	if err != nil {
		s.metrics.PreviousWrites.WithLabelValues(rv.Store.Kind, "release", "error").Inc()
		s.log.Error(err, "cannot remove ipwarden's reservation from the previous IPAM's store; it keeps the previous IPAM off the address until ipwarden hands it out again",
			"ipam", rv.Store.Kind, "dir", rv.Store.Dir, "addresses", reservationAddrs(rv))
		return
	}
	s.metrics.PreviousWrites.WithLabelValues(rv.Store.Kind, "release", "ok").Inc()
}

func reservationAddrs(rv Reserve) string {
	parts := make([]string, len(rv.Reservations))
	for i, r := range rv.Reservations {
		parts[i] = r.Addr.String()
	}
	return strings.Join(parts, ",")
}

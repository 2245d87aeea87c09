package agent

import (
	"context"
	"time"

	"github.com/go-logr/logr"

	"github.com/ipwarden/ipwarden/internal/agent/ipam"
)

// SpecPublisher writes the node's request into its NodeIPAllocation spec; Kube implements it.
type SpecPublisher interface {
	PublishSpec(ctx context.Context, reqs []ipam.PoolRequest) (wrote bool, err error)
}

// Monitor is the pool monitor (seed 000's shape): on every change it is kicked, and at least
// every resync period, it recomputes each pool's target from demand (scaling.Target through the
// state machine), marks what it gives back as releasing (journaled before anything is
// published), and publishes the request. Kicks coalesce: after one, the monitor gathers the
// changes that follow until none came for the coalescing quiet time (at most ten times that), so
// pods bound to the node in a burst raise the request once, and the API sees a write only when
// a target crosses a batch boundary. KickNow, for an ADD that waits for an address, cuts the
// gathering short.
type Monitor struct {
	svc     monitorState
	pub     SpecPublisher
	resync  time.Duration
	log     logr.Logger
	kick    chan struct{}
	now     chan struct{}
	quiet   time.Duration
	metrics *Metrics
	// nextCooled is when the next address counted as cooling by the last round's target leaves
	// its cooldown (zero: none); Run does a round then.
	nextCooled time.Time
	// signal, when set, shows the scheduler signal on the Node after each round.
	signal *NodeSignal
	// nextRelease is when a pool's release delay ends (zero: none runs); Run does a round then.
	nextRelease time.Time
}

// NewMonitor returns a monitor; Run starts it.
func NewMonitor(svc monitorState, pub SpecPublisher, resync time.Duration, log logr.Logger) *Monitor {
	return &Monitor{svc: svc, pub: pub, resync: resync, log: log, kick: make(chan struct{}, 1), now: make(chan struct{}, 1), metrics: svc.Metrics()}
}

// SetCoalesce sets the coalescing quiet time (call before Run; 0, the default, does a round at
// every kick).
func (m *Monitor) SetCoalesce(quiet time.Duration) { m.quiet = max(quiet, 0) }

// SetSignal makes each round show the scheduler signal through sig (call before Run).
func (m *Monitor) SetSignal(sig *NodeSignal) { m.signal = sig }

// Kick asks for a round soon; it never blocks.
func (m *Monitor) Kick() {
	select {
	case m.kick <- struct{}{}:
	default:
	}
}

// KickNow asks for a round at once, ending any gathering; it never blocks.
func (m *Monitor) KickNow() {
	select {
	case m.now <- struct{}{}:
	default:
	}
}

// gather waits, after a kick, until no other kick came for the quiet time, at most ten quiet
// times, or until KickNow or ctx ends.
func (m *Monitor) gather(ctx context.Context) {
	if m.quiet <= 0 {
		return
	}
	limit := time.NewTimer(10 * m.quiet)
	defer limit.Stop()
	quiet := time.NewTimer(m.quiet)
	defer quiet.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-m.now:
			return
		case <-limit.C:
			return
		case <-quiet.C:
			return
		case <-m.kick:
			quiet.Reset(m.quiet)
		}
	}
}

// Run does rounds until ctx ends. A failed round is retried with exponential backoff. Besides
// kicks and the resync period, a round runs when the next freed address leaves its reuse
// cooldown (cooling addresses count as demand, so the target can drop then with no other event)
// and when a release delay ends.
func (m *Monitor) Run(ctx context.Context) {
	ticker := time.NewTicker(m.resync)
	defer ticker.Stop()
	cooled := time.NewTimer(time.Hour)
	cooled.Stop()
	defer cooled.Stop()
	var backoff time.Duration
	var retry <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-m.kick:
			m.gather(ctx)
		case <-m.now:
		case <-ticker.C:
		case <-retry:
		case <-cooled.C:
		}
		if err := m.Round(ctx); err != nil {
			if ctx.Err() != nil {
				return
			}
			backoff = min(max(2*backoff, 200*time.Millisecond), 30*time.Second)
			m.log.Error(err, "pool monitor round failed; the node keeps serving from the addresses it holds", "retryIn", backoff.String())
			retry = time.After(backoff)
			continue
		}
		backoff, retry = 0, nil
		if wake := earliest(m.nextCooled, m.nextRelease); !wake.IsZero() {
			cooled.Reset(max(0, wake.Sub(m.svc.Clock())))
		}
	}
}

// Round does one round: give back what the release decision says (scaling.DecideRelease:
// beyond the hysteresis band for the release delay, or at once while the pool is exhausted),
// then publish the request.
func (m *Monitor) Round(ctx context.Context) error {
	r, err := m.svc.releaseRound()
	if err != nil {
		return err
	}
	for pool, set := range r.Marked {
		m.log.Info("releasing addresses beyond the target", "pool", pool, "addresses", set.String())
	}
	spec := r.Spec
	m.nextCooled = r.NextCooled
	m.nextRelease = r.NextRelease
	m.metrics.setPools(r.Stats, r.Attachments)
	m.metrics.ClaimAttachments.Set(float64(r.Claims.Attachments))
	m.metrics.ClaimShared.Set(float64(r.Claims.Shared))
	if !m.svc.publishesSpec() {
		return nil // another agent holds the node's Lease: it publishes the node's request
	}
	if m.signal != nil {
		// A failed Node write is retried at the next round; it never holds up the request.
		if err := m.signal.Update(ctx, r.Stats, r.Handback); err != nil {
			m.log.Error(err, "cannot show the scheduler signal on the Node; retrying at the next round")
		}
	}
	wrote, err := m.pub.PublishSpec(ctx, spec)
	switch {
	case err != nil:
		m.metrics.SpecWrites.WithLabelValues("error").Inc()
		return err
	case wrote:
		m.metrics.SpecWrites.WithLabelValues("ok").Inc()
		for _, r := range spec {
			m.log.V(1).Info("published request", "pool", r.Pool, "requested", r.Requested, "releasing", r.Releasing.String())
		}
	}
	return nil
}

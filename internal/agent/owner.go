package agent

import (
	"context"
	"time"

	"github.com/ipwarden/ipwarden/internal/agent/gc"
)

// The Service is the one owner of the node's state: its fields (the Machine with the ipam.State and the
// gate, the reporter of the leak collector's outcomes) are touched only by its own methods. The
// other parts of the agent see it through the narrow interfaces below, each the methods that part
// needs, so what they may do to the node's state is written down here.

// monitorState is what the pool monitor needs of the node's state.
type monitorState interface {
	// releaseRound gives back what is beyond the targets (journaled first) and returns the
	// request to publish.
	releaseRound() (Round, error)
	// publishesSpec reports whether this agent publishes the node's request (it holds the
	// node's Lease, or the gate is off).
	publishesSpec() bool
	Clock() time.Time
	Metrics() *Metrics
}

// leaseGate is what the node Lease keeper tells the service.
type leaseGate interface {
	// setLeaseRecheck sets how an ADD asks for a re-check of the Lease.
	setLeaseRecheck(func(context.Context))
	// setLease records whether the agent holds the Lease, who does if not, and until when the
	// agent may serve without a renewal.
	setLease(held bool, holder string, until time.Time)
}

// collectorState is what the leak collector needs of the node's state.
type collectorState interface {
	// gcView returns what the collector needs of every attachment, in-flight ones marked.
	gcView() []gc.Attachment
	// collect frees a candidate's attachment through the DEL path, if it is still the one
	// selected.
	collect(path string, c gc.Candidate, why string) (bool, error)
	// gcDryRun reports whether the collector frees nothing (--gc-dry-run).
	gcDryRun() bool
	// reportGCFailed and reportOutlived report a candidate the collector could not free, and
	// one whose sandbox outlives its pod (logs, metrics, events).
	reportGCFailed(path string, c gc.Candidate, msg string)
	reportOutlived(c gc.Candidate, grace time.Duration)
	Clock() time.Time
	Metrics() *Metrics
}

var (
	_ monitorState   = (*Service)(nil)
	_ leaseGate      = (*Service)(nil)
	_ collectorState = (*Service)(nil)
)

// Clock returns the service's time.
func (s *Service) Clock() time.Time { return s.now() }

// Metrics returns the agent's metrics, which the service and the parts around it update.
func (s *Service) Metrics() *Metrics { return s.metrics }

func (s *Service) publishesSpec() (ok bool) {
	s.read(func(m *Machine) { ok = m.PublishesSpec() })
	return ok
}

func (s *Service) setLeaseRecheck(f func(context.Context)) {
	s.setHook(func(h *hooks) { h.recheck = f })
}

func (s *Service) setLease(held bool, holder string, until time.Time) {
	s.step(func(m *Machine, now time.Time) { m.SetLease(held, holder, until, now) })
}

// The start-up (agent.go) says how far it has come: ADD is planned only as the machine's gate
// allows (machine_gate.go).

// setServeOffline says whether ADD may be served from the journal before the API server answers.
func (s *Service) setServeOffline(ok bool) { s.read(func(m *Machine) { m.SetServeOffline(ok) }) }

// setStage says what the start-up waits for (ADD's error says it until the first reconciliation).
func (s *Service) setStage(stage string) { s.read(func(m *Machine) { m.SetStage(stage) }) }

// setAPIError says why the API server cannot be reached yet.
func (s *Service) setAPIError(err error) {
	s.read(func(m *Machine) { m.SetAPIError(err) })
	if err != nil && s.getHooks().podMeta == nil {
		s.reader.awayOnce.Do(func() { close(s.reader.away) }) // pod reads wait no more (podReader)
	}
}

// setSynced says the first reconciliation with the API server is done.
func (s *Service) setSynced() { s.read(func(m *Machine) { m.SetSynced() }) }

// nodeEvent records an event on the node's NodeIPAllocation (when events are set up).
func (s *Service) nodeEvent(typ, reason, msg string) { s.gcr.event(nil, typ, reason, msg) }

func (s *Service) gcDryRun() bool { return s.gcDryRunOn }

func (s *Service) reportGCFailed(path string, c gc.Candidate, msg string) { s.gcr.failed(path, c, msg) }

func (s *Service) reportOutlived(c gc.Candidate, grace time.Duration) { s.gcr.outlived(c, grace) }

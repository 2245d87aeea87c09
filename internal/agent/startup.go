package agent

import (
	"time"

	"github.com/go-logr/logr"

	"github.com/ipwarden/ipwarden/internal/agent/cri"
	"github.com/ipwarden/ipwarden/internal/agent/ipam"
	"github.com/ipwarden/ipwarden/internal/agent/journal"
)

// The deterministic steps of the agent's start, shared by Run (agent.go) and the simulation
// (sim_test.go), so that the simulation boots through the agent's own start-up: openState before
// anything is served, reconcileStart once the API server answered and the pods are known.

// startFacts is what the start found that catchUp reports or acts on once the API answers.
type startFacts struct {
	recovered    *journal.Recovery // a damaged journal was moved aside
	journalEmpty bool              // new, lost or damaged: the owners of held addresses are unknown
	// offline: ADD may be served from the journal's addresses before the API server answers
	// (gate.offline).
	offline bool
	runtime *cri.Reader // the container runtime, read-only (nil: none configured)
}

// openState opens the journal in dir (a damaged one is moved aside and an empty one started:
// journal.OpenOrRecover), restores the node's state from it, and decides whether ADD may be
// served from the journal before the API server answers: only when it holds addresses and no
// hold after a rebuild was under way. metrics and log receive what it found.
//
// A journal that is empty (new, lost, or damaged and moved aside) means the owners of the node's
// held addresses are unknown: the hold after the rebuild must start, until now+hold at the latest.
// The need is recorded at once, as the hold's marker, before anything is written to the new
// journal: a restart before the hold starts (the API server away, a write refused, a SIGTERM)
// finds a journal that is no longer empty and would otherwise serve the addresses of the pods
// whose records were lost (the agent's simulation found this: seed 16576469368076013389).
func openState(dir, node string, now time.Time, hold time.Duration, metrics *Metrics, log logr.Logger) (*journal.Journal, *ipam.State, startFacts, error) {
	j, snap, recovered, err := journal.OpenOrRecover(dir, journal.Options{Node: node, ObserveWrite: func(d time.Duration) {
		metrics.JournalWrite.Observe(d.Seconds())
	}}, now)
	if err != nil {
		return nil, nil, startFacts{}, err
	}
	for _, r := range []string{journal.ReasonTruncated, journal.ReasonCorrupt, journal.ReasonIncompatibleVersion} {
		metrics.JournalRecovered.WithLabelValues(r)
	}
	if recovered != nil {
		metrics.JournalRecovered.WithLabelValues(recovered.Reason).Inc()
		log.Error(nil, "the journal is damaged: moved it aside and started an empty one; attachments are rebuilt from what the node shows (the runtime's sandboxes, the pods' reports)",
			"reason", recovered.Reason, "problem", recovered.Problem, "movedTo", recovered.MovedTo, "journal", j.Path())
	}
	st := ipam.New(node)
	for _, p := range st.Restore(snap) {
		log.Error(nil, "journal restore found a problem", "problem", p)
	}
	if n := st.ClampFuture(now); n > 0 {
		log.Info("the journal holds times later than this node's clock (it was stepped back since): they count from now", "times", n)
	}
	if snap.IsEmpty() {
		log.Info("the journal is empty (new node, or the journal was lost): attachments will be rebuilt from what the node shows (the runtime's sandboxes, the pods' reports) and a hold is due", "journal", j.Path())
	} else {
		log.Info("journal loaded", "journal", j.Path(), "attachments", len(snap.Attachments), "cooling", len(snap.Cooling),
			"releasing", len(snap.Releasing), "lostReservations", st.LostAhead())
	}
	if n := st.LostAhead(); n > 0 {
		log.Error(nil, "the journal holds addresses an older agent reserved ahead and may have handed out without a record of the sandbox: they stay out of use",
			"addresses", n, "remedy", "docs/operations.md: addresses reserved ahead by an older agent")
	}
	start := startFacts{recovered: recovered, journalEmpty: snap.IsEmpty(), offline: st.CanServeOffline()}
	if start.journalEmpty {
		if _, marked, _ := journal.HeldUntil(dir); !marked {
			if err := journal.MarkHold(dir, now.Add(hold)); err != nil {
				log.Error(err, "cannot record in the state directory that the hold after a rebuild is due; a restart before it starts would not hold")
			}
		}
	}
	if _, interrupted, _ := journal.HeldUntil(dir); interrupted && start.offline {
		// A restart during the hold after a rebuild: which held addresses are unattributed is
		// decided again once the pods are known, so nothing is served from the journal first.
		start.offline = false
		log.Info("a hold of addresses of unknown owner was under way: ADD waits for the API server to resume it")
	}
	return j, st, start, nil
}

// starter is what reconcileStart feeds: Service on a node, the simulation's driver in tests.
type starter interface {
	SetSandboxes(ev ipam.NodeSandboxes)
	Rebuild(pods []ipam.Pod) (int, error)
	RecoverReservations(evs []ipam.ReservationEvidence) (int, error)
	StartHold(until time.Time)
	Hold() (on bool, until time.Time)
}

// reconcileStart is the start's reconciliation once the pools, holdings and pods are pushed: the
// runtime's reading of the node's sandboxes ev (the node's own evidence; unknown when it could
// not be asked) is handed over, attachments are recorded for running pods whose addresses the
// journal lacks (Rebuild), then,
// when the journal was lost, damaged or new, or a restart interrupted a hold (its marker in dir),
// the owners of some held addresses are unknown: the DRA reservations the claims' status entries
// name are re-created (claims reads them: the DRA driver's, nil without --dra; a recovery is
// idempotent, so a restart during the hold recovers again what the first start may not have
// journaled), and the hold starts (or resumes until the marker's deadline), before any ADD or
// Prepare is served from them. Without a hold the reading is dropped: it ages, and later
// rebuilds read the pods' reports. It returns the number of attachments rebuilt.
func reconcileStart(s starter, pods []ipam.Pod, ev ipam.NodeSandboxes, claims func() []ipam.ReservationEvidence, dir string, start startFacts,
	hold time.Duration, now time.Time, log logr.Logger) (int, error) {
	s.SetSandboxes(ev)
	n, err := s.Rebuild(pods)
	if err != nil {
		return 0, err
	}
	heldUntil, interrupted, err := journal.HeldUntil(dir)
	if err != nil {
		log.Error(err, "unreadable hold marker: holding for the full --rebuild-hold")
	}
	if start.journalEmpty || interrupted {
		if claims != nil {
			if _, err := s.RecoverReservations(claims()); err != nil {
				return 0, err
			}
		}
		until := now.Add(hold)
		if interrupted && !heldUntil.IsZero() {
			until = heldUntil
		}
		s.StartHold(until)
	}
	if on, _ := s.Hold(); !on {
		s.SetSandboxes(ipam.NodeSandboxes{})
	}
	return n, nil
}

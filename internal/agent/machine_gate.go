package agent

import (
	"time"

	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// The ADD gate inside the machine. What decides whether the node may hand out addresses (the
// agent serving at all, the handback mark, the node's Lease and the first reconciliation; see
// gate) are facts the driver feeds in, and the machine asks them every time it would plan an
// ADD: when the ADD's turn comes (before its pod is read), and at every attempt after, an ADD
// waiting for addresses or for a rebuild's write included. So an ADD that waits up to
// --address-wait is never planned after the agent saw another holder of the node's Lease, nor
// after the node was handed back: seeing either fails the waiting ADDs at once.

// SetReady says whether the agent serves (after its start-up; Service.SetReady). While it does
// not, ADD, DEL and CHECK are refused (code 11; the runtime retries) and waiting ADDs fail.
func (m *Machine) SetReady(ready bool, now time.Time) {
	m.now = now
	was := m.gate.starting
	m.gate.starting = !ready
	if !was && !ready {
		m.gateClosed()
	}
}

// SetLease takes what the agent's last round on the node's Lease found: whether it holds it, the
// other holder when not, and its permit when it does (until when it may serve without a renewal).
// Another holder fails every waiting ADD with the gate's refusal naming it, and refuses new ones.
func (m *Machine) SetLease(held bool, holder string, permit, now time.Time) {
	m.now = now
	m.gate.setLease(held, holder, permit)
	if !held {
		m.gateClosed()
	}
}

// LeaseChecked says the re-check of the Lease the machine asked for (Ready.Recheck) ended,
// whatever it found (SetLease came first if it read the Lease): the ADDs that waited for it are
// tried again.
func (m *Machine) LeaseChecked(now time.Time) {
	m.now = now
	m.gate.rechecking, m.gate.checkedAt = false, now
	m.changed()
}

// SetServeOffline says whether ADD may be served from the journal before the API server answers.
func (m *Machine) SetServeOffline(ok bool) { m.gate.setOffline(ok) }

// SetStage says what the start-up waits for (ADD's refusal says it until the first
// reconciliation).
func (m *Machine) SetStage(stage string) { m.gate.setStage(stage) }

// SetAPIError says why the API server cannot be reached yet (ADD's refusal names it).
func (m *Machine) SetAPIError(err error) { m.gate.setAPIError(err) }

// SetSynced says the first reconciliation with the API server is done.
func (m *Machine) SetSynced() { m.gate.setSynced() }

// Serving reports whether the agent serves (SetReady).
func (m *Machine) Serving() bool { return !m.gate.starting }

// PublishesSpec reports whether this agent publishes the node's request: it holds the node's
// Lease, or the gate is off.
func (m *Machine) PublishesSpec() bool { return !m.gate.enforce || m.gate.leaseIsHeld() }

// gateClosed fails the waiting ADDs the gate now refuses (they are tried again: their attempt
// asks the gate first).
func (m *Machine) gateClosed() {
	if len(m.waiting) > 0 {
		m.changed()
	}
}

// gateRefusal is the refusal an ADD gets now from what the machine knows, or nil: the agent is
// starting, the node is handed back, or the gate refuses (another holder of the Lease, not
// reconciled yet with nothing to serve from).
func (m *Machine) gateRefusal() *cniproto.Response {
	if r := m.gate.refuseStarting(); r != nil {
		return r
	}
	if err := m.st.HandedBackRefusal(); err != nil {
		return addError(err)
	}
	return m.gate.refuseAdd()
}

// gateAdd asks the gate whether ADD r may be planned now. It returns false when it may; true
// when r was answered with the refusal, or waits for a re-check of the Lease (past the permit).
func (m *Machine) gateAdd(r *mreq) bool {
	if resp := m.gateRefusal(); resp != nil {
		m.dropWaiter(r)
		m.reply(r, resp)
		return true
	}
	if !m.gate.mustRecheck(m.now) {
		return false
	}
	if r.canceled {
		m.dropWaiter(r)
		m.reply(r, errResp(cniproto.CodeTryAgainLater, "ipwarden: the ADD's caller went away while the agent on node "+m.cfg.Node+
			" re-checked its Lease (it was past its permit)", "nothing was handed out; the runtime retries"))
		return true
	}
	if !m.gate.rechecking {
		m.gate.rechecking = true
		m.rd.Recheck = true
	}
	m.wait(r, true) // no deadline: the driver bounds the re-check and answers LeaseChecked
	return true
}

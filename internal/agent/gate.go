package agent

import (
	"fmt"
	"time"

	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/nodelease"
)

// gate says whether the service may hand out addresses (ADD). DEL, CHECK and LIST are served from
// the journal from the start. ADD is served:
//
//   - while the agent holds the node's Lease and has reconciled with the API server once;
//   - before it has heard from the API server at all, from the addresses its journal holds, if
//     the journal holds any (it then held the node's Lease when it last talked to the API server);
//   - never while another agent holds the node's Lease.
//
// A Lease renewal that fails because the API server is away changes nothing: the agent keeps
// serving from what it holds, as through any outage, and stops at once when the API server shows
// another holder. Past its permit (its last successful renewal's start plus the Lease duration:
// the agent was paused, or its renewals fail), an ADD first re-checks the Lease: another agent
// may have taken it meanwhile.
//
// The machine owns it (Machine.gate) and asks it at every attempt of an ADD to plan, an ADD
// waiting for addresses included (machine_gate.go); the driver only feeds it facts.
type gate struct {
	node, leaseNS string
	enforce       bool // off: ADD is always allowed (tests of the request paths)

	// starting: the agent is not serving yet (Service.SetReady); ADD, DEL and CHECK are
	// refused. Independent of enforce.
	starting bool
	// rechecking: a re-check of the Lease asked for by an ADD past its permit runs (Ready.Recheck);
	// checkedAt: when the last one ended (Machine.LeaseChecked).
	rechecking bool
	checkedAt  time.Time

	offline    bool // the journal holds addresses to serve before the API server answers
	leaseKnown bool // the agent has read the Lease at least once
	leaseHeld  bool
	holder     string // the other holder, when !leaseHeld
	permit     time.Time
	synced     bool   // reconciled with the API server once
	apiErr     string // the last error talking to the API server before it synced
	stage      string // what the agent waits for once the API server answers, before it synced
}

// setStage says what the agent waits for before it has reconciled, for the ADD error.
func (g *gate) setStage(s string) { g.stage = s }

func (g *gate) setOffline(ok bool) { g.offline = ok }

// setLease records what the agent's last Lease round found; until is its permit when held.
func (g *gate) setLease(held bool, holder string, until time.Time) {
	g.leaseKnown, g.leaseHeld, g.holder = true, held, holder
	if held {
		g.permit = until
	}
}

// PermitExpired decides whether an ADD must re-check the node's Lease first: the agent holds it
// as far as it knows, but its permit ran out (it was paused past its Lease, or cannot renew).
func PermitExpired(leaseHeld bool, permit, now time.Time) bool {
	return leaseHeld && !permit.IsZero() && now.After(permit)
}

// mustRecheck says whether an ADD must wait for a re-check of the Lease before it is planned
// (PermitExpired): not when one ended less than recheckEvery ago (the API server is away and
// every ADD would ask again; the agent then serves from what it holds, as through any outage).
func (g *gate) mustRecheck(now time.Time) bool {
	return g.enforce && PermitExpired(g.leaseHeld, g.permit, now) &&
		(g.rechecking || g.checkedAt.IsZero() || now.Sub(g.checkedAt) >= recheckEvery)
}

// refuseStarting is the refusal of ADD, DEL and CHECK while the agent is starting, or nil.
func (g *gate) refuseStarting() *cniproto.Response {
	if !g.starting {
		return nil
	}
	return errResp(cniproto.CodeTryAgainLater, "the ipwarden agent on node "+g.node+" is starting and not serving yet",
		"it serves once it has reconciled its journal with the API server")
}

func (g *gate) setSynced() { g.synced, g.apiErr = true, "" }

func (g *gate) setAPIError(err error) {
	if err != nil && !g.synced {
		g.apiErr = err.Error()
		if len(g.apiErr) > 300 {
			g.apiErr = g.apiErr[:300] + "..."
		}
	}
}

func (g *gate) leaseIsHeld() bool { return g.leaseHeld }

// refuseList returns the error LIST gets now: only while the agent waits for the API server with
// nothing to serve from (then it has nothing to list either, and tools that wait for LIST to
// answer keep waiting until the agent serves ADD), never because another agent holds the Lease.
func (g *gate) refuseList() *cniproto.Response {
	r := g.refuseAdd()
	if r != nil && g.leaseKnown && !g.leaseHeld {
		return nil
	}
	return r
}

// refuseAdd returns the CNI error an ADD gets now, or nil when ADD may be served.
func (g *gate) refuseAdd() *cniproto.Response {
	if !g.enforce {
		return nil
	}
	why := g.stage
	if why == "" {
		why = waitingForAPI(g.apiErr)
	}
	return addRefusal(g.node, g.leaseNS, g.offline, g.leaseKnown, g.leaseHeld, g.holder, g.synced, why)
}

func waitingForAPI(apiErr string) string {
	why := "waiting for the API server: it has not reconciled with it since it started"
	if apiErr != "" {
		why += " (last error: " + apiErr + ")"
	}
	return why
}

// addRefusal is the decision of refuseAdd (see gate).
// waiting says what the agent waits for before it has reconciled.
func addRefusal(node, leaseNS string, offline, leaseKnown, leaseHeld bool, holder string, synced bool, waiting string) *cniproto.Response {
	if leaseKnown && !leaseHeld {
		return errResp(cniproto.CodeTryAgainLater, "ipwarden: "+(&nodelease.HeldByOther{Node: node, Holder: holder, Namespace: leaseNS}).Error(), "")
	}
	if offline && (!leaseKnown || leaseHeld) {
		return nil
	}
	if leaseHeld && synced {
		return nil
	}
	return errResp(cniproto.CodeTryAgainLater, fmt.Sprintf("ipwarden: the agent on node %s does not serve ADD yet: %s; its journal holds no address to serve from until then",
		node, waiting), "it serves DEL meanwhile; the runtime retries ADD")
}

// Package ipam is the node agent's allocation state machine: which of the node's addresses each
// CNI attachment holds, which are free, cooling down or being given back, and how many the node
// should ask the controller for. It does no IO and reads no clock: the caller passes the time in,
// writes the Changes it returns to the journal, and serializes calls.
//
// # Address states
//
// Per pool, every address the agent knows about is in one of these states:
//
//   - held: in the NodeIPAllocation status the controller wrote (or, before the agent has seen
//     the API, in the last status it journaled);
//   - in use: part of an attachment (possibly outside held: a conflict, kept and reported);
//   - releasing: marked for return to the pool; never handed out again;
//   - cooling: freed by DEL at some time; usable again once the pool's reuseCooldown has passed,
//     behind every never-used address and every address freed earlier (FIFO);
//   - fresh: held and in none of the states above; handed out lowest first.
//
// Only fresh addresses and cooled-down addresses are ever handed out (invariant 3 of docs/design.md).
//
// # Protocol with the caller
//
// Every change follows one commit protocol (plan.go): plan, reserving what the plan touches;
// the caller journals Plan.Changes(); then Apply, or Abort when the journal refused it, which
// leaves the state as it was. ADD reserves in memory first (Add: the attachment is pending, so
// concurrent ADDs cannot take its addresses), then ConfirmAdd or AbortAdd. DEL is the other way
// round: PlanDel returns the Change without touching memory, and ApplyDel frees the addresses
// after the journal write, so a failed write never lets an address be handed out twice.
// Scale-down marks addresses releasing in memory (Release), the caller journals that and only
// then publishes the lower request; UnmarkReleasing undoes a failed journal write. Facts read
// from the API server (PlanPools, PlanHoldings, PlanMark) reserve nothing and change nothing
// until applied; a rebuild from the pods' status (PlanRebuild) reserves its attachments as
// pending, like an ADD. Calls for one attachment Key must be serialized by the caller; calls on
// a State must not run concurrently, and fact plans and rebuilds must not be in flight together.
package ipam

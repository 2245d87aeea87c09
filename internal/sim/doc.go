// Package sim is ipwarden's capacity planner: a discrete-event simulation of a cluster's pods,
// node agents and controller under a virtual clock. It runs the real decision code, not a model
// of it:
//
//   - each node's agent is an internal/agent/ipam State: ADD takes the lowest fresh address or
//     the oldest cooled-down one, DEL puts it at the back of the cooling queue, demand counts
//     pods bound to the node before their ADD, Release marks free addresses beyond the
//     scaling.Target releasing (scaling.ChooseRelease picks them), Spec is the request the agent
//     publishes. Like the agent's pool monitor, a round runs on every change and at least every
//     agent resync, and changes during a spec write coalesce into one more round;
//   - the controller is an internal/controller State and Scheduler driven the way
//     internal/controller's Controller drives them: need-ordered queue with a minimum interval
//     per node and a bounded number of workers; PlanFill, RecordCooling and a pool status
//     write-ahead for removals, NodeStatus, Commit; Refill of nodes a pool left short; the
//     coalesced pool status loop with MarkExpiredCooling; the periodic full pass;
//   - addresses are internal/addr sets and the controller's allocator with reuse cooldown.
//
// Two shortcuts keep an hour of 5,000 nodes within seconds, and both give the same run as
// doing the work: a node sync that has nothing to do (no need, status already answering its
// spec) is not planned; and State.PoolStatus, which is linear in the number of ranges the
// pool's addresses fall into, is replaced by poolModel, which keeps the numbers a pool status is
// made of as counters and computes the exhausted flag with the hysteresis PoolStatus applies
// (State.Marks.Exhausted) from the same inputs. TestShortcutsChangeNothing checks, status by
// status, that runs without either shortcut are identical.
//
// What is modelled rather than real: the API server and informers (a write takes a fixed
// latency and reaches the other side after a fixed watch delay; writes never conflict or fail),
// the journal (instant, always succeeds), the kubelet (a pod's ADD follows its binding after a
// fixed delay; an ADD that waits longer than the address wait counts as failed and keeps
// waiting, as the kubelet would retry it) and the workload (Poisson pod starts per node with
// exponential lifetimes, an optional burst, or a trace file).
//
// Everything runs on one goroutine with no sleeps, and no decision reads the wall clock (only
// the LastTransitionTime of a condition that flips does, inside the real code), so a run is a
// pure function of its Config, seed included.
package sim

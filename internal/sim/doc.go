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
//   - the controller is internal/controller's Machine, the same value the controller binary runs:
//     the simulator is its second driver (drive, perform, opDone), as Controller.run is its
//     driver on the API server. It feeds the machine the informers' events (a node's spec after
//     the watch delay), the virtual clock and the outcomes of the writes it asked for, and
//     performs each write on the virtual clock behind the client's rate limit. The machine
//     decides everything else: which node to sync when (its scheduler, workers, minimum
//     interval), fills, take-backs and their cooling records, pool status writes and their
//     pacing, the periodic full pass. Nothing of the controller's shell is copied here;
//   - addresses are internal/addr sets and the controller's allocator with reuse cooldown.
//
// Nothing is shortened: every node sync is planned and every pool status is computed by the
// controller's own code. An hour of 5,000 nodes takes about a minute on a 2-core machine.
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

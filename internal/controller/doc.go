// Package controller is ipwarden's cluster controller. It hands nodes the addresses their agents
// request from IPPools and takes back the addresses agents release, keeps one NodeIPAllocation per
// selected Node, returns a deleted Node's addresses to their pools, and reports pool usage.
//
// The decisions are pure functions in this package (plan.go, priority.go, exhaustion.go,
// lifecycle.go, pools.go, steps.go) and the scheduler (scheduler.go) is a clock-driven data
// structure. Machine (machine.go) owns all of it on one goroutine, in the style of etcd's raft:
// informer events, the clock and the outcomes of its operations go in; Ready says what to do.
// Controller (controller.go) is its thin driver on the API server; internal/sim is its other
// driver, on a virtual clock.
//
// Safety rests on three rules:
//   - the in-memory allocation state is rebuilt from a fresh LIST on gaining leadership, and
//     every address is reserved in memory before it is written to a node's status;
//   - an address leaves a live node's status only if that node listed it in spec.releasing;
//   - an address that leaves a node is written to its pool's status.cooling before the node's
//     status drops it, so a restart cannot hand it out again before the reuse cooldown.
package controller

// Package scaling holds the pure pool-sizing math of a node: how many addresses it should hold
// from a pool (Target) and which free ones it gives back when it holds too many (ChooseRelease).
//
// The formula follows the Azure CNS pool monitor: a node wants
//
//	target = batch * ceil(buffer + demand/batch), clamped at maxPerNode
//
// where demand is the addresses in use plus pods already bound to the node that will need one,
// and buffer is bufferPercent/100. While the pool is exhausted, batch and buffer are both 1, so a
// node holds at most demand+1. Everything here is integer arithmetic: no float rounding decides
// how many addresses a node asks for.
package scaling

// Package scaling holds the pure pool-sizing math of a node: how many addresses it should hold
// from a pool (Target), when it gives addresses back (DecideRelease: hysteresis and a delay)
// and which free ones it gives back (ChooseRelease).
//
// The formula follows the Azure CNS pool monitor: a node wants
//
//	target = batch * ceil(buffer + demand/batch), clamped at maxPerNode
//
// where demand is the addresses in use plus pods already bound to the node that will need one,
// and buffer is bufferPercent/100. While the pool is exhausted, batch is 1 and buffer 0, so a
// node holds its demand and its spares go to nodes with waiting pods. Everything here is integer arithmetic: no float rounding decides
// how many addresses a node asks for.
package scaling

package ipam

import (
	"fmt"
	"time"
)

// The handback mark (docs/design.md, "Going back"). Once `ipwarden agent handback` has written
// host-local's reservation files for the node's attachments (package handback), the node's
// addresses belong to host-local: the mark, journaled like every other change, makes every later
// ADD fail (Add returns a *HandedBackError) until `ipwarden agent handback --undo` clears it.
// DEL, CHECK, GC and the leak collector are unaffected: the attachments ipwarden still records
// are freed as their pods go.

// HandbackMark records that the node was handed back to another IPAM.
type HandbackMark struct {
	// At is when the mark was journaled.
	At time.Time `json:"at"`
	// To is the IPAM type the node went back to ("host-local").
	To string `json:"to"`
	// Network is the CNI network name whose attachments were handed back.
	Network string `json:"network"`
	// Dir is host-local's directory the reservation files went to (<dataDir>/<network>).
	Dir string `json:"dir,omitempty"`
}

// HandedBackError refuses an ADD on a node handed back to another IPAM.
type HandedBackError struct{ Mark HandbackMark }

func (e *HandedBackError) Error() string {
	return fmt.Sprintf("this node was handed back to %s at %s (network %s, reservations in %s): ipwarden hands out no address here; "+
		"point the node's CNI configuration at %s, or undo the handback with `ipwarden agent handback --undo` on the node",
		e.Mark.To, e.Mark.At.UTC().Format(time.RFC3339), e.Mark.Network, e.Mark.Dir, e.Mark.To)
}

// HandbackPlan sets or clears the handback mark, planned by PlanHandback.
type HandbackPlan struct {
	Change Change
	mark   *HandbackMark
}

// Changes implements Plan.
func (p HandbackPlan) Changes() Change { return p.Change }

// PlanHandback plans setting the handback mark to m, or clearing it when m is nil. It reserves
// nothing. Its Change is empty when it changes nothing.
func (s *State) PlanHandback(m *HandbackMark) HandbackPlan {
	switch {
	case m == nil && s.handback == nil:
		return HandbackPlan{}
	case m == nil:
		return HandbackPlan{Change: Change{ClearHandback: true}}
	}
	c := *m
	if s.handback != nil && *s.handback == c {
		return HandbackPlan{mark: &c}
	}
	return HandbackPlan{mark: &c, Change: Change{PutHandback: &c}}
}

// HandedBackRefusal is the *HandedBackError every ADD gets while the node is handed back, or
// nil: Add refuses with it, and the agent asks it first, before reading the pod.
func (s *State) HandedBackRefusal() error {
	if s.handback == nil {
		return nil
	}
	return &HandedBackError{Mark: *s.handback}
}

// HandedBack returns the handback mark, or nil.
func (s *State) HandedBack() *HandbackMark {
	if s.handback == nil {
		return nil
	}
	m := *s.handback
	return &m
}

// NumPending counts the ADDs and rebuilt attachments reserved in memory whose journal write has
// not finished.
func (s *State) NumPending() int { return len(s.pending) }

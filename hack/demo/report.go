package main

import (
	"bytes"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/ipwarden/ipwarden/internal/charts"
)

// demoReport is what the demo's report says and its pictures draw, gathered before anything is
// printed: the text and the pictures come from these numbers alone.
type demoReport struct {
	// Nodes are the table's rows: each live node's pods, addresses held and in use at the end.
	Nodes []nodeRow
	// Started is how many pods started; ControllerWrites and AgentWrites the API writes of the
	// whole scenario (the deleted node's agent not counted).
	Started                       int
	ControllerWrites, AgentWrites float64
	// Waits is every ADD's IP wait (the plugin's answer); Collected the leaks the agents freed.
	Waits     []time.Duration
	Collected float64
	// Burst is every ADD of the burst, by node; Holdings the nodes' holdings sampled over the
	// whole scenario, the last sample of each node being its row in Nodes.
	Burst    map[string][]addSample
	Holdings []holding
	// What ipwarden check found: addresses held, nodes, running pods, attachments.
	Held                                   int64
	CheckedNodes, RunningPods, Attachments int
}

type nodeRow struct {
	Name              string
	Pods, Held, InUse int
}

// addSample is one ADD: when it was sent (after the burst's first) and its IP wait.
type addSample struct{ At, Wait time.Duration }

// holding is one node's addresses at one moment, after the scenario's start.
type holding struct {
	At          time.Duration
	Node        string
	Held, InUse int
}

// text is the report as the demo prints it.
func (r demoReport) text() string {
	var b bytes.Buffer
	p := func(format string, a ...any) { fmt.Fprintf(&b, format+"\n", a...) }
	p("  %-8s %6s %6s %8s", "NODE", "PODS", "HELD", "IN USE")
	for _, n := range r.Nodes {
		p("  %-8s %6d %6d %8d", n.Name, n.Pods, n.Held, n.InUse)
	}
	p("  pods started: %d; API writes: %.0f by the controller (node and pool status), %.0f by agents", r.Started, r.ControllerWrites, r.AgentWrites)
	p("  (the deleted node's agent not counted): %.2f per pod start over the whole scenario; see each phase above", (r.ControllerWrites+r.AgentWrites)/float64(max(r.Started, 1)))
	p("  for where they go (Whereabouts and Calico write at least once per pod)")
	p("  IP wait over %d ADDs: p50 %s, p99 %s", len(r.Waits), quantile(r.Waits, 0.5), quantile(r.Waits, 0.99))
	for _, n := range slices.Sorted(maps.Keys(r.Burst)) {
		var w []time.Duration
		for _, a := range r.Burst[n] {
			w = append(w, a.Wait)
		}
		p("  the burst on %s: %d ADDs, IP wait p50 %s, p99 %s", n, len(w), quantile(w, 0.5), quantile(w, 0.99))
	}
	p("  leaked addresses collected by the agents: %.0f", r.Collected)
	p("  invariants checked (ipwarden check with the agents' attachments): %d addresses held by %d nodes,", r.Held, r.CheckedNodes)
	p("  %d running pods, %d attachments: none held twice, none outside its pool, none leaked", r.RunningPods, r.Attachments)
	return b.String()
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// charts are the demo's pictures: each burst ADD's IP wait over the burst, by node; and every
// node's addresses held (solid) against in use (dashed, the same colour) over the scenario.
func (r demoReport) charts() []charts.Chart {
	burst := charts.Chart{File: "burst-ip-wait.svg", Title: "IP wait of each ADD over the burst, by node (make demo)",
		XLabel: "ADD sent, after the burst's first (ms)", YLabel: "IP wait: the ADD's answer (ms)"}
	for _, n := range slices.Sorted(maps.Keys(r.Burst)) {
		s := charts.Series{Name: n, Dots: true}
		for _, a := range r.Burst[n] {
			s.Points = append(s.Points, charts.Point{X: ms(a.At), Y: ms(a.Wait)})
		}
		burst.Series = append(burst.Series, s)
	}
	held := charts.Chart{File: "addresses.svg", Title: "Addresses held against in use, by node, over the scenario (make demo)",
		XLabel: "time since the nodes started (s)", YLabel: "addresses"}
	byNode := map[string][]holding{}
	for _, h := range r.Holdings {
		byNode[h.Node] = append(byNode[h.Node], h)
	}
	for i, n := range slices.Sorted(maps.Keys(byNode)) {
		hs, in := charts.Series{Name: n + " held", Color: i}, charts.Series{Name: n + " in use", Color: i, Dashed: true}
		for _, h := range byNode[n] {
			x := h.At.Seconds()
			hs.Points = append(hs.Points, charts.Point{X: x, Y: float64(h.Held)})
			in.Points = append(in.Points, charts.Point{X: x, Y: float64(h.InUse)})
		}
		held.Series = append(held.Series, hs, in)
	}
	return []charts.Chart{burst, held}
}

// write puts report.txt and the pictures into dir and says where.
func (r demoReport) write(dir string) error {
	paths, err := charts.WriteReport(dir, r.text(), r.charts())
	if err != nil {
		return err
	}
	say("  report and pictures:")
	for _, p := range paths {
		say("    %s", p)
	}
	return nil
}

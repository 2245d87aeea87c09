package sim

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// TraceEvent is one pod start or stop of a trace.
type TraceEvent struct {
	At   time.Duration
	Node string
	Pod  string
	Stop bool
	line int
}

// Trace is a recorded workload: pod starts and stops per node, in time order.
type Trace struct {
	// Nodes in the order they first appear.
	Nodes []string
	// Events sorted by time; events at the same time keep their file order.
	Events []TraceEvent
}

// TraceFormat describes the trace file for help texts and errors.
const TraceFormat = `CSV, one event per line: time_seconds,node,pod,event
  time_seconds  seconds since the start of the run (decimal, >= 0)
  node          node name; every node named in the file is simulated
  pod           pod name, unique among the node's running pods (a name may start again after it stopped)
  event         start (the pod is bound to the node; its ADD follows --add-delay later) or stop (DEL)
A first line "time_seconds,node,pod,event" is a header; lines starting with # are comments.
Pods still running at the end of the file keep running.`

// ParseTrace reads a trace (see TraceFormat). Errors name the line and say what to fix.
func ParseTrace(r io.Reader) (*Trace, error) {
	cr := csv.NewReader(r)
	cr.Comment = '#'
	cr.FieldsPerRecord = -1
	cr.TrimLeadingSpace = true
	cr.ReuseRecord = true
	t := &Trace{}
	seenNode := map[string]bool{}
	for first := true; ; first = false {
		rec, err := cr.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		line, _ := cr.FieldPos(0)
		if err != nil {
			return nil, fmt.Errorf("trace: %w", err)
		}
		if first && len(rec) > 0 && strings.EqualFold(strings.TrimSpace(rec[0]), "time_seconds") {
			continue
		}
		if len(rec) != 4 {
			return nil, fmt.Errorf("trace line %d: %d fields, want 4: time_seconds,node,pod,event", line, len(rec))
		}
		secs, err := strconv.ParseFloat(strings.TrimSpace(rec[0]), 64)
		if err != nil || secs < 0 || math.IsInf(secs, 0) || math.IsNaN(secs) || secs > 7*24*3600 {
			return nil, fmt.Errorf("trace line %d: time_seconds %q: want a number of seconds between 0 and 604800", line, rec[0])
		}
		node, pod := strings.TrimSpace(rec[1]), strings.TrimSpace(rec[2])
		if node == "" || pod == "" {
			return nil, fmt.Errorf("trace line %d: node and pod must not be empty", line)
		}
		ev := TraceEvent{At: time.Duration(math.Round(secs * 1e9)), Node: node, Pod: pod, line: line}
		switch strings.ToLower(strings.TrimSpace(rec[3])) {
		case "start":
		case "stop":
			ev.Stop = true
		default:
			return nil, fmt.Errorf("trace line %d: event %q: want start or stop", line, rec[3])
		}
		if !seenNode[node] {
			seenNode[node] = true
			t.Nodes = append(t.Nodes, node)
		}
		t.Events = append(t.Events, ev)
	}
	slices.SortStableFunc(t.Events, func(a, b TraceEvent) int {
		switch {
		case a.At < b.At:
			return -1
		case a.At > b.At:
			return 1
		}
		return 0
	})
	running := map[[2]string]bool{}
	for _, ev := range t.Events {
		k := [2]string{ev.Node, ev.Pod}
		switch {
		case !ev.Stop && running[k]:
			return nil, fmt.Errorf("trace line %d: pod %s starts on node %s while it is running; stop it first or give it another name", ev.line, ev.Pod, ev.Node)
		case ev.Stop && !running[k]:
			return nil, fmt.Errorf("trace line %d: pod %s stops on node %s but is not running there; add its start before this line", ev.line, ev.Pod, ev.Node)
		}
		running[k] = !ev.Stop
	}
	return t, nil
}

// End is the time of the trace's last event.
func (t *Trace) End() time.Duration {
	if len(t.Events) == 0 {
		return 0
	}
	return t.Events[len(t.Events)-1].At
}

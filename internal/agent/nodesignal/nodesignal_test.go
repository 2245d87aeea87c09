package nodesignal

import (
	"strings"
	"testing"
	"time"
)

func TestDecide(t *testing.T) {
	full := Pool{Name: "v4", Held: 16, InUse: 16, Free: 0, Requested: 16, Demand: 18} // at maxPerNode, 2 pods wait
	for _, tc := range []struct {
		name    string
		pools   []Pool
		current bool
		want    bool
		reason  string
		msg     string
	}{
		{"at maxPerNode, pods wait: set", []Pool{full}, false, true, ReasonAtMaxPerNode, "2 pods wait"},
		{"at maxPerNode, nobody waits: not set", []Pool{{Name: "v4", Held: 16, InUse: 16, Requested: 16, Demand: 16}}, false, false, ReasonAddressesAvailable, ""},
		{"no free, but the controller can still grant more: not set", []Pool{{Name: "v4", Held: 16, InUse: 16, Requested: 32, Demand: 18}}, false, false, ReasonAddressesAvailable, ""},
		{"pool exhausted, none free, pods wait: set", []Pool{{Name: "v4", Held: 8, InUse: 8, Requested: 9, Demand: 9, Exhausted: true}}, false, true, ReasonPoolExhausted, "pool v4 is exhausted"},
		{"pool exhausted but addresses free: not set", []Pool{{Name: "v4", Held: 8, InUse: 6, Free: 2, Requested: 9, Demand: 9, Exhausted: true}}, false, false, ReasonAddressesAvailable, ""},
		{"dual stack: one family full is enough", []Pool{{Name: "v6", Held: 32, InUse: 10, Free: 22, Requested: 32, Demand: 12}, full}, false, true, ReasonAtMaxPerNode, "v4 (16 held)"},
		{"hysteresis: one address back keeps it", []Pool{{Name: "v4", Held: 16, InUse: 15, Free: 1, Requested: 16, Demand: 15}}, true, true, ReasonAddressesReturning, "clears at 2"},
		{"hysteresis: two back clear it", []Pool{{Name: "v4", Held: 16, InUse: 14, Free: 2, Requested: 16, Demand: 14}}, true, false, ReasonAddressesAvailable, ""},
		{"hysteresis: another pool still short keeps it", []Pool{{Name: "v4", Held: 16, InUse: 10, Free: 6, Requested: 16, Demand: 10}, {Name: "v6", Held: 16, InUse: 15, Free: 1, Requested: 16, Demand: 15}}, true, true, ReasonAddressesReturning, "pool v6 has 1 free"},
		{"set while still full, whatever it showed", []Pool{full}, true, true, ReasonAtMaxPerNode, ""},
		{"no pools: clear", nil, true, false, ReasonAddressesAvailable, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := Decide(tc.pools, tc.current, Params{})
			if d.Exhausted != tc.want || d.Reason != tc.reason || !strings.Contains(d.Message, tc.msg) {
				t.Errorf("Decide = %+v, want exhausted %v, reason %s, message containing %q", d, tc.want, tc.reason, tc.msg)
			}
		})
	}
	// A larger ClearFree holds it longer.
	if d := Decide([]Pool{{Name: "v4", Held: 16, InUse: 13, Free: 3, Requested: 16, Demand: 13}}, true, Params{ClearFree: 4}); !d.Exhausted {
		t.Errorf("ClearFree 4 with 3 free cleared: %+v", d)
	}
}

func TestDecideTakeover(t *testing.T) {
	msg := DecideTakeover(map[string]int{"pods": 3}, false, false, "").Message
	for _, tc := range []struct {
		name              string
		adopted           map[string]int
		shown, complete   bool
		message           string
		write, isComplete bool
		reason            string
	}{
		{name: "never adopted: no condition, no write", adopted: map[string]int{"pods": 0}},
		{name: "adopted: False with the counts", adopted: map[string]int{"pods": 3, "v6": 0}, write: true, reason: ReasonPreviousIPAMPods},
		{name: "same counts: no write", adopted: map[string]int{"pods": 3}, shown: true, message: msg},
		{name: "fewer: False again, new counts", adopted: map[string]int{"pods": 2}, shown: true, message: msg, write: true, reason: ReasonPreviousIPAMPods},
		{name: "all gone: True", adopted: map[string]int{"pods": 0}, shown: true, message: msg, write: true, isComplete: true, reason: ReasonTakeoverComplete},
		{name: "complete stays complete", adopted: nil, shown: true, complete: true},
		{name: "adopted again after complete (a lost journal): False", adopted: map[string]int{"pods": 1}, shown: true, complete: true, write: true, reason: ReasonPreviousIPAMPods},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := DecideTakeover(tc.adopted, tc.shown, tc.complete, tc.message)
			if d.Write != tc.write || d.Complete != tc.isComplete || d.Reason != tc.reason {
				t.Fatalf("DecideTakeover = %+v, want write %v complete %v reason %q", d, tc.write, tc.isComplete, tc.reason)
			}
		})
	}
	if !strings.Contains(msg, "3 addresses") || !strings.Contains(msg, "pods: 3") {
		t.Fatalf("message %q lacks the counts", msg)
	}
}

func TestDecideHandback(t *testing.T) {
	mark := &Handback{At: time.Date(2026, 1, 1, 0, 5, 0, 0, time.UTC), To: "host-local", Network: "net"}
	msg := DecideHandback(mark, false, false, "").Message
	for _, tc := range []struct {
		name         string
		mark         *Handback
		shown, on    bool
		message      string
		write, state bool
		reason       string
	}{
		{name: "never handed back: no condition", mark: nil},
		{name: "handed back: True", mark: mark, write: true, state: true, reason: ReasonHandedBack},
		{name: "shown as it is: no write", mark: mark, shown: true, on: true, message: msg},
		{name: "shown False: True", mark: mark, shown: true, message: "the handback was undone", write: true, state: true, reason: ReasonHandedBack},
		{name: "undone: False", mark: nil, shown: true, on: true, message: msg, write: true, reason: ReasonHandbackUndone},
		{name: "undone and shown False: no write", mark: nil, shown: true, on: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := DecideHandback(tc.mark, tc.shown, tc.on, tc.message)
			if d.Write != tc.write || (d.Write && (d.On != tc.state || d.Reason != tc.reason)) {
				t.Fatalf("decision %+v, want write %v on %v reason %s", d, tc.write, tc.state, tc.reason)
			}
		})
	}
	if !strings.Contains(msg, "handed back to host-local at 2026-01-01T00:05:00Z") || !strings.Contains(msg, "ipwarden agent handback --undo") {
		t.Fatalf("message %q", msg)
	}
}

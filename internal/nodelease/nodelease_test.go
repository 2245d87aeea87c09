package nodelease

import (
	"strings"
	"testing"
	"time"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func TestDecide(t *testing.T) {
	const d = 15 * time.Second
	for _, tc := range []struct {
		name  string
		rec   *Record
		seen  time.Duration // before now
		want  Kind
		other string
	}{
		{"no lease", nil, 0, Create, ""},
		{"mine", &Record{Holder: "me", Version: "1"}, time.Hour, Renew, ""},
		{"released", &Record{Holder: "", Version: "2"}, 0, Take, ""},
		{"other, just renewed", &Record{Holder: "b", Version: "3"}, 0, Wait, "b"},
		{"other, renewed within the duration", &Record{Holder: "b", Version: "3"}, d - time.Millisecond, Wait, "b"},
		{"other, not renewed for the duration", &Record{Holder: "b", Version: "3"}, d, Take, ""},
	} {
		a := Decide(tc.rec, "me", t0.Add(-tc.seen), t0, d)
		if a.Kind != tc.want || a.Holder != tc.other {
			t.Errorf("%s: got %v holder %q, want %v holder %q", tc.name, a.Kind, a.Holder, tc.want, tc.other)
		}
		if a.Kind == Wait && !a.ExpiresAt.Equal(t0.Add(-tc.seen).Add(d)) {
			t.Errorf("%s: expires at %v", tc.name, a.ExpiresAt)
		}
	}
}

// TestObserverUsesTheLocalClock: a holder that keeps renewing (new versions) is never expired,
// whatever renewTime it writes; one that stops is expired d after the agent saw its last version.
func TestObserverUsesTheLocalClock(t *testing.T) {
	const d = 15 * time.Second
	var o Observer
	now := t0
	for i := range 100 {
		rec := &Record{Holder: "b", Version: string(rune('a' + i%26))}
		if a := Decide(rec, "me", o.Observe(rec, now), now, d); a.Kind != Wait {
			t.Fatalf("step %d: a renewing holder looked expired: %v", i, a.Kind)
		}
		now = now.Add(d - time.Second)
	}
	rec := &Record{Holder: "b", Version: "stuck"}
	seen := o.Observe(rec, now)
	for now2 := now; now2.Before(now.Add(d)); now2 = now2.Add(time.Second) {
		if a := Decide(rec, "me", o.Observe(rec, now2), now2, d); a.Kind != Wait {
			t.Fatalf("expired %v after the last renewal", now2.Sub(seen))
		}
	}
	if a := Decide(rec, "me", o.Observe(rec, now.Add(d)), now.Add(d), d); a.Kind != Take {
		t.Fatalf("not expired after d: %v", a.Kind)
	}
}

func TestHeldByOtherNamesTheHolder(t *testing.T) {
	msg := (&HeldByOther{Node: "n1", Holder: "agent-x-1234", Namespace: "ipwarden-system"}).Error()
	for _, want := range []string{"n1", "agent-x-1234", "ipwarden-system/ipwarden-agent-n1"} {
		if !strings.Contains(msg, want) {
			t.Errorf("%q does not name %q", msg, want)
		}
	}
}

// A new DaemonSet pod on the same state directory (another pod name, the same journal ID) takes
// the Lease its predecessor held at once; an agent with another state directory waits.
func TestSameJournal(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		want bool
	}{
		{"ipwarden-agent-x7k2p-3f9a1c2b4d5e", "ipwarden-agent-q8r4t-3f9a1c2b4d5e", true},
		{"ipwarden-agent-x7k2p-3f9a1c2b4d5e", "ipwarden-agent-x7k2p-0000aaaabbbb", false},
		{"node-1-3f9a1c2b4d5e", "node-1-3f9a1c2b4d5e", true},
		{"nohyphen", "nohyphen", false},
		{"trailing-", "other-", false},
	} {
		if got := SameJournal(tc.a, tc.b); got != tc.want {
			t.Errorf("SameJournal(%q, %q) = %v, want %v", tc.a, tc.b, got, tc.want)
		}
	}
	const d = 15 * time.Second
	held := &Record{Holder: "ipwarden-agent-old-3f9a1c2b4d5e", Version: "9"}
	if a := Decide(held, "ipwarden-agent-new-3f9a1c2b4d5e", t0, t0, d); a.Kind != Take {
		t.Errorf("a new pod on the same journal: %v, want take", a.Kind)
	}
	if a := Decide(held, "ipwarden-agent-new-0123456789ab", t0, t0, d); a.Kind != Wait {
		t.Errorf("another journal: %v, want wait", a.Kind)
	}
}

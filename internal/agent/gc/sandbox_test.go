package gc

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestNetnsDir(t *testing.T) {
	dirs := []string{"/var/run/netns", "/run/netns/"}
	for _, tc := range []struct {
		netns, dir string
		ok         bool
	}{
		{"/var/run/netns/cni-1234", "/var/run/netns", true},
		{"/run/netns/abc", "/run/netns", true},
		{"", "", false},
		{"/proc/1234/ns/net", "", false},
		{"/proc/self/ns/net", "", false},
		{"var/run/netns/x", "", false},
		{"/var/run/netns/../../etc/passwd", "", false},
		{"/var/run/netns/sub/x", "", false},
		{"/var/run/netns//x", "", false},
		{"/var/run/netns", "", false},
		{"/var/run/netns/", "", false},
	} {
		dir, ok := NetnsDir(tc.netns, dirs)
		if dir != tc.dir || ok != tc.ok {
			t.Errorf("NetnsDir(%q) = %q, %v; want %q, %v", tc.netns, dir, ok, tc.dir, tc.ok)
		}
	}
	if _, ok := NetnsDir("/var/run/netns/x", nil); ok {
		t.Error("a path is checkable with no directories")
	}
}

func TestClassifySandbox(t *testing.T) {
	notExist := &fs.PathError{Op: "lstat", Path: "/var/run/netns/x", Err: fs.ErrNotExist}
	perm := &fs.PathError{Op: "lstat", Path: "/var/run/netns/x", Err: fs.ErrPermission}
	for _, tc := range []struct {
		name            string
		netns           string
		checkable       bool
		dirErr, pathErr error
		want            Sandbox
	}{
		{"no path recorded", "", false, nil, nil, SandboxUnrecorded},
		{"no path recorded, errors ignored", "", true, notExist, notExist, SandboxUnrecorded},
		{"exists", "/var/run/netns/x", true, nil, nil, SandboxExists},
		{"gone", "/var/run/netns/x", true, nil, notExist, SandboxGone},
		{"permission error", "/var/run/netns/x", true, nil, perm, SandboxUnknown},
		{"other error", "/var/run/netns/x", true, nil, errors.New("io error"), SandboxUnknown},
		{"directory not mounted", "/var/run/netns/x", true, notExist, notExist, SandboxUnknown},
		{"directory unreadable", "/var/run/netns/x", true, perm, nil, SandboxUnknown},
		{"outside the directories", "/proc/1/ns/net", false, nil, notExist, SandboxUnknown},
	} {
		if got := ClassifySandbox(tc.netns, tc.checkable, tc.dirErr, tc.pathErr); got != tc.want {
			t.Errorf("%s: got %s, want %s", tc.name, got, tc.want)
		}
	}
}

// TestClassifySandboxOnDisk runs the classification on a real directory, as the agent's shell does.
func TestClassifySandboxOnDisk(t *testing.T) {
	dir := t.TempDir()
	ns := filepath.Join(dir, "cni-1")
	if err := os.WriteFile(ns, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	look := func(p string, dirs []string) Sandbox {
		d, ok := NetnsDir(p, dirs)
		var dirErr, pathErr error
		if ok {
			if _, dirErr = os.Stat(d); dirErr == nil {
				_, pathErr = os.Lstat(p)
			}
		}
		return ClassifySandbox(p, ok, dirErr, pathErr)
	}
	if got := look(ns, []string{dir}); got != SandboxExists {
		t.Fatalf("existing file: %s", got)
	}
	if err := os.Remove(ns); err != nil {
		t.Fatal(err)
	}
	if got := look(ns, []string{dir}); got != SandboxGone {
		t.Fatalf("removed file: %s", got)
	}
	missing := filepath.Join(dir, "not-mounted")
	if got := look(filepath.Join(missing, "x"), []string{missing}); got != SandboxUnknown {
		t.Fatalf("directory missing: %s", got)
	}
}

func TestDecide(t *testing.T) {
	tm := Timing{Grace: time.Minute, SandboxGrace: 10 * time.Minute, Poll: 2 * time.Second, SlowPoll: time.Minute}
	for _, tc := range []struct {
		name     string
		sb       Sandbox
		goneFor  time.Duration
		free     bool
		reason   string
		recheck  time.Duration // from now; -1: none
		outlived bool
	}{
		{"netns gone: at once", SandboxGone, 0, true, ReasonSandboxGone, -1, false},
		{"netns gone, long after", SandboxGone, time.Hour, true, ReasonSandboxGone, -1, false},
		{"netns exists: kept, polled", SandboxExists, 0, false, ReasonSandboxExists, 2 * time.Second, false},
		{"netns exists just inside the sandbox grace", SandboxExists, 10*time.Minute - 1, false, ReasonSandboxExists, 2 * time.Second, false},
		{"netns exists past the sandbox grace: reported, never freed", SandboxExists, 10 * time.Minute, false, ReasonSandboxExists, time.Minute, true},
		{"netns exists a day later: still kept", SandboxExists, 24 * time.Hour, false, ReasonSandboxExists, time.Minute, true},
		{"cannot tell: waits the sandbox grace", SandboxUnknown, 3 * time.Minute, false, ReasonWaiting, 7 * time.Minute, false},
		{"cannot tell: freed after the sandbox grace", SandboxUnknown, 10 * time.Minute, true, ReasonSandboxUnknownGrace, -1, false},
		{"unrecorded: waits the grace", SandboxUnrecorded, 20 * time.Second, false, ReasonWaiting, 40 * time.Second, false},
		{"unrecorded: freed after the grace", SandboxUnrecorded, time.Minute, true, ReasonUnrecordedGrace, -1, false},
		{"unrecorded, deletion in the future (clock skew): waits", SandboxUnrecorded, -time.Minute, false, ReasonWaiting, 2 * time.Minute, false},
	} {
		r := Decide(tc.sb, t0.Add(-tc.goneFor), t0, tm)
		if r.Free != tc.free || r.Reason != tc.reason || r.Outlived != tc.outlived {
			t.Errorf("%s: got %+v", tc.name, r)
			continue
		}
		switch {
		case tc.recheck < 0 && !r.RecheckAt.IsZero():
			t.Errorf("%s: recheck at %v, want none", tc.name, r.RecheckAt)
		case tc.recheck >= 0 && !r.RecheckAt.Equal(t0.Add(tc.recheck)):
			t.Errorf("%s: recheck in %v, want %v", tc.name, r.RecheckAt.Sub(t0), tc.recheck)
		}
	}
}

// TestDecideNeverFreesAnExistingNetns: whatever the times, an existing namespace is never freed,
// and a kept candidate always has a time to be looked at again in the future.
func TestDecideNeverFreesAnExistingNetns(t *testing.T) {
	tm := Timing{Grace: time.Minute, SandboxGrace: 10 * time.Minute, Poll: 2 * time.Second, SlowPoll: time.Minute}
	for d := -time.Hour; d < 48*time.Hour; d += 7 * time.Second {
		for _, sb := range []Sandbox{SandboxUnrecorded, SandboxGone, SandboxExists, SandboxUnknown} {
			r := Decide(sb, t0.Add(-d), t0, tm)
			if sb == SandboxExists && r.Free {
				t.Fatalf("freed an existing namespace gone for %v", d)
			}
			if !r.Free && !r.RecheckAt.After(t0) {
				t.Fatalf("%s gone for %v: kept without a future recheck (%v)", sb, d, r.RecheckAt)
			}
		}
	}
}

package localcluster

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/synctest"
	"time"
)

func TestWaitFor(t *testing.T) {
	errNotYet := errors.New("not yet")
	errGone := errors.New("the process exited")
	tests := []struct {
		name    string
		answers []error // cond's answers in order; the last repeats
		cancel  bool
		want    error // nil, or the error WaitFor's answer wraps
		calls   int
		elapsed time.Duration
	}{
		{"at once", []error{nil}, false, nil, 1, 0},
		{"after two polls", []error{errNotYet, errNotYet, nil}, false, nil, 3, 2 * time.Second},
		{"timed out (past the deadline), with the last answer", []error{errNotYet}, false, errNotYet, 12, 11 * time.Second},
		{"aborted", []error{errNotYet, Abort(errGone)}, false, errGone, 2, time.Second},
		{"context ended", []error{errNotYet}, true, context.Canceled, 1, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				if tc.cancel {
					cancel()
				}
				calls := 0
				start := time.Now()
				err := WaitFor(ctx, 10*time.Second, time.Second, func() error {
					a := tc.answers[min(calls, len(tc.answers)-1)]
					calls++
					return a
				})
				if (tc.want == nil) != (err == nil) || (tc.want != nil && !errors.Is(err, tc.want)) {
					t.Fatalf("WaitFor = %v, want %v", err, tc.want)
				}
				if calls != tc.calls || time.Since(start) != tc.elapsed {
					t.Fatalf("%d calls in %s, want %d in %s", calls, time.Since(start), tc.calls, tc.elapsed)
				}
			})
		})
	}
}

func TestFreePorts(t *testing.T) {
	ports, err := FreePorts(3)
	if err != nil {
		t.Fatal(err)
	}
	if len(ports) != 3 || ports[0] == ports[1] || ports[1] == ports[2] || ports[0] == ports[2] {
		t.Fatalf("ports %v", ports)
	}
	a, err := FreeAddr()
	if err != nil || !strings.HasPrefix(a, "127.0.0.1:") {
		t.Fatalf("FreeAddr = %q, %v", a, err)
	}
}

func TestDataRaceIn(t *testing.T) {
	report := "==================\nWARNING: DATA RACE\nRead at 0x00c by goroutine 7:\n  main.f()\n==================\n"
	tests := []struct {
		name, log, want string
	}{
		{"none", "started\nserving\n", ""},
		{"one", "started\n" + report + "serving\n", "WARNING: DATA RACE\nRead at 0x00c by goroutine 7:\n  main.f()\n"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "log")
			if err := os.WriteFile(path, []byte(tc.log), 0o600); err != nil {
				t.Fatal(err)
			}
			if got := DataRaceIn(path); got != tc.want {
				t.Fatalf("DataRaceIn = %q, want %q", got, tc.want)
			}
		})
	}
}

// A static build is a release or image binary: it never takes build tags (the failpoints tag
// is for the integration tests' agent only), and refuses them before running go.
func TestStaticBuildRefusesTags(t *testing.T) {
	out := filepath.Join(t.TempDir(), "ipwarden")
	err := GoBuild{Dir: t.TempDir(), Out: out, Pkgs: []string{"./cmd/ipwarden"}, Static: true, Tags: []string{"failpoints"}}.Run()
	if err == nil || !strings.Contains(err.Error(), "failpoints") {
		t.Fatalf("static build with the failpoints tag: %v", err)
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Fatalf("the refused build wrote %s: %v", out, err)
	}
}

package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func runSimulate(t *testing.T, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	root := newRootCommand()
	var out, errOut bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetArgs(append([]string{"simulate"}, args...))
	err = root.Execute()
	return out.String(), errOut.String(), err
}

func TestSimulateFlagErrors(t *testing.T) {
	trace := filepath.Join(t.TempDir(), "trace.csv")
	if err := os.WriteFile(trace, []byte("0,n1,a,start\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	bad := filepath.Join(t.TempDir(), "bad.csv")
	if err := os.WriteFile(bad, []byte("0,n1,a,begin\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--batch-size", "0"}, "--batch-size 0: must be between 1 and 65536"},
		{[]string{"--max-per-node", "8"}, "--max-per-node 8: must be at least --batch-size 16"},
		{[]string{"--pool-cidr", "10.0.0.0/16", "--pool-size", "100"}, "give --pool-cidr or --pool-size, not both"},
		{[]string{"--pool-cidr", "10.0.0.0"}, `--pool-cidr "10.0.0.0": not a CIDR such as 10.0.0.0/16`},
		{[]string{"--pool-cidr", "10.0.0.1/16"}, "write 10.0.0.0/16"},
		{[]string{"--trace", trace, "--nodes", "5"}, "--nodes does not go with --trace"},
		{[]string{"--trace", trace, "--start", "cold"}, "--start cold does not go with --trace"},
		{[]string{"--trace", bad}, `trace line 1: event "begin": want start or stop`},
		{[]string{"--trace", filepath.Join(t.TempDir(), "missing.csv")}, "--trace: open"},
		{[]string{"--start", "hot"}, `--start "hot"`},
		{[]string{"-o", "yaml", "--nodes", "1", "--duration", "1s"}, `-o "yaml": use text or json`},
		{[]string{"extra"}, "unknown command"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			_, _, err := runSimulate(t, tc.args...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error = %v, want containing %q", err, tc.want)
			}
		})
	}
}

func TestSimulateRuns(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "out")
	stdout, stderr, err := runSimulate(t, "--nodes", "20", "--duration", "5m", "--pool-size", "4000",
		"-o", "json", "--output-dir", dir)
	if err != nil {
		t.Fatal(err)
	}
	var sum struct {
		Scenario struct {
			Nodes int `json:"nodes"`
		} `json:"scenario"`
		Pool struct {
			Capacity int64 `json:"capacity"`
		} `json:"pool"`
		Pods struct {
			Started int `json:"started"`
		} `json:"pods"`
	}
	if err := json.Unmarshal([]byte(stdout), &sum); err != nil {
		t.Fatalf("-o json printed %q: %v", stdout, err)
	}
	if sum.Scenario.Nodes != 20 || sum.Pool.Capacity != 4000 || sum.Pods.Started == 0 {
		t.Errorf("summary %+v: want 20 nodes, a 4000-address pool and pod starts", sum)
	}
	if !strings.Contains(stderr, "chart.svg") {
		t.Errorf("with -o json the written files go to stderr, got %q", stderr)
	}
	for _, f := range []string{"series.csv", "summary.json", "chart.svg"} {
		if st, err := os.Stat(filepath.Join(dir, f)); err != nil || st.Size() == 0 {
			t.Errorf("%s not written: %v", f, err)
		}
	}

	trace := filepath.Join(t.TempDir(), "trace.csv")
	if err := os.WriteFile(trace, []byte("time_seconds,node,pod,event\n0,a,p1,start\n30,a,p1,stop\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	stdout, _, err = runSimulate(t, "--trace", trace)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"1 node, 1m30s simulated", "trace of 2 events", "addresses per node", "API writes"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("text output lacks %q:\n%s", want, stdout)
		}
	}
}

package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ipwarden/ipwarden/internal/agent"
	"github.com/ipwarden/ipwarden/internal/controller"
	"github.com/ipwarden/ipwarden/internal/controlplane"
)

// names records the fully-qualified names of the metrics registered with it.
type names map[string]bool

var fqName = regexp.MustCompile(`fqName: "([^"]+)"`)

func (n names) Register(c prometheus.Collector) error {
	ch := make(chan *prometheus.Desc)
	go func() { c.Describe(ch); close(ch) }()
	for d := range ch {
		if m := fqName.FindStringSubmatch(d.String()); m != nil {
			n[m[1]] = true
		}
	}
	return nil
}

func (n names) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		_ = n.Register(c)
	}
}

func (n names) Unregister(prometheus.Collector) bool { return false }

// has reports whether a name a rule uses is exported: a registered metric, or a histogram's
// _bucket, _sum or _count series.
func (n names) has(name string) bool {
	if n[name] {
		return true
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suffix); ok && n[base] {
			return true
		}
	}
	return false
}

// The alert rules and the dashboard in deploy/monitoring parse (Prometheus' own rule and PromQL
// parsers, via hack/promcheck) and name only metrics the controller and the agent register.
func TestMonitoringUsesRegisteredMetrics(t *testing.T) {
	registered := names{}
	controller.NewMetrics(registered)
	agent.NewMetrics(registered)
	if !registered["ipwarden_controller_pool_free_addresses"] || !registered["workqueue_depth"] || !registered["ipwarden_agent_ip_wait_seconds"] {
		t.Fatalf("the recording registry missed metrics: %d names", len(registered))
	}
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	promcheck, err := controlplane.EnsurePromcheck(root, controlplane.BinDir(root), os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ kind, file string }{
		{"rules", "deploy/monitoring/ipwarden-rules.yaml"},
		{"dashboard", "deploy/monitoring/ipwarden-dashboard.json"},
	} {
		cmd := exec.Command(promcheck, tc.kind, filepath.Join(root, tc.file))
		var stderr strings.Builder
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Errorf("%s does not parse: %v\n%s", tc.file, err, stderr.String())
			continue
		}
		used := strings.Fields(string(out))
		if len(used) < 5 {
			t.Errorf("%s uses only %v", tc.file, used)
		}
		for _, n := range used {
			if !registered.has(n) {
				t.Errorf("%s uses metric %s, which neither the controller nor the agent registers", tc.file, n)
			}
		}
	}
}

// The checker itself refuses what Prometheus would: a rule file with bad PromQL, and a metric
// the code does not register.
func TestMonitoringCheckCatchesMistakes(t *testing.T) {
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	promcheck, err := controlplane.EnsurePromcheck(root, controlplane.BinDir(root), os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	if err := os.WriteFile(bad, []byte("groups:\n- name: x\n  rules:\n  - alert: X\n    expr: sum(rate(foo[5m])\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promcheck, "rules", bad).CombinedOutput(); err == nil {
		t.Errorf("promcheck accepted a rule with unbalanced parentheses: %s", out)
	}
	registered := names{}
	controller.NewMetrics(registered)
	if registered.has("ipwarden_controller_pool_free_addresses_total") || !registered.has("ipwarden_controller_sync_duration_seconds_bucket") {
		t.Error("names.has: wrong answer for a made-up name or a histogram's bucket series")
	}
}

package main

import (
	"os/exec"
	"strings"
	"testing"
)

// TestPluginImportsNoKubernetesClient keeps client-go and the Kubernetes API types out of the
// plugin binary: their package init runs on every pod start. So does OpenTelemetry's, which
// libcni's invoke package links: it made every exec of the plugin 0.2 ms slower (the CNI bench's
// p50 went from 1.17x to 1.23x host-local's), so "previous" is delegated without it.
func TestPluginImportsNoKubernetesClient(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	forbidden := []string{"k8s.io/client-go", "k8s.io/api/", "k8s.io/apimachinery", "sigs.k8s.io/controller-runtime",
		"go.opentelemetry.io/", "github.com/containernetworking/cni/pkg/invoke"}
	var bad []string
	for _, pkg := range strings.Fields(string(out)) {
		for _, f := range forbidden {
			if strings.HasPrefix(pkg, f) {
				bad = append(bad, pkg)
			}
		}
	}
	if len(bad) > 0 {
		t.Fatalf("ipwarden-cni imports Kubernetes client packages: %v", bad)
	}
	if !strings.Contains(string(out), "github.com/containernetworking/cni/pkg/skel") {
		t.Fatalf("go list -deps output does not look right (no CNI skel):\n%s", out)
	}
}

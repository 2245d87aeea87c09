package main

import (
	"os/exec"
	"strings"
	"testing"
)

// TestPluginImportsNoKubernetesClient keeps client-go and the Kubernetes API types out of the
// plugin binary: their package init runs on every pod start.
func TestPluginImportsNoKubernetesClient(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	forbidden := []string{"k8s.io/client-go", "k8s.io/api/", "k8s.io/apimachinery", "sigs.k8s.io/controller-runtime"}
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

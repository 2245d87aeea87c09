package integration

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// With agent.dra.enabled the chart renders exactly what the kustomize base with the DRA component
// (deploy/kustomize/dra) does: the DeviceClass, the agent's DRA RBAC, --dra and the kubelet's
// plugin directories mounted into the agent.
func TestHelmChartDRAMatchesKustomizeComponent(t *testing.T) {
	chart := chartDir(t)
	rendered := helmRun(t, "template", "ipwarden", chart, "--namespace", "ipwarden-system", "--include-crds", "--kube-version", "1.34.4",
		"--set", "agent.dra.enabled=true")
	overlay := t.TempDir()
	rel := func(p string) string {
		r, err := filepath.Rel(overlay, filepath.Join(chart, "..", "..", "kustomize", p))
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	k := "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [" + rel("") + "]\ncomponents: [" + rel("dra") + "]\n"
	if err := os.WriteFile(filepath.Join(overlay, "kustomization.yaml"), []byte(k), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(kubectl(t), "kustomize", overlay).CombinedOutput()
	if err != nil {
		t.Fatalf("kubectl kustomize: %v\n%s", err, out)
	}
	fromHelm, _ := sameObjects(t, rendered, out, "the kustomize base with the DRA component")
	for _, want := range []string{"DeviceClass /ipwarden-address", "ClusterRole /ipwarden-agent-dra", "ClusterRoleBinding /ipwarden-agent-dra"} {
		if fromHelm[want] == nil {
			t.Errorf("the chart with agent.dra.enabled renders no %s", want)
		}
	}
}

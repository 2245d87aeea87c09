package integration

import (
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"sort"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"
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
	fromHelm, fromKustomize := map[string]*unstructured.Unstructured{}, map[string]*unstructured.Unstructured{}
	for _, u := range decodeObjects(t, rendered) {
		normalize(u)
		fromHelm[objectKey(u)] = u
	}
	for _, u := range decodeObjects(t, out) {
		fromKustomize[objectKey(u)] = u
	}
	delete(fromKustomize, "Namespace /ipwarden-system")
	var keys []string
	for k := range fromKustomize {
		keys = append(keys, k)
	}
	for k := range fromHelm {
		if fromKustomize[k] == nil {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		h, kz := fromHelm[k], fromKustomize[k]
		switch {
		case h == nil:
			t.Errorf("%s: in the kustomize base with the DRA component, not rendered by the chart", k)
		case kz == nil:
			t.Errorf("%s: rendered by the chart, not by the kustomize base with the DRA component", k)
		case !reflect.DeepEqual(h.Object, kz.Object):
			hy, _ := yaml.Marshal(h.Object)
			ky, _ := yaml.Marshal(kz.Object)
			t.Errorf("%s differs:\n%s", k, lineDiff(string(hy), string(ky)))
		}
	}
	for _, want := range []string{"DeviceClass /ipwarden-address", "ClusterRole /ipwarden-agent-dra", "ClusterRoleBinding /ipwarden-agent-dra"} {
		if fromHelm[want] == nil {
			t.Errorf("the chart with agent.dra.enabled renders no %s", want)
		}
	}
}

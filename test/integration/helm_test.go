package integration

// The Helm chart (deploy/helm/ipwarden), with helm built from its Go module (hack/helm): it
// lints, renders the same objects as the kustomize base with default values, and with other
// values renders objects the real API server accepts.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"github.com/ipwarden/ipwarden/internal/controlplane"
)

func helmBinary(t *testing.T) string {
	t.Helper()
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	p, err := controlplane.EnsureHelm(root, controlplane.BinDir(root), os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// helmRun runs helm with its state directories in the test's temp dir (nothing from $HOME).
func helmRun(t *testing.T, args ...string) []byte {
	t.Helper()
	dir := t.TempDir()
	cmd := exec.Command(helmBinary(t), args...)
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+filepath.Join(dir, "cache"), "HELM_CONFIG_HOME="+filepath.Join(dir, "config"),
		"HELM_DATA_HOME="+filepath.Join(dir, "data"))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helm %s: %v\n%s\n%s", strings.Join(args, " "), err, out, stderr.String())
	}
	return out
}

func decodeObjects(t *testing.T, b []byte) []*unstructured.Unstructured {
	t.Helper()
	var out []*unstructured.Unstructured
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096)
	for {
		u := &unstructured.Unstructured{}
		if err := dec.Decode(&u.Object); err != nil {
			if errors.Is(err, io.EOF) {
				break
			}
			t.Fatal(err)
		}
		if len(u.Object) > 0 {
			out = append(out, u)
		}
	}
	return out
}

func objectKey(u *unstructured.Unstructured) string {
	return u.GetKind() + " " + u.GetNamespace() + "/" + u.GetName()
}

// helmLabels are the labels the chart adds to every object's metadata and the base has not.
var helmLabels = []string{"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "app.kubernetes.io/version"}

func normalize(u *unstructured.Unstructured) {
	labels := u.GetLabels()
	for _, l := range helmLabels {
		delete(labels, l)
	}
	if len(labels) == 0 {
		unstructured.RemoveNestedField(u.Object, "metadata", "labels")
	} else {
		u.SetLabels(labels)
	}
}

func chartDir(t *testing.T) string {
	t.Helper()
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(root, "deploy", "helm", "ipwarden")
}

// helm lint passes, and with default values the chart renders exactly the kustomize base's
// objects (after dropping the labels helm adds), except the Namespace, which helm's
// --create-namespace makes. The chart's CRDs are config/crd's.
func TestHelmChartMatchesKustomize(t *testing.T) {
	chart := chartDir(t)
	if out := helmRun(t, "lint", "--strict", chart); !bytes.Contains(out, []byte("0 chart(s) failed")) {
		t.Fatalf("helm lint:\n%s", out)
	}
	for _, name := range []string{"ipwarden.io_ippools.yaml", "ipwarden.io_nodeipallocations.yaml"} {
		a, err := os.ReadFile(filepath.Join(chart, "..", "..", "..", "config", "crd", name))
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(filepath.Join(chart, "crds", name))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(a, b) {
			t.Errorf("deploy/helm/ipwarden/crds/%s differs from config/crd/%s: run make generate", name, name)
		}
	}

	rendered := helmRun(t, "template", "ipwarden", chart, "--namespace", "ipwarden-system", "--include-crds", "--kube-version", "1.34.4")
	var stderr bytes.Buffer
	kc := exec.Command(kubectl(t), "kustomize", filepath.Join(chart, "..", "..", "kustomize"))
	kc.Stderr = &stderr
	base, err := kc.Output()
	if err != nil {
		t.Fatalf("kubectl kustomize: %v\n%s", err, stderr.String())
	}
	fromHelm, fromKustomize := sameObjects(t, rendered, base, "the kustomize base")
	if len(fromHelm) < 15 {
		t.Errorf("the chart rendered only %d objects", len(fromHelm))
	}
	// namespace.create renders the base's Namespace (for helm template | kubectl apply).
	withNS := helmRun(t, "template", "ipwarden", chart, "--namespace", "ipwarden-system", "--kube-version", "1.34.4", "--set", "namespace.create=true")
	var ns *unstructured.Unstructured
	for _, u := range decodeObjects(t, withNS) {
		if u.GetKind() == "Namespace" {
			normalize(u)
			ns = u
		}
	}
	if want := fromKustomize["Namespace /ipwarden-system"]; ns == nil || want == nil || !reflect.DeepEqual(ns.Object, want.Object) {
		t.Errorf("namespace.create=true renders %v, the base has %v", ns, want)
	}
}

// lineDiff names the first lines that differ.
func lineDiff(a, b string) string {
	al, bl := strings.Split(a, "\n"), strings.Split(b, "\n")
	var out []string
	for i := 0; i < max(len(al), len(bl)) && len(out) < 6; i++ {
		var x, y string
		if i < len(al) {
			x = al[i]
		}
		if i < len(bl) {
			y = bl[i]
		}
		if x != y {
			out = append(out, fmt.Sprintf("line %d: helm %q, kustomize %q", i+1, x, y))
		}
	}
	return strings.Join(out, "\n")
}

// With other values (another namespace, pools, the CNI config installed, extra flags, monitors,
// no PDB) the chart follows them, and the API server accepts what it renders (server-side dry
// run; the pool against the CRD's validation).
func TestHelmChartValues(t *testing.T) {
	chart := chartDir(t)
	values := filepath.Join(t.TempDir(), "values.yaml")
	if err := os.WriteFile(values, []byte(`
image: {repository: registry.example/ipwarden, tag: v9.9.9, pullPolicy: Always}
pools:
- name: helm-pool
  spec:
    cidrs: [10.150.0.0/16]
    scaling: {batchSize: 16, bufferPercent: 50, maxPerNode: 250}
    reuseCooldown: 30s
controller:
  replicas: 3
  extraArgs: [--per-node-metrics]
  podDisruptionBudget: {enabled: false}
agent:
  priorityClassName: ""
  extraArgs: [--gc-dry-run]
  exhaustedTaint: true
  tolerations: [{key: example.com/gpu, operator: Exists}]
cni:
  installConfig: true
  config: '{"cniVersion": "1.0.0", "name": "k", "plugins": [{"type": "ptp", "ipam": {"type": "ipwarden", "socket": "{{ .Values.agent.socketDir }}/agent.sock"}}]}'
metrics:
  serviceMonitor: {enabled: true}
`), 0o644); err != nil {
		t.Fatal(err)
	}
	const ns = "ipwarden-helm"
	objs := decodeObjects(t, helmRun(t, "template", "rel", chart, "--namespace", ns, "-f", values, "--kube-version", "1.34.4"))
	byKey := map[string]*unstructured.Unstructured{}
	for _, u := range objs {
		byKey[objectKey(u)] = u
		if u.GetNamespace() != "" && u.GetNamespace() != ns {
			t.Errorf("%s is not in the release namespace", objectKey(u))
		}
	}
	str := func(u *unstructured.Unstructured) string { b, _ := yaml.Marshal(u.Object); return string(b) }
	for key, wants := range map[string][]string{
		"Deployment " + ns + "/ipwarden-controller":                   {"replicas: 3", "image: registry.example/ipwarden:v9.9.9", "imagePullPolicy: Always", "- --per-node-metrics"},
		"DaemonSet " + ns + "/ipwarden-agent":                         {"- --gc-dry-run", "- --exhausted-taint", "key: example.com/gpu", `value: "true"`},
		"ConfigMap " + ns + "/ipwarden-cni-config":                    {`"socket": "/run/ipwarden/agent.sock"`, `"type": "ptp"`},
		"ValidatingAdmissionPolicy /ipwarden-agent-own-node":          {"system:serviceaccount:" + ns + ":ipwarden-agent"},
		"ValidatingAdmissionPolicy /ipwarden-controller-fence":        {"system:serviceaccount:" + ns + ":ipwarden-controller"},
		"ValidatingAdmissionPolicyBinding /ipwarden-controller-fence": {"namespace: " + ns},
		"ServiceMonitor " + ns + "/ipwarden-controller":               {"port: metrics"},
		"PodMonitor " + ns + "/ipwarden-agent":                        {"port: metrics"},
		"IPPool /helm-pool":                                           {"10.150.0.0/16"},
	} {
		u := byKey[key]
		if u == nil {
			t.Errorf("%s not rendered", key)
			continue
		}
		for _, w := range wants {
			if !strings.Contains(str(u), w) {
				t.Errorf("%s lacks %q:\n%s", key, w, str(u))
			}
		}
	}
	if byKey["PodDisruptionBudget "+ns+"/ipwarden-controller"] != nil {
		t.Error("PDB rendered with podDisruptionBudget.enabled false")
	}
	if strings.Contains(str(byKey["DaemonSet "+ns+"/ipwarden-agent"]), "priorityClassName") {
		t.Error("agent priorityClassName rendered although empty")
	}

	// The API server accepts every object it knows the kind of (the monitors' CRDs are not
	// installed here).
	ctx := context.Background()
	nsObj := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}
	if err := k8s.Create(ctx, nsObj); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), nsObj) })
	for _, u := range objs {
		if u.GroupVersionKind().Group == "monitoring.coreos.com" {
			continue
		}
		err := k8s.Create(ctx, u, client.DryRunAll)
		if err != nil && !apierrors.IsAlreadyExists(err) {
			t.Errorf("the API server rejects %s: %v", objectKey(u), err)
		}
	}
}

// sameObjects decodes a chart's rendering and a kustomize build and reports every object that
// is in one and not the other, or differs (after dropping the labels helm adds), naming the
// build what; the Namespace is kustomize's only (helm's --create-namespace makes it). It
// returns both sets by key.
func sameObjects(t *testing.T, rendered, kustomized []byte, what string) (fromHelm, fromKustomize map[string]*unstructured.Unstructured) {
	t.Helper()
	fromHelm, fromKustomize = map[string]*unstructured.Unstructured{}, map[string]*unstructured.Unstructured{}
	for _, u := range decodeObjects(t, rendered) {
		normalize(u)
		fromHelm[objectKey(u)] = u
	}
	for _, u := range decodeObjects(t, kustomized) {
		fromKustomize[objectKey(u)] = u
	}
	onlyKustomize := map[string]bool{"Namespace /ipwarden-system": true}
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
		case onlyKustomize[k]:
			if h != nil {
				t.Errorf("%s: rendered by helm with default values, expected from --create-namespace", k)
			}
		case h == nil:
			t.Errorf("%s: in %s, not rendered by the chart", k, what)
		case kz == nil:
			t.Errorf("%s: rendered by the chart, not in %s", k, what)
		case !reflect.DeepEqual(h.Object, kz.Object):
			hy, _ := yaml.Marshal(h.Object)
			ky, _ := yaml.Marshal(kz.Object)
			t.Errorf("%s differs between the chart and %s:\n--- helm\n%s\n--- kustomize\n%s\n%s", k, what, hy, ky, lineDiff(string(hy), string(ky)))
		}
	}
	return fromHelm, fromKustomize
}

package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/controlplane"
)

// kubectl as built by hack/tools (with its built-in kustomize).
func kubectl(t *testing.T) string {
	t.Helper()
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	p, err := controlplane.EnsureKubectl(root, controlplane.BinDir(root), os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// The kubectl the tests use fails like the real one: an error and a non-zero exit status.
func TestKubectlReturnsErrors(t *testing.T) {
	out, err := exec.Command(kubectl(t), "kustomize", filepath.Join(t.TempDir(), "nonexistent")).CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() == 0 {
		t.Fatalf("kubectl kustomize of a missing directory: err %v, output %q; want a non-zero exit", err, out)
	}
	if !strings.Contains(string(out), "nonexistent") {
		t.Errorf("kubectl's error does not name the directory: %q", out)
	}
}

// The shipped manifests, rendered by `kubectl kustomize deploy/kustomize` (what `kubectl apply
// -k` applies), are accepted by the API server, and the admission policy lets an agent write
// only its own node's spec.
func TestDeployManifests(t *testing.T) {
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd := exec.Command(kubectl(t), "kustomize", filepath.Join(root, "deploy/kustomize"))
	cmd.Stderr = &stderr
	rendered, err := cmd.Output()
	if err != nil {
		t.Fatalf("kubectl kustomize deploy/kustomize: %v\n%s", err, stderr.String())
	}
	kinds := map[string]int{}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(rendered), 4096)
	for {
		u := &unstructured.Unstructured{}
		if err := dec.Decode(&u.Object); err != nil {
			if errors.Is(err, io.EOF) {
				break
			}
			t.Fatal(err)
		}
		if len(u.Object) == 0 {
			continue
		}
		kinds[u.GetKind()]++
		if err := k8s.Create(context.Background(), u); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatalf("create %s %s: %v", u.GetKind(), u.GetName(), err)
		}
	}
	want := map[string]int{"CustomResourceDefinition": 2, "Namespace": 1, "ServiceAccount": 2, "ClusterRole": 3,
		"ClusterRoleBinding": 2, "Role": 2, "RoleBinding": 2, "ValidatingAdmissionPolicy": 3,
		"ValidatingAdmissionPolicyBinding": 3, "Deployment": 1, "Service": 1, "ConfigMap": 1, "DaemonSet": 1,
		"PodDisruptionBudget": 1}
	for k, n := range want {
		if kinds[k] != n {
			t.Errorf("kustomize rendered %d %s, want %d (all: %v)", kinds[k], k, n, kinds)
		}
	}
	ctx := context.Background()
	var ds appsv1.DaemonSet
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: "ipwarden-system", Name: "ipwarden-agent"}, &ds); err != nil {
		t.Fatalf("agent DaemonSet: %v", err)
	}
	// The agent sees the host's network namespaces (read-only, later mounts propagated), the
	// check that a deleted pod's sandbox is gone; and knows its pod name and namespace (the
	// node's Lease).
	mounts := map[string]bool{}
	var env []string
	for _, c := range ds.Spec.Template.Spec.Containers {
		if c.Name != "agent" {
			continue
		}
		for _, m := range c.VolumeMounts {
			if m.ReadOnly && m.MountPropagation != nil && *m.MountPropagation == corev1.MountPropagationHostToContainer {
				mounts[m.MountPath] = true
			}
		}
		for _, e := range c.Env {
			env = append(env, e.Name)
		}
	}
	if !mounts["/var/run/netns"] || !mounts["/run/netns"] {
		t.Errorf("agent mounts %v: want /var/run/netns and /run/netns read-only with HostToContainer propagation", mounts)
	}
	if !slices.Contains(env, "POD_NAME") || !slices.Contains(env, "POD_NAMESPACE") {
		t.Errorf("agent env %v: want POD_NAME and POD_NAMESPACE", env)
	}
	var dep appsv1.Deployment
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: "ipwarden-system", Name: "ipwarden-controller"}, &dep); err != nil {
		t.Fatalf("controller Deployment: %v", err)
	}
	if *dep.Spec.Replicas != 2 {
		t.Errorf("controller replicas %d, want 2", *dep.Spec.Replicas)
	}
	// A drain evicts one replica at a time and never the last one.
	var pdb policyv1.PodDisruptionBudget
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: "ipwarden-system", Name: "ipwarden-controller"}, &pdb); err != nil {
		t.Fatalf("controller PodDisruptionBudget: %v", err)
	}
	if pdb.Spec.MinAvailable == nil || pdb.Spec.MinAvailable.IntValue() != 1 || pdb.Spec.Selector == nil ||
		!maps.Equal(pdb.Spec.Selector.MatchLabels, dep.Spec.Selector.MatchLabels) {
		t.Errorf("controller PDB %+v: want minAvailable 1 selecting the Deployment's pods %v", pdb.Spec, dep.Spec.Selector.MatchLabels)
	}
	// hostNetwork replicas cannot surge onto a node that runs one, and two replicas may share a
	// node: replace one at a time, declare no (host) ports, prefer spreading.
	if ru := dep.Spec.Strategy.RollingUpdate; ru == nil || ru.MaxSurge == nil || ru.MaxSurge.IntValue() != 0 || ru.MaxUnavailable == nil || ru.MaxUnavailable.IntValue() != 1 {
		t.Errorf("controller rolling update %+v, want maxSurge 0, maxUnavailable 1", dep.Spec.Strategy.RollingUpdate)
	}
	if a := dep.Spec.Template.Spec.Affinity; a == nil || a.PodAntiAffinity == nil || len(a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution) > 0 || len(a.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution) == 0 {
		t.Errorf("controller anti-affinity must be preferred only: %+v", a)
	}
	for _, c := range dep.Spec.Template.Spec.Containers {
		if len(c.Ports) > 0 {
			t.Errorf("controller container %s declares ports %v: with hostNetwork they are host ports, and two replicas could not share a node", c.Name, c.Ports)
		}
		// hostNetwork replicas share the node's hostname: the Lease holder names the pod.
		var env []string
		for _, e := range c.Env {
			if e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
				env = append(env, e.Name+"="+e.ValueFrom.FieldRef.FieldPath)
			}
		}
		if !slices.Contains(env, "POD_NAME=metadata.name") {
			t.Errorf("controller container %s env %v: want POD_NAME from metadata.name (the leader's identity)", c.Name, env)
		}
	}
	// Metrics and probe ports stay out of 9100-9999, the range Prometheus exporters allocate.
	for _, spec := range []corev1.PodSpec{dep.Spec.Template.Spec, ds.Spec.Template.Spec} {
		for _, c := range spec.Containers {
			for _, arg := range c.Args {
				for _, flag := range []string{"--metrics-bind-address=", "--health-probe-bind-address="} {
					if port, ok := strings.CutPrefix(arg, flag); ok {
						_, p, _ := strings.Cut(port, ":")
						if n, err := strconv.Atoi(p); err == nil && n >= 9100 && n <= 9999 {
							t.Errorf("%s %s: port %d is in the exporters' range 9100-9999", c.Name, arg, n)
						}
					}
				}
			}
		}
	}
	// The CNI config: containerd 1.6 reads cniVersion (it cannot parse 1.1.0 results); a current
	// libcni picks the newest of cniVersions it supports.
	var cm corev1.ConfigMap
	if err := k8s.Get(ctx, client.ObjectKey{Namespace: "ipwarden-system", Name: "ipwarden-cni-config"}, &cm); err != nil {
		t.Fatal(err)
	}
	conflist := cm.Data["10-ipwarden.conflist"]
	var raw struct {
		CNIVersion  string   `json:"cniVersion"`
		CNIVersions []string `json:"cniVersions"`
	}
	if err := json.Unmarshal([]byte(conflist), &raw); err != nil {
		t.Fatalf("CNI config: %v", err)
	}
	if raw.CNIVersion != "1.0.0" || strings.Join(raw.CNIVersions, ",") != "1.0.0,1.1.0" {
		t.Errorf("CNI config cniVersion %q cniVersions %v, want 1.0.0 and [1.0.0 1.1.0]", raw.CNIVersion, raw.CNIVersions)
	}
	list, err := libcni.NetworkConfFromBytes([]byte(conflist))
	if err != nil {
		t.Fatalf("libcni rejects the shipped CNI config: %v", err)
	}
	if list.CNIVersion != "1.1.0" {
		t.Errorf("libcni picked cniVersion %q from the shipped config, want 1.1.0", list.CNIVersion)
	}

	// Two nodes' NodeIPAllocations, as the controller would create them.
	for _, n := range []string{"vap-a", "vap-b"} {
		a := &ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: n}}
		if err := k8s.Create(ctx, a); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = k8s.Delete(context.Background(), a) })
	}
	agentOn := func(node string) client.Client {
		cfg := rest.CopyConfig(restConfig)
		cfg.Impersonate = rest.ImpersonationConfig{
			UserName: "system:serviceaccount:ipwarden-system:ipwarden-agent",
			Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:ipwarden-system", "system:authenticated"},
			Extra:    map[string][]string{"authentication.kubernetes.io/node-name": {node}},
		}
		c, err := client.New(cfg, client.Options{Scheme: scheme})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	agentA := agentOn("vap-a")
	setRequest := func(c client.Client, node string, n int32) error {
		return retry.RetryOnConflict(retry.DefaultRetry, func() error {
			a := &ipwardenv1.NodeIPAllocation{}
			if err := c.Get(ctx, client.ObjectKey{Name: node}, a); err != nil {
				return err
			}
			a.Spec.Pools = []ipwardenv1.NodePoolRequest{{Pool: "p", Requested: n}}
			return c.Update(ctx, a)
		})
	}

	// The policy is compiled and loaded asynchronously: wait until it bites.
	eventually(t, 30*time.Second, "the admission policy to deny another node's object", func() error {
		err := setRequest(agentA, "vap-b", 16)
		if err == nil {
			return fmt.Errorf("agent on vap-a wrote vap-b's spec")
		}
		if !strings.Contains(err.Error(), `this agent runs on node "vap-a", the object is "vap-b"`) {
			return fmt.Errorf("unexpected error: %v", err)
		}
		return nil
	})
	if err := setRequest(agentA, "vap-a", 16); err != nil {
		t.Fatalf("agent cannot write its own node's spec: %v", err)
	}
	// Status is the controller's: the agent cannot write it (RBAC and policy).
	a := &ipwardenv1.NodeIPAllocation{}
	if err := agentA.Get(ctx, client.ObjectKey{Name: "vap-a"}, a); err != nil {
		t.Fatal(err)
	}
	a.Status.Pools = []ipwardenv1.NodePoolStatus{{Pool: "p", Addresses: []string{"10.0.0.1"}, Held: 1}}
	if err := agentA.Status().Update(ctx, a); !apierrors.IsForbidden(err) {
		t.Errorf("agent wrote status: %v", err)
	}
	// An agent whose token carries no node name cannot write at all.
	if err := setRequest(agentOn(""), "vap-a", 8); err == nil {
		t.Error("an agent without a node name wrote a spec")
	}
	// It may re-create only its own node's object, owned by its Node (after a deletion by hand);
	// it cannot create another node's, delete, or relabel.
	if err := agentA.Create(ctx, &ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: "vap-c"}}); err == nil ||
		!strings.Contains(err.Error(), `this agent runs on node "vap-a", the object is "vap-c"`) {
		t.Errorf("agent created another node's NodeIPAllocation: %v", err)
	}
	own := &ipwardenv1.NodeIPAllocation{}
	if err := k8s.Get(ctx, client.ObjectKey{Name: "vap-a"}, own); err != nil {
		t.Fatal(err)
	}
	if err := k8s.Delete(ctx, own); err != nil {
		t.Fatal(err)
	}
	if err := agentA.Create(ctx, &ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: "vap-a"}}); err == nil ||
		!strings.Contains(err.Error(), "owned by its Node") {
		t.Errorf("agent created its NodeIPAllocation without its Node as owner: %v", err)
	}
	owned := &ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: "vap-a",
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: "vap-a", UID: "0a0a0a0a-0000-0000-0000-000000000000"}}}}
	if err := agentA.Create(ctx, owned); err != nil {
		t.Errorf("agent cannot re-create its own NodeIPAllocation: %v", err)
	}
	if err := agentA.Delete(ctx, &ipwardenv1.NodeIPAllocation{ObjectMeta: metav1.ObjectMeta{Name: "vap-a"}}); !apierrors.IsForbidden(err) {
		t.Errorf("agent deleted a NodeIPAllocation: %v", err)
	}
	if err := agentA.Get(ctx, client.ObjectKey{Name: "vap-a"}, a); err != nil {
		t.Fatal(err)
	}
	a.Labels = map[string]string{"x": "y"}
	if err := agentA.Update(ctx, a); err == nil || !strings.Contains(err.Error(), "owner references or labels") {
		t.Errorf("agent relabeled its object: %v", err)
	}
	if err := agentA.Create(ctx, &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: "agent-pool"}, Spec: ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.200.0.0/24"}}}); !apierrors.IsForbidden(err) {
		t.Errorf("agent created a pool: %v", err)
	}
	// The node's Lease (one agent per node): get, create and renew in its own namespace only.
	id := "agent-a"
	lease := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: "ipwarden-system", Name: "ipwarden-agent-vap-a"},
		Spec: coordinationv1.LeaseSpec{HolderIdentity: &id}}
	if err := agentA.Create(ctx, lease); err != nil {
		t.Fatalf("agent cannot create its Lease: %v", err)
	}
	t.Cleanup(func() { _ = k8s.Delete(context.Background(), lease) })
	if err := agentA.Get(ctx, client.ObjectKeyFromObject(lease), lease); err != nil {
		t.Fatalf("agent cannot read its Lease: %v", err)
	}
	if err := agentA.Update(ctx, lease); err != nil {
		t.Fatalf("agent cannot renew its Lease: %v", err)
	}
	if err := agentA.Delete(ctx, lease); !apierrors.IsForbidden(err) {
		t.Errorf("agent deleted a Lease: %v", err)
	}
	if err := agentA.Create(ctx, &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "x"}}); !apierrors.IsForbidden(err) {
		t.Errorf("agent created a Lease outside its namespace: %v", err)
	}

	// The scheduler signal: an agent patches only its own Node, and there only its condition
	// and its taint.
	for _, n := range []string{"vap-a", "vap-b"} {
		node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}
		if err := k8s.Create(ctx, node); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = k8s.Delete(context.Background(), node) })
	}
	condition := func(c client.Client, node, typ string) error {
		body := fmt.Sprintf(`{"status":{"conditions":[{"type":%q,"status":"True","reason":"AtMaxPerNode","message":"test"}]}}`, typ)
		return c.Status().Patch(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, client.RawPatch(types.StrategicMergePatchType, []byte(body)))
	}
	eventually(t, 30*time.Second, "the node signal policy to deny another node's condition", func() error {
		err := condition(agentA, "vap-b", "ipwarden.io/AddressesExhausted")
		if err == nil {
			return fmt.Errorf("agent on vap-a wrote vap-b's condition")
		}
		if !strings.Contains(err.Error(), `this agent runs on node "vap-a", the object is "vap-b"`) {
			return fmt.Errorf("unexpected error: %v", err)
		}
		return nil
	})
	for _, typ := range []string{"ipwarden.io/AddressesExhausted", "ipwarden.io/TakeoverComplete", "ipwarden.io/HandedBack"} {
		if err := condition(agentA, "vap-a", typ); err != nil {
			t.Errorf("agent cannot write its Node's %s condition: %v", typ, err)
		}
	}
	if err := condition(agentA, "vap-a", "Ready"); err == nil || !strings.Contains(err.Error(), "may change only its Node's condition ipwarden.io/AddressesExhausted") {
		t.Errorf("agent wrote its Node's Ready condition: %v", err)
	}
	// Taints are replaced as a list: the agent sends the Node's taints plus or minus its own
	// (the API server gave new Nodes node.kubernetes.io/not-ready).
	edit := func(c client.Client, node string, change func(*corev1.Node)) error {
		var n corev1.Node
		if err := k8s.Get(ctx, client.ObjectKey{Name: node}, &n); err != nil {
			return err
		}
		base := n.DeepCopy()
		change(&n)
		return c.Patch(ctx, &n, client.MergeFromWithOptions(base, client.MergeFromWithOptimisticLock{}))
	}
	addTaint := func(key string) func(*corev1.Node) {
		return func(n *corev1.Node) {
			n.Spec.Taints = append(n.Spec.Taints, corev1.Taint{Key: key, Effect: corev1.TaintEffectNoSchedule})
		}
	}
	if err := edit(agentA, "vap-a", addTaint("ipwarden.io/addresses-exhausted")); err != nil {
		t.Errorf("agent cannot taint its Node: %v", err)
	}
	if err := edit(agentA, "vap-a", addTaint("other")); err == nil || !strings.Contains(err.Error(), "may change only its Node's taint") {
		t.Errorf("agent set another taint on its Node: %v", err)
	}
	if err := edit(agentA, "vap-a", func(n *corev1.Node) { n.Spec.Taints = nil }); err == nil {
		t.Error("agent removed the other taints of its Node")
	}
	if err := edit(agentA, "vap-a", func(n *corev1.Node) { n.Labels = map[string]string{"x": "y"} }); err == nil {
		t.Error("agent labeled its Node")
	}
	if err := edit(agentA, "vap-b", addTaint("ipwarden.io/addresses-exhausted")); err == nil {
		t.Error("agent tainted another Node")
	}
}

package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/controlplane"
)

// The shipped manifests (every resource of deploy/kustomize/kustomization.yaml) are accepted by
// the API server, and the admission policy lets an agent write only its own node's spec.
func TestDeployManifests(t *testing.T) {
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root, "deploy/kustomize/kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k struct {
		Resources []string `json:"resources"`
	}
	if err := yaml.Unmarshal(b, &k); err != nil {
		t.Fatal(err)
	}
	if len(k.Resources) < 6 {
		t.Fatalf("kustomization lists %d resources", len(k.Resources))
	}
	for _, r := range k.Resources {
		applyYAML(t, filepath.Join("deploy/kustomize", r))
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
}

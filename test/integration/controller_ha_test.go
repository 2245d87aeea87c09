package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/addr"
	"github.com/ipwarden/ipwarden/internal/controlplane"
)

// applyYAML creates every object of a manifest file, as kubectl apply would on a new cluster.
func applyYAML(t *testing.T, rel string) {
	t.Helper()
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		t.Fatal(err)
	}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096)
	for {
		u := &unstructured.Unstructured{}
		if err := dec.Decode(&u.Object); err != nil {
			if errors.Is(err, io.EOF) {
				return
			}
			t.Fatalf("%s: %v", rel, err)
		}
		if len(u.Object) == 0 {
			continue
		}
		if err := k8s.Create(context.Background(), u); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatalf("%s: create %s %s: %v", rel, u.GetKind(), u.GetName(), err)
		}
	}
}

// impersonating returns a kubeconfig file and a client that act as a service account, so a test
// runs a component with exactly the permissions its RBAC manifest grants.
func impersonating(t *testing.T, namespace, sa string) (string, client.Client) {
	t.Helper()
	user := fmt.Sprintf("system:serviceaccount:%s:%s", namespace, sa)
	groups := []string{"system:serviceaccounts", "system:serviceaccounts:" + namespace, "system:authenticated"}
	kc, err := clientcmd.LoadFromFile(kubeconfigPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, ai := range kc.AuthInfos {
		ai.Impersonate = user
		ai.ImpersonateGroups = groups
	}
	path := filepath.Join(t.TempDir(), "kubeconfig-"+sa)
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		t.Fatal(err)
	}
	cfg := rest.CopyConfig(restConfig)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: groups}
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	return path, c
}

func (p *controllerProcess) logContains(s string) bool {
	b, _ := os.ReadFile(p.log)
	return strings.Contains(string(b), s)
}

// Two controller replicas with the shipped RBAC, as the controller's service account: exactly one
// leads and serves; when it dies the other takes over the Lease and serves. The service account
// can do what the controller needs and nothing it does not.
func TestControllerLeaderElectionWithShippedRBAC(t *testing.T) {
	applyYAML(t, "deploy/kustomize/namespace.yaml")
	applyYAML(t, "deploy/kustomize/controller-rbac.yaml")
	kc, sa := impersonating(t, "ipwarden-system", "ipwarden-controller")

	// The fence policy checks writes against the Lease ipwarden-system/ipwarden-controller.
	freeLease(t)
	ha := []string{"--kubeconfig", kc, "--leader-elect=true", "--leader-election-namespace=ipwarden-system",
		"--leader-election-id=ipwarden-controller", "--claim-settle=100ms",
		"--leader-election-lease-duration=2s", "--leader-election-renew-deadline=1500ms", "--leader-election-retry-period=200ms"}
	a := startController(t, ha...)
	b := startController(t, ha...)

	createPool(t, "ha", ipwardenv1.IPPoolSpec{CIDRs: []ipwardenv1.CIDR{"10.106.0.0/24"}})
	createNode(t, "ha-node", nil)
	waitAllocation(t, "ha-node")
	request(t, "ha-node", "ha", 16, addr.Set{})
	waitHeld(t, "ha-node", "ha", 16)

	const serving = `"msg":"controller serving"`
	leader, standby := a, b
	if b.logContains(serving) {
		leader, standby = b, a
	}
	if !leader.logContains(serving) || standby.logContains(serving) {
		t.Fatalf("want exactly one serving replica: a=%v b=%v", a.logContains(serving), b.logContains(serving))
	}

	leader.kill()
	eventually(t, 30*time.Second, "the standby to take over", func() error {
		if !standby.logContains(serving) {
			return fmt.Errorf("standby not serving yet")
		}
		return nil
	})
	request(t, "ha-node", "ha", 32, addr.Set{})
	waitHeld(t, "ha-node", "ha", 32)

	// Least privilege: the controller's identity cannot touch what it does not manage.
	ctx := context.Background()
	pool := &ipwardenv1.IPPool{}
	if err := sa.Get(ctx, client.ObjectKey{Name: "ha"}, pool); err != nil {
		t.Fatalf("controller identity cannot read pools: %v", err)
	}
	pool.Spec.CIDRs = append(pool.Spec.CIDRs, "10.107.0.0/24")
	if err := sa.Update(ctx, pool); !apierrors.IsForbidden(err) {
		t.Errorf("controller identity changed a pool's spec: %v", err)
	}
	// It lists a node's pods (a settling pool reads a silent node's), and does nothing else with them.
	if err := sa.List(ctx, &corev1.PodList{}, client.MatchingFields{"spec.nodeName": "ha-node"}); err != nil {
		t.Errorf("controller identity cannot list a node's pods: %v", err)
	}
	if err := sa.Get(ctx, client.ObjectKey{Namespace: "default", Name: "any"}, &corev1.Pod{}); !apierrors.IsForbidden(err) {
		t.Errorf("controller identity read a pod: %v", err)
	}
	if err := sa.Delete(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "any"}}); !apierrors.IsForbidden(err) {
		t.Errorf("controller identity deleted a pod: %v", err)
	}
	if err := sa.Create(ctx, &corev1.Node{}); !apierrors.IsForbidden(err) {
		t.Errorf("controller identity created a node: %v", err)
	}
	alloc := &ipwardenv1.NodeIPAllocation{}
	if err := sa.Get(ctx, client.ObjectKey{Name: "ha-node"}, alloc); err != nil {
		t.Fatal(err)
	}
	alloc.Spec.Pools[0].Requested = 1
	if err := sa.Update(ctx, alloc); !apierrors.IsForbidden(err) {
		t.Errorf("controller identity wrote a node's spec (the agent's half): %v", err)
	}
}

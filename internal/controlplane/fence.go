package controlplane

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// FencePolicyFile is the controller's fence policy (docs/design.md, "Fencing"), relative to the
// repository root. The test control plane installs it like a cluster does, with the namespace
// its Lease lives in, so every test that runs a leader-elected controller runs it fenced.
const FencePolicyFile = "deploy/kustomize/fence-policy.yaml"

// ControllerNamespace is where the controller's Lease lives (the fence policy's paramRef).
const ControllerNamespace = "ipwarden-system"

// ControllerLease is the controller's leader election Lease (the fence policy's paramRef).
const ControllerLease = "ipwarden-controller"

// InstallFencePolicy creates the ipwarden-system namespace and the fence policy and binding of
// root/FencePolicyFile.
func InstallFencePolicy(ctx context.Context, cfg *rest.Config, root string) error {
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ControllerNamespace}}
	if _, err := cs.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create namespace %s: %w", ControllerNamespace, err)
	}
	// The binding denies every status write while its Lease does not exist, before it looks at
	// who writes (parameterNotFoundAction: Deny). In a cluster the controller creates the Lease
	// when it first leads; here an unheld one is created up front, so tests that run a controller
	// without leader election (unfenced, matched by no condition) can write.
	lease := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: ControllerNamespace, Name: ControllerLease}}
	if _, err := cs.CoordinationV1().Leases(ControllerNamespace).Create(ctx, lease, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create Lease %s/%s: %w", ControllerNamespace, ControllerLease, err)
	}
	b, err := os.ReadFile(filepath.Join(root, FencePolicyFile))
	if err != nil {
		return err
	}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096)
	for {
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return fmt.Errorf("decode %s: %w", FencePolicyFile, err)
		}
		var meta metav1.TypeMeta
		if err := json.Unmarshal(raw, &meta); err != nil {
			return err
		}
		doc := []byte(raw)
		switch meta.Kind {
		case "ValidatingAdmissionPolicy":
			var p admissionv1.ValidatingAdmissionPolicy
			if err := json.Unmarshal(doc, &p); err != nil {
				return err
			}
			if _, err := cs.AdmissionregistrationV1().ValidatingAdmissionPolicies().Create(ctx, &p, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
				return fmt.Errorf("install %s: %w", p.Name, err)
			}
		case "ValidatingAdmissionPolicyBinding":
			var p admissionv1.ValidatingAdmissionPolicyBinding
			if err := json.Unmarshal(doc, &p); err != nil {
				return err
			}
			if _, err := cs.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Create(ctx, &p, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
				return fmt.Errorf("install %s: %w", p.Name, err)
			}
		case "":
		default:
			return fmt.Errorf("%s: unexpected kind %q", FencePolicyFile, meta.Kind)
		}
	}
}

package controller

import (
	"context"
	"fmt"
	"strings"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// A leader-elected controller is safe only while the API server fences its status writes against
// its Lease (docs/design.md, "Fencing"). Without the fence policy, or with one whose binding reads
// another Lease, a leader paused past its Lease writes stale statuses that land, or every write is
// refused and the controller restarts in a loop. So the controller checks the policy before it
// campaigns, and refuses to lead, saying what is wrong, until it is right.

// FenceBinding is what the check reads of one ValidatingAdmissionPolicyBinding.
type FenceBinding struct {
	Name, PolicyName string
	// ParamNamespace and ParamName are its paramRef's ("" without one, or with a selector).
	ParamNamespace, ParamName string
}

// FencePolicyView is what the check read: whether the policy exists, and every binding.
type FencePolicyView struct {
	PolicyExists bool
	Bindings     []FenceBinding
}

// CheckFencePolicy says why the policy does not fence the Lease leaseNS/leaseName, or nil: the
// policy must exist and some binding of it must name that Lease as its parameter.
func CheckFencePolicy(v FencePolicyView, leaseNS, leaseName string) error {
	if !v.PolicyExists {
		return fmt.Errorf("the fence policy (ValidatingAdmissionPolicy %s) is missing: install it (deploy/kustomize/fence-policy.yaml, "+
			"part of kubectl apply -k deploy/kustomize and of the Helm chart) so the API server refuses a stale leader's writes; "+
			"or run one replica with --leader-elect=false", FencePolicyName)
	}
	var others []string
	for _, b := range v.Bindings {
		if b.PolicyName != FencePolicyName {
			continue
		}
		if b.ParamNamespace == leaseNS && b.ParamName == leaseName {
			return nil
		}
		others = append(others, fmt.Sprintf("%s reads Lease %s/%s", b.Name, b.ParamNamespace, b.ParamName))
	}
	if len(others) == 0 {
		return fmt.Errorf("the fence policy %s has no ValidatingAdmissionPolicyBinding %s: install deploy/kustomize/fence-policy.yaml whole", FencePolicyName, FencePolicyName)
	}
	return fmt.Errorf("the fence policy's bindings do not read this controller's Lease %s/%s (%s): set --leader-election-namespace "+
		"and --leader-election-id to the Lease the binding's paramRef names, or edit the binding", leaseNS, leaseName, strings.Join(others, "; "))
}

// ReadFencePolicy reads the fence policy and its binding, both named FencePolicyName as in
// deploy/ (RBAC: get on exactly these two objects, admissionregistration.k8s.io).
func ReadFencePolicy(ctx context.Context, r client.Reader) (FencePolicyView, error) {
	var v FencePolicyView
	var p admissionv1.ValidatingAdmissionPolicy
	switch err := r.Get(ctx, client.ObjectKey{Name: FencePolicyName}, &p); {
	case err == nil:
		v.PolicyExists = true
	case apierrors.IsNotFound(err):
	default:
		return v, fmt.Errorf("read ValidatingAdmissionPolicy %s: %w", FencePolicyName, err)
	}
	var b admissionv1.ValidatingAdmissionPolicyBinding
	switch err := r.Get(ctx, client.ObjectKey{Name: FencePolicyName}, &b); {
	case err == nil:
		fb := FenceBinding{Name: b.Name, PolicyName: b.Spec.PolicyName}
		if pr := b.Spec.ParamRef; pr != nil {
			fb.ParamNamespace, fb.ParamName = pr.Namespace, pr.Name
		}
		v.Bindings = append(v.Bindings, fb)
	case apierrors.IsNotFound(err):
	default:
		return v, fmt.Errorf("read ValidatingAdmissionPolicyBinding %s: %w", FencePolicyName, err)
	}
	return v, nil
}

package controller

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
)

// A leader-elected controller is safe only while the API server fences its status writes against
// its Lease (docs/design.md, "Fencing"). A fence policy that is missing, or that is there but
// would let a stale leader's write through (a binding that only warns or audits, failurePolicy
// Ignore, its validation edited away, a binding that reads another Lease or skips some of the
// controller's writes), leaves writes unfenced without anyone noticing. So the controller judges
// the policy and its binding at every lease operation (FenceGate): it takes the Lease only while
// JudgeFence says the pair denies a stale leader's write, and a leader whose fence stops doing so
// stops writing and steps down.

// FenceProblem names why a fence policy and binding would not deny a stale leader's write. It is
// the reason label of ipwarden_controller_fence_lost_total.
type FenceProblem string

const (
	// FenceValid: the pair denies every status write whose fence does not match the Lease.
	FenceValid FenceProblem = ""
	// FencePolicyMissing: no ValidatingAdmissionPolicy FencePolicyName.
	FencePolicyMissing FenceProblem = "policy_missing"
	// FenceBindingMissing: no ValidatingAdmissionPolicyBinding FencePolicyName binding the policy.
	FenceBindingMissing FenceProblem = "binding_missing"
	// FenceNotDenying: the binding's validationActions lack Deny (Warn or Audit only).
	FenceNotDenying FenceProblem = "not_denying"
	// FenceFailsOpen: the policy's failurePolicy is Ignore (an error in the check lets the write
	// through).
	FenceFailsOpen FenceProblem = "fails_open"
	// FenceWrongLease: the binding's paramRef does not name this controller's Lease exactly, or
	// lets writes through while the Lease is missing (parameterNotFoundAction Allow).
	FenceWrongLease FenceProblem = "wrong_lease"
	// FenceCheckChanged: the policy's parameter kind, variables or holder and epoch validation
	// are not ipwarden's (missing or edited).
	FenceCheckChanged FenceProblem = "check_changed"
	// FenceNarrowed: the policy's or binding's match rules, selectors or conditions skip some of
	// the controller's status writes.
	FenceNarrowed FenceProblem = "narrowed"
	// FenceUnreadable: the policy or binding could not be read (never from JudgeFence).
	FenceUnreadable FenceProblem = "unreadable"
)

// FenceVerdict is JudgeFence's answer: Problem is FenceValid or why not, Detail says it to a
// person (what is wrong and what to do).
type FenceVerdict struct {
	Problem FenceProblem
	Detail  string
}

// OK says whether the fence holds.
func (v FenceVerdict) OK() bool { return v.Problem == FenceValid }

func verdict(p FenceProblem, format string, args ...any) FenceVerdict {
	return FenceVerdict{Problem: p, Detail: fmt.Sprintf(format, args...)}
}

// The fence check as deploy/kustomize/fence-policy.yaml (and the Helm chart) installs it. JudgeFence
// compares expressions with all runs of white space made one space, and needs these exactly:
// anything else could let a stale leader's write through, and whether it does is not for the
// controller to guess.
const (
	// FenceHolderVariable and FenceEpochVariable are the Lease's holder and epoch as the
	// validation reads them (variables.holder, variables.epoch).
	FenceHolderVariable = "has(params.spec.holderIdentity) ? params.spec.holderIdentity : ''"
	FenceEpochVariable  = "has(params.spec.leaseTransitions) ? int(params.spec.leaseTransitions) : 0"
	// FenceValidation denies a write whose status.fence is not the Lease's holder and epoch.
	FenceValidation = "object.status.fence.holder == variables.holder && int(object.status.fence.epoch) == variables.epoch"
)

// fenceMatchCondition is the one matchCondition the policy may have: the controller's service
// account (any name: the Helm chart's namespace varies), or any write that carries a fence. It is
// true for every write a leader-elected controller makes, since they all carry a fence.
var fenceMatchCondition = regexp.MustCompile(`^request\.userInfo\.username == '[^'\\]*' \|\| \(has\(object\.status\) && has\(object\.status\.fence\)\)$`)

// fencedWrite is one kind of write the fence must cover: the controller's status updates (a
// patch is an UPDATE to admission) of cluster-scoped objects.
type fencedWrite struct{ group, version, resource, subresource string }

var fencedWrites = []fencedWrite{
	{ipwardenv1.SchemeGroupVersion.Group, ipwardenv1.SchemeGroupVersion.Version, "nodeipallocations", "status"},
	{ipwardenv1.SchemeGroupVersion.Group, ipwardenv1.SchemeGroupVersion.Version, "ippools", "status"},
}

func (w fencedWrite) String() string {
	return fmt.Sprintf("UPDATE %s/%s (%s/%s)", w.resource, w.subresource, w.group, w.version)
}

// JudgeFence says whether the policy and binding (nil when missing) deny a status write of a
// controller that does not hold the Lease leaseNS/leaseName (a stale leader), and if not, why.
// Namespace selectors are not looked at: the written objects are cluster-scoped, and the API
// server never exempts those by namespace.
func JudgeFence(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding, leaseNS, leaseName string) FenceVerdict {
	lease := leaseNS + "/" + leaseName
	install := "install deploy/kustomize/fence-policy.yaml (or the Helm chart's) as shipped"
	if p == nil {
		return verdict(FencePolicyMissing, "the fence policy (ValidatingAdmissionPolicy %s) is missing: %s, so the API server "+
			"refuses a stale leader's writes; or run one replica with --leader-elect=false", FencePolicyName, install)
	}
	if b == nil {
		return verdict(FenceBindingMissing, "the fence policy %s has no ValidatingAdmissionPolicyBinding %s: %s", FencePolicyName, FencePolicyName, install)
	}
	s, bs := p.Spec, b.Spec
	if bs.PolicyName != FencePolicyName {
		return verdict(FenceBindingMissing, "the ValidatingAdmissionPolicyBinding %s binds policy %q, not %s: %s", b.Name, bs.PolicyName, FencePolicyName, install)
	}
	if !slices.Contains(bs.ValidationActions, admissionv1.Deny) {
		return verdict(FenceNotDenying, "the binding %s's validationActions are %v: without Deny a stale leader's write is only warned of or audited, "+
			"and lands; set validationActions: [Deny]", b.Name, bs.ValidationActions)
	}
	if pr := bs.ParamRef; pr == nil || pr.Namespace != leaseNS || pr.Name != leaseName || pr.Selector != nil {
		return verdict(FenceWrongLease, "the binding %s does not read this controller's Lease %s (its paramRef: %s): set --leader-election-namespace "+
			"and --leader-election-id to the Lease the binding's paramRef names, or edit the binding", b.Name, lease, describeParamRef(pr))
	} else if pr.ParameterNotFoundAction == nil || *pr.ParameterNotFoundAction != admissionv1.DenyAction {
		return verdict(FenceWrongLease, "the binding %s's paramRef.parameterNotFoundAction is not Deny: while the Lease %s is missing, "+
			"every write would land; set it to Deny", b.Name, lease)
	}
	if fp := s.FailurePolicy; fp != nil && *fp != admissionv1.Fail {
		return verdict(FenceFailsOpen, "the fence policy's failurePolicy is %s: a check that fails (the Lease unreadable, an expression error) "+
			"would let a stale leader's write land; set failurePolicy: Fail", *fp)
	}
	if pk := s.ParamKind; pk == nil || pk.APIVersion != "coordination.k8s.io/v1" || pk.Kind != "Lease" {
		return verdict(FenceCheckChanged, "the fence policy's paramKind is %s, not coordination.k8s.io/v1 Lease: %s", describeParamKind(pk), install)
	}
	for _, want := range []admissionv1.Variable{{Name: "holder", Expression: FenceHolderVariable}, {Name: "epoch", Expression: FenceEpochVariable}} {
		i := slices.IndexFunc(s.Variables, func(v admissionv1.Variable) bool { return v.Name == want.Name })
		if i < 0 || oneLine(s.Variables[i].Expression) != want.Expression {
			return verdict(FenceCheckChanged, "the fence policy's variable %q is missing or not %q: %s", want.Name, want.Expression, install)
		}
	}
	if !slices.ContainsFunc(s.Validations, func(v admissionv1.Validation) bool { return oneLine(v.Expression) == FenceValidation }) {
		return verdict(FenceCheckChanged, "the fence policy has no validation %q (the holder and epoch check): %s", FenceValidation, install)
	}
	for _, c := range s.MatchConditions {
		if !fenceMatchCondition.MatchString(oneLine(c.Expression)) {
			return verdict(FenceNarrowed, "the fence policy's matchCondition %q is not ipwarden's and could exempt a stale leader's write: %s", c.Name, install)
		}
	}
	if s.MatchConstraints == nil {
		return verdict(FenceNarrowed, "the fence policy has no matchConstraints: %s", install)
	}
	if why := skips(*s.MatchConstraints); why != "" {
		return verdict(FenceNarrowed, "the fence policy's matchConstraints %s: %s", why, install)
	}
	if bs.MatchResources != nil {
		if why := skips(*bs.MatchResources); why != "" {
			return verdict(FenceNarrowed, "the binding %s's matchResources %s: remove them or cover every controller status write", b.Name, why)
		}
	}
	return FenceVerdict{}
}

// skips says which of the controller's status writes m does not select ("" if it selects all):
// an object selector may skip some objects, an exclude rule that matches a write skips it (for
// some or all names), and resource rules (when present) must match each write for every name.
func skips(m admissionv1.MatchResources) string {
	if sel := m.ObjectSelector; sel != nil && (len(sel.MatchLabels) > 0 || len(sel.MatchExpressions) > 0) {
		return "have an objectSelector: objects without those labels are not fenced"
	}
	for _, w := range fencedWrites {
		for _, r := range m.ExcludeResourceRules {
			if ruleMatches(r.RuleWithOperations, w) {
				return "exclude " + w.String()
			}
		}
		if len(m.ResourceRules) == 0 {
			continue // the API server selects every resource then
		}
		if !slices.ContainsFunc(m.ResourceRules, func(r admissionv1.NamedRuleWithOperations) bool {
			return len(r.ResourceNames) == 0 && ruleMatches(r.RuleWithOperations, w)
		}) {
			return "do not select " + w.String() + " for every object"
		}
	}
	return ""
}

// ruleMatches is the API server's rule matching for one write of a cluster-scoped object:
// "*" is every resource but no subresource, "x/*" every subresource of x, "*/*" everything.
func ruleMatches(r admissionv1.RuleWithOperations, w fencedWrite) bool {
	has := func(list []string, v string) bool { return slices.Contains(list, "*") || slices.Contains(list, v) }
	if !slices.Contains(r.Operations, admissionv1.OperationAll) && !slices.Contains(r.Operations, admissionv1.Update) {
		return false
	}
	if !has(r.APIGroups, w.group) || !has(r.APIVersions, w.version) {
		return false
	}
	if r.Scope != nil && *r.Scope != admissionv1.AllScopes && *r.Scope != admissionv1.ClusterScope {
		return false
	}
	return slices.ContainsFunc(r.Resources, func(res string) bool {
		name, sub, _ := strings.Cut(res, "/")
		return (name == "*" || name == w.resource) && (sub == "*" || sub == w.subresource)
	})
}

func oneLine(expr string) string { return strings.Join(strings.Fields(expr), " ") }

func describeParamRef(pr *admissionv1.ParamRef) string {
	switch {
	case pr == nil:
		return "none"
	case pr.Selector != nil:
		return "a selector"
	}
	return fmt.Sprintf("Lease %s/%s", pr.Namespace, pr.Name)
}

func describeParamKind(pk *admissionv1.ParamKind) string {
	if pk == nil {
		return "missing"
	}
	return pk.APIVersion + " " + pk.Kind
}

// ReadFence reads the fence policy and its binding, both named FencePolicyName as in deploy/
// (RBAC: get on exactly these two objects, admissionregistration.k8s.io); nil for one that does
// not exist.
func ReadFence(ctx context.Context, r client.Reader) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding, error) {
	p := &admissionv1.ValidatingAdmissionPolicy{}
	switch err := r.Get(ctx, client.ObjectKey{Name: FencePolicyName}, p); {
	case apierrors.IsNotFound(err):
		p = nil
	case err != nil:
		return nil, nil, fmt.Errorf("read ValidatingAdmissionPolicy %s: %w", FencePolicyName, err)
	}
	b := &admissionv1.ValidatingAdmissionPolicyBinding{}
	switch err := r.Get(ctx, client.ObjectKey{Name: FencePolicyName}, b); {
	case apierrors.IsNotFound(err):
		b = nil
	case err != nil:
		return nil, nil, fmt.Errorf("read ValidatingAdmissionPolicyBinding %s: %w", FencePolicyName, err)
	}
	return p, b, nil
}

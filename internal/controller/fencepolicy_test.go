package controller

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os"
	"strings"
	"testing"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
)

// shippedFence is the policy and binding of deploy/kustomize/fence-policy.yaml.
func shippedFence(t *testing.T) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
	t.Helper()
	b, err := os.ReadFile("../../deploy/kustomize/fence-policy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var p *admissionv1.ValidatingAdmissionPolicy
	var bind *admissionv1.ValidatingAdmissionPolicyBinding
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096)
	for {
		var raw json.RawMessage
		if err := dec.Decode(&raw); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		var meta metav1.TypeMeta
		if err := json.Unmarshal(raw, &meta); err != nil {
			t.Fatal(err)
		}
		switch meta.Kind {
		case "ValidatingAdmissionPolicy":
			p = &admissionv1.ValidatingAdmissionPolicy{}
			err = json.Unmarshal(raw, p)
		case "ValidatingAdmissionPolicyBinding":
			bind = &admissionv1.ValidatingAdmissionPolicyBinding{}
			err = json.Unmarshal(raw, bind)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if p == nil || bind == nil {
		t.Fatal("fence-policy.yaml lacks the policy or the binding")
	}
	return p, bind
}

func TestJudgeFence(t *testing.T) {
	const ns, lease = "ipwarden-system", "ipwarden-controller"
	ignore, fail := admissionv1.Ignore, admissionv1.Fail
	allow := admissionv1.AllowAction
	namespaced, cluster := admissionv1.NamespacedScope, admissionv1.ClusterScope
	rule := func(resources ...string) admissionv1.NamedRuleWithOperations {
		return admissionv1.NamedRuleWithOperations{RuleWithOperations: admissionv1.RuleWithOperations{
			Operations: []admissionv1.OperationType{admissionv1.Update},
			Rule:       admissionv1.Rule{APIGroups: []string{"ipwarden.io"}, APIVersions: []string{"*"}, Resources: resources}}}
	}
	for _, tc := range []struct {
		name      string
		edit      func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding)
		want      FenceProblem
		wantInMsg string
	}{
		{"as shipped", nil, FenceValid, ""},
		{"Helm's service account name and other white space", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.MatchConditions[0].Expression = "request.userInfo.username == 'system:serviceaccount:kube-ipam:ipwarden-controller'\n   ||  (has(object.status) && has(object.status.fence))"
			p.Spec.Validations[1].Expression = "  " + strings.ReplaceAll(FenceValidation, " ", "\n ") + "\n"
			return p, b
		}, FenceValid, ""},
		{"failurePolicy unset (the API server defaults it to Fail)", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.FailurePolicy = nil
			return p, b
		}, FenceValid, ""},
		{"Deny and Audit", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			b.Spec.ValidationActions = []admissionv1.ValidationAction{admissionv1.Deny, admissionv1.Audit}
			return p, b
		}, FenceValid, ""},
		{"more validations, no matchConditions, rules as wildcards", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.Validations = append(p.Spec.Validations, admissionv1.Validation{Expression: "true"})
			p.Spec.MatchConditions = nil
			r := rule("*/*")
			r.Operations = []admissionv1.OperationType{admissionv1.OperationAll}
			r.Scope = &cluster
			p.Spec.MatchConstraints.ResourceRules = []admissionv1.NamedRuleWithOperations{r}
			return p, b
		}, FenceValid, ""},
		{"binding matchResources that cover every write", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			b.Spec.MatchResources = &admissionv1.MatchResources{
				ResourceRules:        []admissionv1.NamedRuleWithOperations{rule("nodeipallocations/*", "ippools/status")},
				ExcludeResourceRules: []admissionv1.NamedRuleWithOperations{rule("ippools")},
				NamespaceSelector:    &metav1.LabelSelector{MatchLabels: map[string]string{"a": "b"}}, // cluster-scoped objects: ignored
				ObjectSelector:       &metav1.LabelSelector{},
			}
			return p, b
		}, FenceValid, ""},

		{"policy deleted", func(_ *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			return nil, b
		}, FencePolicyMissing, "is missing"},
		{"binding deleted", func(p *admissionv1.ValidatingAdmissionPolicy, _ *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			return p, nil
		}, FenceBindingMissing, "has no ValidatingAdmissionPolicyBinding"},
		{"binding of another policy", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			b.Spec.PolicyName = "something-else"
			return p, b
		}, FenceBindingMissing, `binds policy "something-else"`},
		{"Warn only", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			b.Spec.ValidationActions = []admissionv1.ValidationAction{admissionv1.Warn}
			return p, b
		}, FenceNotDenying, "[Warn]"},
		{"Audit only", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			b.Spec.ValidationActions = []admissionv1.ValidationAction{admissionv1.Audit}
			return p, b
		}, FenceNotDenying, "[Audit]"},
		{"Warn and Audit", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			b.Spec.ValidationActions = []admissionv1.ValidationAction{admissionv1.Warn, admissionv1.Audit}
			return p, b
		}, FenceNotDenying, "without Deny"},
		{"failurePolicy Ignore", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.FailurePolicy = &ignore
			return p, b
		}, FenceFailsOpen, "failurePolicy is Ignore"},
		{"binding reads another Lease", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			b.Spec.ParamRef.Namespace = "kube-system"
			return p, b
		}, FenceWrongLease, "Lease kube-system/ipwarden-controller"},
		{"binding without a paramRef", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			b.Spec.ParamRef = nil
			return p, b
		}, FenceWrongLease, "its paramRef: none"},
		{"paramRef by selector", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			b.Spec.ParamRef = &admissionv1.ParamRef{Namespace: ns, Selector: &metav1.LabelSelector{}}
			return p, b
		}, FenceWrongLease, "a selector"},
		{"parameterNotFoundAction Allow", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			b.Spec.ParamRef.ParameterNotFoundAction = &allow
			return p, b
		}, FenceWrongLease, "parameterNotFoundAction is not Deny"},
		{"holder and epoch validation removed", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.Validations = p.Spec.Validations[:1]
			return p, b
		}, FenceCheckChanged, "has no validation"},
		{"validation edited to pass", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.Validations[1].Expression = FenceValidation + " || true"
			return p, b
		}, FenceCheckChanged, "has no validation"},
		{"no validations", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.Validations = nil
			return p, b
		}, FenceCheckChanged, "has no validation"},
		{"holder variable redefined", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.Variables[0].Expression = "object.status.fence.holder"
			return p, b
		}, FenceCheckChanged, `variable "holder"`},
		{"epoch variable missing", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.Variables = p.Spec.Variables[:1]
			return p, b
		}, FenceCheckChanged, `variable "epoch"`},
		{"paramKind not a Lease", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.ParamKind = &admissionv1.ParamKind{APIVersion: "v1", Kind: "ConfigMap"}
			return p, b
		}, FenceCheckChanged, "v1 ConfigMap"},
		{"matchCondition that exempts everyone", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.MatchConditions[0].Expression = "false"
			return p, b
		}, FenceNarrowed, `matchCondition "controller-or-fenced"`},
		{"matchCondition that looks like ipwarden's but is a ternary", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.MatchConditions[0].Expression = "true ? false : request.userInfo.username == 'x' || (has(object.status) && has(object.status.fence))"
			return p, b
		}, FenceNarrowed, "matchCondition"},
		{"matchCondition with an escaped quote", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.MatchConditions[0].Expression = `request.userInfo.username == 'a\' || false ? false : \'' || (has(object.status) && has(object.status.fence))`
			return p, b
		}, FenceNarrowed, "matchCondition"},
		{"a second matchCondition", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.MatchConditions = append(p.Spec.MatchConditions, admissionv1.MatchCondition{Name: "only-a", Expression: "object.metadata.name == 'a'"})
			return p, b
		}, FenceNarrowed, `matchCondition "only-a"`},
		{"policy covers nodeipallocations only", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.MatchConstraints.ResourceRules = []admissionv1.NamedRuleWithOperations{rule("nodeipallocations/status")}
			return p, b
		}, FenceNarrowed, "do not select UPDATE ippools/status"},
		{"policy's wildcard without subresources", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.MatchConstraints.ResourceRules = []admissionv1.NamedRuleWithOperations{rule("*")}
			return p, b
		}, FenceNarrowed, "do not select UPDATE nodeipallocations/status"},
		{"policy on CREATE only", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.MatchConstraints.ResourceRules[0].Operations = []admissionv1.OperationType{admissionv1.Create}
			return p, b
		}, FenceNarrowed, "do not select"},
		{"policy on another group", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.MatchConstraints.ResourceRules[0].APIGroups = []string{"example.com"}
			return p, b
		}, FenceNarrowed, "do not select"},
		{"policy on another version", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.MatchConstraints.ResourceRules[0].APIVersions = []string{"v1"}
			return p, b
		}, FenceNarrowed, "do not select"},
		{"policy on namespaced objects only", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.MatchConstraints.ResourceRules[0].Scope = &namespaced
			return p, b
		}, FenceNarrowed, "do not select"},
		{"policy on some names", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.MatchConstraints.ResourceRules[0].ResourceNames = []string{"node-a"}
			return p, b
		}, FenceNarrowed, "for every object"},
		{"policy excludes ippools' status", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.MatchConstraints.ExcludeResourceRules = []admissionv1.NamedRuleWithOperations{rule("ippools/*")}
			return p, b
		}, FenceNarrowed, "exclude UPDATE ippools/status"},
		{"policy with an objectSelector", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.MatchConstraints.ObjectSelector = &metav1.LabelSelector{MatchLabels: map[string]string{"fenced": "yes"}}
			return p, b
		}, FenceNarrowed, "objectSelector"},
		{"policy without matchConstraints", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.MatchConstraints = nil
			return p, b
		}, FenceNarrowed, "no matchConstraints"},
		{"binding excludes one node by name", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			r := rule("nodeipallocations/status")
			r.ResourceNames = []string{"node-a"}
			b.Spec.MatchResources = &admissionv1.MatchResources{ExcludeResourceRules: []admissionv1.NamedRuleWithOperations{r}}
			return p, b
		}, FenceNarrowed, "binding ipwarden-controller-fence's matchResources exclude UPDATE nodeipallocations/status"},
		{"binding selects pools only", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			b.Spec.MatchResources = &admissionv1.MatchResources{ResourceRules: []admissionv1.NamedRuleWithOperations{rule("ippools/status")}}
			return p, b
		}, FenceNarrowed, "do not select UPDATE nodeipallocations/status"},
		{"binding with an objectSelector", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			b.Spec.MatchResources = &admissionv1.MatchResources{ObjectSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "x", Operator: metav1.LabelSelectorOpDoesNotExist}}}}
			return p, b
		}, FenceNarrowed, "objectSelector"},
		{"failurePolicy Fail but Warn-only binding", func(p *admissionv1.ValidatingAdmissionPolicy, b *admissionv1.ValidatingAdmissionPolicyBinding) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
			p.Spec.FailurePolicy = &fail
			b.Spec.ValidationActions = []admissionv1.ValidationAction{admissionv1.Warn}
			return p, b
		}, FenceNotDenying, "Warn"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, b := shippedFence(t)
			if tc.edit != nil {
				p, b = tc.edit(p, b)
			}
			v := JudgeFence(p, b, ns, lease)
			if v.Problem != tc.want {
				t.Fatalf("JudgeFence = %q (%s), want %q", v.Problem, v.Detail, tc.want)
			}
			if v.OK() != (tc.want == FenceValid) || (v.OK() && v.Detail != "") {
				t.Errorf("OK() = %v with detail %q", v.OK(), v.Detail)
			}
			if !strings.Contains(v.Detail, tc.wantInMsg) {
				t.Errorf("detail %q does not say %q", v.Detail, tc.wantInMsg)
			}
		})
	}
}

// The controller's other Lease: the shipped binding fences ipwarden-system/ipwarden-controller only.
func TestJudgeFenceOtherLease(t *testing.T) {
	p, b := shippedFence(t)
	if v := JudgeFence(p, b, "ipwarden-system", "ipwarden-elsewhere"); v.Problem != FenceWrongLease || !strings.Contains(v.Detail, "Lease ipwarden-system/ipwarden-controller") {
		t.Fatalf("JudgeFence for another Lease = %+v", v)
	}
}

func TestDecideFence(t *testing.T) {
	for _, tc := range []struct {
		problem FenceProblem
		leading bool
		want    FenceStep
	}{
		{FenceValid, false, FenceTake},
		{FenceValid, true, FenceTake},
		{FencePolicyMissing, false, FenceWait},
		{FencePolicyMissing, true, FenceStepDown},
		{FenceBindingMissing, true, FenceStepDown},
		{FenceNotDenying, false, FenceWait},
		{FenceNotDenying, true, FenceStepDown},
		{FenceFailsOpen, true, FenceStepDown},
		{FenceWrongLease, true, FenceStepDown},
		{FenceCheckChanged, true, FenceStepDown},
		{FenceNarrowed, true, FenceStepDown},
		{FenceUnreadable, false, FenceWait},
		{FenceUnreadable, true, FenceWait}, // no evidence: the lease runs out by itself if reads keep failing
	} {
		v := FenceVerdict{Problem: tc.problem}
		if tc.problem != FenceValid {
			v.Detail = "why"
		}
		if got := DecideFence(v, tc.leading); got != tc.want {
			t.Errorf("DecideFence(%q, leading=%v) = %v, want %v", tc.problem, tc.leading, got, tc.want)
		}
	}
}

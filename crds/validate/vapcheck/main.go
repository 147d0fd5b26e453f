// Evaluate a ValidatingAdmissionPolicy the way kube-apiserver does (the same compiler,
// composition of variables, match conditions, cost budget and authorizer library), for
// DilocoRun requests described in a JSON file, with a table of authorization grants standing in
// for RBAC. Every expression is also compiled in the CEL environment of Kubernetes 1.30, the
// oldest the chart supports.
//
//	vapcheck POLICY.yaml CASES.json
//
// CASES.json: [{"name", "operation", "namespace", "user", "object", "oldObject",
// "grants": [{"verb", "group", "resource", "subresource", "namespace", "name"}]}]
// Output: "COMPILED 1.30" (or "COMPILE ERROR ..." lines and exit 1), then per case
// "ADMIT name", or "DENY name :: message | message".
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/version"
	"k8s.io/apiserver/pkg/admission"
	plugincel "k8s.io/apiserver/pkg/admission/plugin/cel"
	"k8s.io/apiserver/pkg/admission/plugin/policy/validating"
	"k8s.io/apiserver/pkg/admission/plugin/webhook/matchconditions"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/apiserver/pkg/authorization/authorizer"
	"k8s.io/apiserver/pkg/cel/environment"
	"sigs.k8s.io/yaml"
)

type grant struct {
	Verb        string `json:"verb"`
	Group       string `json:"group"`
	Resource    string `json:"resource"`
	Subresource string `json:"subresource"`
	Namespace   string `json:"namespace"`
	Name        string `json:"name"`
}

type request struct {
	Name      string                 `json:"name"`
	Operation string                 `json:"operation"`
	Namespace string                 `json:"namespace"`
	User      string                 `json:"user"`
	Object    map[string]interface{} `json:"object"`
	OldObject map[string]interface{} `json:"oldObject"`
	Grants    []grant                `json:"grants"`
}

// grants allows exactly what its table lists; an empty name or namespace matches any.
type grants []grant

func (g grants) Authorize(_ context.Context, a authorizer.Attributes) (authorizer.Decision, string, error) {
	for _, x := range g {
		if x.Verb == a.GetVerb() && x.Group == a.GetAPIGroup() && x.Resource == a.GetResource() &&
			x.Subresource == a.GetSubresource() &&
			(x.Namespace == "" || x.Namespace == a.GetNamespace()) &&
			(x.Name == "" || x.Name == a.GetName()) {
			return authorizer.DecisionAllow, "granted", nil
		}
	}
	return authorizer.DecisionNoOpinion, "not granted", nil
}

func main() {
	raw, err := os.ReadFile(os.Args[1])
	must(err)
	var policy admissionregistrationv1.ValidatingAdmissionPolicy
	must(yaml.UnmarshalStrict(raw, &policy))
	raw, err = os.ReadFile(os.Args[2])
	must(err)
	var cases []request
	must(json.Unmarshal(raw, &cases))

	if errs := compileAt(&policy, version.MajorMinor(1, 30)); len(errs) > 0 {
		for _, e := range errs {
			fmt.Println("COMPILE ERROR", e)
		}
		os.Exit(1)
	}
	fmt.Println("COMPILED 1.30")
	validator := compile(&policy, environment.MustBaseEnvSet(environment.DefaultCompatibilityVersion()), environment.StoredExpressions)
	gvk := schema.GroupVersionKind{Group: "diloco.dev", Version: "v1alpha1", Kind: "DilocoRun"}
	gvr := schema.GroupVersionResource{Group: "diloco.dev", Version: "v1alpha1", Resource: "dilocoruns"}
	for _, c := range cases {
		obj := &unstructured.Unstructured{Object: c.Object}
		var old runtime.Object
		if c.OldObject != nil {
			old = &unstructured.Unstructured{Object: c.OldObject}
		}
		attrs := admission.NewAttributesRecord(obj, old, gvk, c.Namespace, obj.GetName(), gvr, "",
			admission.Operation(c.Operation), nil, false, &user.DefaultInfo{Name: c.User})
		versioned := &admission.VersionedAttributes{Attributes: attrs, VersionedKind: gvk,
			VersionedObject: admission.NewLazyObject(obj), VersionedOldObject: admission.NewLazyObject(old)}
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: c.Namespace}}
		result := validator.Validate(context.TODO(), gvr, versioned, nil, ns, celconfig.RuntimeCELCostBudget, grants(c.Grants))
		denied := []string{}
		for _, d := range result.Decisions {
			switch d.Action {
			case validating.ActionDeny:
				denied = append(denied, d.Message)
			case validating.ActionAdmit:
			default:
				denied = append(denied, fmt.Sprintf("%s: %s", d.Action, d.Message))
			}
		}
		if len(denied) == 0 {
			fmt.Printf("ADMIT %s\n", c.Name)
		} else {
			fmt.Printf("DENY %s :: %s\n", c.Name, strings.Join(denied, " | "))
		}
	}
}

// compile builds the policy's validator as kube-apiserver's ValidatingAdmissionPolicy plugin
// does (variables composed in, match conditions, message expressions without the authorizer).
func compile(p *admissionregistrationv1.ValidatingAdmissionPolicy, env *environment.EnvSet, mode environment.Type) validating.Validator {
	withAuthz := plugincel.OptionalVariableDeclarations{HasAuthorizer: true}
	compiler, err := plugincel.NewCompositedCompiler(env)
	must(err)
	compiler.CompileAndStoreVariables(variables(p), withAuthz, mode)
	var matcher matchconditions.Matcher
	if len(p.Spec.MatchConditions) > 0 {
		conds := make([]plugincel.ExpressionAccessor, len(p.Spec.MatchConditions))
		for i := range p.Spec.MatchConditions {
			conds[i] = (*matchconditions.MatchCondition)(&p.Spec.MatchConditions[i])
		}
		matcher = matchconditions.NewMatcher(compiler.CompileCondition(conds, withAuthz, mode), p.Spec.FailurePolicy, "policy", "validate", p.Name)
	}
	validations, messages := conditions(p)
	return validating.NewValidator(
		compiler.CompileCondition(validations, withAuthz, mode),
		matcher,
		compiler.CompileCondition(nil, withAuthz, mode),
		compiler.CompileCondition(messages, plugincel.OptionalVariableDeclarations{}, mode),
		p.Spec.FailurePolicy,
		nil,
	)
}

func variables(p *admissionregistrationv1.ValidatingAdmissionPolicy) []plugincel.NamedExpressionAccessor {
	out := make([]plugincel.NamedExpressionAccessor, len(p.Spec.Variables))
	for i, v := range p.Spec.Variables {
		out[i] = &validating.Variable{Name: v.Name, Expression: v.Expression}
	}
	return out
}

func conditions(p *admissionregistrationv1.ValidatingAdmissionPolicy) ([]plugincel.ExpressionAccessor, []plugincel.ExpressionAccessor) {
	validations := make([]plugincel.ExpressionAccessor, len(p.Spec.Validations))
	messages := make([]plugincel.ExpressionAccessor, len(p.Spec.Validations))
	for i, v := range p.Spec.Validations {
		validations[i] = &validating.ValidationCondition{Expression: v.Expression, Message: v.Message, Reason: v.Reason}
		if v.MessageExpression != "" {
			messages[i] = &validating.MessageExpressionCondition{MessageExpression: v.MessageExpression}
		}
	}
	return validations, messages
}

// compileAt compiles every expression as a new expression of the given Kubernetes version's
// CEL environment, which is what that API server accepts when the policy is created.
func compileAt(p *admissionregistrationv1.ValidatingAdmissionPolicy, v *version.Version) []string {
	withAuthz := plugincel.OptionalVariableDeclarations{HasAuthorizer: true}
	compiler, err := plugincel.NewCompositedCompiler(environment.MustBaseEnvSet(v))
	must(err)
	errs := []string{}
	for _, variable := range variables(p) {
		if r := compiler.CompileAndStoreVariable(variable, withAuthz, environment.NewExpressions); r.Error != nil {
			errs = append(errs, fmt.Sprintf("variables.%s: %v", variable.GetName(), r.Error))
		}
	}
	validations, messages := conditions(p)
	for i, e := range validations {
		if r := compiler.CompileCELExpression(e, withAuthz, environment.NewExpressions); r.Error != nil {
			errs = append(errs, fmt.Sprintf("validations[%d]: %v", i, r.Error))
		}
		if messages[i] != nil {
			if r := compiler.CompileCELExpression(messages[i], plugincel.OptionalVariableDeclarations{}, environment.NewExpressions); r.Error != nil {
				errs = append(errs, fmt.Sprintf("validations[%d].messageExpression: %v", i, r.Error))
			}
		}
	}
	for i := range p.Spec.MatchConditions {
		if r := compiler.CompileCELExpression((*matchconditions.MatchCondition)(&p.Spec.MatchConditions[i]), withAuthz, environment.NewExpressions); r.Error != nil {
			errs = append(errs, fmt.Sprintf("matchConditions[%d]: %v", i, r.Error))
		}
	}
	return errs
}

func must(err error) {
	if err != nil {
		panic(err)
	}
}

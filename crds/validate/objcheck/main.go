// Validate built Kubernetes objects with kube-apiserver's own create validation (decode to the
// internal version with defaults, the Job strategy's generated selector, then Validate*Create).
package main

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"

	apimachineryvalidation "k8s.io/apimachinery/pkg/api/validation"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation/field"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/kubernetes/pkg/api/legacyscheme"
	"k8s.io/kubernetes/pkg/api/pod"
	"k8s.io/kubernetes/pkg/apis/apps"
	_ "k8s.io/kubernetes/pkg/apis/apps/install"
	appsvalidation "k8s.io/kubernetes/pkg/apis/apps/validation"
	"k8s.io/kubernetes/pkg/apis/batch"
	_ "k8s.io/kubernetes/pkg/apis/batch/install"
	batchvalidation "k8s.io/kubernetes/pkg/apis/batch/validation"
	"k8s.io/kubernetes/pkg/apis/core"
	_ "k8s.io/kubernetes/pkg/apis/core/install"
	corevalidation "k8s.io/kubernetes/pkg/apis/core/validation"
	"k8s.io/kubernetes/pkg/apis/networking"
	_ "k8s.io/kubernetes/pkg/apis/networking/install"
	networkingvalidation "k8s.io/kubernetes/pkg/apis/networking/validation"
	"k8s.io/kubernetes/pkg/apis/policy"
	_ "k8s.io/kubernetes/pkg/apis/policy/install"
	policyvalidation "k8s.io/kubernetes/pkg/apis/policy/validation"
)

func main() {
	reader := utilyaml.NewYAMLReader(bufio.NewReader(os.Stdin))
	decoder := legacyscheme.Codecs.UniversalDecoder()
	bad := 0
	for {
		doc, err := reader.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			panic(err)
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		js, err := utilyaml.ToJSON(doc)
		if err != nil {
			panic(err)
		}
		obj, gvk, err := decoder.Decode(js, nil, nil)
		if err != nil {
			fmt.Printf("DECODE-ERROR %v\n", err)
			bad++
			continue
		}
		var errs field.ErrorList
		var name string
		switch o := obj.(type) {
		case *batch.Job:
			name = o.Name
			// What the Job strategy does on create before validating: a generated selector.
			uid := types.UID("00000000-0000-0000-0000-000000000001")
			o.UID = uid
			sel := map[string]string{batch.LegacyControllerUidLabel: string(uid)}
			o.Spec.Selector = &metav1.LabelSelector{MatchLabels: sel}
			for k, v := range sel {
				o.Spec.Template.Labels[k] = v
			}
			o.Spec.Template.Labels[batch.JobNameLabel] = o.Name
			o.Spec.Template.Labels[batch.LegacyControllerUidLabel] = string(uid)
			o.Spec.Template.Labels[batch.ControllerUidLabel] = string(uid)
			o.Spec.Template.Labels[batch.LegacyJobNameLabel] = o.Name
			// The Job strategy's options: the pod template's, from the feature gates'
			// defaults of this version (container restart rules are allowed only with theirs).
			opts := batchvalidation.JobValidationOptions{
				PodValidationOptions:  pod.GetValidationOptionsFromPodTemplate(&o.Spec.Template, nil),
				RequirePrefixedLabels: true,
			}
			errs = batchvalidation.ValidateJobCreate(o, opts)
		case *apps.Deployment:
			name = o.Name
			errs = appsvalidation.ValidateDeployment(o, pod.GetValidationOptionsFromPodTemplate(&o.Spec.Template, nil))
		case *core.Service:
			name = o.Name
			// The service registry fills clusterIPs (and the IP family policy) before validating.
			if o.Spec.ClusterIP != "" && len(o.Spec.ClusterIPs) == 0 {
				o.Spec.ClusterIPs = []string{o.Spec.ClusterIP}
			}
			if o.Spec.ClusterIP == "" {
				o.Spec.ClusterIP = "10.0.0.10"
				o.Spec.ClusterIPs = []string{"10.0.0.10"}
			}
			single := core.IPFamilyPolicySingleStack
			o.Spec.IPFamilyPolicy = &single
			o.Spec.IPFamilies = []core.IPFamily{core.IPv4Protocol}
			errs = corevalidation.ValidateServiceCreate(o)
		case *core.Secret:
			name = o.Name
			errs = corevalidation.ValidateSecret(o)
		case *core.ConfigMap:
			name = o.Name
			errs = corevalidation.ValidateConfigMap(o)
		case *core.PersistentVolumeClaim:
			name = o.Name
			errs = corevalidation.ValidatePersistentVolumeClaim(o, corevalidation.PersistentVolumeClaimSpecValidationOptions{})
		case *networking.NetworkPolicy:
			name = o.Name
			errs = networkingvalidation.ValidateNetworkPolicy(o, networkingvalidation.NetworkPolicyValidationOptions{})
		case *policy.PodDisruptionBudget:
			name = o.Name
			// The registry validates the metadata, the strategy the spec.
			errs = apimachineryvalidation.ValidateObjectMeta(&o.ObjectMeta, true, apimachineryvalidation.NameIsDNSSubdomain, field.NewPath("metadata"))
			errs = append(errs, policyvalidation.ValidatePodDisruptionBudget(o, policyvalidation.PodDisruptionBudgetValidationOptions{})...)
		default:
			fmt.Printf("UNKNOWN %v\n", gvk)
			bad++
			continue
		}
		if len(errs) > 0 {
			bad++
			fmt.Printf("INVALID %s/%s :: %v\n", gvk.Kind, name, errs.ToAggregate())
		} else {
			fmt.Printf("VALID %s/%s\n", gvk.Kind, name)
		}
	}
	if bad > 0 {
		os.Exit(1)
	}
}

// Validate a CRD file the way kube-apiserver does on create (structural schema, CEL compile and
// cost), then validate custom resources against it (schema + CEL), printing errors per file.
package main

import (
	"context"
	"fmt"
	"os"
	"strings"

	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/validation"
	structuralschema "k8s.io/apiextensions-apiserver/pkg/apiserver/schema"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/listtype"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/pruning"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel"
	apiservervalidation "k8s.io/apiextensions-apiserver/pkg/apiserver/validation"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/validation/field"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"sigs.k8s.io/yaml"
)

func main() {
	data, err := os.ReadFile(os.Args[1])
	must(err)
	var v1 apiextensionsv1.CustomResourceDefinition
	must(yaml.UnmarshalStrict(data, &v1))
	apiextensionsv1.SetObjectDefaults_CustomResourceDefinition(&v1)
	var crd apiextensions.CustomResourceDefinition
	must(apiextensionsv1.Convert_v1_CustomResourceDefinition_To_apiextensions_CustomResourceDefinition(&v1, &crd, nil))
	errs := validation.ValidateCustomResourceDefinition(context.TODO(), &crd)
	if len(errs) > 0 {
		for _, e := range errs {
			fmt.Println("CRD INVALID:", e.Error())
		}
		os.Exit(1)
	}
	fmt.Println("CRD OK")
	internal := v1Internal(&crd)
	ss, err := structuralschema.NewStructural(internal)
	must(err)
	validator, _, err := apiservervalidation.NewSchemaValidator(internal)
	must(err)
	celValidator := cel.NewValidator(ss, true, celconfig.PerCallLimit)
	for _, path := range os.Args[2:] {
		raw, err := os.ReadFile(path)
		must(err)
		js, err := yaml.YAMLToJSON(raw)
		must(err)
		var u unstructured.Unstructured
		must(u.UnmarshalJSON(js)) // integers as int64, like the API server decodes them
		obj := u.Object
		unknown := pruning.PruneWithOptions(obj, ss, true, structuralschema.UnknownFieldPathOptions{TrackUnknownFieldPaths: true})
		res := apiservervalidation.ValidateCustomResource(field.NewPath(""), obj, validator)
		res = append(res, listtype.ValidateListSetsAndMaps(field.NewPath(""), ss, obj)...)
		for _, u := range unknown {
			res = append(res, field.Invalid(field.NewPath(u), "", "unknown field (strict field validation)"))
		}
		if celValidator != nil {
			celErrs, _ := celValidator.Validate(context.TODO(), nil, ss, obj, nil, celconfig.RuntimeCELCostBudget)
			res = append(res, celErrs...)
		}
		msgs := []string{}
		for _, e := range res {
			msgs = append(msgs, e.Error())
		}
		if len(msgs) == 0 {
			fmt.Printf("ACCEPT %s\n", path)
		} else {
			fmt.Printf("REJECT %s :: %s\n", path, strings.Join(msgs, " | "))
		}
	}
}


func must(err error) {
	if err != nil {
		panic(err)
	}
}

func v1Internal(crd *apiextensions.CustomResourceDefinition) *apiextensions.JSONSchemaProps {
	if crd.Spec.Versions[0].Schema != nil {
		return crd.Spec.Versions[0].Schema.OpenAPIV3Schema
	}
	return crd.Spec.Validation.OpenAPIV3Schema
}

"""Generate the DilocoRun CRD from the pydantic models: `python -m diloco_operator.api.crdgen --out crds/`.

Pydantic emits JSON Schema 2020-12; the API server wants a *structural* OpenAPI v3 schema:
every node typed, no $ref, no anyOf-with-null (nullable instead), int-or-string marked with
x-kubernetes-int-or-string, no additionalProperties=false next to properties (the server prunes
unknown fields and `kubectl apply` strict field validation reports them). Rules pydantic checks in
Python are mirrored as CEL x-kubernetes-validations (crd_rules.py) so the API server rejects the
same manifests. Strings and lists get length bounds so the CEL cost estimate stays within the
server's budget.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from diloco_operator import api
from diloco_operator.api import pod_security
from diloco_operator.api.crd_rules import RULES, root_rules
from diloco_operator.api.release import release

DEFAULT_MAX_LENGTH = 1024
DEFAULT_MAX_ITEMS = 1000
CRD_FILE = "diloco.dev_dilocoruns.yaml"
# The release that made the CRD and a digest of its spec: the operator upgrades an older CRD to
# its own at start (k8s/crd_upgrade.py), and the digest tells it when there is nothing to do.
VERSION_ANNOTATION = f"{api.GROUP}/version"
SCHEMA_ANNOTATION = f"{api.GROUP}/schema-sha256"

# Lists whose items have a unique key: the API server then rejects duplicates itself.
LIST_MAP_KEYS = {"unitGroups": ["name"]}


def _describe_default(node: dict[str, Any], default: Any) -> None:
    if default is None or default == [] or default == {}:
        return
    text = json.dumps(default)
    desc = node.get("description", "").rstrip()
    node["description"] = f"{desc} Default: {text}." if desc else f"Default: {text}."


def structural(node: Any, defs: dict[str, Any], name: str | None = None) -> Any:
    """Turn one pydantic JSON-schema node into a structural OpenAPI v3 node (recursively)."""
    if not isinstance(node, dict):
        return node
    node = copy.deepcopy(node)
    if "$ref" in node:
        ref = node.pop("$ref").rsplit("/", 1)[-1]
        target = structural(defs[ref], defs, ref)
        return {**target, **{k: v for k, v in node.items() if k == "description"}}
    for drop in ("title", "propertyNames"):
        node.pop(drop, None)
    if "patternProperties" in node:
        # A structural schema types map values with additionalProperties only; the keys'
        # pattern is a CEL rule on the map (json_schema_extra of the field).
        (value,) = node.pop("patternProperties").values()
        node["additionalProperties"] = value
    default = node.pop("default", None)
    if "anyOf" in node:
        options = node.pop("anyOf")
        non_null = [o for o in options if o.get("type") != "null"]
        nullable = len(non_null) < len(options)
        types = sorted(o.get("type", "") for o in non_null)
        if types == ["integer", "string"]:
            # Int-or-string: each branch's bounds apply to its own type only (a pattern to
            # strings, a minimum to numbers), so they can sit side by side on the one node.
            merged: dict[str, Any] = {"x-kubernetes-int-or-string": True}
            for option in non_null:
                merged.update({k: v for k, v in option.items() if k not in ("type", "title")})
        elif len(non_null) == 1:
            merged = structural(non_null[0], defs)
        else:
            raise ValueError(f"cannot express anyOf {options} structurally")
        # Absent and null mean the same unless the default is not null ("null disables"): only
        # then keep nulls (nullable); otherwise the server prunes them and has() stays simple.
        if nullable and default is not None:
            merged["nullable"] = True
        # The outer description wins: it is the field's, the inner one the type's.
        node = {**merged, **node}
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in node and not isinstance(node[key], bool):
            node["minimum" if key == "exclusiveMinimum" else "maximum"] = node[key]
            node[key] = True
    if node.get("type") == "object" or "properties" in node:
        node["type"] = "object"
        if node.get("additionalProperties") is True:
            # Passed through as given (a volume source, a sidecar, a securityContext): the
            # server keeps the fields it has no schema for; declared ones are still checked.
            node.pop("additionalProperties")
            node["x-kubernetes-preserve-unknown-fields"] = True
        if "properties" in node:
            node.pop("additionalProperties", None)
            node["properties"] = {k: _property(k, v, defs) for k, v in node["properties"].items()}
        elif isinstance(node.get("additionalProperties"), dict):
            node["additionalProperties"] = structural(node["additionalProperties"], defs)
    if node.get("type") == "array":
        node["items"] = structural(node.get("items", {}), defs)
        node.setdefault("maxItems", DEFAULT_MAX_ITEMS)
    if node.get("type") == "string" and "enum" not in node:
        node.setdefault("maxLength", DEFAULT_MAX_LENGTH)
    if name in RULES:
        # A copy per node: a model used twice (a pod template) must not become a YAML alias.
        node["x-kubernetes-validations"] = copy.deepcopy(RULES[name])
    _describe_default(node, default)
    return node


def _property(key: str, value: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    prop: dict[str, Any] = structural(value, defs)
    if key in LIST_MAP_KEYS:
        prop["x-kubernetes-list-type"] = "map"
        prop["x-kubernetes-list-map-keys"] = LIST_MAP_KEYS[key]
    return prop


def model_schema(model: type[api.Strict], name: str) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    schema: dict[str, Any] = structural(raw, defs, name)
    return schema


def _root_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "A decoupled-DiLoCo training run: learner units (one TPU slice each) "
        "and a syncer that merges what they learn.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": model_schema(api.DilocoRunSpec, "DilocoRunSpec"),
            "status": model_schema(api.DilocoRunStatus, "DilocoRunStatus"),
        },
        "x-kubernetes-validations": root_rules(),
    }


PRINTER_COLUMNS = [
    ("Online", "integer", ".status.unitsOnline", "Units online"),
    ("Replicas", "integer", ".spec.replicas", "Units of the first (scalable) group"),
    ("Step", "integer", ".status.outerStep", "Outer step (sum of fragment versions)"),
    ("Loss", "number", ".status.loss", "Held-out loss of the global model"),
    ("Phase", "string", ".status.phase", "Run phase"),
    ("Age", "date", ".metadata.creationTimestamp", ""),
]


def _printer_columns() -> list[dict[str, Any]]:
    return [
        {
            "name": n,
            "type": t,
            "jsonPath": p,
            **({"description": d} if d else {}),
            # Replicas only in -o wide: for mixed runs it is one group's count.
            **({"priority": 1} if n == "Replicas" else {}),
        }
        for n, t, p, d in PRINTER_COLUMNS
    ]


def crd() -> dict[str, Any]:
    spec = _crd_spec()
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{api.PLURAL}.{api.GROUP}",
            "annotations": {
                VERSION_ANNOTATION: release(),
                SCHEMA_ANNOTATION: schema_digest(spec),
            },
        },
        "spec": spec,
    }


def schema_digest(spec: dict[str, Any]) -> str:
    """A short digest of a CRD spec as we render it (not as the API server stores it: it adds
    defaults, so only our own rendering is ever digested)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _crd_spec() -> dict[str, Any]:
    return {
        "group": api.GROUP,
        "names": {
            "kind": api.KIND,
            "listKind": f"{api.KIND}List",
            "plural": api.PLURAL,
            "singular": api.SINGULAR,
            "shortNames": api.SHORT_NAMES,
            "categories": ["all", "diloco"],
        },
        "scope": "Namespaced",
        "versions": [
            {
                "name": api.VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": _root_schema()},
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                        "labelSelectorPath": ".status.selector",
                    },
                },
                "additionalPrinterColumns": _printer_columns(),
            }
        ],
    }


def render() -> str:
    header = "# Generated by `make crds` (python -m diloco_operator.api.crdgen) from diloco_operator.api; do not edit.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100)


HELPERS_FILE = "_pod_template_refs.tpl"


def render_chart_helpers() -> str:
    """The Helm partial the chart's ValidatingAdmissionPolicy builds on: the CEL listing the
    Secrets a pod template names (pod_security.SECRET_REFERENCES), for a template bound to the
    CEL variable named by the include's argument."""
    root = "{{ . }}"
    return (
        "{{/* Generated by `make crds` (python -m diloco_operator.api.crdgen) from "
        "diloco_operator.api.pod_security; do not edit. */}}\n"
        '{{- define "diloco-operator.templateSecretNames" -}}\n'
        f"{pod_security.secrets_joined_cel(root)}\n"
        "{{- end -}}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", default="crds", help="directory for the CRD YAML")
    parser.add_argument(
        "--chart",
        default="charts/diloco-operator/crds",
        help="also copy it into the Helm chart's crds/ (empty string to skip)",
    )
    parser.add_argument(
        "--chart-templates",
        default="charts/diloco-operator/templates",
        help=f"where to write the chart's {HELPERS_FILE} (empty string to skip)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / CRD_FILE
    target.write_text(render())
    print(f"wrote {target}", file=sys.stderr)
    if args.chart:
        chart = Path(args.chart)
        chart.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target, chart / CRD_FILE)
        print(f"wrote {chart / CRD_FILE}", file=sys.stderr)
    if args.chart_templates:
        helpers = Path(args.chart_templates) / HELPERS_FILE
        helpers.parent.mkdir(parents=True, exist_ok=True)
        helpers.write_text(render_chart_helpers())
        print(f"wrote {helpers}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

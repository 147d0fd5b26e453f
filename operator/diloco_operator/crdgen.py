"""Generate the DilocoRun CRD from the pydantic models: `python -m diloco_operator.crdgen --out crds/`.

Pydantic emits JSON Schema 2020-12; the API server wants a *structural* OpenAPI v3 schema:
every node typed, no $ref, no anyOf-with-null (nullable instead), int-or-string marked with
x-kubernetes-int-or-string, no additionalProperties=false next to properties (the server prunes
unknown fields and `kubectl apply` strict field validation reports them). Rules pydantic checks in
Python are mirrored as CEL x-kubernetes-validations so the API server rejects the same manifests.
Strings and lists get length bounds so the CEL cost estimate stays within the server's budget.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml
from diloco_trainer.config import PER_BYTE, CompressionConfig, TrainingConfig

from diloco_operator import api, pod_template
from diloco_operator.accelerators import ACCELERATOR_LABEL, SPOT_LABEL, TOPOLOGY_LABEL
from diloco_operator.crd_tpu import tpu_rules

DEFAULT_MAX_LENGTH = 1024
DEFAULT_MAX_ITEMS = 1000
CRD_FILE = "diloco.dev_dilocoruns.yaml"


_TOTAL_UNITS = (
    "(has(self.replicas) ? self.replicas : 1) + (has(self.unitGroups) ? "
    "self.unitGroups.map(g, has(g.replicas) ? g.replicas : 0).sum() : 0)"
)


def _default(model: type[api.Strict], field: str) -> str:
    """A field's default as a CEL literal: the CRD states no defaults, so rules spell them."""
    return repr(model.model_fields[field].default)


def _or_default(path: str, model: type[api.Strict], field: str) -> str:
    parent = path.rpartition(".")[0]
    guards = " && ".join(f"has({p})" for p in _prefixes(parent)) + f" && has({path})"
    return f"({guards.removeprefix(' && ')} ? {path} : {_default(model, field)})"


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[: i + 1]) for i in range(1, len(parts))]


_HEARTBEAT = _or_default("self.training.heartbeatSeconds", TrainingConfig, "heartbeat_seconds")
_OFFLINE = _or_default(
    "self.failurePolicy.offlineAfterSeconds", api.FailurePolicy, "offline_after_seconds"
)

# CEL mirrors of the pydantic validators, keyed by model ($defs) name.
RULES: dict[str, list[dict[str, str]]] = {
    "DilocoRunSpec": [
        {
            "rule": f"{_TOTAL_UNITS} <= {api.MAX_UNITS}",
            "message": f"replicas: at most {api.MAX_UNITS} units in a run (spec.replicas plus "
            "unitGroups[].replicas)",
        },
        {
            "rule": "!has(self.chaos) || !has(self.chaos.schedule) || "
            f"self.chaos.schedule.all(e, !has(e.unit) || e.unit < {_TOTAL_UNITS})",
            "message": "chaos.schedule[].unit: no such unit (units are numbered 0..units-1)",
        },
        {
            "rule": f"{_HEARTBEAT} * {float(api.HEARTBEATS_PER_OFFLINE)} <= {_OFFLINE}",
            "message": "training.heartbeatSeconds: not well below "
            f"failurePolicy.offlineAfterSeconds (at most 1/{api.HEARTBEATS_PER_OFFLINE} of it)",
        },
        {
            "rule": "!has(self.unitGroups) || !has(self.unitGroups[0].replicas)",
            "message": "unitGroups[0].replicas: the first group is sized by spec.replicas; remove it",
        },
        {
            "rule": "!has(self.unitGroups) || "
            "self.unitGroups.all(g, g.name == self.unitGroups[0].name || has(g.replicas))",
            "message": "unitGroups[].replicas: required for every group but the first",
        },
        {
            "rule": "!has(self.training) || !has(self.training.quorum) || "
            f"self.training.quorum <= {_TOTAL_UNITS}",
            "message": "training.quorum: exceeds the number of units of the run",
        },
        {
            "rule": "!has(self.chaos) || !has(self.chaos.slowdown) || "
            "self.chaos.slowdown.all(k, has(self.unitGroups) ? "
            "self.unitGroups.exists(g, g.name == k) : k == 'default')",
            "message": "chaos.slowdown: every key must name a unit group of the run",
        },
    ],
    "TpuSpec": tpu_rules(),
    "Toleration": [
        {
            "rule": "!has(self.operator) || self.operator != 'Exists' || !has(self.value) || "
            "self.value == ''",
            "message": "value: must be empty when operator is Exists",
            "fieldPath": ".value",
        },
        {
            "rule": "(has(self.key) && self.key != '') || "
            "(has(self.operator) && self.operator == 'Exists')",
            "message": "operator: must be Exists when key is empty",
        },
        {
            "rule": "!has(self.tolerationSeconds) || (has(self.effect) && "
            "self.effect == 'NoExecute')",
            "message": "effect: must be NoExecute when tolerationSeconds is set",
        },
    ],
    "FailurePolicy": [
        {
            "rule": _or_default(
                "self.restartBackoffSeconds", api.FailurePolicy, "restart_backoff_seconds"
            )
            + " <= "
            + _or_default(
                "self.maxRestartBackoffSeconds", api.FailurePolicy, "max_restart_backoff_seconds"
            ),
            "message": "restartBackoffSeconds: above its cap maxRestartBackoffSeconds",
            "fieldPath": ".restartBackoffSeconds",
        }
    ],
    "CompressionConfig": [
        {
            "rule": f"!((has(self.scheme) && self.scheme == '{scheme}') || (has(self.downlink) && "
            f"self.downlink == '{scheme}')) || "
            f"{_or_default('self.blockSize', CompressionConfig, 'block_size')} % {per_byte} == 0",
            "message": f"blockSize: must be a multiple of {per_byte} with {scheme} "
            f"({per_byte} values per byte)",
            "fieldPath": ".blockSize",
        }
        for scheme, per_byte in PER_BYTE.items()
        if per_byte > 1
    ],
    "TrainingConfig": [
        {
            "rule": "has(self.totalSteps) || has(self.totalTokens)",
            "message": "set totalSteps or totalTokens: a run needs a budget",
        },
        {
            # Learners and the syncer read it once; fragments or model changes mid-run would
            # make their states incompatible. A different training is a new run.
            "rule": "self == oldSelf",
            "message": "training: immutable once the run exists; create a new DilocoRun",
        },
    ],
    "DataConfig": [
        {
            "rule": "!has(self.source) || self.source != 'memmap' || has(self.path)",
            "message": "data.path is required when data.source is memmap",
            "fieldPath": ".path",
        }
    ],
    "ModelConfig": [
        {
            "rule": "!has(self.dModel) || !has(self.nHeads) || self.dModel % self.nHeads == 0",
            "message": "dModel must be divisible by nHeads",
        }
    ],
}

# Selector keys the operator sets from `tpu` and `spot` (api.UnitGroup._selector_not_owned).
OWNED_SELECTOR_RULES = [
    {
        "rule": "!has(self.tpu) || !has(self.nodeSelector) || "
        f"!({ACCELERATOR_LABEL!r} in self.nodeSelector || {TOPOLOGY_LABEL!r} in self.nodeSelector)",
        "message": f"nodeSelector: {ACCELERATOR_LABEL} and {TOPOLOGY_LABEL} are set by the "
        "operator from tpu",
        "fieldPath": ".nodeSelector",
    },
    {
        "rule": "!has(self.spot) || !self.spot || !has(self.nodeSelector) || "
        f"!({SPOT_LABEL!r} in self.nodeSelector)",
        "message": f"nodeSelector: {SPOT_LABEL} is set by the operator from spot",
        "fieldPath": ".nodeSelector",
    },
]
for _model, _rules in {**pod_template.CEL_RULES, "UnitGroup": OWNED_SELECTOR_RULES}.items():
    RULES.setdefault(_model, []).extend(_rules)

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


def crd() -> dict[str, Any]:
    spec_schema = model_schema(api.DilocoRunSpec, "DilocoRunSpec")
    status_schema = model_schema(api.DilocoRunStatus, "DilocoRunStatus")
    root = {
        "type": "object",
        "description": "A decoupled-DiLoCo training run: learner units (one TPU slice each) "
        "and a syncer that merges what they learn.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
        "x-kubernetes-validations": [
            {
                "rule": f"size(self.metadata.name) <= {api.MAX_RUN_NAME}",
                "message": f"metadata.name: at most {api.MAX_RUN_NAME} characters "
                "(it prefixes Job, Service and Pod names)",
            },
            {
                "rule": f"self.metadata.name.matches(r'{api.RUN_NAME}')",
                "message": "metadata.name: lower-case letters, digits and '-', starting with a "
                "letter (it names the run's Services)",
            },
        ],
    }
    columns = [
        ("Online", "integer", ".status.unitsOnline", "Units online"),
        ("Replicas", "integer", ".spec.replicas", "Units of the first (scalable) group"),
        ("Step", "integer", ".status.outerStep", "Outer step (sum of fragment versions)"),
        ("Loss", "number", ".status.loss", "Held-out loss of the global model"),
        ("Phase", "string", ".status.phase", "Run phase"),
        ("Age", "date", ".metadata.creationTimestamp", ""),
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
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
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {
                            "name": n,
                            "type": t,
                            "jsonPath": p,
                            **({"description": d} if d else {}),
                            # Replicas only in -o wide: for mixed runs it is one group's count.
                            **({"priority": 1} if n == "Replicas" else {}),
                        }
                        for n, t, p, d in columns
                    ],
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `make crds` (python -m diloco_operator.crdgen) from diloco_operator.api; do not edit.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", default="crds", help="directory for the CRD YAML")
    parser.add_argument(
        "--chart",
        default="charts/diloco-operator/crds",
        help="also copy it into the Helm chart's crds/ (empty string to skip)",
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

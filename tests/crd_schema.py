"""Test helper: validate manifests against the generated CRD's OpenAPI schema with jsonschema.

OpenAPI v3.0 differs from JSON Schema draft 4 in two spots we use: `nullable` and the
Kubernetes `x-kubernetes-int-or-string` marker; both are translated here. CEL rules and
list-map uniqueness are the API server's business (checked by the e2e tests).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[1]
CRD_PATH = ROOT / "crds" / "diloco.dev_dilocoruns.yaml"


def _draft4(node: Any) -> Any:
    if isinstance(node, list):
        return [_draft4(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _draft4(v) for k, v in node.items() if not k.startswith("x-kubernetes-validations")}
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if out.pop("nullable", False) and "type" in out:
        out["type"] = (
            [out["type"], "null"] if isinstance(out["type"], str) else [*out["type"], "null"]
        )
    if "properties" in node:
        out["properties"] = {k: _draft4(v) for k, v in node["properties"].items()}
    return out


@functools.cache
def _validator() -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(_draft4(openapi_schema()))


@functools.cache
def openapi_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_PATH.read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def schema_errors(doc: dict[str, Any]) -> list[jsonschema.ValidationError]:
    return list(_validator().iter_errors(doc))

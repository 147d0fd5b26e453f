"""The bad-manifest catalogue (tests/manifests/bad): each file is rejected by the pydantic model
with a message naming the field; schema-level ones also by the CRD's OpenAPI schema. CEL and
list-map ones are checked here for a rule that covers them; the e2e tests apply every file to a
real API server."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import openapi_schema, schema_errors
from diloco_operator.api import parse_manifest

BAD = sorted((Path(__file__).parents[1] / "manifests" / "bad").glob("*.yaml"))


def header(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^# (\w+): (.*)$", path.read_text(), re.M))


def all_rules(node: object) -> list[dict[str, str]]:
    found: list[dict[str, str]] = []
    if isinstance(node, dict):
        found += node.get("x-kubernetes-validations", [])
        for value in node.values():
            found += all_rules(value)
    elif isinstance(node, list):
        for value in node:
            found += all_rules(value)
    return found


def test_catalogue_is_large_and_annotated() -> None:
    assert len(BAD) >= 20
    for path in BAD:
        meta = header(path)
        assert {"expect", "crd", "why"} <= set(meta), path.name
        assert meta["crd"] in {"schema", "cel", "unknown-field", "list-map"}, path.name


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_pydantic_rejects_naming_the_field(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    with pytest.raises(ValueError) as info:
        parse_manifest(doc, pods=True)
    assert header(path)["expect"] in str(info.value), str(info.value)


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_crd_covers_it(path: Path) -> None:
    meta = header(path)
    doc = yaml.safe_load(path.read_text())
    field = meta["expect"]
    if meta["crd"] == "schema":
        errors = schema_errors(doc)
        assert errors, f"{path.name}: the CRD schema accepts it"
        where = " ".join(".".join(map(str, e.absolute_path)) + " " + e.message for e in errors)
        assert field in where, where
    elif meta["crd"] == "cel":
        assert not schema_errors(doc), "a CEL case should pass the plain schema"
        messages = [r["message"] + " " + r["rule"] for r in all_rules(openapi_schema())]
        assert any(field.split(".")[-1] in m for m in messages), f"no CEL rule about {field}"
    elif meta["crd"] == "unknown-field":
        # The server prunes unknown fields, and kubectl's strict field validation reports them:
        # the field must simply not exist in the schema.
        assert field in unknown_keys(doc, openapi_schema())
    else:  # list-map: names are the list-map key, so the server rejects duplicates
        groups = openapi_schema()["properties"]["spec"]["properties"]["unitGroups"]
        assert groups["x-kubernetes-list-type"] == "map"
        assert groups["x-kubernetes-list-map-keys"] == [field]


def unknown_keys(doc: object, schema: dict[str, Any]) -> set[str]:
    """Keys of `doc` that the schema does not declare (what the server prunes or reports)."""
    found: set[str] = set()
    if isinstance(doc, dict) and "properties" in schema:
        for key, value in doc.items():
            if key not in schema["properties"]:
                found.add(key)
            else:
                found |= unknown_keys(value, schema["properties"][key])
    elif isinstance(doc, list) and "items" in schema:
        for value in doc:
            found |= unknown_keys(value, schema["items"])
    return found


def test_the_valid_base_of_the_catalogue_is_accepted() -> None:
    doc = yaml.safe_load(BAD[0].read_text())
    doc["spec"]["image"] = "diloco-trainer:dev"
    parse_manifest(doc, pods=True)
    assert not schema_errors(doc)

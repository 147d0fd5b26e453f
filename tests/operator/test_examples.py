"""Every DilocoRun example validates with the pydantic model and the CRD schema, round-trips
(parse -> wire -> parse), and yields valid Kubernetes children."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import ROOT, schema_errors
from diloco_operator.api import parse_manifest, parse_spec
from diloco_operator.k8s import builders
from diloco_operator.planner import ObservedSyncer, plan
from k8s_roundtrip import roundtrip

EXAMPLES = [
    p
    for p in sorted((ROOT / "examples").glob("*.yaml"))
    if yaml.safe_load(p.read_text()).get("kind") == "DilocoRun"
]


def test_the_operator_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"gke-tpu-v6e.yaml", "mixed-v6e-v5p.yaml", "kind-cpu.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_validates_and_round_trips(path: Path) -> None:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    spec = parse_manifest(doc)
    assert not schema_errors(doc), [e.message for e in schema_errors(doc)]
    wire = spec.to_wire()
    assert parse_spec(wire) == spec
    assert not schema_errors({**doc, "spec": wire})
    run = builders.Run(doc["metadata"]["name"], "default", "uid", spec)
    first = plan(run.name, spec, [], None, 0.0, syncer=ObservedSyncer(False, False))
    objs = builders.run_objects(run)
    for action in first.of_type(builders.CreateUnit):
        objs += builders.unit_objects(run, action, "run-secret")
    assert len([o for o in objs if o["kind"] == "Job"]) == spec.total_units
    for obj in objs:
        assert roundtrip(obj) == obj

"""The generated CRD: fresh (crds/ and the chart's copy match the models), structural, bounded
for CEL cost, with the scale/status subresources, printer columns and CEL rules that name real
fields."""

from __future__ import annotations

import copy
import json
import random
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import ROOT, openapi_schema
from diloco_operator.api import crdgen
from diloco_operator.api.accelerators import ACCELERATORS, check_tpu

FORBIDDEN = {"$ref", "anyOf", "oneOf", "allOf", "const", "title", "$defs", "propertyNames"}


def walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every schema node below `node` (properties, items, additionalProperties)."""
    found = [(path, node)]
    for key, child in (node.get("properties") or {}).items():
        found += walk(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        found += walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        found += walk(node["additionalProperties"], f"{path}{{}}")
    return found


def test_checked_in_crd_is_fresh_in_crds_and_in_the_chart() -> None:
    rendered = crdgen.render()
    for path in (
        ROOT / "crds" / crdgen.CRD_FILE,
        ROOT / "charts/diloco-operator/crds" / crdgen.CRD_FILE,
    ):
        assert path.read_text() == rendered, f"{path} is stale: run `make crds`"


def test_crdgen_cli_writes_both_copies(tmp_path: Path) -> None:
    assert crdgen.main(["--out", str(tmp_path / "a"), "--chart", str(tmp_path / "b")]) == 0
    assert (tmp_path / "a" / crdgen.CRD_FILE).read_text() == (
        tmp_path / "b" / crdgen.CRD_FILE
    ).read_text()


def test_schema_is_structural_and_cost_bounded() -> None:
    for path, node in walk(openapi_schema()):
        assert not FORBIDDEN & set(node), f"{path}: {FORBIDDEN & set(node)}"
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path}: untyped"
        if "properties" in node:
            assert "additionalProperties" not in node, path
        if path.startswith(".spec") and node.get("type") == "string":
            assert "maxLength" in node or "enum" in node, f"{path}: unbounded string"
        if node.get("type") == "array":
            assert "maxItems" in node, f"{path}: unbounded list"


def test_explain_has_descriptions_for_the_main_fields() -> None:
    spec = openapi_schema()["properties"]["spec"]
    for field in ("image", "replicas", "unitGroups", "training", "syncer", "failurePolicy"):
        assert spec["properties"][field].get("description"), field
    group = spec["properties"]["unitGroups"]["items"]
    assert "first group" in group["properties"]["replicas"]["description"]
    assert "Default: 8470." in spec["properties"]["syncer"]["properties"]["port"]["description"]


def undescribed_properties(schema: dict[str, Any]) -> list[str]:
    """Properties of spec and status whose description says nothing beyond the generated
    "Default: ..." note (what `kubectl explain dlr --recursive` would show as empty)."""
    missing = []
    for root in ("spec", "status"):
        for path, node in walk(schema["properties"][root], f".{root}"):
            for key, child in (node.get("properties") or {}).items():
                text = child.get("description", "").split("Default:")[0].strip()
                if not text:
                    missing.append(f"{path}.{key}")
    return missing


def test_every_spec_and_status_property_has_a_description() -> None:
    assert undescribed_properties(openapi_schema()) == []


def test_the_description_walk_finds_an_undescribed_property() -> None:
    schema = copy.deepcopy(openapi_schema())  # the cached one is shared by every test
    units = schema["properties"]["status"]["properties"]["units"]["items"]["properties"]
    units["state"].pop("description")
    units["attempt"]["description"] = "Default: 0."
    assert undescribed_properties(schema) == [".status.units[].state", ".status.units[].attempt"]


def test_subresources_printer_columns_and_names() -> None:
    crd = yaml.safe_load((ROOT / "crds" / crdgen.CRD_FILE).read_text())
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["dlr"]
    assert crd["spec"]["scope"] == "Namespaced"
    scale = version["subresources"]["scale"]
    assert version["subresources"]["status"] == {}
    schema = openapi_schema()
    for json_path in (
        scale["specReplicasPath"],
        scale["statusReplicasPath"],
        scale["labelSelectorPath"],
        *(c["jsonPath"] for c in version["additionalPrinterColumns"]),
    ):
        node = schema
        for part in json_path.strip(".").split("."):
            node = node["properties"][part] if part != "creationTimestamp" else {"type": "string"}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert {"Online", "Step", "Loss", "Phase", "Age"} <= set(columns)


def test_cel_rules_only_reference_fields_that_exist() -> None:
    """A typo in a CEL field name would make the API server refuse the whole CRD."""
    rules = 0
    for path, node in walk(openapi_schema()):
        for rule in node.get("x-kubernetes-validations", []):
            rules += 1
            if "properties" not in node:  # a map's rule: it checks the keys (self.all(k, ...))
                assert rule["rule"].startswith("self.all(k, "), f"{path}: {rule['rule']}"
                continue
            props = node["properties"]
            for chain in re.findall(r"\bself((?:\.\w+)+)", rule["rule"]):
                head = chain.strip(".").split(".")
                cursor: dict[str, Any] = {"properties": props, "type": "object"}
                for part in head:
                    if (
                        part in ("size", "all", "map", "exists", "sum")
                        or "properties" not in cursor
                    ):
                        break
                    assert part in cursor["properties"], f"{path}: {rule['rule']}: {part}"
                    cursor = cursor["properties"][part]
            for field in re.findall(r"\bg\.(\w+)", rule["rule"]):
                # g is a unit group, in rules on the spec and on the root.
                groups = props.get("unitGroups") or props["spec"]["properties"]["unitGroups"]
                assert field in groups["items"]["properties"], f"{path}: g.{field}"
    assert rules >= 8


CRDCHECK = Path.home() / ".cache" / "diloco-e2e" / "bin" / "crdcheck"


@pytest.mark.skipif(not CRDCHECK.exists(), reason="crdcheck not built (crds/validate/build.sh)")
def test_apiserver_validation_accepts_the_crd_and_examples_and_rejects_the_catalogue() -> None:
    """The API server's own Go validation code (built from k8s.io/apiextensions-apiserver)."""
    examples = [
        str(p)
        for p in sorted((ROOT / "examples").glob("*.yaml"))
        if "kind: DilocoRun" in p.read_text()
    ]
    bad = sorted((Path(__file__).parents[1] / "manifests" / "bad").glob("*.yaml"))
    out = subprocess.run(
        [str(CRDCHECK), str(ROOT / "crds" / crdgen.CRD_FILE), *examples, *map(str, bad)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert out[0] == "CRD OK"
    verdicts = {line.split(" ", 2)[1]: line for line in out[1:]}
    for path in examples:
        assert verdicts[path].startswith("ACCEPT"), verdicts[path]
    for path in bad:
        line = verdicts[str(path)]
        expect = re.search(r"^# expect: (.*)$", path.read_text(), re.M)
        assert line.startswith("REJECT") and expect and expect.group(1) in line, line


def tpu_cases() -> list[tuple[str, str, int | None]]:
    """Every named shape with each host size, edge shapes, and a seeded sample of 3D strings."""
    cases: list[tuple[str, str, int | None]] = []
    for name, acc in ACCELERATORS.items():
        for topology in acc.topologies:
            cases += [(name, topology, per_host) for per_host in (None, 1, 2, 4, 8)]
    edges = ["04x4x4", "4x4x4", "16x16x24", "16x16x32", "16x24x24", "24x24x24", "4x4x256"]
    edges += ["4x4x260", "8x4x4", "2x2x3", "1x1x1", "4x8", "12x12x12", "8x16x16"]
    rng = random.Random(7)
    edge_lengths = [4, 8, 12, 16, 20, 24, 28, 32, 36, 64, 128, 256]
    odd_lengths = [*edge_lengths, 1, 2, 3, 6, 260]
    ascending = [sorted(rng.choices(edge_lengths, k=3)) for _ in range(80)]
    anything = [rng.choices(odd_lengths, k=3) for _ in range(40)]
    sample = ["x".join(map(str, dims)) for dims in ascending + anything]
    for name in ACCELERATORS:
        cases += [(name, t, None) for t in edges + sample]
        cases += [(name, t, rng.choice([4, 8])) for t in sample[:30]]
    return cases


@pytest.mark.skipif(not CRDCHECK.exists(), reason="crdcheck not built (crds/validate/build.sh)")
def test_apiserver_and_pydantic_agree_on_every_tpu_shape(tmp_path: Path) -> None:
    """The CRD's CEL (map lookups plus cube arithmetic) accepts exactly what accelerators.py
    accepts, and refuses the rest naming the same field."""
    cases = tpu_cases()
    paths = []
    for i, (accelerator, topology, per_host) in enumerate(cases):
        tpu: dict[str, Any] = {"accelerator": accelerator, "topology": topology}
        if per_host is not None:
            tpu["chipsPerHost"] = per_host
        doc = {
            "apiVersion": "diloco.dev/v1alpha1",
            "kind": "DilocoRun",
            "metadata": {"name": "tpu"},
            "spec": {
                "image": "t",
                "unitGroups": [{"name": "g", "tpu": tpu}],
                "training": {"totalSteps": 10},
            },
        }
        path = tmp_path / f"{i:04d}.json"
        path.write_text(json.dumps(doc))
        paths.append(str(path))
    out = subprocess.run(
        [str(CRDCHECK), str(ROOT / "crds" / crdgen.CRD_FILE), *paths],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert out[0] == "CRD OK"
    verdicts = {line.split(" ", 2)[1]: line for line in out[1:]}
    accepted = cube_built = 0
    for path, (accelerator, topology, per_host) in zip(paths, cases, strict=True):
        line, problem = verdicts[path], check_tpu(accelerator, topology, per_host)
        if problem is None:
            accepted += 1
            cube_built += topology not in ACCELERATORS[accelerator].topologies
            assert line.startswith("ACCEPT"), (accelerator, topology, per_host, line)
        else:
            field = problem.split(":")[0]
            assert line.startswith("REJECT") and f"tpu.{field}:" in line, (problem, line)
    # Both verdicts, and shapes accepted by the cube rule alone, are well represented.
    assert cube_built > 50 and 100 < accepted < len(cases) - 100, (cube_built, accepted)

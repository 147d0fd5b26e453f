"""Admission and the local runtime agree on generated manifests (tests/manifest_cases.py): every
broken one is rejected by the pydantic model (what `diloco local run` and the operator use) AND
by the API server's own validation of the generated CRD (OpenAPI schema + CEL, via crdcheck),
each time with a message naming the field; every valid one is accepted by both, and the
children the operator builds from it pass kube-apiserver's create validation (objcheck)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from crd_schema import ROOT
from diloco_operator.api import parse_manifest
from diloco_operator.api.crdgen import CRD_FILE
from diloco_operator.k8s import builders
from diloco_operator.planner import CreateUnit, desired_units
from manifest_cases import BROKEN, Case, cases

BIN = Path.home() / ".cache" / "diloco-e2e" / "bin"
CRDCHECK = BIN / "crdcheck"
OBJCHECK = BIN / "objcheck"
SEEDS = (1, 2, 3)
PER_FAMILY = 12


def pydantic_verdict(case: Case) -> str | None:
    """None when accepted, else the error text."""
    try:
        parse_manifest(case.doc)
    except ValueError as exc:
        return str(exc)
    return None


def test_generator_covers_every_family_and_varies_with_the_seed() -> None:
    one, two = cases(1, 3), cases(2, 3)
    assert {c.family for c in one} == {"valid", *BROKEN}
    assert [c.doc for c in one] != [c.doc for c in two]
    assert cases(1, 3) == one  # deterministic for a seed


@pytest.mark.parametrize("seed", SEEDS)
def test_pydantic_rejects_every_broken_manifest_naming_the_field(seed: int) -> None:
    for case in cases(seed, PER_FAMILY):
        verdict = pydantic_verdict(case)
        if case.valid:
            assert verdict is None, f"{case.family}: {verdict}\n{case.doc}"
        else:
            assert verdict is not None, f"{case.family} accepted: {case.doc}"
            assert case.field in verdict, f"{case.family}: {case.field!r} not in {verdict!r}"


def crdcheck(all_cases: list[Case], tmp: Path) -> dict[str, str]:
    paths = []
    for i, case in enumerate(all_cases):
        path = tmp / f"{i:04d}-{case.family}.json"
        path.write_text(json.dumps(case.doc))  # JSON is YAML, and keeps big integers exact
        paths.append(str(path))
    out = subprocess.run(
        [str(CRDCHECK), str(ROOT / "crds" / CRD_FILE), *paths],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert out[0] == "CRD OK", out[0]
    return {line.split(" ", 2)[1]: line for line in out[1:]}


@pytest.mark.skipif(not CRDCHECK.exists(), reason="crdcheck not built (make validators)")
@pytest.mark.parametrize("seed", SEEDS)
def test_admission_rejects_every_broken_manifest_naming_the_field(
    seed: int, tmp_path: Path
) -> None:
    all_cases = cases(seed, PER_FAMILY)
    verdicts = crdcheck(all_cases, tmp_path)
    assert len(verdicts) == len(all_cases)
    for i, case in enumerate(all_cases):
        line = verdicts[str(tmp_path / f"{i:04d}-{case.family}.json")]
        if case.valid:
            assert line.startswith("ACCEPT"), f"{case.family}: {line}\n{case.doc}"
        else:
            assert line.startswith("REJECT"), f"{case.family} admitted: {case.doc}"
            assert case.field in line, f"{case.family}: {case.field!r} not in {line}"


@pytest.mark.skipif(not OBJCHECK.exists(), reason="objcheck not built (make validators)")
def test_children_of_every_valid_manifest_pass_apiserver_create_validation() -> None:
    objs = []
    for seed in SEEDS:
        for case in cases(seed, PER_FAMILY):
            if not case.valid:
                continue
            spec = parse_manifest(case.doc)
            run = builders.Run(case.doc["metadata"]["name"], "ns", "uid-1", spec)
            objs += builders.run_objects(run)
            for slot in desired_units(run.name, spec)[:2]:
                unit = CreateUnit(
                    slot.name, slot.group, slot.index, slot.global_index, 0, 2, slot.hosts
                )
                objs += builders.unit_objects(run, unit, "run-secret")
    out = subprocess.run(
        [str(OBJCHECK)], input=yaml.safe_dump_all(objs), capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout[-4000:]
    assert sum(line.startswith("VALID ") for line in out.stdout.splitlines()) == len(objs)

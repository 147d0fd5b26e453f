"""Bad input to `diloco local run` is rejected before anything starts, with the messages of the
operator's own model (the CRD's schema source)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_operator.api import parse_manifest
from diloco_operator.cli import checkpoint_location, main
from diloco_operator.local.chaos import DEFAULT_CHAOS
from diloco_operator.local.manifest import chaos_settings, load_manifest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local.yaml"


def example() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return doc


def write(tmp_path: Path, doc: Any, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


def broken(change: str) -> dict[str, Any]:
    doc = example()
    spec = doc["spec"]
    if change == "replicas":
        spec["replicas"] = 0
    elif change == "quorum":
        spec["training"]["quorum"] = 9
    elif change == "innerSteps":
        spec["training"]["innerSteps"] = 0
    elif change == "typo":
        spec["training"]["innerStep"] = 5
    elif change == "slowdown":
        spec["chaos"]["slowdown"]["slow"] = 0.5
    elif change == "budget":
        del spec["training"]["totalTokens"]
    elif change == "chaos":
        spec["chaos"]["schedule"][0]["action"] = "explode"
    elif change == "kind":
        doc["kind"] = "Deployment"
    return doc


CASES = {
    "replicas": "spec.replicas",
    "quorum": "training.quorum",
    "innerSteps": "spec.training.innerSteps",
    "typo": "spec.training.innerStep",
    "slowdown": "spec.chaos.slowdown.slow",
    "budget": "totalTokens",
    "chaos": "spec.chaos.schedule.0.action",
    "kind": "kind: expected DilocoRun",
}


@pytest.mark.parametrize("change", sorted(CASES))
def test_invalid_manifest_rejected_with_the_models_message(
    change: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = broken(change)
    report = tmp_path / "report"
    code = main(["local", "run", str(write(tmp_path, doc)), "--report-dir", str(report)])
    err = capsys.readouterr().err
    assert code == 2
    assert CASES[change] in err
    with pytest.raises(ValueError) as model_error:
        parse_manifest(doc)
    # The very lines the operator's model (and so the CRD validation) gives.
    for line in str(model_error.value).splitlines():
        assert line in err
    assert not report.exists(), "nothing may start for an invalid manifest"


def test_unreadable_and_non_mapping_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["local", "run", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read config" in capsys.readouterr().err
    assert main(["local", "run", str(write(tmp_path, "a: [1, 2\n"))]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["local", "run", str(write(tmp_path, "- 1\n- 2\n"))]) == 2
    assert "mapping at the top level" in capsys.readouterr().err


def test_chaos_schedule_naming_a_missing_unit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = example()
    doc["spec"]["chaos"]["schedule"][0]["unit"] = 4
    assert main(["local", "run", str(write(tmp_path, doc)), "--chaos"]) == 2
    assert "spec.chaos.schedule.0.unit: unit 4 does not exist" in capsys.readouterr().err


def test_units_of_several_hosts_are_left_to_kubernetes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = example()
    doc["spec"]["unitGroups"] = [{"name": "cpu", "hostsPerUnit": 2}]
    del doc["spec"]["chaos"]
    report = tmp_path / "report"
    assert main(["local", "run", str(write(tmp_path, doc)), "--report-dir", str(report)]) == 2
    assert "spec.unitGroups.0.hostsPerUnit: units of several hosts run on Kubernetes" in (
        capsys.readouterr().err
    )
    assert not report.exists()


@pytest.mark.parametrize(
    ("flag", "kind"),
    [
        ("--resume-from", "missing"),
        ("--resume-from", "file"),
        ("--resume-from", "empty"),
        # a new run's directory: one with anything in it would be resumed silently
        ("--checkpoint-dir", "file"),
        ("--checkpoint-dir", "not empty"),
    ],
)
def test_a_checkpoint_dir_the_flag_cannot_use_is_a_clear_error(
    flag: str, kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    if kind == "file":
        ckpt.write_text("not a directory")
    elif kind in ("empty", "not empty"):
        ckpt.mkdir()
    if kind == "not empty":
        (ckpt / "manifest.json").write_text("{}")
    code = main(["local", "run", str(EXAMPLE), flag, str(ckpt)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{flag}: " in err and str(ckpt) in err
    assert "Traceback" not in err


def test_checkpoint_dir_and_resume_from_exclude_each_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        args = ["--checkpoint-dir", str(tmp_path), "--resume-from", str(tmp_path)]
        main(["local", "run", str(EXAMPLE), *args])
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_checkpoint_location_prefers_the_fresh_dir_then_the_resumed_one(tmp_path: Path) -> None:
    assert checkpoint_location(None, None) is None
    assert checkpoint_location(None, tmp_path / "new") == (tmp_path / "new").resolve()
    assert checkpoint_location("gs://bucket/run", None) == "gs://bucket/run"
    assert checkpoint_location(str(tmp_path), None) == tmp_path.resolve()


def test_chaos_flag_selects_the_manifest_block_or_the_default() -> None:
    run = load_manifest(EXAMPLE)
    assert run.spec.chaos is not None
    assert not chaos_settings(run.spec.chaos, enabled=False).enabled
    from_block = chaos_settings(run.spec.chaos, enabled=True)
    assert from_block.kill_interval_seconds == run.spec.chaos.kill_every_seconds
    assert [f.kind for f in from_block.schedule] == ["kill", "pause", "kill", "kill", "kill-syncer"]
    assert chaos_settings(None, enabled=True) == DEFAULT_CHAOS
    assert chaos_settings(None, enabled=True, seed=5).seed == 5


def test_a_chaos_block_with_only_a_slowdown_leaves_the_faults_to_the_flag() -> None:
    doc = example()
    doc["spec"]["chaos"] = {"slowdown": {"slow": 3}}
    spec = parse_manifest(doc)
    assert spec.chaos is not None and spec.chaos.slowdown == {"slow": 3.0}
    assert not spec.chaos.has_fault_settings
    assert chaos_settings(spec.chaos, enabled=True) == DEFAULT_CHAOS  # as without a block
    assert not chaos_settings(spec.chaos, enabled=False).enabled
    doc["spec"]["chaos"]["seed"] = 4  # a block that speaks about faults decides them
    assert not chaos_settings(parse_manifest(doc).chaos, enabled=True).kill_interval_seconds


def test_a_slowdown_for_a_group_the_run_lacks_is_rejected() -> None:
    doc = example()
    doc["spec"]["chaos"]["slowdown"] = {"fats": 2}
    with pytest.raises(ValueError, match=r"chaos\.slowdown\.fats: no unit group of that name"):
        parse_manifest(doc)

"""`diloco export`: where it finds the checkpoint, what it writes, and every refusal (exit 2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy
from diloco_operator.cli import main as diloco
from diloco_trainer.syncer.checkpoint import CheckpointStore, Snapshot


def _snapshot(value: float, outer_step: int) -> Snapshot:
    params = {
        "params.Dense_0.kernel": np.full((2, 3), value, np.float32),
        "params.Dense_0.bias": np.full(3, -value, np.float32),
    }
    return Snapshot(
        params=params,
        outer_state=[[np.ones((2, 3), np.float32), np.ones(3, np.float32)]],  # momentum
        versions=[outer_step],
        layout=[sorted(params)],
        outer_step=outer_step,
        extra={"run": "mine", "configHash": "abc123"},
    )


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    checkpoints = CheckpointStore(tmp_path / "run" / "checkpoints", keep=5)
    checkpoints.save(_snapshot(1.0, 1))
    checkpoints.save(_snapshot(2.0, 2))
    return checkpoints


def _exported(out: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    with safetensors.safe_open(out, framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118


def test_a_checkpoint_directory_exports_its_newest_checkpoint_without_momentum(
    store: CheckpointStore, tmp_path: Path
) -> None:
    out = tmp_path / "m.safetensors"
    assert diloco(["export", str(store.root), "--out", str(out)]) == 0
    tensors, meta = _exported(out)
    assert sorted(tensors) == ["params.Dense_0.bias", "params.Dense_0.kernel"]
    np.testing.assert_array_equal(tensors["params.Dense_0.kernel"], np.full((2, 3), 2.0))
    assert meta == {
        "format": "diloco-export/1",
        "run": "mine",
        "outerStep": "2",
        "versions": "[2]",
        "checkpointSeq": "2",
        "configHash": "abc123",
        "checkpoint": str((store.root / "ckpt-0000000002").resolve()),
    }


def test_a_local_run_folder_and_a_single_checkpoint_are_sources_too(
    store: CheckpointStore, tmp_path: Path
) -> None:
    out = tmp_path / "m.safetensors"
    assert diloco(["export", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert _exported(out)[1]["outerStep"] == "2"
    assert diloco(["export", str(store.root / "ckpt-0000000001"), "--out", str(out)]) == 0
    tensors, meta = _exported(out)
    assert meta["outerStep"] == "1"
    np.testing.assert_array_equal(tensors["params.Dense_0.bias"], np.full(3, -1.0))


def test_a_corrupt_newest_checkpoint_falls_back_and_a_corrupt_single_one_is_refused(
    store: CheckpointStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    newest = store.root / "ckpt-0000000002" / "params.safetensors"
    newest.write_bytes(newest.read_bytes()[:-4] + b"\x00\x00\x00\x01")
    out = tmp_path / "m.safetensors"
    assert diloco(["export", str(store.root), "--out", str(out)]) == 0
    assert _exported(out)[1]["outerStep"] == "1"
    assert diloco(["export", str(newest.parent), "--out", str(out)]) == 2
    assert "params.safetensors checksum mismatch" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("source", "out", "message"),
    [
        ("absent", "m.safetensors", "absent: no such file or directory"),
        ("a-file", "m.safetensors", "a-file: not a directory"),
        ("empty-dir", "m.safetensors", "empty-dir: holds no checkpoint"),
        ("run", "m.bin", "the file name must end in .safetensors"),
        ("run", "nowhere/m.safetensors", "nowhere does not exist"),
        ("run", "/proc/m.safetensors", "--out /proc/m.safetensors: cannot write"),
        ("run", "out-dir.safetensors", "cannot write"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(
    store: CheckpointStore,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    source: str,
    out: str,
    message: str,
) -> None:
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "out-dir.safetensors").mkdir()
    target = out if out.startswith("/") else str(tmp_path / out)
    assert diloco(["export", str(tmp_path / source), "--out", target]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diloco export: ") and message in err


def test_a_checkpoint_directory_with_only_broken_checkpoints_is_refused(
    store: CheckpointStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for ckpt in store.root.glob("ckpt-*"):
        (ckpt / "manifest.json").write_text("{")
    assert diloco(["export", str(store.root), "--out", str(tmp_path / "m.safetensors")]) == 2
    assert "holds no valid checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "m.safetensors").exists()

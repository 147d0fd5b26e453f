"""Checkpoint atomicity: round trip, pruning, corrupt/partial newest skipped, clear errors."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
from diloco_trainer.syncer.checkpoint import CheckpointError, CheckpointStore, Snapshot


def snap(version: int) -> Snapshot:
    rng = np.random.default_rng(version)
    return Snapshot(
        params={
            "embed": rng.normal(size=(4, 3)).astype(np.float32),
            "w": rng.normal(size=5).astype(np.float32),
        },
        outer_state=[[np.full((4, 3), version, np.float32)], [np.full(5, version, np.float32)]],
        versions=[version, version + 1],
        layout=[["embed"], ["w"]],
        outer_step=2 * version + 1,
        learners={
            "unit-0": {"group": "default", "attempt": 1, "attempts": {"0": [10, 100], "1": [2, 20]}}
        },
        extra={"evalLoss": 2.5},
    )


def test_round_trip_and_pruning(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck", keep=2)
    for v in range(1, 5):
        store.save(snap(v))
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == ["ckpt-0000000003", "ckpt-0000000004"]
    got = store.load_latest()
    assert got is not None
    want = snap(4)
    assert got.versions == want.versions and got.outer_step == want.outer_step and got.seq == 4
    assert got.layout == want.layout and got.learners == want.learners and got.extra == want.extra
    for k in want.params:
        np.testing.assert_array_equal(got.params[k], want.params[k])
    np.testing.assert_array_equal(got.outer_state[1][0], want.outer_state[1][0])


def test_corrupt_newest_is_skipped_with_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.save(snap(1))
    newest = store.save(snap(2))
    data = bytearray((newest / "params.safetensors").read_bytes())
    data[-1] ^= 0xFF  # a flipped bit in the tensor data
    (newest / "params.safetensors").write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="diloco.checkpoint"):
        got = store.load_latest()
    assert got is not None and got.versions == [1, 2]
    assert any("checksum mismatch" in r.getMessage() for r in caplog.records)


def test_partial_newest_without_manifest_and_stray_tmp(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.save(snap(1))
    partial = tmp_path / "ckpt-0000000002"
    partial.mkdir()
    (partial / "params.safetensors").write_bytes(b"\x00" * 16)
    stray = tmp_path / ".tmp-0000000003-999"
    stray.mkdir()
    (stray / "params.safetensors").write_bytes(b"half")
    got = store.load_latest()
    assert got is not None and got.versions == [1, 2]
    assert not stray.exists()
    # The next save gets a fresh number and becomes the newest valid one.
    store.save(snap(5))
    latest = store.load_latest()
    assert latest is not None and latest.versions == [5, 6]


def test_truncated_file_is_detected(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(snap(1))
    newest = store.save(snap(2))
    with open(newest / "outer.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(newest / "outer.safetensors") // 2)
    got = store.load_latest()
    assert got is not None and got.versions == [1, 2]


def test_absent_or_empty_dir_means_fresh_start(tmp_path: Path) -> None:
    assert CheckpointStore(tmp_path / "missing").load_latest() is None
    (tmp_path / "empty").mkdir()
    assert CheckpointStore(tmp_path / "empty").load_latest() is None


def test_fresh_ext4_volume_with_lost_and_found_is_a_fresh_start(tmp_path: Path) -> None:
    """A new PersistentVolume formatted as ext4 holds lost+found (root-owned, unreadable to the
    syncer's user): that is an empty disk, not someone else's data."""
    lost = tmp_path / "lost+found"
    lost.mkdir()
    lost.chmod(0o700)
    store = CheckpointStore(tmp_path)
    assert store.load_latest() is None
    store.save(snap(1))
    loaded = store.load_latest()
    assert loaded is not None and loaded.outer_step == 3


def test_non_empty_dir_without_valid_checkpoint_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("someone else's files")
    with pytest.raises(CheckpointError, match="not empty but holds no valid checkpoint"):
        CheckpointStore(tmp_path).load_latest()
    only_bad = tmp_path / "bad"
    (only_bad / "ckpt-0000000001").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="manifest"):
        CheckpointStore(only_bad).load_latest()


def test_path_that_is_a_file_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        CheckpointStore(f).load_latest()


def test_version_journal_round_trip_and_alone_is_a_fresh_start(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    assert store.recorded_versions() is None
    store.record_versions([3, 1])
    store.record_versions([4, 1])
    assert store.recorded_versions() == [4, 1]
    assert store.load_latest() is None  # a journal without checkpoints is not foreign content
    (tmp_path / "versions.json").write_text("{broken")
    assert store.recorded_versions() is None

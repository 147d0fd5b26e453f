"""gs:// checkpoints against a real GCS-compatible server (fake-gcs-server on loopback): round
trip, pruning, the manifest as commit marker, damaged and foreign content, access errors."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from conftest import Bucket
from diloco_operator.cli import main as diloco
from diloco_trainer.syncer.checkpoint import (
    CheckpointError,
    CheckpointStore,
    StorageAccessError,
    StorageUnavailable,
)
from test_checkpoint import snap

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "local.yaml"


def ckpt_names(bucket: Bucket, prefix: str) -> dict[str, set[str]]:
    """ckpt-* name -> its files, as the server holds them."""
    found: dict[str, set[str]] = {}
    for key in bucket.objects(prefix + "/"):
        top, _, rest = key.removeprefix(prefix + "/").partition("/")
        if rest:
            found.setdefault(top, set()).add(rest)
    return found


FILES = {"manifest.json", "params.safetensors", "outer.safetensors"}


def test_round_trip_pruning_and_journal_in_a_bucket(bucket: Bucket) -> None:
    store = CheckpointStore(bucket.url("runs/a"), keep=2)
    assert store.load_latest() is None  # an empty prefix is a fresh start
    big = snap(4)
    # 12 MB: over the library's single-request limit (8 MiB), so a resumable upload.
    big.params["big"] = np.random.default_rng(0).normal(size=3_000_000).astype(np.float32)
    for v in range(1, 4):
        store.save(snap(v))
    where = store.save(big)
    assert where == f"gs://{bucket.name}/runs/a/ckpt-0000000004"
    assert ckpt_names(bucket, "runs/a") == {"ckpt-0000000003": FILES, "ckpt-0000000004": FILES}
    store.record_versions([7, 1])
    store.record_versions([8, 1])
    fresh = CheckpointStore(bucket.url("runs/a/"))  # a trailing slash names the same prefix
    assert fresh.recorded_versions() == [8, 1]
    got = fresh.load_latest()
    assert got is not None and got.seq == 4 and got.versions == big.versions
    assert got.learners == big.learners and got.extra == big.extra
    for name, value in big.params.items():
        np.testing.assert_array_equal(got.params[name], value)
    np.testing.assert_array_equal(got.outer_state[1][0], big.outer_state[1][0])
    # A sibling prefix sharing the first letters is another root.
    assert CheckpointStore(bucket.url("runs/a-other")).load_latest() is None


def test_an_uncommitted_checkpoint_is_ignored_numbered_past_and_removed_by_the_owner(
    bucket: Bucket, caplog: pytest.LogCaptureFixture
) -> None:
    """What a syncer killed mid-upload leaves: objects under ckpt-<seq>/ without the manifest."""
    url = bucket.url("run")
    CheckpointStore(url).save(snap(1))
    bucket.put("run/ckpt-0000000002/outer.safetensors", b"\x00" * 64)
    bucket.put("run/ckpt-0000000002/params.safetensors", b"half")
    observer = CheckpointStore(url)
    got = observer.load_latest(remove_stray=False)  # a reader during an upload: no harm done
    assert got is not None and got.versions == [1, 2] and observer.skipped == []
    assert "ckpt-0000000002" in ckpt_names(bucket, "run")
    # A save never reuses the interrupted number.
    assert observer.save(snap(3)).endswith("ckpt-0000000003")  # type: ignore[union-attr]
    with caplog.at_level(logging.WARNING, logger="diloco.checkpoint"):
        owned = CheckpointStore(url).load_latest()  # the syncer at start
    assert owned is not None and owned.versions == [3, 4]
    assert set(ckpt_names(bucket, "run")) == {"ckpt-0000000001", "ckpt-0000000003"}
    assert any("ckpt-0000000002 action=removed" in r.getMessage() for r in caplog.records)


def test_a_damaged_committed_checkpoint_is_skipped(
    bucket: Bucket, caplog: pytest.LogCaptureFixture
) -> None:
    url = bucket.url("run")
    store = CheckpointStore(url, keep=3)
    store.save(snap(1))
    store.save(snap(2))
    key = "run/ckpt-0000000002/params.safetensors"
    data = bytearray(bucket.get(key))
    data[-1] ^= 0xFF
    bucket.put(key, bytes(data))  # a complete object with other bytes than the manifest says
    with caplog.at_level(logging.ERROR, logger="diloco.checkpoint"):
        reader = CheckpointStore(url)
        got = reader.load_latest()
    assert got is not None and got.versions == [1, 2]
    assert len(reader.skipped) == 1 and "checksum mismatch" in reader.skipped[0]
    assert f"gs://{bucket.name}/run/ckpt-0000000002" in reader.skipped[0]


def test_foreign_objects_without_a_checkpoint_refuse_to_start(bucket: Bucket) -> None:
    bucket.put("shared/notes.txt", b"someone else's data")
    with pytest.raises(CheckpointError, match="not empty but holds no valid checkpoint"):
        CheckpointStore(bucket.url("shared")).load_latest()


def test_checkpoint_objects_are_create_only(bucket: Bucket) -> None:
    """Two writers on one path: the second cannot overwrite what the first committed."""
    store = CheckpointStore(bucket.url("run"))
    store.save(snap(1))
    with store.location.stage("ckpt-0000000001") as staged:
        (staged / "manifest.json").write_text("{}")
        with pytest.raises(StorageUnavailable, match="exists already"):
            store.location.publish(staged, "ckpt-0000000001")
    got = CheckpointStore(bucket.url("run")).load_latest()
    assert got is not None and got.versions == [1, 2]


def test_a_missing_bucket_or_bucket_name_is_an_access_error_naming_the_field(
    bucket: Bucket,
) -> None:
    field = "training.checkpoint.path"
    with pytest.raises(StorageAccessError, match=f"{field} gs://no-such-bucket-x/run: bucket"):
        CheckpointStore("gs://no-such-bucket-x/run", field=field).load_latest()
    with pytest.raises(StorageAccessError, match="no bucket name"):
        CheckpointStore("gs:///run", field=field)


def test_export_and_resume_from_read_a_bucket(
    bucket: Bucket, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = bucket.url("run")
    store = CheckpointStore(url)
    store.save(snap(1))
    store.save(snap(2))
    out = tmp_path / "model.safetensors"
    assert diloco(["export", url, "--out", str(out)]) == 0
    with safetensors.safe_open(out, "np") as f:  # type: ignore[no-untyped-call]
        meta = f.metadata()
    assert meta["checkpoint"] == f"{url}/ckpt-0000000002" and meta["checkpointSeq"] == "2"
    got = safetensors.numpy.load_file(out)
    np.testing.assert_array_equal(got["embed"], snap(2).params["embed"])
    assert diloco(["export", f"{url}/ckpt-0000000001", "--out", str(out)]) == 0
    np.testing.assert_array_equal(safetensors.numpy.load_file(out)["w"], snap(1).params["w"])
    capsys.readouterr()
    assert diloco(["export", bucket.url("nothing"), "--out", str(out)]) == 2
    assert "holds no checkpoint yet" in capsys.readouterr().err
    code = diloco(["local", "run", str(EXAMPLE), "--resume-from", bucket.url("nothing")])
    assert code == 2
    assert "--resume-from: gs://" in capsys.readouterr().err

"""Two syncers on one gs:// checkpoint path (a pod left running on a partitioned node beside
its replacement): the one that claimed the path last writes; the other's next journal write or
checkpoint commit fails as Superseded and it stands down, having changed nothing. Against a
real GCS-compatible server (fake-gcs-server, which enforces ifGenerationMatch)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import Bucket
from diloco_trainer.auth import unit_token
from diloco_trainer.learner.client import SyncerClient
from diloco_trainer.syncer.checkpoint import CheckpointStore, Superseded
from diloco_trainer.syncer.main import EXIT_SUPERSEDED
from test_checkpoint import snap
from test_checkpoint_gcs import ckpt_names
from test_syncer_process import TOKEN, SyncerProcess, delta_for, procs, start, write_config

__all__ = ["procs"]  # the fixture, imported for its use below


def test_the_syncer_that_claimed_last_writes_and_the_other_is_refused(bucket: Bucket) -> None:
    url = bucket.url("run")
    old, new = CheckpointStore(url), CheckpointStore(url)
    assert old.load_latest() is None and old.claim() == []
    old.save(snap(1))
    old.record_versions([1, 2])
    old.record_leases({"shards": 4})
    # The replacement reads what is there, claims, and writes.
    assert new.load_latest() is not None and new.recorded_versions() == [1, 2]
    assert new.claim() == []  # nothing moved between its reads and its claim
    new.record_versions([2, 2])

    with pytest.raises(Superseded, match=r"write versions\.json: versions\.json changed"):
        old.record_versions([2, 3])
    with pytest.raises(Superseded, match=r"write data-leases\.json: versions\.json changed"):
        old.record_leases({"shards": 8})  # an object the other one did not write: fenced too
    with pytest.raises(Superseded, match=r"commit a checkpoint: versions\.json changed"):
        old.save(snap(5))
    assert CheckpointStore(url).recorded_versions() == [2, 2]  # the old one's write refused
    committed = {n for n, files in ckpt_names(bucket, "run").items() if "manifest.json" in files}
    assert committed == {"ckpt-0000000001"}  # its second checkpoint was never committed
    new.record_versions([3, 2])
    new.record_leases({"shards": 5})
    assert new.save(snap(6)) == f"gs://{bucket.name}/run/ckpt-0000000003"


def test_an_object_first_written_after_the_claim_is_fenced(bucket: Bucket) -> None:
    url = bucket.url("run")
    old, new = CheckpointStore(url), CheckpointStore(url)
    old.claim()
    new.claim()
    new.record_leases({"shards": 4})  # absent when the old one claimed
    with pytest.raises(Superseded, match=r"data-leases\.json was changed by another writer"):
        old.record_leases({"shards": 8})
    assert json.loads(bucket.get("run/data-leases.json")) == {"shards": 4}


def test_claim_names_what_changed_since_this_process_read_it(bucket: Bucket) -> None:
    """A standby follows the journal while the serving syncer writes; at take-over it reads
    again what moved since it last looked."""
    url = bucket.url("run")
    serving, standby = CheckpointStore(url), CheckpointStore(url)
    serving.claim()
    serving.record_versions([1, 1])
    serving.record_leases({"shards": 4})
    assert standby.recorded_versions() == [1, 1]
    assert standby.recorded_leases() == {"shards": 4}
    serving.record_versions([2, 1])  # the serving syncer's last write before it dies
    assert standby.claim() == ["versions.json"]
    assert standby.recorded_versions() == [2, 1]
    standby.record_versions([2, 2])  # the take-over writes from what it read again
    assert CheckpointStore(url).recorded_versions() == [2, 2]


def test_a_retried_write_whose_first_attempt_landed_is_not_taken_for_another_writer(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client library retries a conditional write whose response was lost; the retry is
    refused (the generation moved: by that very write). The metadata tag tells it apart."""
    from google.api_core import exceptions as api
    from google.cloud.storage.blob import Blob

    store = CheckpointStore(bucket.url("run"))
    store.claim()
    store.record_versions([1, 1])
    original: Callable[..., Any] = Blob.upload_from_string
    lost = {"responses": 1}

    def lands_then_refused(self: Blob, *args: Any, **kwargs: Any) -> Any:
        original(self, *args, **kwargs)
        if lost["responses"]:
            lost["responses"] -= 1
            raise api.PreconditionFailed("the retry of a write whose first attempt landed")
        return None

    monkeypatch.setattr(Blob, "upload_from_string", lands_then_refused)
    store.record_versions([2, 1])  # not Superseded
    assert lost["responses"] == 0
    store.record_versions([3, 1])  # and its generation was recorded: the next write goes on
    assert CheckpointStore(bucket.url("run")).recorded_versions() == [3, 1]
    other = CheckpointStore(bucket.url("run"))
    other.claim()
    other.record_versions([4, 1])
    lost["responses"] = 1
    with pytest.raises(Superseded):  # refused, and the object is another writer's: fenced
        store.record_versions([5, 1])


def _wait_exit(proc: SyncerProcess, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while proc.proc.poll() is None:
        assert time.monotonic() < deadline, "the superseded syncer did not stop"
        time.sleep(0.1)
    return proc.proc.returncode


def test_a_second_syncer_on_the_path_supersedes_the_first_process(
    bucket: Bucket, tmp_path: Path, procs: list[SyncerProcess]
) -> None:
    url = bucket.url("run")
    config = write_config(tmp_path / "run.yaml", checkpoint={"path": url, "everySeconds": 3600})
    first = start(procs, config, None, tmp_path / "first.log")
    old = SyncerClient(first.url, unit_token(TOKEN, "unit-0"), "unit-0", 0, timeout=10)
    layout = old.join().layout
    old.push(0, 0, delta_for(old, layout, 0, seed=1), c_steps=4, c_tokens=256)
    assert old.poll(0, 0, wait=20) is not None  # version 1, journaled by the first syncer

    second = start(procs, config, None, tmp_path / "second.log")  # claims, journals at start
    new = SyncerClient(second.url, unit_token(TOKEN, "unit-1"), "unit-1", 0, timeout=10)
    new.join()
    assert [f.version for f in new.status().fragments] == [1, 0]  # it resumed the first's work
    # The first syncer's next merge cannot journal its version: it stands down, exit 3.
    old.push(0, 1, delta_for(old, layout, 0, seed=2), c_steps=4, c_tokens=256)
    assert _wait_exit(first, 30) == EXIT_SUPERSEDED
    log = (tmp_path / "first.log").read_text()
    assert re.search(r"event=superseded what=merge action=stop_serving", log), log
    assert "event=stopping reason=superseded" in log
    assert "event=checkpoint_saved" not in log.split("event=superseded")[1]
    journal = json.loads(bucket.get("run/versions.json"))
    assert journal["versions"] == [1, 0]  # the first one's version 2 was never journaled
    # The second serves on.
    new.push(0, 1, delta_for(new, layout, 0, seed=3), c_steps=4, c_tokens=256)
    got = new.poll(0, 1, wait=20)
    assert got is not None and got[0] == 2
    assert second.proc.poll() is None

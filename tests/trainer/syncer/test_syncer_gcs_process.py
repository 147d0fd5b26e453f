"""`diloco-syncer` with `checkpoint.path: gs://...` as a real process against a real
GCS-compatible server (fake-gcs-server on loopback): SIGKILL in the middle of a checkpoint
upload, restart from the last committed one; no credential or no bucket: exit 2 naming the
field."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import Bucket
from diloco_trainer.auth import unit_token
from diloco_trainer.learner.client import SyncerClient
from diloco_trainer.syncer.checkpoint import CheckpointStore
from gcs_server import free_port
from processes import syncer_argv
from test_checkpoint_gcs import ckpt_names
from test_syncer_process import TOKEN, SyncerProcess, procs, start, write_config

__all__ = ["procs"]  # the fixture, imported for its use below

# ~20 MB of parameters and as much outer momentum: an upload takes long enough to be caught
# half done (the byte vocabulary is what makes it big; the model is never run here).
BIG_MODEL = {
    "preset": "tiny",
    "vocabSize": 8192,
    "dModel": 512,
    "nLayers": 1,
    "nHeads": 4,
    "seqLen": 8,
}


def _smallest_fragment(learner: SyncerClient) -> tuple[int, dict[str, np.ndarray]]:
    join = learner.join()
    sizes = [sum(int(np.prod(join.shapes[n])) for n in names) for names in join.layout]
    p = sizes.index(min(sizes))
    rng = np.random.default_rng(p)
    delta = {n: (rng.normal(size=join.shapes[n]) * 0.01).astype(np.float32) for n in join.layout[p]}
    return p, delta


@pytest.fixture
def heartbeats() -> Iterator[list[SyncerClient]]:
    """Learners beating with a growing step count: each beat changes the state, so a
    checkpoint is due every period."""
    clients: list[SyncerClient] = []
    stop = threading.Event()

    def beat() -> None:
        steps = 4
        while not stop.wait(0.05):
            for client in clients:
                steps += 1
                # the syncer is being killed and restarted: keep beating
                with contextlib.suppress(Exception):
                    client.heartbeat(steps, steps * 64, 100.0, 3.0)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    yield clients
    stop.set()
    thread.join(5)


def _catch_half_uploaded(bucket: Bucket, committed: set[str], timeout: float = 40) -> str:
    """A checkpoint newer than `committed` with its first tensor file uploaded and neither the
    second nor the manifest yet (the store uploads files in name order, the manifest last)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, files in ckpt_names(bucket, "run").items():
            if name not in committed and files == {"outer.safetensors"}:
                return name
        time.sleep(0.01)
    raise AssertionError(f"no half-uploaded checkpoint seen: {ckpt_names(bucket, 'run')}")


def test_sigkill_mid_upload_then_restart_resumes_from_the_last_committed_checkpoint(
    bucket: Bucket, tmp_path: Path, procs: list[SyncerProcess], heartbeats: list[SyncerClient]
) -> None:
    url, log = bucket.url("run"), tmp_path / "syncer.log"
    config = write_config(
        tmp_path / "run.yaml", model=BIG_MODEL, checkpoint={"path": url, "everySeconds": 0.3}
    )
    first = start(procs, config, None, log)
    learner = SyncerClient(first.url, unit_token(TOKEN, "unit-0"), "unit-0", 0, timeout=30)
    p, delta = _smallest_fragment(learner)
    learner.push(p, 0, delta, c_steps=4, c_tokens=256)
    assert learner.poll(p, 0, wait=20) is not None  # merged: version 1
    heartbeats.append(learner)
    deadline = time.monotonic() + 40
    while True:
        committed = {n for n, files in ckpt_names(bucket, "run").items() if len(files) == 3}
        manifests = [json.loads(bucket.get(f"run/{n}/manifest.json")) for n in committed]
        if any(m["versions"][p] == 1 for m in manifests):
            break
        assert time.monotonic() < deadline, "no committed checkpoint after the merge"
        time.sleep(0.05)
    half = _catch_half_uploaded(bucket, committed)
    first.proc.send_signal(signal.SIGKILL)
    assert first.proc.wait(10) == -signal.SIGKILL
    assert ckpt_names(bucket, "run")[half] == {"outer.safetensors"}  # killed mid-upload

    last = CheckpointStore(url).load_latest(remove_stray=False)  # what a restart must find
    assert last is not None and f"ckpt-{last.seq:010d}" < half
    assert last.versions[p] == 1

    quiet = write_config(
        tmp_path / "quiet.yaml", model=BIG_MODEL, checkpoint={"path": url, "everySeconds": 3600}
    )
    second = start(procs, quiet, None, log, port=first.port)
    out = log.read_text()
    assert f"event=checkpoint_loaded seq={last.seq} " in out
    assert f"path={url}/{half} action=removed" in out  # the partial one is cleaned at start
    assert half not in ckpt_names(bucket, "run") or len(ckpt_names(bucket, "run")[half]) == 3
    status = learner.status()
    assert [f.version for f in status.fragments] == last.versions
    assert status.outer_step == last.outer_step
    # Training goes on from there, and a clean stop commits a newer checkpoint.
    learner.join()
    learner.push(p, 1, delta, c_steps=4, c_tokens=256)
    got = learner.poll(p, 1, wait=20)
    assert got is not None and got[0] == 2
    heartbeats.clear()
    assert second.stop(signal.SIGTERM) == 0
    final = CheckpointStore(url).load_latest(remove_stray=False)
    assert final is not None and final.seq > last.seq and final.versions[p] == 2
    assert all(len(files) == 3 for files in ckpt_names(bucket, "run").values())


def _start_syncer(config: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *syncer_argv(str(config), "0"),
        ],
        env={**env, "JAX_PLATFORMS": "cpu", "DILOCO_TOKEN": TOKEN},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_no_credential_or_no_bucket_exits_2_naming_the_field(
    bucket: Bucket, tmp_path: Path
) -> None:
    config = write_config(tmp_path / "run.yaml", checkpoint={"path": "gs://some-bucket/run"})
    # No emulator, no key file, no gcloud login, and the metadata server (what Workload
    # Identity answers through on GKE) at a closed loopback port: no credential anywhere.
    closed = f"127.0.0.1:{free_port()}"
    bare = {
        k: v
        for k, v in os.environ.items()
        if k not in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS")
    }
    bare.update(
        HOME=str(tmp_path),
        CLOUDSDK_CONFIG=str(tmp_path / "gcloud"),
        GCE_METADATA_HOST=closed,
        GCE_METADATA_IP=closed,
    )
    # The two syncers are independent (the second has the server but a bucket that does not
    # exist): they run side by side, each mostly its single-threaded start.
    started = [_start_syncer(config, bare), _start_syncer(config, dict(os.environ))]
    try:
        ended = [(proc.communicate(timeout=60)[1], proc.returncode) for proc in started]
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    (no_credential, code), (no_bucket, code_no_bucket) = ended
    assert code == 2, no_credential
    assert "training.checkpoint.path gs://some-bucket/run:" in no_credential
    assert "credential" in no_credential and "Workload Identity" in no_credential
    assert "Traceback" not in no_credential
    assert code_no_bucket == 2, no_bucket
    assert "training.checkpoint.path gs://some-bucket/run: bucket some-bucket does not exist" in (
        no_bucket
    )

"""`diloco-syncer` as a real process: SIGKILL + restart from checkpoint, SIGTERM, config errors."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from diloco_trainer.auth import unit_token
from diloco_trainer.learner.client import SyncerClient, SyncerUnavailable
from diloco_trainer.syncer import main as syncer_main
from diloco_trainer.syncer.checkpoint import CheckpointStore
from processes import syncer_argv

TOKEN = "process-token"


def small_model(**fields: object) -> dict[str, object]:
    """The one-layer model of these process tests; `fields` change or add some (initFrom)."""
    return {"preset": "tiny", "dModel": 16, "nLayers": 1, "nHeads": 2, "seqLen": 8, **fields}


def write_config(path: Path, **overrides: object) -> Path:
    cfg: dict[str, object] = {
        "model": small_model(),
        "fragments": 2,
        "quorum": 1,
        "grace": {"mode": "none"},
        "totalSteps": 1000,
        "checkpoint": {"everySeconds": 0.3, "keep": 2},
        "eval": {"everySeconds": None},
    }
    cfg.update(overrides)
    path.write_text(yaml.safe_dump(cfg))
    return path


class SyncerProcess:
    def __init__(self, config: Path, ckpt: Path | None, log: Path, port: int = 0) -> None:
        """`ckpt` None: the config's checkpoint.path."""
        self.log = log
        self.offset = log.stat().st_size if log.exists() else 0  # earlier runs share the log
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "DILOCO_TOKEN": TOKEN}
        where = [] if ckpt is None else ["--checkpoint-dir", str(ckpt)]
        self.proc = subprocess.Popen(
            [
                *syncer_argv(str(config), str(port)),
                *where,
            ],
            stdout=subprocess.DEVNULL,
            stderr=log.open("ab"),
            env=env,
        )
        self.port = self._wait_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def _wait_port(self, timeout: float = 90.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"syncer exited {self.proc.returncode}:\n{self.log.read_text()}"
                )
            ports = re.findall(r"event=listening host=\S+ port=(\d+)", self._new_output())
            if ports:
                return int(ports[-1])
            time.sleep(0.1)
        raise AssertionError(f"syncer did not start:\n{self.log.read_text()}")

    def _new_output(self) -> str:
        with self.log.open("rb") as f:
            f.seek(self.offset)
            return f.read().decode(errors="replace")

    def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(30)


@pytest.fixture
def procs() -> Iterator[list[SyncerProcess]]:
    started: list[SyncerProcess] = []
    yield started
    for p in started:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(10)


def start(
    procs: list[SyncerProcess], config: Path, ckpt: Path | None, log: Path, port: int = 0
) -> SyncerProcess:
    p = SyncerProcess(config, ckpt, log, port)
    procs.append(p)
    return p


def delta_for(
    client: SyncerClient, layout: list[list[str]], p: int, seed: int
) -> dict[str, np.ndarray]:
    shapes = client.join().shapes
    rng = np.random.default_rng(seed)
    return {n: (rng.normal(size=shapes[n]) * 0.01).astype(np.float32) for n in layout[p]}


def test_sigkill_then_restart_loses_no_checkpointed_version(
    tmp_path: Path, procs: list[SyncerProcess]
) -> None:
    config, ckpt, log = (
        write_config(tmp_path / "run.yaml"),
        tmp_path / "ckpt",
        tmp_path / "syncer.log",
    )
    first = start(procs, config, ckpt, log)
    learner = SyncerClient(first.url, unit_token(TOKEN, "unit-0"), "unit-0", 0, timeout=5)
    join = learner.join()
    for i in range(3):  # fragment 0 -> version 3, fragment 1 -> version 3
        for p in range(2):
            learner.push(
                p, i, delta_for(learner, join.layout, p, 10 * i + p), c_steps=4, c_tokens=4 * 64
            )
            assert learner.poll(p, i, wait=10) is not None
    learner.heartbeat(12, 12 * 64, 500.0, 4.0)
    store = CheckpointStore(ckpt)
    deadline = time.monotonic() + 30
    while True:  # wait until the periodic checkpoint has caught up with the state
        snap = store.load_latest(remove_stray=False)
        if snap is not None and snap.versions == [3, 3] and snap.learners:
            break
        assert time.monotonic() < deadline, "no checkpoint with versions [3, 3]"
        time.sleep(0.1)
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    with pytest.raises(SyncerUnavailable):
        learner.heartbeat(13, 13 * 64, 500.0, 4.0)  # the learner sees the outage as retryable

    # Same address, so learners reconnect; periodic checkpoints off, to see the SIGTERM one.
    quiet = write_config(tmp_path / "quiet.yaml", checkpoint={"everySeconds": 3600, "keep": 2})
    second = start(procs, quiet, ckpt, log, port=first.port)
    status = learner.status()
    assert [f.version for f in status.fragments] == [3, 3]
    assert status.steps == 12 and status.outer_step == 6
    params, versions = learner.pull_all()
    assert versions == [3, 3]
    for name, value in snap.params.items():
        np.testing.assert_array_equal(params[name], value)
    # Training goes on: the outer optimizer state came back too, and new versions follow.
    learner.join()
    learner.push(0, 3, delta_for(learner, join.layout, 0, 99), 4, 256)
    got = learner.poll(0, 3, wait=10)
    assert got is not None and got[0] == 4
    # SIGTERM with a long-poll in flight: the poll is answered and the process exits promptly.
    poller = SyncerClient(second.url, unit_token(TOKEN, "unit-0"), "unit-0", 0, timeout=5)
    polled: list[object] = []
    thread = threading.Thread(target=lambda: polled.append(poller.poll(1, 3, wait=50)))
    thread.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    assert second.stop(signal.SIGTERM) == 0
    assert time.monotonic() - t0 < 15
    thread.join(10)
    assert polled == [None]
    final = store.load_latest(remove_stray=False)
    assert final is not None and final.versions == [4, 3] and final.seq > snap.seq
    np.testing.assert_array_equal(final.params[join.layout[0][0]], got[1][join.layout[0][0]])


def test_config_errors_exit_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DILOCO_TOKEN", raising=False)
    monkeypatch.delenv("DILOCO_TOKEN_FILE", raising=False)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"innerSteps": 0, "totalSteps": 10}))
    assert syncer_main.main(["--config", str(bad), "--token", "t"]) == 2
    assert "innerSteps" in capsys.readouterr().err
    good = write_config(tmp_path / "good.yaml")
    assert syncer_main.main(["--config", str(good)]) == 2
    assert "--token (or DILOCO_TOKEN / DILOCO_TOKEN_FILE) is required" in capsys.readouterr().err
    monkeypatch.setenv("DILOCO_SYNCER_PORT", "http")
    assert syncer_main.main(["--config", str(good), "--token", "t"]) == 2
    assert "DILOCO_SYNCER_PORT" in capsys.readouterr().err
    monkeypatch.delenv("DILOCO_SYNCER_PORT")
    for bad_units in ("0", "two", "+3"):
        monkeypatch.setenv("DILOCO_MAX_UNITS", bad_units)
        assert syncer_main.main(["--config", str(good), "--token", "t"]) == 2
        assert "DILOCO_MAX_UNITS" in capsys.readouterr().err
    assert syncer_main.resolve_max_units(None, {"DILOCO_MAX_UNITS": "4"}) == 4
    assert syncer_main.resolve_max_units("2", {"DILOCO_MAX_UNITS": "4"}) == 2
    assert syncer_main.resolve_max_units(None, {}) is None


def test_token_file_and_run_name_from_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DILOCO_TOKEN", raising=False)
    monkeypatch.delenv("DILOCO_RUN", raising=False)
    (tmp_path / "tok").write_text("s3cret\n")
    monkeypatch.setenv("DILOCO_TOKEN_FILE", str(tmp_path / "tok"))
    assert syncer_main.resolve_token(None, os.environ) == "s3cret"
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        yaml.safe_dump({"kind": "DilocoRun", "metadata": {"name": "llm-7"}, "spec": {}})
    )
    assert syncer_main.run_name(None, str(manifest)) == "llm-7"
    assert syncer_main.run_name(None, str(write_config(tmp_path / "bare.yaml"))) == "bare"


def test_checkpoint_dir_with_foreign_files_refuses_to_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "something.bin").write_bytes(b"x")
    config = write_config(tmp_path / "run.yaml")
    args = ["--config", str(config), "--token", "t", "--checkpoint-dir", str(ckpt)]
    assert syncer_main.main(args) == 1
    assert "no valid checkpoint" in capsys.readouterr().err


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """Make the directory `path` read-only for real: a read-only bind mount over itself as root
    (root ignores permission bits), mode 0555 otherwise."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    bind = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
    if bind.returncode != 0:
        pytest.skip(f"root without the right to mount: {bind.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def _http(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_a_read_only_checkpoint_dir_stops_merges_without_losing_them(
    tmp_path: Path, procs: list[SyncerProcess]
) -> None:
    """The disk under the checkpoint directory turns read-only. Merges (whose
    versions must be journaled first) and checkpoints fail: /readyz says 503 and names them,
    the metric says so, pushes are kept pending; once the disk is writable again the round
    merges and the syncer is ready again."""
    config, ckpt, log = (
        write_config(tmp_path / "run.yaml"),
        tmp_path / "ckpt",
        tmp_path / "syncer.log",
    )
    syncer = start(procs, config, ckpt, log)
    learner = SyncerClient(syncer.url, unit_token(TOKEN, "unit-0"), "unit-0", 0, timeout=5)
    join = learner.join()
    assert _http(f"{syncer.url}/readyz") == (200, "ready")
    with read_only(ckpt):
        learner.push(0, 0, delta_for(learner, join.layout, 0, 1), c_steps=4, c_tokens=256)
        learner.heartbeat(4, 256, 100.0, 3.0)  # changes the state: a checkpoint is due
        deadline = time.monotonic() + 20
        while True:
            code, body = _http(f"{syncer.url}/readyz")
            if code == 503 and {"merge", "checkpoint"} <= set(json.loads(body)["problems"]):
                break
            assert time.monotonic() < deadline, f"still {code} {body}"
            time.sleep(0.1)
        assert "Read-only file system" in json.loads(body)["problems"]["merge"]
        metrics = _http(f"{syncer.url}/metrics")[1]
        assert 'diloco_syncer_failing{what="merge"} 1.0' in metrics
        assert learner.status().fragments[0].version == 0
    got = learner.poll(0, 0, wait=30)  # the kept contribution merges once the disk is back
    assert got is not None and got[0] == 1
    deadline = time.monotonic() + 20
    while _http(f"{syncer.url}/readyz")[0] != 200:
        assert time.monotonic() < deadline, "not ready again"
        time.sleep(0.1)
    assert CheckpointStore(ckpt).recorded_versions() == [1, 0]

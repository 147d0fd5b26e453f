"""A bad model entrypoint stops the real learner and syncer programs at start: exit code 2, one
message naming the field, and the syncer never listens."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

BAD = {
    "totalSteps": 10,
    "model": {"entrypoint": "no_such_models_pkg:build"},
    "data": {"batchSize": 4, "maxBytes": 1 << 18},
}
MESSAGE = "training.model.entrypoint: cannot import module 'no_such_models_pkg'"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(BAD))
    env = dict(os.environ, JAX_PLATFORMS="cpu", DILOCO_TOKEN="t")
    return subprocess.run(
        [sys.executable, "-m", *args, "--config", str(config)],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip


def test_the_syncer_exits_2_before_listening(tmp_path: Path) -> None:
    port = _free_port()
    done = _run(["diloco_trainer.syncer.main", "--port", str(port)], tmp_path)
    assert done.returncode == 2, done.stderr
    assert MESSAGE in done.stderr
    assert "event=listening" not in done.stderr + done.stdout


def test_the_learner_exits_2_before_joining(tmp_path: Path) -> None:
    args = ["--syncer", f"http://127.0.0.1:{_free_port()}", "--unit", "0", "--num-units", "1"]
    done = _run(["diloco_trainer.learner.main", *args], tmp_path)
    assert done.returncode == 2, done.stderr
    assert MESSAGE in done.stderr
    assert "event=join" not in done.stderr + done.stdout


def test_local_run_refuses_a_bad_entrypoint_before_starting_anything(tmp_path: Path) -> None:
    manifest = {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DilocoRun",
        "metadata": {"name": "bad-model"},
        "spec": {"image": "x", "replicas": 2, "training": BAD},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(manifest))
    report = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "diloco_operator.cli", "local", "run", str(path),
         "--report-dir", str(report), "--max-seconds", "30"],
        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=120,
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert MESSAGE in " ".join(done.stderr.split())  # rich may wrap the line
    assert not report.exists()

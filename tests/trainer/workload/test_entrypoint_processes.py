"""A bad model entrypoint stops the real learner and syncer programs at start: exit code 2, one
message naming the field, and the syncer never listens.

The three programs are independent, so they start together (one module fixture) and each test
judges its own: most of each run is a single-threaded `import jax`, and side by side they use
both of the suite's cores instead of one after the other."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

BAD = {
    "totalSteps": 10,
    "model": {"entrypoint": "no_such_models_pkg:build"},
    "data": {"batchSize": 4, "maxBytes": 1 << 18},
}
MESSAGE = "training.model.entrypoint: cannot import module 'no_such_models_pkg'"


class Finished(NamedTuple):
    folder: Path  # where it ran: what it must not have written would be under it
    returncode: int
    stdout: str
    stderr: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _module(args: list[str], folder: Path) -> list[str]:
    config = folder / "bad.yaml"
    config.write_text(yaml.safe_dump(BAD))
    return [sys.executable, "-m", *args, "--config", str(config)]


def _local_run(folder: Path) -> list[str]:
    manifest = {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DilocoRun",
        "metadata": {"name": "bad-model"},
        "spec": {"image": "x", "replicas": 2, "training": BAD},
    }
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return [
        sys.executable,
        "-m",
        "diloco_operator.cli",
        "local",
        "run",
        str(path),
        "--report-dir",
        str(folder / "report"),
        "--max-seconds",
        "30",
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Finished]:
    """Each program's finished run, keyed by name."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("syncer", "learner", "local")}
    learner = ["--syncer", f"http://127.0.0.1:{_free_port()}", "--unit", "0", "--num-units", "1"]
    commands = {
        "syncer": (
            _module(["diloco_trainer.syncer.main", "--port", str(_free_port())], folders["syncer"]),
            dict(os.environ, JAX_PLATFORMS="cpu", DILOCO_TOKEN="t"),
        ),
        "learner": (
            _module(["diloco_trainer.learner.main", *learner], folders["learner"]),
            dict(os.environ, JAX_PLATFORMS="cpu", DILOCO_TOKEN="t"),
        ),
        "local": (_local_run(folders["local"]), dict(os.environ, JAX_PLATFORMS="cpu")),
    }
    started = {
        name: subprocess.Popen(
            command,
            env=env,
            cwd=folders[name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (command, env) in commands.items()
    }
    done: dict[str, Finished] = {}
    try:
        for name, proc in started.items():
            out, err = proc.communicate(timeout=120)
            done[name] = Finished(folders[name], proc.returncode, out, err)
    finally:
        for proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return done


def test_the_syncer_exits_2_before_listening(
    runs: dict[str, Finished],
) -> None:
    done = runs["syncer"]
    assert done.returncode == 2, done.stderr
    assert MESSAGE in done.stderr
    assert "event=listening" not in done.stderr + done.stdout


def test_the_learner_exits_2_before_joining(
    runs: dict[str, Finished],
) -> None:
    done = runs["learner"]
    assert done.returncode == 2, done.stderr
    assert MESSAGE in done.stderr
    assert "event=join" not in done.stderr + done.stdout


def test_local_run_refuses_a_bad_entrypoint_before_starting_anything(
    runs: dict[str, Finished],
) -> None:
    done = runs["local"]
    assert done.returncode == 2, done.stderr
    assert MESSAGE in " ".join(done.stderr.split())  # rich may wrap the line
    assert not (done.folder / "report").exists()

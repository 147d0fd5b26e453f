"""A real `diloco-syncer` on a loopback port and three real `diloco-learner` processes.

Asserts the data plane end to end: the global model's held-out loss goes down, every fragment's
version advances, learners report progress, and everything exits 0 once the budget is reached.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_trainer.auth import unit_token

pytestmark = pytest.mark.slow

TOKEN = "integration-token"
UNITS = 3
STEPS_PER_UNIT = 80
# Stretch steps so the syncer (same 2 cores) merges while learners still train.
SLOWDOWN = "4"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _status(port: int) -> dict[str, Any]:
    return dict(json.loads(_get(port, "/v1/status")))


def _get(port: int, path: str) -> bytes:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return bytes(response.read())


def _wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "syncer exited during startup"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise AssertionError("syncer did not become healthy")


def _eval_losses(syncer_log: str) -> list[float]:
    return [float(m) for m in re.findall(r"event=eval outer_step=\d+ loss=([0-9.]+)", syncer_log)]


def test_syncer_and_three_learners_train_together(tmp_path: Path) -> None:
    config = {
        "model": {"dModel": 32, "nLayers": 1, "nHeads": 2, "seqLen": 32},
        "data": {"batchSize": 8, "maxBytes": 1 << 20},
        "innerSteps": 8,
        "fragments": 2,
        "quorum": 1,
        # Both directions quantized: the learners rebuild each new version from int4 steps.
        "compression": {"scheme": "int8", "downlink": "int4"},
        "outerOptimizer": {"lr": 0.5, "momentum": 0.5},
        "innerOptimizer": {"lr": 0.003, "warmupSteps": 5},
        "totalSteps": UNITS * STEPS_PER_UNIT,
        "heartbeatSeconds": 0.3,
        "eval": {"everySeconds": 2.0, "batches": 2},
        "checkpoint": {"path": str(tmp_path / "ckpt"), "everySeconds": 5},
    }
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(config))
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", DILOCO_TOKEN=TOKEN)
    env["DILOCO_CACHE_DIR"] = os.environ.get("DILOCO_CACHE_DIR", str(Path.home() / ".cache/diloco"))
    syncer_log = tmp_path / "syncer.log"
    with syncer_log.open("wb") as out:
        syncer = subprocess.Popen(
            [
                _bin("diloco-syncer"),
                "--config",
                str(config_path),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    learners: list[subprocess.Popen[bytes]] = []
    try:
        _wait_healthy(port, syncer)
        for unit in range(UNITS):
            learner_env = dict(
                env,
                DILOCO_SYNCER_ADDR=f"http://127.0.0.1:{port}",
                DILOCO_UNIT=str(unit),
                DILOCO_NUM_UNITS=str(UNITS),
                DILOCO_SLOWDOWN=SLOWDOWN,
                DILOCO_TOKEN=unit_token(TOKEN, f"unit-{unit}"),  # its own, not the run secret
            )
            with (tmp_path / f"learner-{unit}.log").open("wb") as out:
                learners.append(
                    subprocess.Popen(
                        [_bin("diloco-learner"), "--config", str(config_path), "--log-every", "10"],
                        env=learner_env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
        codes = [proc.wait(timeout=240) for proc in learners]
        logs = {u: (tmp_path / f"learner-{u}.log").read_text() for u in range(UNITS)}
        assert codes == [0] * UNITS, logs
        status = _status(port)
        metrics = _get(port, "/metrics").decode()
        # One more eval of the final global model before judging the loss curve.
        time.sleep(1.5)
    finally:
        for proc in learners:
            if proc.poll() is None:
                proc.kill()
        syncer.send_signal(signal.SIGTERM)
        syncer_code = syncer.wait(timeout=30)
    text = syncer_log.read_text()
    assert syncer_code == 0, text[-3000:]

    assert status["complete"] is True
    assert status["steps"] >= UNITS * STEPS_PER_UNIT
    assert all(f["version"] >= 2 for f in status["fragments"]), status["fragments"]
    assert set(status["learners"]) == {f"unit-{u}" for u in range(UNITS)}
    received = 0
    for u in range(UNITS):
        assert "event=run_complete" in logs[u]
        exit_line = re.search(
            r"event=exit unit=unit-\d .*complete=True .*versions=([\d,]+) .*"
            r"overwritten_share=([0-9.]+)",
            logs[u],
        )
        assert exit_line, logs[u][-2000:]
        received += sum(int(v) for v in exit_line.group(1).split(","))
        # Every install lands at least one step after the push it answers (the step in flight),
        # and every fragment is pushed: some of the learner's work is replaced, never all of it.
        assert 0 < float(exit_line.group(2)) < 1, exit_line.group(0)
    assert received > 0, "no learner installed a new global fragment"
    steps_sent = re.search(
        r'diloco_syncer_fragment_downloads_total\{kind="step"\} ([0-9.]+)', metrics
    )
    assert steps_sent and float(steps_sent.group(1)) > 0, metrics
    losses = _eval_losses(text)
    assert len(losses) >= 2, text[-3000:]
    assert losses[-1] < losses[0] - 0.5, losses

"""A supervised learner (`--supervise`) as real processes: the supervisor imports once and forks
the learner; a SIGKILLed learner is forked again at once, a new attempt at the syncer, while the
supervisor stays; once the pod's restarts in place are spent the next learner exits 3 and so
does the supervisor (the operator then recreates the unit)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from diloco_trainer.auth import unit_token
from diloco_trainer.syncer.core import Syncer

from tests.trainer.syncer.test_syncer import TOKEN, LiveSyncer, tiny_cfg

pytestmark = pytest.mark.slow

UNIT = "unit-0"


def wait(what: str, cond: Callable[[], object], proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    while not cond():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what}: exit {proc.poll()}\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_crashed_learner_is_forked_again_until_its_restarts_are_spent(tmp_path: Path) -> None:
    cfg = tiny_cfg(totalSteps=10**9, heartbeatSeconds=0.2, innerSteps=5)
    live = LiveSyncer(Syncer(cfg, TOKEN, run="r", store=None, eval_fn=None))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg.to_wire()))
    log = tmp_path / "learner.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env |= {
        "JAX_PLATFORMS": "cpu",
        "DILOCO_SYNCER_ADDR": live.url,
        "DILOCO_TOKEN": unit_token(TOKEN, UNIT),
        "DILOCO_UNIT": "0",
        "DILOCO_UNIT_NAME": UNIT,
        "DILOCO_SUPERVISE": "1",
        "DILOCO_RESTART_DIR": str(tmp_path),
        "DILOCO_IN_PLACE_RESTARTS": "1",
        "DILOCO_CACHE_DIR": os.environ.get("DILOCO_CACHE_DIR", str(tmp_path / "cache")),
    }
    argv = [sys.executable, "-m", "diloco_trainer.learner.main", "--config", str(config)]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:

        def heard(attempt: int) -> bool:
            learner = live.syncer.learners.records.get(UNIT)
            return learner is not None and learner.attempt == attempt and bool(learner.attempts)

        wait("the first learner joined", lambda: heard(0), proc, log)
        (first,) = children(proc.pid)
        os.kill(first, signal.SIGKILL)
        crashed = time.monotonic()
        wait("the learner forked again, attempt 1", lambda: heard(1), proc, log)
        print(
            f"SIGKILL -> the next learner heard by the syncer in {time.monotonic() - crashed:.2f}s"
        )
        assert proc.poll() is None, "the supervisor must outlive its learner"
        (second,) = children(proc.pid)
        assert second != first

        os.kill(second, signal.SIGKILL)  # the one restart in place allowed is spent
        assert proc.wait(120) == 3, log.read_text()[-3000:]
        text = log.read_text()
        assert "event=learner_crashed exit=137 action=restart_in_container" in text
        assert "restarts in place allowed in this pod are spent" in text
    finally:
        if proc.poll() is None:
            proc.kill()
        live.close()

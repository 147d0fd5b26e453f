"""A two-host unit as real processes: two supervised learners form one JAX program
(jax.distributed over loopback, gloo collectives on CPU) and train against a live syncer. A
SIGKILL of host 1's learner restarts both hosts' learners in their supervisors (a new
generation, a new attempt at the syncer), and the unit trains on."""

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
from gcs_server import free_port

from tests.trainer.learner.test_supervisor_process import children
from tests.trainer.syncer.test_syncer import TOKEN, LiveSyncer, tiny_cfg

pytestmark = pytest.mark.slow

UNIT = "unit-0"
HOSTS = ["127.0.0.1", "127.0.0.2"]


def start_host(
    i: int, live: LiveSyncer, config: Path, tmp: Path, port: int
) -> tuple[subprocess.Popen[bytes], Path]:
    folder = tmp / f"host-{i}"
    folder.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env |= {
        "JAX_PLATFORMS": "cpu",
        "DILOCO_SYNCER_ADDR": live.url,
        "DILOCO_TOKEN": unit_token(TOKEN, UNIT),
        "DILOCO_UNIT": "0",
        "DILOCO_UNIT_NAME": UNIT,
        "DILOCO_SUPERVISE": "1",
        "DILOCO_RESTART_DIR": str(folder),
        "DILOCO_IN_PLACE_RESTARTS": "3",
        "DILOCO_CACHE_DIR": os.environ.get("DILOCO_CACHE_DIR", str(tmp / "cache")),
        "TPU_WORKER_HOSTNAMES": ",".join(HOSTS),
        "TPU_WORKER_ID": str(i),
        "DILOCO_UNIT_RESTART_PORT": str(port),
        "DILOCO_UNIT_RESTART_BIND": HOSTS[i],
    }
    log = tmp / f"host-{i}.log"
    argv = [sys.executable, "-m", "diloco_trainer.learner.main", "--config", str(config)]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def test_one_hosts_crash_restarts_the_whole_unit_in_place(tmp_path: Path) -> None:
    cfg = tiny_cfg(totalSteps=10**9, heartbeatSeconds=0.2, innerSteps=5)
    live = LiveSyncer(Syncer(cfg, TOKEN, run="r", store=None, eval_fn=None))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg.to_wire()))
    port = free_port()
    hosts = [start_host(i, live, config, tmp_path, port) for i in range(2)]

    def logs() -> str:
        return "\n".join(f"--- {p}\n{p.read_text()[-2500:]}" for _, p in hosts)

    def wait(what: str, cond: Callable[[], object], timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            dead = [p.poll() for p, _ in hosts if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise AssertionError(f"{what}: exits {dead}\n{logs()}")
            time.sleep(0.05)

    def stepped(attempt: int, past: int) -> bool:
        record = live.syncer.learners.records.get(UNIT)
        steps = record.attempts.get(attempt) if record is not None else None
        return bool(steps) and steps[0] > past

    try:
        wait("the unit trained as attempt 0", lambda: stepped(0, 10))
        leader_before = children(hosts[0][0].pid)
        (victim,) = children(hosts[1][0].pid)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        wait("both hosts restarted; the unit trains as attempt 1", lambda: stepped(1, 10))
        print(
            f"SIGKILL of host 1's learner -> the unit training again: {time.monotonic() - killed:.2f}s"
        )
        assert children(hosts[0][0].pid) != leader_before, "host 0's learner must restart too"
        host0, host1 = (p.read_text() for _, p in hosts)
        assert "event=learner_crashed exit=137" in host1
        assert "event=unit_restart generation=1" in host1
        assert "event=unit_restart_heard generation=1 was=0" in host0
        assert "event=learner_restarted_for_unit" in host0
        assert "coordinator=127.0.0.1:8477" in host0 and "coordinator=127.0.0.1:8477" in host1
        # Stopped (the pods deleted): each supervisor passes SIGTERM on and, for a learner that
        # cannot act on it (waiting in a collective its peer left), SIGKILLs it after a grace.
        for proc, _ in hosts:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in hosts:
            proc.wait(60)  # never: a learner left waiting would keep its pod to the grace end
    finally:
        for proc, _ in hosts:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in hosts:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        live.close()

"""The local runtime's fork server: real learners forked from a process that imported JAX once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from diloco_operator.local.forkserver import ForkedChild, ForkServer
from diloco_operator.local.programs import child_env

CONFIG = (
    "totalSteps: 10\nmodel: {preset: tiny, dModel: 32, nLayers: 1, nHeads: 2, seqLen: 32}\n"
    "data: {batchSize: 4, maxBytes: 65536}\n"
)


def wait_exit(child: ForkedChild, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = child.poll()
        if code is not None:
            return code
        time.sleep(0.1)
    return None


@pytest.mark.slow
def test_forked_spare_warms_up_takes_an_identity_and_reports_exit_codes(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG)
    env = child_env(dict(os.environ))
    env.update(
        {"DILOCO_NUM_UNITS": "2", "DILOCO_TOKEN": "t", "DILOCO_SYNCER_ADDR": "http://127.0.0.1:1"}
    )
    server = ForkServer(env)
    try:
        assert server.wait_ready(120), "the fork server never finished its imports"
        spare_log = tmp_path / "spare.log"
        spare = server.fork(["--config", str(config), "--standby"], env, spare_log).result(30)
        assert os.getpgid(spare.pid) == spare.pid  # its own group: killpg reaches only it
        # ... in the supervisor's session: a session of its own is a scheduler autogroup of its
        # own, and the learners' speeds swing (processes.py)
        assert os.getsid(spare.pid) == os.getsid(0)
        deadline = time.monotonic() + 120
        while "event=standby_ready" not in _text(spare_log) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "event=standby_ready" in spare_log.read_text()
        # A bad identity is the same usage error (exit 2) as the flag would be, through the
        # supervisor's pipe, with the learner's own message in the log.
        assert spare.stdin is not None
        spare.stdin.write(b'{"unit": 5, "attempt": 1}\n')
        spare.stdin.close()
        assert wait_exit(spare, 60) == 2
        assert "--unit 5 must be < --num-units 2" in spare_log.read_text()

        # A spare released without an identity exits 0; one killed reports the signal.
        idle = server.fork(["--config", str(config), "--standby"], env, spare_log).result(30)
        assert idle.stdin is not None
        idle.stdin.close()
        assert wait_exit(idle, 120) == 0
        victim = server.fork(["--config", str(config), "--standby"], env, spare_log).result(30)
        os.killpg(victim.pid, signal.SIGKILL)
        assert wait_exit(victim, 30) == -signal.SIGKILL
        assert forkservers(), "the fork server is not a child of this process"
    finally:
        server.finish_pending()
        server.close()
    assert forkservers() == []


def _text(log: Path) -> str:
    """The log so far; "" before the child has created it (it takes its own process group,
    which is what the fork waits for, before it opens its log)."""
    return log.read_text() if log.exists() else ""


def forkservers() -> list[int]:
    found = []
    for child in psutil.Process().children():
        try:
            server = any("multiprocessing.forkserver" in arg for arg in child.cmdline())
            if server and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child.pid)
        except psutil.Error:
            continue
    return found

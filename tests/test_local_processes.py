"""The process table: process groups, pause/resume, stop without survivors, and no orphans even
when the supervisor itself is SIGKILLed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from diloco_operator.local.processes import ProcessTable

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
# A child that starts a grandchild in its own process group: stop must still reach it.
SPAWNER = [
    sys.executable,
    "-c",
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
    "'import time; time.sleep(60)']); time.sleep(60)",
]


def wait_for(cond: Callable[[], object], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_signal_poll_and_stop_all_leave_no_survivors(tmp_path: Path) -> None:
    table = ProcessTable()
    a = table.spawn("a", SLEEPER, {}, tmp_path / "a.log")
    b = table.spawn("b", SPAWNER, {}, tmp_path / "b.log")
    assert wait_for(lambda: len(psutil.Process(b.pid).children()) == 1)
    table.poll()  # notes b's grandchild
    assert table.signal("a", signal.SIGSTOP) and a.paused
    assert wait_for(lambda: psutil.Process(a.pid).status() == psutil.STATUS_STOPPED)
    assert table.signal("a", signal.SIGCONT) and not a.paused
    assert table.signal("a", signal.SIGKILL)
    assert wait_for(lambda: table.poll().get("a") == -signal.SIGKILL)
    assert not table.signal("a", signal.SIGKILL)  # already gone
    table.signal("b", signal.SIGSTOP)  # stop_all must still end a stopped process
    table.stop_all(grace_seconds=2.0)
    assert table.survivors() == []
    assert b.returncode is not None and len(b.seen_pids) == 2


def test_children_die_with_a_sigkilled_supervisor(tmp_path: Path) -> None:
    script = (
        "import json, sys, time\n"
        "from pathlib import Path\n"
        "from diloco_operator.local.processes import ProcessTable\n"
        "t = ProcessTable()\n"
        f"pids = [t.spawn(k, {SLEEPER!r}, {{}}, Path({str(tmp_path)!r}) / k).pid for k in 'xy']\n"
        "print(json.dumps(pids), flush=True)\n"
        "time.sleep(60)\n"
    )
    sup = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert sup.stdout is not None
    pids = json.loads(sup.stdout.readline())
    assert all(psutil.pid_exists(p) for p in pids)
    sup.kill()
    sup.wait()
    assert wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), timeout=10)

"""The process table: process groups, pause/resume, stop without survivors, and no orphans even
when the supervisor itself is SIGKILLed."""

from __future__ import annotations

import json
import os
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
    # Each leads its own group, in this session: not one autogroup per child (processes.py).
    assert os.getpgid(a.pid) == a.pid and os.getsid(a.pid) == os.getsid(0)
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


def test_an_exit_reaped_while_stopping_others_is_still_reported(tmp_path: Path) -> None:
    """stop() reaps every child; a death it came across (the syncer's, say) must still reach
    the next poll(), while the children it was asked to stop are no exit to act on."""
    table = ProcessTable()
    doomed = table.spawn(
        "doomed", [sys.executable, "-c", "raise SystemExit(3)"], {}, tmp_path / "d.log"
    )
    table.spawn("stopped", SLEEPER, {}, tmp_path / "s.log")
    assert wait_for(lambda: doomed.popen.poll() is not None)
    table.stop(["stopped"], grace_seconds=2.0)
    table.stop([], grace_seconds=2.0)  # what every pass of the runtime does with no deletes
    assert table.poll() == {"doomed": 3}
    assert table.poll() == {}


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


# A stand-in spare: waits for one line on stdin, then "becomes" what it says until killed.
WAITER = [
    sys.executable,
    "-c",
    "import sys, time; line = sys.stdin.readline(); print('took', line.strip(), flush=True); "
    "time.sleep(60)",
]


def test_hand_over_makes_a_waiting_process_the_unit(tmp_path: Path) -> None:
    table = ProcessTable()
    old = table.spawn("u", SLEEPER, {}, tmp_path / "u.log")
    assert table.signal("u", signal.SIGKILL)
    assert wait_for(lambda: "u" in table.poll())
    spare = table.spawn("spare:0", WAITER, {}, tmp_path / "spares.log", stdin_pipe=True)
    assert not table.any_exited()
    assert table.hand_over("spare:0", "u", b'{"unit": 0}\n', tmp_path / "u.log")
    assert table.get("u") is spare and "spare:0" not in table
    assert spare.key == "u" and spare.log_path == tmp_path / "u.log"
    assert wait_for(lambda: "took" in (tmp_path / "spares.log").read_text())
    # It is the unit now: signals by the unit's name reach it, its exit is the unit's.
    assert table.signal("u", signal.SIGKILL)
    assert wait_for(table.any_exited)
    assert table.poll() == {"u": -signal.SIGKILL}
    # The first attempt's record is kept, so survivors() still checks its pids.
    table.stop_all(grace_seconds=1.0)
    assert table.survivors() == []
    assert old.returncode == -signal.SIGKILL


def test_hand_over_to_a_dead_spare_fails_and_renames_nothing(tmp_path: Path) -> None:
    table = ProcessTable()
    spare = table.spawn("spare:0", WAITER, {}, tmp_path / "spares.log", stdin_pipe=True)
    assert table.signal("spare:0", signal.SIGKILL)
    assert wait_for(lambda: spare.popen.poll() is not None)
    assert not table.hand_over("spare:0", "u", b"{}\n", tmp_path / "u.log")
    assert table.get("u") is None
    assert table.poll() == {"spare:0": -signal.SIGKILL}

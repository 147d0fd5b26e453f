"""The seeded chaos scheduler: deterministic, keeps its fault count, respects fixed schedules."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from diloco_operator.local.chaos import (
    ChaosScheduler,
    ChaosSettings,
    Fault,
    FaultDelivery,
    ScheduledFault,
)
from diloco_operator.local.processes import ProcessTable
from diloco_operator.local.recorder import Recorder


def drive(settings: ChaosSettings, running: list[int], until: float, tick: float = 0.5):
    sched = ChaosScheduler(settings)
    out = []
    t = 0.0
    while t <= until:
        out.extend(sched.due(t, running))
        t += tick
    return out


def test_same_seed_same_faults_and_other_seed_differs() -> None:
    s = ChaosSettings(enabled=True, seed=7, start_after_seconds=0, kill_interval_seconds=5)
    a = drive(s, [0, 1, 2, 3], 120)
    b = drive(s, [0, 1, 2, 3], 120)
    c = drive(ChaosSettings(**{**s.__dict__, "seed": 8}), [0, 1, 2, 3], 120)
    assert a == b
    assert [(f.at, f.unit) for f in a] != [(f.at, f.unit) for f in c]
    # Poisson arrivals with mean gap 5 s over 120 s: about 24 kills; allow wide noise.
    assert 10 <= len(a) <= 45
    assert {f.unit for f in a} == {0, 1, 2, 3}
    assert all(f.kind == "kill" for f in a)


def test_disabled_injects_nothing_even_with_schedule() -> None:
    s = ChaosSettings(
        enabled=False, kill_interval_seconds=1, schedule=(ScheduledFault(1.0, "kill", 0),)
    )
    assert drive(s, [0, 1], 30) == []


def test_fixed_schedule_in_order_with_pause_resume_time() -> None:
    s = ChaosSettings(
        enabled=True,
        schedule=(
            ScheduledFault(6.0, "kill-syncer"),
            ScheduledFault(2.0, "pause", 1, pause_seconds=3.0),
            ScheduledFault(4.0, "kill", 0),
        ),
    )
    faults = drive(s, [0, 1], 10)
    assert [(f.kind, f.unit, f.at) for f in faults] == [
        ("pause", 1, 2.0),
        ("kill", 0, 4.0),
        ("kill-syncer", None, 6.0),
    ]
    assert faults[0].resume_at == 5.0


def test_syncer_kill_waits_until_the_syncer_serves_and_keeps_the_order() -> None:
    s = ChaosSettings(
        enabled=True,
        schedule=(ScheduledFault(1.0, "kill-syncer"), ScheduledFault(2.0, "kill", 0)),
    )
    sched = ChaosScheduler(s)
    assert sched.due(5.0, [0], syncer_up=False) == []  # still starting: both wait, in order
    faults = sched.due(6.0, [0], syncer_up=True)
    assert [(f.kind, f.unit) for f in faults] == [("kill-syncer", None), ("kill", 0)]


def test_unit_fault_waits_until_its_unit_runs() -> None:
    sched = ChaosScheduler(ChaosSettings(enabled=True, schedule=(ScheduledFault(1.0, "kill", 2),)))
    assert sched.due(1.0, [0, 1]) == []  # unit 2 not running: kept, not dropped
    assert sched.due(3.0, [0, 1]) == []
    (fault,) = sched.due(3.5, [0, 1, 2])
    assert (fault.kind, fault.unit, fault.at) == ("kill", 2, 3.5)
    assert sched.due(10.0, [0, 1, 2]) == []


def test_random_kill_never_targets_a_stopped_unit_and_one_fault_per_unit_per_tick() -> None:
    s = ChaosSettings(
        enabled=True,
        start_after_seconds=0,
        kill_interval_seconds=0.1,
        pause_interval_seconds=0.1,
    )
    sched = ChaosScheduler(s)
    for t in range(1, 50):
        faults = sched.due(float(t), [3])
        assert all(f.unit == 3 for f in faults)
        assert len(faults) <= 1


@pytest.mark.parametrize(
    ("field", "value"),
    [("kill_interval_seconds", 0.0), ("pause_seconds", -1.0), ("start_after_seconds", -2.0)],
)
def test_bad_settings_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        ChaosSettings(enabled=True, **{field: value})


def test_two_syncer_kills_due_together_kill_one_process_once(tmp_path: Path) -> None:
    """Found by the soak bench: two kill-syncer faults due in one tick both signalled the one
    (still dying) process and were counted as two kills. The second is dropped; a kill after
    the syncer was replaced reaches the new process."""
    procs = ProcessTable()
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    recorder = Recorder(time.time())
    chaos = FaultDelivery(ChaosScheduler(ChaosSettings()), procs, recorder, [], ["syncer"])
    try:
        first = procs.spawn("syncer", sleeper, {}, tmp_path / "s.log")
        now = time.time()
        chaos.deliver(Fault("kill-syncer", None, 1.0), now)
        chaos.deliver(Fault("kill-syncer", None, 1.0), now)
        assert [e.kind for e in recorder.events] == ["chaos-kill-syncer"]
        first.popen.wait(timeout=10)
        assert procs.poll() == {"syncer": -9}
        second = procs.spawn("syncer", sleeper, {}, tmp_path / "s.log")
        chaos.deliver(Fault("kill-syncer", None, 2.0), time.time())
        assert [e.kind for e in recorder.events] == ["chaos-kill-syncer"] * 2
        assert second.popen.wait(timeout=10) < 0
    finally:
        procs.stop_all(grace_seconds=1.0)

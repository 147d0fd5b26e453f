"""What the planner sees of the local run's learner processes (pure), and the display's view
model built from a tick's snapshot."""

from __future__ import annotations

from diloco_operator.api import DilocoRunStatus, UnitStatus, parse_spec
from diloco_operator.local.display import RunSnapshot, build_view, chaos_line, unit_state
from diloco_operator.local.observe import UnitProcess, observe_units
from diloco_operator.planner import LearnerStatus, SyncerStatus, desired_units
from diloco_operator.planner.model import PROCESS_EXITED

SPEC = parse_spec(
    {
        "image": "local",
        "replicas": 4,
        "training": {"model": {"preset": "tiny"}, "totalTokens": 1000},
    }
)
SLOTS = desired_units("r", SPEC)
NAMES = [s.name for s in SLOTS]


def test_each_process_state_maps_to_a_phase_and_a_failure() -> None:
    procs = {
        NAMES[0]: UnitProcess(attempt=1, started_at=5.0),
        NAMES[1]: UnitProcess(attempt=0, started_at=5.0, exit_code=0),
        NAMES[2]: UnitProcess(attempt=2, started_at=5.0, exit_code=-9),
    }
    observed, ready = observe_units(SLOTS, procs, None, frozenset())
    by_name = {o.name: o for o in observed}
    assert NAMES[3] not in by_name  # no process: Missing
    assert (by_name[NAMES[0]].phase, by_name[NAMES[0]].ready) == ("Running", False)
    assert by_name[NAMES[0]].attempt == 1 and by_name[NAMES[0]].since == 5.0
    assert by_name[NAMES[1]].phase == "Succeeded"
    failed = by_name[NAMES[2]]
    assert (failed.phase, failed.failure) == ("Failed", PROCESS_EXITED)
    assert failed.message == "learner process killed by SIGKILL"
    assert ready == frozenset()


def test_a_killed_process_is_a_failure_before_it_is_reaped() -> None:
    procs = {NAMES[0]: UnitProcess(attempt=0, started_at=1.0, killed=True)}
    (unit,), _ = observe_units(SLOTS, procs, None, frozenset())
    assert (unit.phase, unit.failure) == ("Running", PROCESS_EXITED)
    assert "SIGKILL" in unit.message


def test_ready_once_the_syncer_heard_from_this_attempt_and_while_it_lives() -> None:
    procs = {NAMES[0]: UnitProcess(attempt=1, started_at=1.0)}
    old_attempt = SyncerStatus(learners={NAMES[0]: LearnerStatus(attempt=0)})
    (unit,), ready = observe_units(SLOTS, procs, old_attempt, frozenset())
    assert not unit.ready and ready == frozenset()
    this_attempt = SyncerStatus(learners={NAMES[0]: LearnerStatus(attempt=1)})
    (unit,), ready = observe_units(SLOTS, procs, this_attempt, ready)
    assert unit.ready and ready == {NAMES[0]}
    # A restarted syncer has forgotten the learner for now: it stays ready.
    (unit,), ready = observe_units(SLOTS, procs, None, ready)
    assert unit.ready and ready == {NAMES[0]}


def test_the_view_shows_the_last_served_status_and_paused_units() -> None:
    status = DilocoRunStatus(
        units=[
            UnitStatus(name=NAMES[0], group="default", index=0, global_index=0, state="Online"),
            UnitStatus(
                name=NAMES[1],
                group="default",
                index=1,
                global_index=1,
                state="Recreating",
                attempt=2,
                restarts=2,
            ),
        ]
    )
    syncer = SyncerStatus(
        outer_step=7,
        tokens=500,
        loss=3.5,
        learners={NAMES[0]: LearnerStatus(step=40, tokens_per_sec=900.0, loss=3.6)},
    )
    snap = RunSnapshot(
        run="r",
        spec=SPEC,
        slots=SLOTS,
        status=status,
        syncer=syncer,
        syncer_online=False,
        paused={NAMES[0]},
        slowdown={"default": 2.0},
        events=[],
        chaos=chaos_line(True, 30.0, 12.0),
        report_dir="runs/r",
    )
    view = build_view(snap, elapsed=12.0)
    assert (view.syncer_state, view.outer_step, view.tokens, view.token_budget) == (
        "offline",
        7,
        500,
        1000,
    )
    rows = {r.name: r for r in view.units}
    assert (rows[NAMES[0]].state, rows[NAMES[0]].step, rows[NAMES[0]].slowdown) == (
        "paused",
        40,
        2.0,
    )
    assert (rows[NAMES[1]].state, rows[NAMES[1]].restarts) == ("restarting", 2)
    assert rows[NAMES[2]].state == "pending" and rows[NAMES[2]].step is None
    assert view.chaos == "on, next fault in 18s"
    assert unit_state("Completed", False) == "complete"
    assert chaos_line(False, 3.0, 1.0) == "off"

"""Planner decisions: startup, every failure signal, recovery, budget, scaling, completion and an
operator restart rebuilding from observed children."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_operator.api import DilocoRunSpec, DilocoRunStatus, parse_spec
from diloco_operator.planner import (
    CreateSyncer,
    CreateUnit,
    DeleteUnit,
    EmitEvent,
    LearnerStatus,
    ObservedSyncer,
    ObservedUnit,
    Plan,
    SyncerStatus,
    desired_units,
    fault_targets,
    plan,
)
from diloco_operator.planner.failure import CACHE_LAG_SECONDS
from diloco_operator.planner.model import (
    DISRUPTION_TARGET,
    JOB_FAILED,
    NODE_NOT_READY,
    POD_DELETED,
)
from diloco_operator.planner.reconcile import FINISH_GRACE_SECONDS

T0 = 1_700_000_000.0
SYNCER_UP = ObservedSyncer(present=True, ready=True)


def make_spec(replicas: int = 3, **extra: Any) -> DilocoRunSpec:
    doc: dict[str, Any] = {
        "image": "trainer:dev",
        "replicas": replicas,
        "training": {"totalSteps": 1000},
        "failurePolicy": {
            "maxUnitRestarts": 2,
            "restartBackoffSeconds": 10,
            "offlineAfterSeconds": 30,
        },
    }
    doc.update(extra)
    return parse_spec(doc)


def running(name: str, attempt: int = 0, **kw: Any) -> ObservedUnit:
    group, index = name.split("-")[-2], int(name.split("-")[-1])
    fields: dict[str, Any] = {"phase": "Running", "ready": True, "since": T0}
    fields.update(kw)
    return ObservedUnit(name=name, group=group, index=index, attempt=attempt, **fields)


def events(p: Plan, reason: str | None = None) -> list[EmitEvent]:
    return [e for e in p.of_type(EmitEvent) if reason is None or e.reason == reason]


def unit(p: Plan, name: str) -> Any:
    return next(u for u in p.status.units if u.name == name)


def online_run(spec: DilocoRunSpec, now: float = T0) -> tuple[list[ObservedUnit], DilocoRunStatus]:
    """Start a run and bring every unit Online; returns the observed units and the status."""
    first = plan("r", spec, [], None, now, syncer=SYNCER_UP)
    observed = [running(c.name) for c in first.of_type(CreateUnit)]
    second = plan("r", spec, observed, first.status, now + 1, syncer=SYNCER_UP)
    assert second.status.phase == "Running"
    return observed, second.status


def test_fresh_run_creates_syncer_and_every_unit_with_stable_names() -> None:
    spec = make_spec(3)
    p = plan("r", spec, [], None, T0, syncer=ObservedSyncer(present=False, ready=False))
    assert p.of_type(CreateSyncer) == [CreateSyncer()]
    creates = p.of_type(CreateUnit)
    assert [(c.name, c.attempt, c.global_index, c.num_units) for c in creates] == [
        ("r-default-0", 0, 0, 3),
        ("r-default-1", 0, 1, 3),
        ("r-default-2", 0, 2, 3),
    ]
    assert p.status.phase == "Pending"
    assert {u.state for u in p.status.units} == {"Pending"}
    assert p.status.replicas == 3
    assert p.status.selector == "diloco.dev/run=r,diloco.dev/group=default"


def test_units_go_online_and_run_becomes_ready() -> None:
    spec = make_spec(2)
    observed, status = online_run(spec)
    assert status.units_online == 2
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert ready.status == "True"
    # A rerun with the same facts is a no-op: no actions, conditions keep their transition time.
    again = plan("r", spec, observed, status, T0 + 50, syncer=SYNCER_UP)
    assert again.actions == ()
    assert again.status.conditions == status.conditions


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"phase": "Failed", "ready": False}, "PodFailed"),
        ({"failure": DISRUPTION_TARGET}, DISRUPTION_TARGET),
        ({"failure": NODE_NOT_READY}, NODE_NOT_READY),
        # NODE_DELETED is a preemption, not a failure: tests/operator/test_spot.py.
        ({"failure": JOB_FAILED, "phase": "Failed"}, JOB_FAILED),
        ({"failure": POD_DELETED, "phase": "Pending", "ready": False}, POD_DELETED),
        ({"phase": "Terminating"}, "UnitDeleted"),
        (None, "UnitDeleted"),  # the whole unit vanished
    ],
)
def test_every_failure_signal_takes_only_that_unit_offline(
    change: dict[str, Any] | None, reason: str
) -> None:
    spec = make_spec(3)
    observed, status = online_run(spec)
    victim = "r-default-1"
    world = [o for o in observed if o.name != victim]
    if change is not None:
        world.append(running(victim, **change))
    p = plan("r", spec, world, status, T0 + 5, syncer=SYNCER_UP)
    assert unit(p, victim).state == "Offline"
    assert unit(p, victim).last_failure.reason == reason
    assert [e.unit for e in events(p, "UnitOffline")] == [victim]
    assert reason in events(p, "UnitOffline")[0].message
    deletes = p.of_type(DeleteUnit)
    assert [d.name for d in deletes] == [victim]
    assert not p.of_type(CreateUnit)
    assert unit(p, "r-default-0").state == unit(p, "r-default-2").state == "Online"
    assert p.status.phase == "Degraded"
    degraded = next(c for c in p.status.conditions if c.type == "Degraded")
    assert degraded.status == "True" and victim in degraded.message


def test_unit_just_created_but_not_yet_in_the_watch_cache_is_waited_for_not_recreated() -> None:
    spec = make_spec(2)
    first = plan("r", spec, [], None, T0, syncer=SYNCER_UP)
    seen = [running("r-default-0")]  # r-default-1's Job is not in the cache yet
    soon = plan("r", spec, seen, first.status, T0 + 0.05, syncer=SYNCER_UP)
    assert not soon.of_type(DeleteUnit) and not soon.of_type(CreateUnit)
    assert not events(soon, "UnitOffline")
    assert (unit(soon, "r-default-1").state, unit(soon, "r-default-1").attempt) == ("Pending", 0)
    assert soon.requeue_after is not None and soon.requeue_after <= 1.0
    # Past the cache's grace it really is gone: deleted by someone, so the unit goes Offline.
    late = plan("r", spec, seen, soon.status, T0 + CACHE_LAG_SECONDS + 1, syncer=SYNCER_UP)
    assert unit(late, "r-default-1").state == "Offline"
    assert unit(late, "r-default-1").last_failure.reason == "UnitDeleted"


def test_stale_heartbeat_is_a_failure_but_only_for_the_current_attempt() -> None:
    spec = make_spec(2)
    observed, status = online_run(spec)
    fresh = SyncerStatus(learners={"r-default-0": LearnerStatus(attempt=0, age_seconds=3)})
    assert plan("r", spec, observed, status, T0 + 5, syncer=SYNCER_UP, report=fresh).actions == ()
    old_attempt = SyncerStatus(learners={"r-default-0": LearnerStatus(attempt=7, age_seconds=99)})
    p = plan("r", spec, observed, status, T0 + 5, syncer=SYNCER_UP, report=old_attempt)
    assert not p.of_type(DeleteUnit)
    stale = SyncerStatus(learners={"r-default-0": LearnerStatus(attempt=0, age_seconds=31)})
    # Online for 4 s only: that heartbeat predates it (a resumed Job), so it gets its period.
    p = plan("r", spec, observed, status, T0 + 5, syncer=SYNCER_UP, report=stale)
    assert not p.of_type(DeleteUnit)
    p = plan("r", spec, observed, status, T0 + 32, syncer=SYNCER_UP, report=stale)
    assert unit(p, "r-default-0").last_failure.reason == "HeartbeatStale"
    assert [d.name for d in p.of_type(DeleteUnit)] == ["r-default-0"]


def test_offline_unit_is_deleted_waited_for_then_recreated_after_backoff() -> None:
    spec = make_spec(2)
    observed, status = online_run(spec)
    healthy = observed[0]
    failed = running("r-default-1", failure=DISRUPTION_TARGET)
    p = plan("r", spec, [healthy, failed], status, T0 + 10, syncer=SYNCER_UP)
    # Still present (delete lost in a crash): delete is issued again, nothing created.
    p = plan("r", spec, [healthy, failed], p.status, T0 + 11, syncer=SYNCER_UP)
    assert [d.name for d in p.of_type(DeleteUnit)] == ["r-default-1"]
    # Terminating: just wait.
    terminating = running("r-default-1", phase="Terminating")
    p = plan("r", spec, [healthy, terminating], p.status, T0 + 12, syncer=SYNCER_UP)
    assert p.actions == ()
    # Gone, but the backoff (10 s from going offline at T0+10) has not passed.
    p = plan("r", spec, [healthy], p.status, T0 + 15, syncer=SYNCER_UP)
    assert not p.of_type(CreateUnit)
    assert p.requeue_after == pytest.approx(5.0)
    p = plan("r", spec, [healthy], p.status, T0 + 20, syncer=SYNCER_UP)
    (create,) = p.of_type(CreateUnit)
    assert (create.name, create.attempt, create.global_index) == ("r-default-1", 1, 1)
    assert unit(p, "r-default-1").state == "Recreating"
    assert unit(p, "r-default-1").restarts == 1
    assert events(p, "UnitRecreated")
    p = plan(
        "r", spec, [healthy, running("r-default-1", attempt=1)], p.status, T0 + 25, syncer=SYNCER_UP
    )
    assert unit(p, "r-default-1").state == "Online"
    assert p.status.phase == "Running"


def test_unit_that_ran_healthily_is_recreated_at_once() -> None:
    spec = make_spec(2)  # restartBackoffSeconds 10, healthyAfterSeconds 10 (default)
    observed, status = online_run(spec)  # Online since T0+1
    healthy, victim = observed[0], "r-default-1"
    progress = SyncerStatus(
        learners={
            "r-default-0": LearnerStatus(attempt=0, age_seconds=1, step=500),
            victim: LearnerStatus(attempt=0, age_seconds=1, step=480),
        }
    )
    now = T0 + 60
    p = plan("r", spec, [healthy], status, now, syncer=SYNCER_UP, report=progress)
    assert unit(p, victim).state == "Offline"
    assert unit(p, victim).quick_failures == 0
    assert p.requeue_after == 0.0  # look again at once: nothing to wait for once it is gone
    p = plan("r", spec, [healthy], p.status, now, syncer=SYNCER_UP, report=progress)
    (create,) = p.of_type(CreateUnit)
    assert (create.name, create.attempt) == (victim, 1)


def test_chaos_hits_only_units_that_have_run_healthily() -> None:
    """Found by the soak bench: faults that came due while units were down landed on each unit
    the moment it came back Online, so every restart failed at once, the crash-loop backoff grew
    to a minute and no unit pushed for 2.5 minutes. A unit fault waits for a unit that has run
    healthily, as a fault process in the field would find it."""
    spec = make_spec(3)  # healthyAfterSeconds 10 (default)
    _, status = online_run(spec)  # Online since T0+1
    names = [u.name for u in status.units]
    assert fault_targets(status.units, None, spec.failure_policy, T0 + 5) == []  # just started
    later = fault_targets(status.units, None, spec.failure_policy, T0 + 12)
    assert [u.name for u in later] == names
    # the syncer says one of them has not made a step yet (a long compile): not a target
    report = SyncerStatus(learners={names[1]: LearnerStatus(attempt=0, age_seconds=1, step=0)})
    got = fault_targets(status.units, report, spec.failure_policy, T0 + 12)
    assert [u.name for u in got] == [names[0], names[2]]


def test_crash_loop_backs_off_doubling_capped_and_a_healthy_run_resets_it() -> None:
    spec = make_spec(
        2,
        failurePolicy={
            "maxUnitRestarts": 20,
            "restartBackoffSeconds": 10,
            "maxRestartBackoffSeconds": 35,
        },
    )
    observed, status = online_run(spec)
    healthy, victim = observed[0], "r-default-1"
    now = T0 + 60
    # Attempt 0 was healthy (Online 59 s; no syncer report to say otherwise): at once.
    p = plan("r", spec, [healthy], status, now, syncer=SYNCER_UP)
    assert p.requeue_after == 0.0
    p = plan("r", spec, [healthy], p.status, now, syncer=SYNCER_UP)
    assert p.of_type(CreateUnit)[0].attempt == 1
    # Then every new attempt dies while starting (never Online): 10, 20, 35 (cap), 35 s.
    waits = []
    for attempt in (1, 2, 3, 4):
        crashed = running(victim, attempt=attempt, phase="Failed", ready=False)
        p = plan("r", spec, [healthy, crashed], p.status, now, syncer=SYNCER_UP)
        assert unit(p, victim).state == "Offline"
        assert unit(p, victim).quick_failures == attempt
        waits.append(p.requeue_after)
        p = plan("r", spec, [healthy], p.status, now + waits[-1] - 0.5, syncer=SYNCER_UP)
        assert not p.of_type(CreateUnit)
        now += waits[-1]
        p = plan("r", spec, [healthy], p.status, now, syncer=SYNCER_UP)
        assert p.of_type(CreateUnit)[0].attempt == attempt + 1
    assert waits == [10.0, 20.0, 35.0, 35.0]
    # Attempt 5 comes Online and trains for a while: its failure is a fresh incident.
    p = plan("r", spec, [healthy, running(victim, attempt=5)], p.status, now, syncer=SYNCER_UP)
    assert unit(p, victim).state == "Online"
    trained = SyncerStatus(learners={victim: LearnerStatus(attempt=5, age_seconds=1, step=40)})
    p = plan("r", spec, [healthy], p.status, now + 30, syncer=SYNCER_UP, report=trained)
    assert unit(p, victim).quick_failures == 0 and p.requeue_after == 0.0


def test_online_unit_that_never_made_progress_is_a_quick_failure() -> None:
    """Online long enough, but the syncer still has it at step 0 (it heartbeated at join and
    died compiling): that is a crash loop, not a healthy run."""
    spec = make_spec(2)
    observed, status = online_run(spec)
    victim = "r-default-1"
    stuck = SyncerStatus(learners={victim: LearnerStatus(attempt=0, age_seconds=1, step=0)})
    p = plan("r", spec, [observed[0]], status, T0 + 300, syncer=SYNCER_UP, report=stuck)
    assert unit(p, victim).quick_failures == 1
    assert p.requeue_after == pytest.approx(10.0)
    # Online only briefly (5 s < healthyAfterSeconds): quick as well.
    observed, status = online_run(spec)
    p = plan("r", spec, [observed[0]], status, T0 + 6, syncer=SYNCER_UP)
    assert unit(p, victim).quick_failures == 1


def test_restart_budget_spent_gives_the_unit_up_and_quorum_loss_fails_the_run() -> None:
    spec = make_spec(2)
    observed, status = online_run(spec)
    now = T0 + 10
    world = list(observed)
    for attempt in range(3):  # maxUnitRestarts=2: attempts 0,1,2 may fail, the third is final
        world = [world[0], running("r-default-1", attempt=attempt, phase="Failed")]
        p = plan("r", spec, world, status, now, syncer=SYNCER_UP)
        if attempt < 2:
            assert unit(p, "r-default-1").state == "Offline"
            # Quick failures in a row (crash loop): backoff 10 s, then 20 s.
            p = plan("r", spec, [world[0]], p.status, now + 21, syncer=SYNCER_UP)
            assert p.of_type(CreateUnit)[0].attempt == attempt + 1
        status, now = p.status, now + 30
    assert unit(p, "r-default-1").state == "Failed"
    assert events(p, "RestartBudgetSpent")
    assert p.status.phase == "Degraded"  # quorum 1: the other unit keeps training
    p = plan("r", spec, [world[0]], status, now, syncer=SYNCER_UP)
    assert not p.of_type(CreateUnit)  # a given-up unit is never recreated
    # Now the last unit also spends its budget: nothing can merge any more.
    status = p.status.model_copy(
        update={"units": [u.model_copy(update={"restarts": 2}) for u in p.status.units]}
    )
    p = plan("r", spec, [running("r-default-0", phase="Failed")], status, now + 1, syncer=SYNCER_UP)
    assert p.status.phase == "Failed"
    assert events(p, "RunFailed")
    assert not p.of_type(CreateUnit)
    progressing = next(c for c in p.status.conditions if c.type == "Progressing")
    assert progressing.status == "False"


def test_scale_up_adds_units_and_leaves_the_others_alone() -> None:
    observed, status = online_run(make_spec(2))
    p = plan("r", make_spec(4), observed, status, T0 + 5, syncer=SYNCER_UP)
    creates = p.of_type(CreateUnit)
    assert [(c.name, c.global_index, c.num_units) for c in creates] == [
        ("r-default-2", 2, 4),
        ("r-default-3", 3, 4),
    ]
    assert not p.of_type(DeleteUnit)
    assert unit(p, "r-default-0").state == "Online"


def test_scale_down_removes_highest_indices_first_then_forgets_them() -> None:
    observed, status = online_run(make_spec(4))
    p = plan("r", make_spec(2), observed, status, T0 + 5, syncer=SYNCER_UP)
    assert [d.name for d in p.of_type(DeleteUnit)] == ["r-default-3", "r-default-2"]
    assert {d.reason for d in p.of_type(DeleteUnit)} == {"ScaledDown"}
    assert unit(p, "r-default-3").state == "Removing"
    assert p.status.replicas == 2
    assert p.status.phase == "Running"
    p = plan("r", make_spec(2), observed[:2], p.status, T0 + 6, syncer=SYNCER_UP)
    assert [u.name for u in p.status.units] == ["r-default-0", "r-default-1"]
    assert p.actions == ()


def test_syncer_reported_completion_succeeds_the_run_and_stops_units() -> None:
    spec = make_spec(2)
    observed, status = online_run(spec)
    report = SyncerStatus(outer_step=40, steps=1000, tokens=5000, loss=2.5, complete=True)
    p = plan("r", spec, observed, status, T0 + 9, syncer=SYNCER_UP, report=report)
    assert p.status.phase == "Succeeded"
    # the learners hear of it with their next heartbeat and exit 0: they get time to
    assert not p.of_type(DeleteUnit)
    assert p.requeue_after == pytest.approx(FINISH_GRACE_SECONDS)
    assert {u.state for u in p.status.units} == {"Completed"}
    one_exited = [running("r-default-0", phase="Succeeded", ready=False), observed[1]]
    later = plan("r", spec, one_exited, p.status, T0 + 20, syncer=SYNCER_UP, report=report)
    assert not later.of_type(DeleteUnit)
    # ... and whoever has not exited when the grace ends is stopped
    late = T0 + 9 + FINISH_GRACE_SECONDS
    stopped = plan("r", spec, one_exited, later.status, late, syncer=SYNCER_UP, report=report)
    assert [d.name for d in stopped.of_type(DeleteUnit)] == ["r-default-1"]
    assert (p.status.outer_step, p.status.tokens, p.status.loss) == (40, 5000, 2.5)
    complete = next(c for c in p.status.conditions if c.type == "Complete")
    assert complete.status == "True"
    assert p.status.final_loss is None  # the syncer's final evaluation comes a moment later
    final = SyncerStatus.from_json({"complete": True, "loss": 2.6, "finalLoss": 2.4})
    p = plan("r", spec, [], p.status, T0 + 9.5, syncer=SYNCER_UP, report=final)
    assert (p.status.loss, p.status.final_loss) == (2.6, 2.4)
    # Terminal: a unit vanishing afterwards creates nothing.
    p = plan("r", spec, [], p.status, T0 + 10, syncer=ObservedSyncer(False, False))
    assert p.actions == () and p.status.phase == "Succeeded" and p.status.final_loss == 2.4


def test_units_exiting_successfully_complete_the_run() -> None:
    spec = make_spec(2)
    observed, status = online_run(spec)
    done = [running(o.name, phase="Succeeded", ready=False) for o in observed]
    p = plan("r", spec, done, status, T0 + 9, syncer=SYNCER_UP)
    assert p.status.phase == "Succeeded"
    assert not p.of_type(DeleteUnit) and not p.of_type(CreateUnit)


def test_operator_restart_rebuilds_from_observed_children_without_duplicates() -> None:
    spec = make_spec(3)
    # Status was lost; the cluster still holds unit 0 (attempt 2), unit 1 (attempt 0, pending).
    observed = [
        running("r-default-0", attempt=2),
        running("r-default-1", phase="Pending", ready=False),
    ]
    p = plan("r", spec, observed, None, T0, syncer=SYNCER_UP)
    assert [c.name for c in p.of_type(CreateUnit)] == ["r-default-2"]
    assert not p.of_type(DeleteUnit)
    assert unit(p, "r-default-0").attempt == 2
    assert unit(p, "r-default-0").state == "Online"
    # A second crash before the status write: the same inputs plan the same single create,
    # and Kubernetes' AlreadyExists makes the repeat harmless.
    again = plan("r", spec, observed, None, T0 + 1, syncer=SYNCER_UP)
    assert [c.name for c in again.of_type(CreateUnit)] == ["r-default-2"]
    # A status written before the create was applied: the child shows up at a higher attempt.
    created = [*observed, running("r-default-2", attempt=0)]
    after = plan("r", spec, created, p.status, T0 + 2, syncer=SYNCER_UP)
    assert not after.of_type(CreateUnit) and not after.of_type(DeleteUnit)
    assert (after.status.phase, after.status.units_online) == ("Running", 2)
    assert unit(after, "r-default-1").state == "Pending"


def test_mixed_groups_give_fixed_groups_the_low_global_indices() -> None:
    spec = make_spec(
        2,
        unitGroups=[
            {"name": "v6e", "tpu": {"accelerator": "tpu-v6e-slice", "topology": "2x4"}},
            {
                "name": "v5p",
                "replicas": 1,
                "tpu": {"accelerator": "tpu-v5p-slice", "topology": "2x2x1"},
            },
        ],
    )
    slots = desired_units("r", spec)
    assert [(s.name, s.global_index, s.hosts) for s in slots] == [
        ("r-v5p-0", 0, 1),
        ("r-v6e-0", 1, 2),
        ("r-v6e-1", 2, 2),
    ]


def test_all_learners_stale_at_once_blames_the_syncer_not_the_units() -> None:
    spec = make_spec(3)
    observed, status = online_run(spec)
    everyone_stale = SyncerStatus(
        learners={o.name: LearnerStatus(attempt=0, age_seconds=500) for o in observed}
    )
    p = plan("r", spec, observed, status, T0 + 5, syncer=SYNCER_UP, report=everyone_stale)
    assert not p.of_type(DeleteUnit)
    assert p.status.phase == "Running"


def test_replacement_created_before_a_lost_status_write_is_adopted_not_killed() -> None:
    spec = make_spec(2)
    observed, status = online_run(spec)
    offline = plan(
        "r",
        spec,
        [observed[0], running("r-default-1", phase="Failed")],
        status,
        T0 + 5,
        syncer=SYNCER_UP,
    )
    assert unit(offline, "r-default-1").state == "Offline"
    # The operator created attempt 1 and crashed before writing status: status still says Offline.
    world = [observed[0], running("r-default-1", attempt=1, phase="Pending", ready=False)]
    p = plan("r", spec, world, offline.status, T0 + 30, syncer=SYNCER_UP)
    assert not p.of_type(DeleteUnit) and not p.of_type(CreateUnit)
    assert (unit(p, "r-default-1").state, unit(p, "r-default-1").attempt) == ("Recreating", 1)
    assert unit(p, "r-default-1").restarts == 1


def test_random_crashes_and_failures_converge_without_duplicates() -> None:
    """A simulated cluster: actions are applied partially and status writes are lost at random
    (operator crashes), units fail at random. Invariants: a unit is never created while another
    attempt of it still exists, and once failures stop everything converges to Running."""
    import random

    rng = random.Random(7)
    spec = make_spec(4, failurePolicy={"maxUnitRestarts": 1000, "restartBackoffSeconds": 2})
    world: dict[str, ObservedUnit] = {}
    status: DilocoRunStatus | None = None
    now = T0
    for step in range(300):
        now += 1
        failing = step < 200
        # The cluster moves: terminating units vanish, pending ones start, some fail.
        for name, o in list(world.items()):
            if o.phase == "Terminating":
                del world[name]
            elif o.phase == "Pending":
                world[name] = running(name, attempt=o.attempt)
            elif failing and rng.random() < 0.05:
                world[name] = running(name, attempt=o.attempt, phase="Failed", ready=False)
        p = plan("r", spec, list(world.values()), status, now, syncer=SYNCER_UP)
        crash_at = rng.randrange(len(p.actions) + 1) if rng.random() < 0.2 else len(p.actions)
        for action in p.actions[:crash_at]:
            if isinstance(action, CreateUnit):
                existing = world.get(action.name)
                assert existing is None or existing.attempt == action.attempt, (
                    step,
                    action,
                    existing,
                )
                if existing is None:
                    world[action.name] = running(
                        action.name, attempt=action.attempt, phase="Pending", ready=False
                    )
            elif isinstance(action, DeleteUnit) and action.name in world:
                o = world[action.name]
                world[action.name] = running(o.name, attempt=o.attempt, phase="Terminating")
        if crash_at == len(p.actions):
            status = p.status  # the single status write of the pass
    assert status is not None and status.phase == "Running"
    assert sorted(world) == [f"r-default-{i}" for i in range(4)]
    assert all(u.state == "Online" for u in status.units)
    assert sum(u.restarts for u in status.units) >= 10  # failures really happened
    assert all(
        o.attempt == u.attempt
        for o, u in zip(sorted(world.values(), key=lambda o: o.name), status.units, strict=True)
    )


def test_a_quarantined_attempt_is_taken_offline_and_its_next_attempt_is_clean() -> None:
    spec = make_spec(2)
    observed, status = online_run(spec)
    why = "3 of attempt 0's last 3 merged pushes were outliers"
    report = SyncerStatus(
        learners={
            "r-default-0": LearnerStatus(attempt=0, age_seconds=1.0, quarantined=why),
            "r-default-1": LearnerStatus(attempt=0, age_seconds=1.0),
        }
    )
    p = plan("r", spec, observed, status, T0 + 5, syncer=SYNCER_UP, report=report)
    assert unit(p, "r-default-0").state == "Offline"
    assert unit(p, "r-default-0").last_failure.reason == "Quarantined"
    assert why in unit(p, "r-default-0").last_failure.message
    assert [d.name for d in p.of_type(DeleteUnit)] == ["r-default-0"]
    assert unit(p, "r-default-1").state == "Online"
    # The syncer still quarantines attempt 0; the recreated attempt 1 is not blamed for it.
    p = plan("r", spec, observed[1:], p.status, T0 + 16, syncer=SYNCER_UP, report=report)
    created = p.of_type(CreateUnit)
    assert [(c.name, c.attempt) for c in created] == [("r-default-0", 1)]
    assert unit(p, "r-default-0").restarts == 1  # counted against maxUnitRestarts
    online = [running("r-default-0", attempt=1), observed[1]]
    p = plan("r", spec, online, p.status, T0 + 20, syncer=SYNCER_UP, report=report)
    assert unit(p, "r-default-0").state == "Online" and not p.of_type(DeleteUnit)


def test_claims_the_syncer_refused_are_counted_in_status_with_an_event_per_increase() -> None:
    spec = make_spec(1)
    observed, status = online_run(spec)

    def refused(count: int) -> SyncerStatus:
        entry = LearnerStatus(attempt=0, age_seconds=1.0, refused=count, last_refusal="push: x")
        return SyncerStatus(learners={"r-default-0": entry})

    p = plan("r", spec, observed, status, T0 + 5, syncer=SYNCER_UP, report=refused(2))
    assert unit(p, "r-default-0").claims_refused == 2
    [event] = events(p, "UnitClaimRefused")
    assert event.type == "Warning" and "2 heartbeat(s) or push(es)" in event.message
    p = plan("r", spec, observed, p.status, T0 + 6, syncer=SYNCER_UP, report=refused(2))
    assert not events(p, "UnitClaimRefused")
    p = plan("r", spec, observed, p.status, T0 + 7, syncer=SYNCER_UP, report=refused(3))
    assert "1 heartbeat(s)" in events(p, "UnitClaimRefused")[0].message
    assert unit(p, "r-default-0").state == "Online"  # refused claims alone are no failure

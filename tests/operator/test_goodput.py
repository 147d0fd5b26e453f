"""Per-unit goodput in status.units[]: the local report's definition, accounted pass by pass."""

from __future__ import annotations

from diloco_operator.api import UnitStatus, parse_spec
from diloco_operator.local.recorder import Heartbeat
from diloco_operator.local.report import compute_goodput
from diloco_operator.planner import (
    CreateUnit,
    LearnerStatus,
    ObservedSyncer,
    ObservedUnit,
    SyncerStatus,
    plan,
)
from diloco_operator.planner.goodput import account

T0 = 1_700_000_000.0
SYNCER_UP = ObservedSyncer(present=True, ready=True)

# (time, attempt, step) of one unit's heartbeats: it trains, is killed after t=6, its next
# attempt joins at 14 (steps are summed over attempts), compiles until 16, then trains again.
BEATS = [(0, 0, 0), (2, 0, 10), (4, 0, 20), (6, 0, 30), (14, 1, 30), (16, 1, 30)]
BEATS += [(18, 1, 40), (20, 1, 50)]


def unit(state: str = "Online") -> UnitStatus:
    return UnitStatus(name="u", group="g", index=0, global_index=0, state=state)  # type: ignore[arg-type]


def replay(passes: list[float], beats: list[tuple[float, int, int]]) -> UnitStatus:
    """Run `account` at each pass time with the latest heartbeat the syncer would report."""
    status = unit()
    for now in passes:
        seen = [b for b in beats if b[0] <= now]
        learner = None
        if seen:
            t, attempt, step = seen[-1]
            learner = LearnerStatus(attempt=attempt, step=step, last_heartbeat=T0 + t)
        status = account(status, learner, T0 + now)
    return status


def test_matches_the_local_report_when_every_heartbeat_is_seen() -> None:
    passes = [float(t) for t in range(0, 21, 2)]  # 8, 10 and 12 see no new heartbeat
    got = replay(passes, BEATS)
    local = compute_goodput([Heartbeat("u", a, T0 + t, s, 0) for t, a, s in BEATS], [], {}, T0 + 20)
    assert got.goodput is not None
    assert got.goodput.useful_seconds == local.useful_seconds == 10.0
    assert got.goodput.total_seconds == local.total_seconds == 20.0
    assert got.goodput.ratio == local.per_unit["u"] == 0.5


def test_nothing_is_counted_before_the_unit_trains() -> None:
    assert account(unit(), None, T0).goodput is None
    joined = replay([0.0, 5.0, 9.0], [(0, 0, 0)])  # heard from, never advanced
    assert joined.goodput is not None
    assert (joined.goodput.useful_seconds, joined.goodput.total_seconds) == (0.0, 0.0)
    assert joined.goodput.counted_until is None


def test_time_without_heartbeats_is_lost_and_units_that_ended_stop_counting() -> None:
    trained = replay([0.0, 2.0, 30.0], [(0, 0, 0), (2, 0, 10)])
    assert trained.goodput is not None
    assert trained.goodput.useful_seconds == 2.0
    assert trained.goodput.total_seconds == 30.0  # 28 s with no progress
    for state in ("Completed", "Failed", "Removing"):
        ended = trained.model_copy(update={"state": state})
        assert account(ended, None, T0 + 100) == ended


def test_a_ratio_never_exceeds_one_when_the_clocks_disagree() -> None:
    # Two passes 1 s apart (the operator's clock) see heartbeats 2 s apart (the syncer's).
    status = unit()
    for now, beat, step in ((0.0, 0.0, 0), (2.0, 2.0, 10), (3.0, 4.0, 20)):
        learner = LearnerStatus(attempt=0, step=step, last_heartbeat=T0 + beat)
        status = account(status, learner, T0 + now)
    assert status.goodput is not None
    assert (status.goodput.useful_seconds, status.goodput.total_seconds) == (4.0, 3.0)
    assert status.goodput.ratio == 1.0


def test_plan_writes_goodput_into_status_units() -> None:
    spec = parse_spec({"image": "t:dev", "replicas": 2, "training": {"totalSteps": 1000}})
    first_pass = plan("r", spec, [], None, T0, syncer=SYNCER_UP)
    observed = [
        ObservedUnit(c.name, c.group, c.index, 0, "Running", ready=True, since=T0)
        for c in first_pass.of_type(CreateUnit)
    ]
    status = plan("r", spec, observed, first_pass.status, T0 + 1, syncer=SYNCER_UP).status
    names = [u.name for u in status.units]
    for step, now in enumerate((T0 + 2, T0 + 4, T0 + 6)):
        report = SyncerStatus(
            learners={
                n: LearnerStatus(attempt=0, step=10 * step * (i + 1), last_heartbeat=now)
                for i, n in enumerate(names)
            }
        )
        status = plan("r", spec, observed, status, now, syncer=SYNCER_UP, report=report).status
    first = status.units[0].goodput
    assert first is not None
    assert (first.useful_seconds, first.total_seconds, first.ratio) == (4.0, 4.0, 1.0)
    dumped = status.model_dump(mode="json", by_alias=True)
    assert dumped["units"][1]["goodput"]["usefulSeconds"] == 4.0


def test_operator_metrics_add_what_each_pass_gained_and_forget_the_run() -> None:
    from diloco_operator.api import DilocoRunStatus
    from diloco_operator.api.unit_goodput import UnitGoodput
    from diloco_operator.k8s import run_metrics
    from prometheus_client import REGISTRY

    def status(useful: float, total: float) -> DilocoRunStatus:
        good = UnitGoodput(useful_seconds=useful, total_seconds=total, ratio=useful / total)
        return DilocoRunStatus(units=[unit().model_copy(update={"goodput": good})])

    labels = {"namespace": "ns", "run": "gp", "unit": "u"}

    def sample(name: str) -> float | None:
        return REGISTRY.get_sample_value(name, labels)

    run_metrics.export_goodput("ns", "gp", None, status(2.0, 4.0))
    run_metrics.export_goodput("ns", "gp", status(2.0, 4.0), status(5.0, 10.0))
    assert sample("diloco_operator_unit_useful_seconds_total") == 5.0
    assert sample("diloco_operator_unit_seconds_total") == 10.0
    assert sample("diloco_operator_unit_goodput_ratio") == 0.5
    run_metrics.forget_run("ns", "gp", status(5.0, 10.0))
    assert sample("diloco_operator_unit_seconds_total") is None

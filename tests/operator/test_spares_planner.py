"""Warm spares in the planner: the spare Jobs a spec asks for, their states from what the syncer
reports, a cover asked for a unit that lost its pods (once, and not after its recreated pod
joined), a failed spare replaced, and no spares in a suspended or finished run."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_operator.api import parse_spec
from diloco_operator.planner import (
    CoverUnit,
    CreateSpare,
    CreateUnit,
    DeleteUnit,
    LearnerStatus,
    ObservedUnit,
    SyncerStatus,
    plan,
)
from diloco_operator.planner.model import POD_DELETED
from diloco_trainer.attempts import COVER_RESTARTS, cover_attempt
from diloco_trainer.status import SpareStatus as Heard

from tests.operator.test_planner import SYNCER_UP, T0, make_spec, running, unit


def spare_spec(spares: int = 1, **extra: Any) -> Any:
    return make_spec(2, unitGroups=[{"name": "default", "spares": spares}], **extra)


def spare_obs(name: str = "r-default-s0", attempt: int = 0, **kw: Any) -> ObservedUnit:
    fields: dict[str, Any] = {"phase": "Running", "ready": True, "since": T0, "spare": True}
    fields.update(kw)
    return ObservedUnit(name=name, group="default", index=0, attempt=attempt, **fields)


def report(spares: dict[str, Heard], **learners: LearnerStatus) -> SyncerStatus:
    return SyncerStatus(run="r", spares=spares, learners=dict(learners))


WAITING = {"r-default-s0": Heard(group="default", state="Waiting")}


def started(spec: Any) -> tuple[list[ObservedUnit], Any]:
    """A run whose units are Online and whose spare waits at the syncer."""
    first = plan("r", spec, [], None, T0, syncer=SYNCER_UP)
    assert [(a.name, a.attempt) for a in first.of_type(CreateSpare)] == [("r-default-s0", 0)]
    assert first.status.spares is not None and first.status.spares[0].state == "Starting"
    observed = [running(c.name) for c in first.of_type(CreateUnit)] + [spare_obs()]
    second = plan(
        "r", spec, observed, first.status, T0 + 1, syncer=SYNCER_UP, report=report(WAITING)
    )
    assert second.of_type(CreateSpare) == [] and second.of_type(CoverUnit) == []
    assert second.status.spares is not None and second.status.spares[0].state == "Ready"
    return observed, second.status


def test_spare_names_never_clash_with_a_unit_of_another_group() -> None:
    # Group "default-s" has a unit named r-default-s-0; the spare of "default" is r-default-s0.
    spec = make_spec(
        1, unitGroups=[{"name": "default", "spares": 1}, {"name": "default-s", "replicas": 1}]
    )
    p = plan("r", spec, [], None, T0, syncer=SYNCER_UP)
    units = {a.name for a in p.of_type(CreateUnit)}
    spares = {a.name for a in p.of_type(CreateSpare)}
    assert spares == {"r-default-s0"} and not units & spares


def test_a_lost_unit_is_covered_by_the_waiting_spare_once() -> None:
    spec = spare_spec()
    observed, status = started(spec)
    lost = [
        o if o.name != "r-default-1" else running(o.name, failure=POD_DELETED) for o in observed
    ]
    p = plan("r", spec, lost, status, T0 + 60, syncer=SYNCER_UP, report=report(WAITING))
    assert unit(p, "r-default-1").state == "Offline"
    assert p.of_type(CoverUnit) == [CoverUnit("r-default-1", "default", 1, 2, cover_attempt(0))]
    # The syncer handed it: the report shows the cover; nothing more is asked.
    covering = {
        "r-default-s0": Heard(group="default", state="Covering", unit="r-default-1", attempt=999)
    }
    cover = LearnerStatus(attempt=0, restarts_in_place=COVER_RESTARTS, step=10)
    again = plan(
        "r",
        spec,
        lost,
        p.status,
        T0 + 61,
        syncer=SYNCER_UP,
        report=report(covering, **{"r-default-1": cover}),
    )
    assert again.of_type(CoverUnit) == []
    assert unit(again, "r-default-1").covered_by == "r-default-s0"
    assert unit(again, "r-default-1").restarts_in_place == 0  # a cover is no restart in place
    spare = again.status.spares[0]
    assert (spare.state, spare.covering, spare.covers) == ("Covering", "r-default-1", 1)


def test_no_cover_without_a_waiting_spare_or_once_the_recreated_pod_joined() -> None:
    spec = spare_spec()
    observed, status = started(spec)
    lost = [
        o if o.name != "r-default-1" else running(o.name, failure=POD_DELETED) for o in observed
    ]
    silent = report({"r-default-s0": Heard(group="default", state="Returning")})
    p = plan("r", spec, lost, status, T0 + 60, syncer=SYNCER_UP, report=silent)
    assert p.of_type(CoverUnit) == [] and unit(p, "r-default-1").state == "Offline"
    # Recreated (attempt 1) and its learner heard: a spare waiting now has nothing to cover.
    recreating = p.status.model_copy(
        update={
            "units": [
                u.model_copy(update={"state": "Recreating", "attempt": 1})
                if u.name == "r-default-1"
                else u
                for u in p.status.units
            ]
        }
    )
    fresh = [o for o in observed if o.name != "r-default-1"] + [
        running("r-default-1", attempt=1, phase="Pending", ready=False)
    ]
    joined = report(WAITING, **{"r-default-1": LearnerStatus(attempt=1)})
    q = plan("r", spec, fresh, recreating, T0 + 70, syncer=SYNCER_UP, report=joined)
    assert q.of_type(CoverUnit) == []
    # Not heard yet: the cover is asked under the lost attempt (0), not the new one.
    r = plan("r", spec, fresh, recreating, T0 + 70, syncer=SYNCER_UP, report=report(WAITING))
    assert [c.attempt for c in r.of_type(CoverUnit)] == [cover_attempt(0)]


def test_one_waiting_spare_covers_one_unit() -> None:
    spec = spare_spec()
    observed, status = started(spec)
    lost = [running(o.name, failure=POD_DELETED) if not o.spare else o for o in observed]
    p = plan("r", spec, lost, status, T0 + 60, syncer=SYNCER_UP, report=report(WAITING))
    assert [c.name for c in p.of_type(CoverUnit)] == ["r-default-0"]


@pytest.mark.parametrize(
    "change", [{"phase": "Failed", "ready": False}, {"failure": "NodeNotReady"}]
)
def test_a_failed_spare_is_deleted_and_created_again(change: dict[str, Any]) -> None:
    spec = spare_spec()
    observed, status = started(spec)
    broken = [o if not o.spare else spare_obs(**change) for o in observed]
    p = plan("r", spec, broken, status, T0 + 5, syncer=SYNCER_UP, report=report(WAITING))
    assert DeleteUnit("r-default-s0", "SpareFailed") in p.actions
    assert p.status.spares[0].state == "Failed"
    gone = [o for o in observed if not o.spare]
    # Within the restart backoff nothing is created; after it, attempt 1.
    q = plan("r", spec, gone, p.status, T0 + 6, syncer=SYNCER_UP, report=report({}))
    assert q.of_type(CreateSpare) == [] and q.requeue_after is not None
    r = plan("r", spec, gone, p.status, T0 + 20, syncer=SYNCER_UP, report=report({}))
    assert [(a.name, a.attempt) for a in r.of_type(CreateSpare)] == [("r-default-s0", 1)]


def test_a_suspended_run_and_a_scaled_down_group_keep_no_spares() -> None:
    observed, status = started(spare_spec())
    suspended = plan("r", spare_spec(suspend=True), observed, status, T0 + 5, syncer=SYNCER_UP)
    assert DeleteUnit("r-default-s0", "SpareNotWanted") in suspended.actions
    assert suspended.status.spares is None
    fewer = plan("r", spare_spec(0), observed, status, T0 + 5, syncer=SYNCER_UP)
    assert DeleteUnit("r-default-s0", "SpareNotWanted") in fewer.actions
    assert fewer.status.spares is None


def test_spares_are_refused_beside_units_of_several_hosts_and_remote_groups() -> None:
    with pytest.raises(ValueError, match="spares: warm spares cover units of one host"):
        make_spec(1, unitGroups=[{"name": "default", "spares": 1, "hostsPerUnit": 2}])
    with pytest.raises(ValueError, match="spares: warm spares cover units of one host"):
        make_spec(
            1,
            unitGroups=[
                {
                    "name": "default",
                    "spares": 1,
                    "tpu": {"accelerator": "tpu-v5p-slice", "topology": "2x2x2"},
                }
            ],
        )
    with pytest.raises(ValueError, match="spares: a remote group"):
        parse_spec(
            {
                "image": "t",
                "replicas": 1,
                "training": {"totalSteps": 10},
                "unitGroups": [
                    {"name": "default"},
                    {"name": "far", "replicas": 1, "remote": True, "spares": 1},
                ],
                "syncer": {"expose": {"type": "LoadBalancer"}},
            }
        )


def test_a_spare_not_in_the_watch_cache_yet_is_waited_for_and_a_vanished_one_replaced() -> None:
    spec = spare_spec()
    first = plan("r", spec, [], None, T0, syncer=SYNCER_UP)
    units = [running(c.name) for c in first.of_type(CreateUnit)]
    early = plan("r", spec, units, first.status, T0 + 2, syncer=SYNCER_UP)
    assert early.of_type(CreateSpare) == [] and early.requeue_after is not None
    late = plan("r", spec, units, first.status, T0 + 20, syncer=SYNCER_UP)
    assert [(a.name, a.attempt) for a in late.of_type(CreateSpare)] == [("r-default-s0", 1)]
    # A Ready spare whose Job vanished (deleted by hand) is created again at once.
    observed, status = started(spec)
    without = [o for o in observed if not o.spare]
    again = plan("r", spec, without, status, T0 + 3, syncer=SYNCER_UP, report=report({}))
    assert [(a.name, a.attempt) for a in again.of_type(CreateSpare)] == [("r-default-s0", 1)]

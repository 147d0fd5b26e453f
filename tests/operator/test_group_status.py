"""`status.groups`: each unit group (each cluster, for a run across clusters) summed from its units
and the syncer's report."""

from __future__ import annotations

from typing import Any

from diloco_operator.api import UnitStatus, parse_spec
from diloco_operator.api.status import GroupStatus
from diloco_operator.api.unit_goodput import UnitGoodput
from diloco_operator.planner.groups import group_summaries
from diloco_trainer.status import LearnerStatus, SyncerStatus


def spec(away: bool = False) -> Any:
    syncer: dict[str, Any] = {"tls": {}}
    if away:
        syncer = {
            "external": {
                "address": "https://syncer.home.example:8470",
                "ca": {"name": "home-ca", "key": "ca.crt"},
                "credential": {"name": "join", "key": "credential"},
            }
        }
    return parse_spec(
        {
            "image": "t",
            "replicas": 2,
            "unitGroups": [
                {"name": "v6e", "remote": away},
                {"name": "v5p", "replicas": 1, "remote": not away},
            ],
            "training": {"totalSteps": 10},
            "syncer": syncer,
        }
    )


def unit(name: str, group: str, state: str, useful: float = 0, total: float = 0) -> UnitStatus:
    goodput = UnitGoodput(useful_seconds=useful, total_seconds=total) if total else None
    return UnitStatus(name=name, group=group, index=0, global_index=0, state=state, goodput=goodput)  # type: ignore[arg-type]


UNITS = [
    unit("r-v6e-0", "v6e", "Online", 90, 100),
    unit("r-v6e-1", "v6e", "Offline", 30, 100),
    unit("r-v6e-2", "v6e", "Removing", 0, 0),
    unit("r-v5p-0", "v5p", "Online"),
]
REPORT = SyncerStatus(
    learners={
        "r-v6e-0": LearnerStatus(tokens=1000, tokens_per_sec=50.0),
        "r-v6e-1": LearnerStatus(tokens=400, tokens_per_sec=0.0),
        "r-v5p-0": LearnerStatus(tokens=700, tokens_per_sec=20.0, group="v5p"),
    }
)


def test_home_shows_each_group_and_so_each_cluster_side_by_side() -> None:
    v6e, v5p = group_summaries(spec(), UNITS, REPORT, [])
    assert v6e == GroupStatus(
        name="v6e",
        remote=False,
        units=2,  # the Removing one is leaving
        units_online=1,
        tokens=1400,
        tokens_per_sec=50.0,
        goodput=(90 + 30) / 200,
    )
    assert (v5p.name, v5p.remote, v5p.units, v5p.units_online) == ("v5p", True, 1, 1)
    assert (v5p.tokens, v5p.tokens_per_sec, v5p.goodput) == (700, 20.0, None)


def test_without_a_report_a_group_keeps_what_it_last_showed() -> None:
    before = group_summaries(spec(), UNITS, REPORT, [])
    silent = group_summaries(spec(), UNITS, None, before)
    assert [(g.tokens, g.tokens_per_sec) for g in silent] == [(1400, 50.0), (700, 20.0)]
    # A group nobody has heard of yet shows nothing rather than zero.
    assert [g.tokens for g in group_summaries(spec(), UNITS, SyncerStatus(), [])] == [None, None]


def test_an_away_run_shows_its_own_group_only() -> None:
    (own,) = group_summaries(spec(away=True), [unit("r-v5p-0", "v5p", "Online")], REPORT, [])
    assert (own.name, own.remote, own.units, own.tokens) == ("v5p", False, 1, 700)


def test_clock_skew_never_shows_more_than_all_of_it() -> None:
    """Useful seconds come from heartbeat times (the syncer's clock), total from the operator's:
    a group's goodput is capped at 1 as a unit's is."""
    ahead = [unit("r-v6e-0", "v6e", "Online", 102.2, 100)]
    (v6e, _) = group_summaries(spec(), ahead, REPORT, [])
    assert v6e.goodput == 1.0

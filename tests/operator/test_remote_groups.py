"""One run across clusters, as the planner sees it: the home run creates only its own groups'
units and reports the other clusters' units as the syncer hears them; an away run creates no
syncer and only its one group's units, numbered as at home."""

from __future__ import annotations

from typing import Any

from diloco_operator.api import DilocoRunSpec, parse_spec
from diloco_operator.planner import (
    CreateSyncer,
    CreateUnit,
    DeleteUnit,
    EmitEvent,
    LearnerStatus,
    ObservedSyncer,
    ObservedUnit,
    SyncerStatus,
    desired_units,
    plan,
)
from diloco_operator.planner.placement import roster_document

T0 = 1_700_000_000.0
UP = ObservedSyncer(present=True, ready=True)
CA = {"name": "home-ca", "key": "ca.crt"}
CREDENTIAL = {"name": "v5p-join", "key": "credential"}


def groups(away: bool) -> list[dict[str, Any]]:
    """The run's two groups as each cluster describes them: v6e at home, v5p away."""
    return [
        {"name": "v6e", "remote": away},
        {"name": "v5p", "replicas": 2, "remote": not away},
    ]


def home_spec(**syncer: Any) -> DilocoRunSpec:
    return parse_spec(
        {
            "image": "t",
            "replicas": 2,
            "unitGroups": groups(away=False),
            "training": {"totalSteps": 1000},
            "syncer": {"tls": {"secretName": "syncer-tls"}, **syncer},
            "failurePolicy": {"offlineAfterSeconds": 30},
        }
    )


def away_spec() -> DilocoRunSpec:
    return parse_spec(
        {
            "image": "t",
            "replicas": 2,
            "unitGroups": groups(away=True),
            "training": {"totalSteps": 1000, "quorum": 3},
            "syncer": {
                "external": {
                    "address": "https://syncer.home.example:8470",
                    "ca": CA,
                    "credential": CREDENTIAL,
                }
            },
        }
    )


def heard(**ages: float) -> SyncerStatus:
    return SyncerStatus(
        learners={name: LearnerStatus(attempt=1, age_seconds=age) for name, age in ages.items()}
    )


def test_home_creates_its_own_units_only_and_admits_every_unit() -> None:
    spec = home_spec()
    first = plan("r", spec, [], None, T0, syncer=ObservedSyncer(present=False, ready=False))
    created = {a.name for a in first.of_type(CreateUnit)}
    assert created == {"r-v6e-0", "r-v6e-1"}
    assert first.of_type(CreateSyncer)
    remote = [u for u in first.status.units if u.remote]
    assert [(u.name, u.state) for u in remote] == [("r-v5p-0", "Pending"), ("r-v5p-1", "Pending")]
    roster = roster_document("r", spec, 3)
    assert roster["units"] == {
        "r-v5p-0": "v5p",
        "r-v5p-1": "v5p",
        "r-v6e-0": "v6e",
        "r-v6e-1": "v6e",
    }


def test_remote_units_follow_their_heartbeats_and_are_never_acted_on() -> None:
    spec = home_spec()
    local = [
        ObservedUnit(name=f"r-v6e-{i}", group="v6e", index=i, attempt=0, phase="Running")
        for i in range(2)
    ]
    status = plan("r", spec, local, None, T0, syncer=UP).status
    online = plan("r", spec, local, status, T0 + 5, syncer=UP, report=heard(**{"r-v5p-0": 2}))
    states = {u.name: u.state for u in online.status.units if u.remote}
    assert states == {"r-v5p-0": "Online", "r-v5p-1": "Pending"}
    assert [e.reason for e in online.of_type(EmitEvent) if e.unit == "r-v5p-0"] == [
        "RemoteUnitOnline"
    ]
    cut = plan(
        "r",
        spec,
        local,
        online.status,
        T0 + 60,
        syncer=UP,
        report=heard(**{"r-v5p-0": 45, "r-v5p-1": 1}),
    )
    states = {u.name: u.state for u in cut.status.units if u.remote}
    assert states == {"r-v5p-0": "Offline", "r-v5p-1": "Online"}
    offline = [e for e in cut.of_type(EmitEvent) if e.reason == "RemoteUnitOffline"]
    assert [(e.type, e.unit) for e in offline] == [("Warning", "r-v5p-0")]
    # Nothing is ever created, deleted or recreated for another cluster's units.
    for p in (online, cut):
        touched = {a.name for a in p.actions if isinstance(a, CreateUnit | DeleteUnit)}
        assert not {n for n in touched if "-v5p-" in n}
    # Without a report (the syncer unreachable), the last known states stand.
    blind = plan("r", spec, local, cut.status, T0 + 90, syncer=UP, report=None)
    assert {u.name: u.state for u in blind.status.units if u.remote} == states


def test_an_away_run_creates_no_syncer_and_numbers_its_units_as_home_does() -> None:
    home, away = home_spec(), away_spec()
    p = plan("r", away, [], None, T0, syncer=ObservedSyncer(present=True, ready=False))
    assert not p.of_type(CreateSyncer)
    made = p.of_type(CreateUnit)
    assert sorted(a.name for a in made) == ["r-v5p-0", "r-v5p-1"]
    at_home = {s.name: s.global_index for s in desired_units("r", home)}
    assert {a.name: a.global_index for a in made} == {a.name: at_home[a.name] for a in made}
    assert {a.num_units for a in made} == {home.total_units}
    # The away run reports its own units only, and the run's quorum (3) is home's business.
    assert {u.name for u in p.status.units} == {"r-v5p-0", "r-v5p-1"}
    assert p.status.phase != "Failed"


def test_revoked_credentials_reach_the_syncer_with_the_roster() -> None:
    spec = home_spec(revokedCredentials=["b2", "a1", "b2"])
    assert roster_document("r", spec, 4)["revokedCredentials"] == ["a1", "b2"]
    assert "revokedCredentials" not in roster_document("r", home_spec(), 4)

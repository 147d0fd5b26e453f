"""Warm spares policy: which spare pods a run keeps, when one is recreated, and which lost unit
a waiting spare is asked to cover.

A group with `spares: N` keeps N spare Jobs `{run}-{group}-s{i}` (a unit's name ends in its
index, all digits, so the two never clash). A spare pod compiles its step and waits at the
syncer (the trainer's learner/spare.py). When a unit goes Offline, or is being recreated, and
a spare of its group waits, the operator asks the syncer for a cover: the spare becomes the
unit under an attempt between the lost pod's and the recreated one's, and trains from the
unit's data lease while the unit's Job is recreated. The recreated pod's join ends the cover;
the spare waits again. What the syncer reports (who waits, who covers whom) is the truth here:
the pass only asks for what it does not see yet, and asking twice gets the same spare.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from diloco_trainer.attempts import COVER_RESTARTS, cover_attempt
from diloco_trainer.status import SpareStatus as HeardSpare
from diloco_trainer.status import SyncerStatus

from diloco_operator.api import DilocoRunSpec, FailurePolicy, UnitStatus
from diloco_operator.api.status import SpareStatus
from diloco_operator.planner.failure import CACHE_LAG_SECONDS
from diloco_operator.planner.model import (
    Action,
    CoverUnit,
    CreateSpare,
    DeleteUnit,
    EmitEvent,
    ObservedUnit,
    gone,
)
from diloco_operator.planner.timefmt import at, seconds_since

SPARE_FAILED = "SpareFailed"


@dataclass(frozen=True)
class SpareSlot:
    name: str
    group: str
    index: int


def spare_name(run: str, group: str, index: int) -> str:
    return f"{run}-{group}-s{index}"


def desired_spares(run: str, spec: DilocoRunSpec) -> list[SpareSlot]:
    """The spares the spec asks for: none in an away run (its operator cannot ask the home
    syncer for covers) nor for a remote group (its own cluster keeps them)."""
    if spec.away:
        return []
    return [
        SpareSlot(spare_name(run, g.name, i), g.name, i)
        for g in spec.unit_groups
        if not g.remote
        for i in range(g.spares)
    ]


def _heard_state(heard: HeardSpare | None) -> tuple[str, str | None]:
    """(state, covering) of a live spare pod from what the syncer hears of it."""
    if heard is not None and heard.state == "Covering":
        return "Covering", heard.unit
    if heard is not None and heard.state == "Waiting":
        return "Ready", None
    return "Starting", None  # warming up: its first compile, or again after a cover


def _step_spare(
    slot: SpareSlot,
    prev: SpareStatus | None,
    obs: ObservedUnit | None,
    heard: HeardSpare | None,
    num_units: int,
    policy: FailurePolicy,
    now: float,
) -> tuple[SpareStatus, list[Action], float | None]:
    create = CreateSpare(slot.name, slot.group, slot.index, 0, num_units)
    if prev is None:
        new = SpareStatus(name=slot.name, group=slot.group, state="Starting", since=at(now))
        if gone(obs):
            return new, [create], None
        assert obs is not None
        prev = new.model_copy(update={"attempt": obs.attempt})
    spare = prev
    if obs is not None and obs.attempt > spare.attempt:
        spare = spare.model_copy(update={"attempt": obs.attempt})  # a lost status write
    if gone(obs) and spare.state == "Starting":
        # Created (or seen starting) moments ago: the watch cache may not show its Job yet.
        lag = CACHE_LAG_SECONDS - seconds_since(spare.since, now)
        if lag > 0:
            return spare, [], lag
    if gone(obs):
        wait = policy.restart_backoff_seconds - seconds_since(spare.since, now)
        if spare.state == "Failed" and wait > 0:
            return spare, [], wait
        attempt = spare.attempt + 1
        again = CreateSpare(slot.name, slot.group, slot.index, attempt, num_units)
        update = {"state": "Starting", "attempt": attempt, "covering": None, "since": at(now)}
        return spare.model_copy(update=update), [again], None
    assert obs is not None
    if obs.phase == "Terminating":
        return spare, [], 1.0
    if (
        obs.phase in ("Failed", "Succeeded")
        or obs.failure is not None
        or obs.attempt < spare.attempt
    ):
        why = obs.failure or obs.phase
        failed = spare.model_copy(update={"state": "Failed", "covering": None, "since": at(now)})
        event = EmitEvent("Warning", SPARE_FAILED, f"{slot.name}: {why}: {obs.message}"[:1024])
        return failed, [DeleteUnit(slot.name, SPARE_FAILED), event], None
    state, covering = _heard_state(heard)
    if (state, covering) == (spare.state, spare.covering):
        return spare, [], None
    covers = spare.covers + (1 if covering is not None and covering != spare.covering else 0)
    update = {"state": state, "covering": covering, "covers": covers, "since": at(now)}
    return spare.model_copy(update=update), [], None


def step_spares(
    run: str,
    spec: DilocoRunSpec,
    prev: Sequence[SpareStatus] | None,
    observed: Mapping[str, ObservedUnit],
    report: SyncerStatus | None,
    now: float,
    stopping: bool,
) -> tuple[list[SpareStatus], list[Action], list[float]]:
    """Every spare's status and actions this pass. A stopping run (suspended, finished) keeps
    none: their Jobs are deleted. So are spares the spec no longer asks for."""
    slots = [] if stopping else desired_spares(run, spec)
    wanted = {s.name for s in slots}
    actions: list[Action] = [
        DeleteUnit(name, "SpareNotWanted")
        for name, obs in observed.items()
        if name not in wanted and obs.phase != "Terminating"
    ]
    prev_by = {s.name: s for s in prev or ()}
    heard = report.spares if report is not None else {}
    spares: list[SpareStatus] = []
    waits: list[float] = []
    for slot in slots:
        spare, acts, wait = _step_spare(
            slot,
            prev_by.get(slot.name),
            observed.get(slot.name),
            heard.get(slot.name),
            spec.total_units,
            spec.failure_policy,
            now,
        )
        spares.append(spare)
        actions += acts
        if wait is not None:
            waits.append(wait)
    return spares, actions, waits


def _lost_attempt(unit: UnitStatus) -> int | None:
    """The attempt (the operator's count) whose pods a unit lost and a spare may cover now."""
    if unit.remote:
        return None
    if unit.state == "Offline":
        return unit.attempt
    if unit.state == "Recreating" and unit.attempt > 0:
        return unit.attempt - 1
    return None


def covers(
    units: Sequence[UnitStatus], report: SyncerStatus | None, num_units: int
) -> list[CoverUnit]:
    """A cover for each unit that lost its pods, while a spare of its group waits and no spare
    covers it yet, and the unit's recreated pod has not joined."""
    if report is None:
        return []
    waiting: dict[str, int] = {}
    covered = set()
    for heard in report.spares.values():
        if heard.state == "Waiting":
            waiting[heard.group] = waiting.get(heard.group, 0) + 1
        if heard.state == "Covering" and heard.unit is not None:
            covered.add(heard.unit)
    asks = []
    for unit in units:
        lost = _lost_attempt(unit)
        if lost is None or unit.name in covered or not waiting.get(unit.group):
            continue
        learner = report.learners.get(unit.name)
        if learner is not None and learner.attempt > lost:
            continue  # its recreated pod joined: nothing to cover
        waiting[unit.group] -= 1
        asks.append(
            CoverUnit(unit.name, unit.group, unit.global_index, num_units, cover_attempt(lost))
        )
    return asks


def mark_covered(units: Sequence[UnitStatus], report: SyncerStatus | None) -> list[UnitStatus]:
    """`units` with the spare covering each (coveredBy), as the syncer reports it."""
    heard = report.spares if report is not None else {}
    by_unit = {s.unit: name for name, s in heard.items() if s.state == "Covering" and s.unit}
    out = []
    for unit in units:
        covered_by = by_unit.get(unit.name)
        out.append(
            unit
            if unit.covered_by == covered_by
            else unit.model_copy(update={"covered_by": covered_by})
        )
    return out


def is_cover(restarts_in_place: int) -> bool:
    """Whether a learner the syncer hears is a spare's cover (its attempt's restarts part)."""
    return restarts_in_place == COVER_RESTARTS

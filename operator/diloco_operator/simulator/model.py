"""Goodput simulator: a discrete-event simulation of training on a fleet of failing chips.

It reproduces the setting of the Decoupled DiLoCo paper's goodput study: a fleet of `total_chips`
accelerators, each interrupted on average once per `chip_mtbi_hours` of running, grouped into
slices (the failure domain: one bad chip takes its slice out). Three ways to train on that fleet:

- ``non-elastic``: one SPMD job over every healthy slice. Any failure restarts the whole job
  (reschedule, reload the last checkpoint) and the work since that checkpoint is lost.
- ``elastic-dp``: one data-parallel job that drops a failed replica and keeps going. Every failure
  still pauses every chip while the job re-forms its collectives without the failed slice.
- ``diloco``: M independent learners, each an SPMD job over its share of the slices. A failure
  pauses only the learner that owns the slice; that learner re-forms, pulls the global parameters
  and loses the inner-step progress it had not yet pushed to the syncer.

Goodput = useful chip-seconds / (fleet chip-seconds); uptime = share of wall time in which at least
one group is making progress. The model is pure Python (a seeded `random.Random`, no I/O, no
numpy, so the operator image can run it); `report` presents results (markdown, a rich table,
a plot) and `cli` is the command-line edge.

Assumptions, all global (one value for every cell of the table, never tuned per cell):
see `Assumptions` and `describe_assumptions`.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Strategy = Literal["non-elastic", "elastic-dp", "diloco"]
STRATEGIES: tuple[Strategy, ...] = ("non-elastic", "elastic-dp", "diloco")

HOURS_PER_YEAR = 8760.0

# The paper's published goodput figures (5B model, chip MTBI 1 year), keyed (strategy, M, chips).
PAPER_GOODPUT: dict[tuple[Strategy, int, int], float] = {
    ("elastic-dp", 1, 1_200_000): 0.58,
    ("diloco", 2, 1_200_000): 0.70,
    ("diloco", 8, 1_200_000): 0.88,
    ("diloco", 16, 1_200_000): 0.93,
    ("non-elastic", 1, 2_400_000): 0.18,
    ("elastic-dp", 1, 2_400_000): 0.40,
    ("diloco", 8, 2_400_000): 0.80,
    ("diloco", 16, 2_400_000): 0.86,
}

DEFAULT_CHIPS: tuple[int, ...] = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
DEFAULT_LEARNERS: tuple[int, ...] = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Assumptions:
    """Physical parameters shared by every scenario. Defaults are the calibration used in
    docs/benchmarks.md (chosen once, globally; see `describe_assumptions` for the reasoning)."""

    chip_mtbi_hours: float = HOURS_PER_YEAR  # the paper: one interruption per chip-year
    slice_chips: int = 256  # failure domain: one chip down takes its slice down
    repair_hours: float = 1.5  # a failed slice is out of service this long
    reconfigure_seconds: float = 18.0  # a group drops a slice and re-forms its mesh
    restart_seconds: float = 60.0  # non-elastic: reschedule every host, reload checkpoint
    step_seconds: float = 0.25  # one inner (or data-parallel) step
    inner_steps: int = 24  # H: a fragment is pushed every H inner steps (paper default)
    fragments: int = 24  # P: fragments pushed staggered (paper default)
    checkpoint_steps: int = 1  # non-elastic: in-memory checkpoint every this many steps

    def __post_init__(self) -> None:
        for name in ("chip_mtbi_hours", "repair_hours", "step_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("reconfigure_seconds", "restart_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("slice_chips", "inner_steps", "fragments", "checkpoint_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def slice_failure_rate(self) -> float:
        """Interruptions per second of one running slice."""
        return self.slice_chips / (self.chip_mtbi_hours * 3600.0)


@dataclass(frozen=True)
class Scenario:
    strategy: Strategy
    total_chips: int
    learners: int = 1

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.total_chips < 1:
            raise ValueError(f"total_chips must be >= 1, got {self.total_chips}")
        if self.learners < 1:
            raise ValueError(f"learners must be >= 1, got {self.learners}")
        if self.strategy != "diloco" and self.learners != 1:
            raise ValueError(f"learners must be 1 for strategy {self.strategy}")

    @property
    def label(self) -> str:
        return f"DiLoCo M={self.learners}" if self.strategy == "diloco" else self.strategy


@dataclass(frozen=True)
class SimResult:
    scenario: Scenario
    horizon_seconds: float
    fleet_chips: int
    goodput: float
    uptime: float
    failures: int
    useful_chip_seconds: float
    lost_work_chip_seconds: float  # ran, then thrown away (unsynced / since checkpoint)
    paused_chip_seconds: float  # healthy chips idle while their group re-forms or restarts
    repair_chip_seconds: float  # chips inside slices under repair

    @property
    def accounted_fraction(self) -> float:
        """useful + lost + paused + repair over the fleet's chip-seconds: 1 when the event
        bookkeeping is consistent (every chip-second lands in exactly one bucket)."""
        total = (
            self.useful_chip_seconds
            + self.lost_work_chip_seconds
            + self.paused_chip_seconds
            + self.repair_chip_seconds
        )
        return total / (self.fleet_chips * self.horizon_seconds)


def split_slices(total_slices: int, groups: int) -> list[int]:
    """Slices per group, as even as possible (the first groups take the remainder)."""
    if groups > total_slices:
        raise ValueError(f"{groups} groups need at least {groups} slices, fleet has {total_slices}")
    base, extra = divmod(total_slices, groups)
    return [base + (1 if g < extra else 0) for g in range(groups)]


def unsynced_seconds(elapsed: float, a: Assumptions) -> float:
    """Mean over fragments of the run time since that fragment was last pushed, for a learner
    that started `elapsed` seconds ago: the work a DiLoCo learner loses when it dies.
    Fragment p is first pushed at (p+1)*H/P steps, then every H steps (the staggered schedule)."""
    period = a.inner_steps * a.step_seconds
    total = 0.0
    for p in range(a.fragments):
        first = (p + 1) * period / a.fragments
        total += elapsed if elapsed < first else (elapsed - first) % period
    return total / a.fragments


def lost_seconds(strategy: Strategy, elapsed: float, a: Assumptions) -> float:
    """Run time whose work is thrown away when a group fails `elapsed` seconds into a run."""
    if strategy == "diloco":
        return unsynced_seconds(elapsed, a)
    if strategy == "elastic-dp":  # the step in flight is redone
        return elapsed % a.step_seconds
    return elapsed % (a.checkpoint_steps * a.step_seconds)  # back to the last checkpoint


@dataclass
class _Group:
    slices: int  # healthy slices (repairing ones excluded)
    running: bool = True
    run_start: float = 0.0
    mark: float = 0.0  # time up to which chip-seconds have been accounted
    generation: int = 0  # invalidates a scheduled failure when the group's state changes
    useful: float = 0.0
    lost: float = 0.0
    paused: float = 0.0
    run_seconds: float = 0.0


_FAIL, _RESUME, _REPAIRED = 0, 1, 2


class _Fleet:
    """The event-driven state of one simulation: groups of slices, the event queue, and the
    chip-seconds booked so far."""

    def __init__(
        self, scenario: Scenario, a: Assumptions, total_slices: int, horizon: float, seed: int
    ) -> None:
        self.strategy = scenario.strategy
        self.a = a
        self.horizon = horizon
        groups_n = scenario.learners if scenario.strategy == "diloco" else 1
        self.pause = (
            a.restart_seconds if scenario.strategy == "non-elastic" else a.reconfigure_seconds
        )
        self.rng = random.Random(seed)
        self.groups = [_Group(slices=n) for n in split_slices(total_slices, groups_n)]
        self.repairing = [0] * groups_n
        self.events: list[tuple[float, int, int, int]] = []  # (time, kind, group, generation)
        self.failures = 0
        self.repair_chip_seconds = 0.0
        # Uptime: wall time during which at least one group runs.
        self.running_groups = groups_n
        self.up_since = 0.0
        self.up_time = 0.0
        for g in range(groups_n):
            self.schedule_failure(g, 0.0)

    def settle(self, g: int, now: float) -> None:
        """Book chip-seconds of group g from its mark to `now` in its current state."""
        grp = self.groups[g]
        chips = grp.slices * self.a.slice_chips
        dt = now - grp.mark
        if grp.running:
            grp.useful += chips * dt
            grp.run_seconds += dt
        else:
            grp.paused += chips * dt
        grp.mark = now

    def schedule_failure(self, g: int, now: float) -> None:
        grp = self.groups[g]
        grp.generation += 1
        if grp.running and grp.slices > 0:
            dt = self.rng.expovariate(grp.slices * self.a.slice_failure_rate)
            heapq.heappush(self.events, (now + dt, _FAIL, g, grp.generation))

    def fail(self, g: int, now: float) -> None:
        """A slice of group g fails: the group loses its unsaved work and pauses; the slice goes
        to repair."""
        a, grp = self.a, self.groups[g]
        self.failures += 1
        self.settle(g, now)
        elapsed = now - grp.run_start
        lost = lost_seconds(self.strategy, elapsed, a) * grp.slices * a.slice_chips
        grp.useful -= lost
        grp.lost += lost
        grp.slices -= 1
        self.repairing[g] += 1
        repaired_at = now + a.repair_hours * 3600.0
        heapq.heappush(self.events, (repaired_at, _REPAIRED, g, 0))
        self.repair_chip_seconds += a.slice_chips * (min(repaired_at, self.horizon) - now)
        grp.running = False
        grp.generation += 1  # a paused group accrues no failures
        self.running_groups -= 1
        if self.running_groups == 0:
            self.up_time += now - self.up_since
        heapq.heappush(self.events, (now + self.pause, _RESUME, g, grp.generation))

    def resume(self, g: int, now: float) -> None:
        grp = self.groups[g]
        self.settle(g, now)
        grp.running = True
        grp.run_start = now
        if self.running_groups == 0:
            self.up_since = now
        self.running_groups += 1
        self.schedule_failure(g, now)

    def repaired(self, g: int, now: float) -> None:
        """A slice comes back from repair and joins its group at once."""
        self.settle(g, now)
        self.groups[g].slices += 1
        self.repairing[g] -= 1
        if self.groups[g].running:
            self.schedule_failure(g, now)  # more slices: a higher failure rate from now on

    def run(self) -> None:
        while self.events:
            now, kind, g, gen = heapq.heappop(self.events)
            if now >= self.horizon:
                break
            grp = self.groups[g]
            if kind == _FAIL:
                if gen == grp.generation:  # else superseded by a state change of the group
                    self.fail(g, now)
            elif kind == _RESUME:
                if gen == grp.generation and not grp.running:
                    self.resume(g, now)
            else:
                self.repaired(g, now)
        for g in range(len(self.groups)):
            self.settle(g, self.horizon)
        if self.running_groups > 0:
            self.up_time += self.horizon - self.up_since


def simulate(
    scenario: Scenario,
    assumptions: Assumptions | None = None,
    *,
    horizon_seconds: float | None = None,
    target_failures: int = 10_000,
    seed: int = 0,
) -> SimResult:
    """Run one scenario. Without an explicit horizon, simulate long enough for about
    `target_failures` interruptions (at least one day), so every cell has similar noise."""
    a = assumptions or Assumptions()
    total_slices = max(1, round(scenario.total_chips / a.slice_chips))
    fleet_chips = total_slices * a.slice_chips
    fleet_rate = total_slices * a.slice_failure_rate
    if horizon_seconds is None:
        horizon_seconds = max(86_400.0, target_failures / fleet_rate)
    if horizon_seconds <= 0:
        raise ValueError(f"horizon_seconds must be > 0, got {horizon_seconds}")
    fleet = _Fleet(scenario, a, total_slices, horizon_seconds, seed)
    fleet.run()
    useful = sum(grp.useful for grp in fleet.groups)
    return SimResult(
        scenario=scenario,
        horizon_seconds=horizon_seconds,
        fleet_chips=fleet_chips,
        goodput=useful / (fleet_chips * horizon_seconds),
        uptime=fleet.up_time / horizon_seconds,
        failures=fleet.failures,
        useful_chip_seconds=useful,
        lost_work_chip_seconds=sum(grp.lost for grp in fleet.groups),
        paused_chip_seconds=sum(grp.paused for grp in fleet.groups),
        repair_chip_seconds=fleet.repair_chip_seconds,
    )


def default_scenarios(
    chips: Sequence[int] = DEFAULT_CHIPS, learners: Sequence[int] = DEFAULT_LEARNERS
) -> list[Scenario]:
    """The paper's grid: both baselines and DiLoCo with each M, for each fleet size."""
    out: list[Scenario] = []
    for n in chips:
        out.append(Scenario("non-elastic", n))
        out.append(Scenario("elastic-dp", n))
        out.extend(Scenario("diloco", n, m) for m in learners)
    return out


def sweep(
    scenarios: Sequence[Scenario],
    assumptions: Assumptions | None = None,
    *,
    target_failures: int = 10_000,
    seed: int = 0,
) -> list[SimResult]:
    return [
        simulate(s, assumptions, target_failures=target_failures, seed=seed + i)
        for i, s in enumerate(scenarios)
    ]


def paper_figure(scenario: Scenario) -> float | None:
    return PAPER_GOODPUT.get((scenario.strategy, scenario.learners, scenario.total_chips))

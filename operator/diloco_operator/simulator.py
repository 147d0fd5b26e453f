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
numpy, so the operator image can run it); `main` is the CLI edge.

Assumptions, all global (one value for every cell of the table, never tuned per cell):
see `Assumptions` and `describe_assumptions`.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

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
    groups_n = scenario.learners if scenario.strategy == "diloco" else 1
    fleet_rate = total_slices * a.slice_failure_rate
    if horizon_seconds is None:
        horizon_seconds = max(86_400.0, target_failures / fleet_rate)
    if horizon_seconds <= 0:
        raise ValueError(f"horizon_seconds must be > 0, got {horizon_seconds}")
    pause = a.restart_seconds if scenario.strategy == "non-elastic" else a.reconfigure_seconds
    rng = random.Random(seed)
    groups = [_Group(slices=n) for n in split_slices(total_slices, groups_n)]
    repairing = [0] * groups_n
    events: list[tuple[float, int, int, int]] = []  # (time, kind, group, generation)
    failures = 0
    repair_chip_seconds = 0.0

    def settle(g: int, now: float) -> None:
        """Book chip-seconds of group g from its mark to `now` in its current state."""
        grp = groups[g]
        chips = grp.slices * a.slice_chips
        dt = now - grp.mark
        if grp.running:
            grp.useful += chips * dt
            grp.run_seconds += dt
        else:
            grp.paused += chips * dt
        grp.mark = now

    def schedule_failure(g: int, now: float) -> None:
        grp = groups[g]
        grp.generation += 1
        if grp.running and grp.slices > 0:
            dt = rng.expovariate(grp.slices * a.slice_failure_rate)
            heapq.heappush(events, (now + dt, _FAIL, g, grp.generation))

    for g in range(groups_n):
        schedule_failure(g, 0.0)

    # Uptime: wall time during which at least one group runs.
    running_groups = groups_n
    up_since = 0.0
    up_time = 0.0

    while events:
        now, kind, g, gen = heapq.heappop(events)
        if now >= horizon_seconds:
            break
        grp = groups[g]
        if kind == _FAIL:
            if gen != grp.generation:
                continue  # superseded by a state change of the group
            failures += 1
            settle(g, now)
            elapsed = now - grp.run_start
            lost = lost_seconds(scenario.strategy, elapsed, a) * grp.slices * a.slice_chips
            grp.useful -= lost
            grp.lost += lost
            grp.slices -= 1
            repairing[g] += 1
            heapq.heappush(events, (now + a.repair_hours * 3600.0, _REPAIRED, g, 0))
            repair_chip_seconds += a.slice_chips * (
                min(now + a.repair_hours * 3600.0, horizon_seconds) - now
            )
            grp.running = False
            grp.generation += 1  # a paused group accrues no failures
            running_groups -= 1
            if running_groups == 0:
                up_time += now - up_since
            heapq.heappush(events, (now + pause, _RESUME, g, grp.generation))
        elif kind == _RESUME:
            if gen != grp.generation or grp.running:
                continue
            settle(g, now)
            grp.running = True
            grp.run_start = now
            if running_groups == 0:
                up_since = now
            running_groups += 1
            schedule_failure(g, now)
        else:  # a slice comes back from repair and joins its group at once
            settle(g, now)
            grp.slices += 1
            repairing[g] -= 1
            if grp.running:
                schedule_failure(g, now)  # more slices: a higher failure rate from now on

    for g in range(groups_n):
        settle(g, horizon_seconds)
    if running_groups > 0:
        up_time += horizon_seconds - up_since

    useful = sum(grp.useful for grp in groups)
    return SimResult(
        scenario=scenario,
        horizon_seconds=horizon_seconds,
        fleet_chips=fleet_chips,
        goodput=useful / (fleet_chips * horizon_seconds),
        uptime=up_time / horizon_seconds,
        failures=failures,
        useful_chip_seconds=useful,
        lost_work_chip_seconds=sum(grp.lost for grp in groups),
        paused_chip_seconds=sum(grp.paused for grp in groups),
        repair_chip_seconds=repair_chip_seconds,
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


def describe_assumptions(a: Assumptions) -> list[str]:
    """One line per assumption, for the table's caption."""
    fleet_floor = a.slice_chips * a.repair_hours / a.chip_mtbi_hours
    return [
        f"Chip mean time between interruptions: {a.chip_mtbi_hours:.0f} h of running "
        f"({a.chip_mtbi_hours / HOURS_PER_YEAR:.2g} year; the paper's setting). Interruptions are "
        "Poisson per running chip; idle chips (paused group, slice in repair) are not interrupted.",
        f"Failure domain: a slice of {a.slice_chips} chips (one chip down takes its slice down).",
        f"Repair: a failed slice is out of service {a.repair_hours:g} h, then rejoins its group "
        f"without a further pause. This alone idles {100 * fleet_floor:.1f}% of the fleet "
        "(slice_chips x repair / MTBI) in every strategy.",
        f"Reconfigure: the synchronous group that owns the failed slice pauses "
        f"{a.reconfigure_seconds:g} s (detect, drop the slice, re-form the mesh; a DiLoCo learner "
        "also pulls the global parameters). elastic-dp: the group is the whole job; diloco: one "
        "learner.",
        f"Non-elastic restart: every failure stops the whole job for {a.restart_seconds:g} s "
        f"(reschedule all hosts, reload) and rolls back to the last in-memory checkpoint "
        f"(every {a.checkpoint_steps} step(s)).",
        f"Step time {a.step_seconds:g} s. elastic-dp loses the step in flight; a DiLoCo learner "
        f"loses the progress not yet pushed: P={a.fragments} fragments, each pushed every "
        f"H={a.inner_steps} steps, staggered (on average H/2 steps = "
        f"{a.inner_steps * a.step_seconds / 2:g} s of a long-running learner).",
        "Goodput = useful chip-seconds / fleet chip-seconds. Uptime = share of wall time in which "
        "at least one group makes progress. Learners are equal shares of the slices; the ML "
        "efficiency of M learners vs data-parallel is not part of goodput (it is measured in the "
        "ML-parity rows).",
        "Calibration: these values were chosen once for all cells (reconfigure and repair against "
        "the paper's elastic-DP and DiLoCo figures, restart against its non-elastic figure); no "
        "per-cell factors.",
    ]


def results_table_markdown(results: Sequence[SimResult]) -> str:
    """Goodput (and uptime) per strategy row and fleet-size column, the paper's figure beside."""
    chips, rows = _grid(results)
    head = "| strategy | " + " | ".join(_fmt_chips(n) for n in chips) + " |"
    sep = "|---|" + "---|" * len(chips)
    lines = [head, sep]
    for label, by_chips in rows.items():
        cells = []
        for n in chips:
            cell_result = by_chips.get(n)
            if cell_result is None:
                cells.append("")
                continue
            cell = f"{100 * cell_result.goodput:.1f}% (up {100 * cell_result.uptime:.0f}%)"
            paper = paper_figure(cell_result.scenario)
            if paper is not None:
                delta = 100 * (cell_result.goodput - paper)
                cell += f" · paper {100 * paper:.0f}% (Δ {delta:+.1f})"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paper_deltas(results: Sequence[SimResult]) -> list[tuple[SimResult, float]]:
    """(result, ours - paper) for every cell where the paper publishes a figure."""
    out = []
    for r in results:
        paper = paper_figure(r.scenario)
        if paper is not None:
            out.append((r, r.goodput - paper))
    return out


def plot_goodput(results: Sequence[SimResult], path: str | Path) -> Path:
    """Goodput vs fleet size, one line per strategy, the paper's points as crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[SimResult]] = {}
    for r in results:
        series.setdefault(r.scenario.label, []).append(r)
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r.scenario.total_chips)
        xs = [r.scenario.total_chips for r in rs]
        (line,) = ax.plot(xs, [100 * r.goodput for r in rs], marker="o", label=label)
        paper = [(r.scenario.total_chips, paper_figure(r.scenario)) for r in rs]
        px = [x for x, p in paper if p is not None]
        py = [100 * p for _, p in paper if p is not None]
        if px:
            ax.scatter(px, py, marker="x", s=80, color=line.get_color(), zorder=5)
    ax.set_xscale("log")
    ax.set_xlabel("total chips")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Simulated goodput (lines) vs the paper's figures (crosses)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _grid(results: Sequence[SimResult]) -> tuple[list[int], dict[str, dict[int, SimResult]]]:
    """Fleet sizes (columns) and results by strategy label (rows) then fleet size."""
    chips = sorted({r.scenario.total_chips for r in results})
    rows: dict[str, dict[int, SimResult]] = {}
    for r in results:
        rows.setdefault(r.scenario.label, {})[r.scenario.total_chips] = r
    return chips, rows


def _fmt_chips(n: int) -> str:
    return f"{n / 1e6:g}M chips" if n >= 1_000_000 else f"{n / 1e3:g}k chips"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(float(v)) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco simulate` (also used by `python -m diloco_operator.simulator`)."""
    d = Assumptions()
    parser.add_argument("--chips", type=_int_list, default=list(DEFAULT_CHIPS), help="fleet sizes")
    parser.add_argument(
        "--learners", type=_int_list, default=list(DEFAULT_LEARNERS), help="M values"
    )
    parser.add_argument("--failures", type=int, default=10_000, help="interruptions per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mtbi-hours", type=float, default=d.chip_mtbi_hours)
    parser.add_argument("--slice-chips", type=int, default=d.slice_chips)
    parser.add_argument("--repair-hours", type=float, default=d.repair_hours)
    parser.add_argument("--reconfigure-seconds", type=float, default=d.reconfigure_seconds)
    parser.add_argument("--restart-seconds", type=float, default=d.restart_seconds)
    parser.add_argument("--step-seconds", type=float, default=d.step_seconds)
    parser.add_argument("--inner-steps", type=int, default=d.inner_steps)
    parser.add_argument("--fragments", type=int, default=d.fragments)
    parser.add_argument("--plot", type=Path, default=None, help="write a goodput PNG here")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def assumptions_from_args(args: argparse.Namespace) -> Assumptions:
    return replace(
        Assumptions(),
        chip_mtbi_hours=args.mtbi_hours,
        slice_chips=args.slice_chips,
        repair_hours=args.repair_hours,
        reconfigure_seconds=args.reconfigure_seconds,
        restart_seconds=args.restart_seconds,
        step_seconds=args.step_seconds,
        inner_steps=args.inner_steps,
        fragments=args.fragments,
    )


def result_to_json(r: SimResult) -> dict[str, Any]:
    out = asdict(r)
    out["scenario"] = asdict(r.scenario)
    out["paper"] = paper_figure(r.scenario)
    return out


def run_from_args(args: argparse.Namespace) -> int:
    """Run the sweep described by parsed `simulate` flags; print a table (or JSON)."""
    try:
        a = assumptions_from_args(args)
        scenarios = default_scenarios(args.chips, args.learners)
        if args.failures < 1:
            raise ValueError(f"--failures must be >= 1, got {args.failures}")
        results = sweep(scenarios, a, target_failures=args.failures, seed=args.seed)
    except ValueError as exc:
        print(f"diloco simulate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([result_to_json(r) for r in results], indent=2))
    else:
        _print_rich(results, a)
    if args.plot is not None:
        print(f"plot: {plot_goodput(results, args.plot)}", file=sys.stderr)
    return 0


def _print_rich(results: Sequence[SimResult], a: Assumptions) -> None:
    from rich.console import Console
    from rich.table import Table

    chips, rows = _grid(results)
    table = Table(title="Simulated goodput (uptime); paper figure in brackets")
    table.add_column("strategy")
    for n in chips:
        table.add_column(_fmt_chips(n), justify="right")
    for label, by in rows.items():
        cells = []
        for n in chips:
            cell_result = by.get(n)
            if cell_result is None:
                cells.append("")
                continue
            paper = paper_figure(cell_result.scenario)
            extra = f" [{100 * paper:.0f}]" if paper is not None else ""
            cells.append(
                f"{100 * cell_result.goodput:.1f}% ({100 * cell_result.uptime:.0f}%){extra}"
            )
        table.add_row(label, *cells)
    console = Console()
    console.print(table)
    for line in describe_assumptions(a):
        console.print(f"- {line}", highlight=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="diloco simulate", description="Goodput of elastic training on failing chips."
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "PAPER_GOODPUT",
    "Assumptions",
    "Scenario",
    "SimResult",
    "add_arguments",
    "default_scenarios",
    "describe_assumptions",
    "main",
    "paper_deltas",
    "plot_goodput",
    "results_table_markdown",
    "run_from_args",
    "simulate",
    "sweep",
]

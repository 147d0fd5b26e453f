"""Heterogeneous speeds with real processes (`diloco local run`).

Four units: two at full speed (group `fast`, slowdown 1) and two at half speed (group `slow`,
slowdown 2: each step is stretched to twice its measured time). Decoupled DiLoCo lets every unit
run at its own rate, so the fast units should spend their loop time in train steps, never
waiting, and (where the units do not share CPUs) do about twice the steps of the slow ones. The
full variant adds the pair (2, 4): the same 2:1 ratio with every unit pacing itself.

The synchronous comparison is a second run of the same runtime with all four units at slowdown 2:
the rate a barrier imposes when every round waits for the slowest unit. It is an upper bound for
synchronous DiLoCo, which would also pay the barrier waits themselves (and the fast units' idle
time) on top of that rate; the rest (model, data shards, H, P, merge, outer step) is unchanged.
Both runs stop after the same wall-clock; the global eval loss (the syncer's periodic evaluation)
is compared at equal seconds since training started.

Everything comes from each run's own records: the syncer log's `event=eval` lines (time, loss),
and each learner log's `event=first_step`, `event=progress` and `event=exit` lines (steps,
tokens, and how the loop's time split between train steps, the slowdown sleep and the rest).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.lib.common import BenchContext, Section, log, md_table
from bench.lib.live import IMAGE, local_run, local_training, run_document
from bench.lib.syncer_logs import TIMESTAMP, log_time

NAME = "bench-mixed"
GROUPS = (("fast", 2), ("slow", 2))
_TIME = "^" + TIMESTAMP
_EVAL = re.compile(_TIME + r" .*event=eval outer_step=(\d+) loss=([0-9.]+)", re.M)
_FIRST = re.compile(_TIME + r" .*event=first_step ", re.M)
_PROGRESS = re.compile(_TIME + r" .*event=progress unit=\S+ step=(\d+) ", re.M)
_EXIT = re.compile(
    _TIME
    + r" .*event=exit unit=\S+ steps=(\d+) .*train_seconds=([0-9.]+) slowdown_seconds=([0-9.]+) "
    r"other_seconds=([0-9.]+)",
    re.M,
)


def manifest(fast: float, slow: float) -> dict[str, Any]:
    """4 units: the `fast` group at slowdown `fast`, the `slow` group at slowdown `slow`."""
    spec = {
        "image": IMAGE,
        "replicas": GROUPS[0][1],
        "unitGroups": [
            {"name": GROUPS[0][0]},
            {"name": GROUPS[1][0], "replicas": GROUPS[1][1]},
        ],
        # Local-only: no faults without --chaos, but the slowdown applies.
        "chaos": {"slowdown": {GROUPS[0][0]: fast, GROUPS[1][0]: slow}},
        # The token budget is out of reach on purpose: both runs stop at the same wall-clock.
        "training": local_training(100_000_000, checkpoint_seconds=30, eval_seconds=5),
        "failurePolicy": {"maxUnitRestarts": 3, "restartBackoffSeconds": 1},
    }
    return run_document(NAME, spec)


def tokens_per_step() -> int:
    from diloco_trainer.config import TrainingConfig

    training = manifest(1.0, 2.0)["spec"]["training"]
    return TrainingConfig.model_validate(training).tokens_per_step


@dataclass
class UnitFigures:
    name: str
    group: str
    steps: int
    tokens_per_sec: float  # from the end of its first (compiling) step to its exit
    train_share: float | None  # of the loop's time after its first step
    slowdown_share: float | None
    other_share: float | None
    first_step: float


@dataclass
class RunFigures:
    units: list[UnitFigures]
    evals: list[tuple[float, float]]  # (seconds since training started, eval loss)
    t0: float  # wall time (epoch) training started: the last unit's first step
    wall: float


def parse_run(report: Path) -> RunFigures:
    logs = report / "logs"
    units: list[UnitFigures] = []
    per_step = tokens_per_step()
    for path in sorted(logs.glob(f"{NAME}-*.log")):
        text = path.read_text()
        name = path.stem
        group = name.split("-")[-2]
        first = _FIRST.search(text)
        progress = [(log_time(t), int(s)) for t, s in _PROGRESS.findall(text)]
        exit_ = _EXIT.search(text)
        if first is None or not progress:
            raise RuntimeError(f"{name}: too few records in {path}")
        # Rate over the training window: from the end of the first (compiling) step to the last
        # record (the exit line; the last progress record if the learner died without one).
        t_first = log_time(first.group(1))
        t_last, steps = progress[-1]
        shares: list[float | None] = [None, None, None]
        if exit_ is not None:
            t_last, steps = log_time(exit_.group(1)), int(exit_.group(2))
            parts = [float(exit_.group(i)) for i in (3, 4, 5)]
            if sum(parts) > 0:
                shares = [p / sum(parts) for p in parts]
        rate = (steps - 1) * per_step / (t_last - t_first) if t_last > t_first else 0.0
        train, slowdown, other = shares
        units.append(
            UnitFigures(name, group, steps, rate, train, slowdown, other, log_time(first.group(1)))
        )
    t0 = max(u.first_step for u in units)
    evals = [
        (log_time(t) - t0, float(loss))
        for t, _, loss in _EVAL.findall((logs / "syncer.log").read_text())
    ]
    summary = yaml.safe_load((report / "summary.json").read_text())
    return RunFigures(units, evals, t0, float(summary.get("wallSeconds", 0.0)))


def loss_at(evals: list[tuple[float, float]], t: float) -> float | None:
    """The last evaluation at or before t seconds (the global model as of then)."""
    before = [loss for s, loss in evals if s <= t]
    return before[-1] if before else None


def one_run(fast: float, slow: float, max_seconds: float) -> RunFigures:
    # No spares: there are no restarts here, and a warming spare would only take CPU.
    with local_run(manifest(fast, slow), max_seconds, spares=0) as (report, _):
        return parse_run(report)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def total_rate(r: RunFigures) -> float:
    return sum(u.tokens_per_sec for u in r.units)


def mean_steps(r: RunFigures, group: str) -> float:
    xs = [u.steps for u in r.units if u.group == group]
    return sum(xs) / len(xs)


def compare(fast: float, slow: float, max_seconds: float) -> tuple[str, dict[str, str]]:
    """Run the mixed pair (fast, slow) and the all-at-`slow` stand-in for a barrier; the markdown
    tables and the headline figures."""
    label_mixed = f"decoupled: 2 at {fast:g}, 2 at {slow:g}"
    label_sync = f"all 4 at {slow:g}"
    mixed = one_run(fast, slow, max_seconds)
    log(f"mixed_speed {label_mixed}: evals {mixed.evals[-2:]}")
    sync = one_run(slow, slow, max_seconds)
    log(f"mixed_speed {label_sync}: evals {sync.evals[-2:]}")
    unit_rows = []
    for label, r in ((label_mixed, mixed), (label_sync, sync)):
        for u in r.units:
            unit_rows.append(
                (
                    label,
                    u.name,
                    u.steps,
                    f"{u.tokens_per_sec:,.0f}",
                    _pct(u.train_share),
                    _pct(u.slowdown_share),
                    _pct(u.other_share),
                )
            )
        total = (label, "**all units**", sum(u.steps for u in r.units), f"**{total_rate(r):,.0f}**")
        unit_rows.append((*total, "", "", ""))
    unit_table = md_table(
        ["run", "unit", "steps", "tokens/s", "loop: train steps", "slowdown sleep", "other"],
        unit_rows,
    )
    horizon = min(mixed.evals[-1][0], sync.evals[-1][0])
    marks = [t for t in (15, 30, 45, 60, 90, 120, 180, 240) if t < horizon] + [horizon]
    loss_rows = []
    for t in marks:
        a, b = loss_at(mixed.evals, t), loss_at(sync.evals, t)
        loss_rows.append(
            (
                f"{t:.0f} s",
                "-" if a is None else f"{a:.4f}",
                "-" if b is None else f"{b:.4f}",
                f"{a / b:.3f}" if a and b else "-",
            )
        )
    loss_table = md_table(
        [
            "since training started",
            f"eval loss: {label_mixed}",
            f"eval loss: {label_sync}",
            "ratio",
        ],
        loss_rows,
    )
    fast_rate = [u.tokens_per_sec for u in mixed.units if u.group == "fast"]
    slow_rate = [u.tokens_per_sec for u in mixed.units if u.group == "slow"]
    fast_train = [u.train_share for u in mixed.units if u.group == "fast"]
    figures = {
        "steps_ratio": f"{mean_steps(mixed, 'fast') / mean_steps(mixed, 'slow'):.2f}",
        "rate_ratio": f"{sum(fast_rate) / sum(slow_rate):.2f}",
        "fast_train": ", ".join(_pct(x) for x in fast_train),
        "total_mixed": f"{total_rate(mixed):,.0f}",
        "total_sync": f"{total_rate(sync):,.0f}",
        "total_ratio": f"{total_rate(mixed) / total_rate(sync):.2f}",
        "loss_ratio": loss_rows[-1][3],
        "horizon": f"{horizon:.0f}",
    }
    text = f"""
### Slowdowns {fast:g} and {slow:g}

{unit_table}

Fast units: **{figures["rate_ratio"]}x** the tokens/s of slow units ({figures["steps_ratio"]}x the
steps, start-up differences included); their loop time in train steps: {figures["fast_train"]}.
Total tokens/s: {figures["total_mixed"]} (mixed) vs {figures["total_sync"]} (all at {slow:g}).

Global eval loss at equal seconds since training started (the last unit's first step; the
syncer's last evaluation at or before each mark; evaluations every 5 s):

{loss_table}
"""
    return text, figures


def verdict(head: dict[str, str]) -> str:
    """The reading of the first pair's figures: slowdowns 1 and 2, the headline."""
    idle = (
        f"**What this shows.** The fast units never idle: {head['fast_train']} of their loop time "
        "is train steps and none is waiting; the rest is fragment installs and bookkeeping, as in "
        "the all-slow run."
    )
    if float(head["rate_ratio"]) >= 1.8:
        return (
            f"{idle} They run at {head['rate_ratio']}x the slow units' tokens/s, and the global "
            f"model's eval loss at {head['horizon']} s is {head['loss_ratio']}x that of the run at "
            "the barrier's rate (one seed, one short run: a few hundredths are noise)."
        )
    return f"""{idle} But they do **not** run at 2x the slow units ({head["rate_ratio"]}x the
tokens/s): this machine is CPU-bound (2 cores shared by 4 learners, the syncer and other work),
and a slowdown sleep hands its CPU to the other processes instead of leaving it idle; a process
that sleeps half the time gets its share back when it wakes, so a "slow" unit computes its steps
faster than an always-busy "fast" one. Total tokens/s: {head["total_mixed"]} (mixed) vs
{head["total_sync"]} (all slow), where separate hardware would give the mixed run 1.5x
(2 x 1 + 2 x 0.5 vs 4 x 0.5). The loss comparison at equal wall-clock (ratio {head["loss_ratio"]}
at {head["horizon"]} s) therefore compares two runs of similar total compute (the mixed one had
{head["total_ratio"]}x the other's tokens/s, where separate hardware would give 1.5x), on a
machine whose load changes from one run to the next: it measures neither the gain decoupling would give on
separate hardware nor a cost of it (one seed, one short run per configuration). The full variant
adds the pair (2, 4), in which every unit sleeps part of each step, so the scheduler treats fast
and slow units alike."""


def run(ctx: BenchContext) -> Section:
    max_seconds = 110 if ctx.quick else 300
    # (1, 2): the headline, half the units at half speed. (2, 4): the same 2:1 ratio with every
    # unit pacing itself, so that no learner is always runnable (see the note on CPU sharing in
    # the section).
    pairs = [(1.0, 2.0)] if ctx.quick else [(1.0, 2.0), (2.0, 4.0)]
    parts = [compare(fast, slow, max_seconds) for fast, slow in pairs]
    head = parts[0][1]
    body = f"""
4 units (`diloco local run`, real processes, no faults, no spares), tiny model, batch 8, H=20,
P=4, quorum 1: group `fast` (2 units) at slowdown 1 and group `slow` (2 units) at slowdown 2 (each
step stretched by sleeping (F-1) x its measured time), against a second run with all 4 units at
slowdown 2: the rate a barrier imposes when every round waits for the slowest unit. That run is an
**upper bound** for synchronous DiLoCo: a real barrier also costs the waits themselves and the
fast units' idle time, which it does not pay. Each run stops after {max_seconds:g} s of wall-clock
(start-up included; the token budget is out of reach). Per unit: steps done; tokens/s between its
first step's end and its exit (compile excluded); the learner's own split of its loop time after
the first, compiling step (`event=exit`: train steps, slowdown sleep, other = installing arrivals,
queueing pushes, logging; there is no wait on other units anywhere in the loop).
{"".join(text for text, _ in parts)}
{verdict(head)}
"""
    config = ", ".join(f"({f:g}, {s:g})" for f, s in pairs)
    return Section(
        name="mixed_speed",
        title="Heterogeneous speeds in real local runs (2 units at 1x, 2 at 0.5x)",
        body=body,
        command=ctx.command,
        config=f"4 units, slowdowns (fast, slow) {config} vs all 4 at the slow one, tiny preset, "
        f"batch 8, H=20, P=4, quorum 1, eval every 5 s, {max_seconds:g} s per run, no spares",
        quick=ctx.quick,
    )

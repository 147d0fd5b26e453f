"""Final loss with and without chaos, over repeated real runs.

One run of each (goodput_real) says little about the loss: two real runs of the same manifest
without faults ended 20% apart at 2M tokens (2.31 and 2.79 on 2026-11-30), because the arrival
pattern of four processes sharing two cores differs from run to run, and with quorum-1 merges
the trajectory follows it. So this section runs the goodput manifest REPEATS times without chaos
and REPEATS times at one kill per unit per minute, alternating, and compares the means, next to
the spread of each side.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.faults.goodput_real import SPARES, UNITS, one_run
from bench.lib.common import BenchContext, Section, log, md_table

REPEATS = 3


def compare_sides(chaos: list[float], calm: list[float]) -> str:
    """What the two sides' final losses say, beyond their means."""
    if chaos and calm and max(chaos) < min(calm):
        return (
            "every run with kills ended below every run without (docs/design.md, "
            '"Kills and the final loss", has more runs and what it is not).'
        )
    if chaos and calm and min(chaos) > max(calm):
        return (
            "every run with kills ended above every run without: the kills cost more than the "
            "run-to-run noise of this setup."
        )
    return (
        "the two sides' runs overlap, so the kills cost less than the run-to-run noise of this "
        "setup."
    )


def run(ctx: BenchContext) -> Section:
    tokens = 600_000 if ctx.quick else 2_000_000
    repeats = 2 if ctx.quick else REPEATS
    kill_every = 60 / UNITS
    runs: dict[str, list[dict[str, Any]]] = {"no chaos": [], "1 kill / unit / min": []}
    for i in range(repeats):
        for label, every in (("no chaos", None), ("1 kill / unit / min", kill_every)):
            s = one_run(tokens, every, 1500, SPARES)
            log(
                f"chaos_loss {label} #{i + 1}: loss {s.get('finalEvalLoss')} kills {s.get('unitKills')}"
            )
            runs[label].append(s)
    rows = []
    means: dict[str, float] = {}
    losses_of: dict[str, list[float]] = {}
    for label, results in runs.items():
        losses = [float(s["finalEvalLoss"]) for s in results if s.get("finalEvalLoss")]
        losses_of[label] = losses
        means[label] = statistics.fmean(losses) if losses else float("nan")
        rows.append(
            (
                label,
                len(losses),
                ", ".join(f"{x:.4f}" for x in losses),
                f"{means[label]:.4f}",
                f"{(max(losses) - min(losses)) / means[label]:.1%}" if losses else "-",
                ", ".join(str(s.get("unitKills", 0)) for s in results),
                ", ".join(f"{100 * s['goodput']:.1f}%" for s in results),
            )
        )
    ratio = means["1 kill / unit / min"] / means["no chaos"]
    reading = compare_sides(losses_of["1 kill / unit / min"], losses_of["no chaos"])
    verdict = "met" if abs(ratio - 1) <= 0.03 else "NOT met"
    table = md_table(
        ["schedule", "runs", "final eval losses", "mean", "range / mean", "kills", "goodput"],
        rows,
    )
    body = f"""
The goodput_real manifest ({UNITS} units, tiny model, {tokens:,} tokens, `--spares {SPARES}`),
run {repeats} times without chaos and {repeats} times with a Poisson kill every
{kill_every:g} s on average (one kill per unit per minute), alternating, on the same machine.
Final eval loss: the syncer's evaluation once the budget is reached.

{table}

Mean loss with chaos / mean without: **{ratio:.3f}** (target: within 3%: **{verdict}**).
Read it against the range column, the spread among the runs of one side:
{reading}
"""
    return Section(
        name="chaos_loss",
        title="Final loss with and without chaos, repeated real runs",
        body=body,
        command=ctx.command,
        config=f"{UNITS} units, tiny preset, batch 8, H=20, P=4, totalTokens {tokens}, "
        f"{SPARES} warm spares, {repeats} runs per side",
        quick=ctx.quick,
    )

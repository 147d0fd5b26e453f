"""What an install does with the steps a learner made since its push (`install`: replace or
rebase), measured where it matters most: the decoupled product at three widths and three seeds.

A learner trains on while its push is merged; replace drops the steps it made on the fragment in
the meantime, rebase keeps them on top of the new version and sends them with its next push.
The share dropped grows as steps get shorter against the merge's round trip, so the narrow
models (fast steps) show the effect most. Each pair of decoupled runs (real processes, alone on
the machine) is read against data-parallel at its own seed and width (deterministic, in-process,
two at a time, after the decoupled runs).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from bench.lib.common import BenchContext, Section, interval_text, log, md_table
from bench.lib.plots import axes, save_ratio_plot
from bench.lib.training import (
    BASE_STEPS,
    SEEDS,
    WIDTHS,
    M,
    Outcome,
    Variant,
    decoupled,
    in_process_runs,
    width_variants,
    with_install,
)

MODES = ("replace", "rebase")


@dataclass(frozen=True)
class Pair:
    """Both modes at one width and seed, and data-parallel there."""

    variant: Variant
    dp: Outcome
    runs: dict[str, Outcome]

    def ratio(self, mode: str) -> float:
        return self.runs[mode].loss / self.dp.loss


def run_pairs(grid: list[Variant], h: int) -> list[Pair]:
    decoupled_runs = {}
    for v in grid:
        for mode in MODES:
            out = decoupled(with_install(v.config(h), mode), v.steps, f"install: {mode}")
            log(
                f"install {v.label} seed {v.seed} {mode}: {out.loss:.4f} ({out.seconds:.0f}s) "
                f"{out.note}"
            )
            decoupled_runs[v, mode] = out
    references = in_process_runs(grid, h, "install", kinds=("dp",))
    return [Pair(v, references[v, "dp"], {m: decoupled_runs[v, m] for m in MODES}) for v in grid]


def by_width(pairs: list[Pair]) -> dict[int, list[Pair]]:
    widths: dict[int, list[Pair]] = {}
    for pair in pairs:
        widths.setdefault(pair.variant.width, []).append(pair)
    return dict(sorted(widths.items()))


def plot(pairs: list[Pair], path: Path) -> Path:
    fig, ax = axes((6, 4))
    groups = by_width(pairs)
    for mode, color in zip(MODES, ("tab:orange", "tab:green"), strict=True):
        for d, at_d in groups.items():
            ax.scatter([d] * len(at_d), [p.ratio(mode) for p in at_d], color=color, alpha=0.4, s=16)
        ax.plot(
            list(groups),
            [statistics.fmean(p.ratio(mode) for p in g) for g in groups.values()],
            marker="o",
            color=color,
            label=f"install: {mode} (mean; dots: seeds)",
        )
    ax.set_xscale("log", base=2)
    return save_ratio_plot(
        fig, ax, path, "dModel", f"Decoupled DiLoCo, M={M}: what an install keeps"
    )


def overwritten(out: Outcome) -> str:
    return "?" if out.overwritten is None else f"{out.overwritten:.1%}"


def run(ctx: BenchContext) -> Section:
    h = 25 if ctx.quick else 30
    grid = (
        width_variants((32,), (0, 1), 200)
        if ctx.quick
        else width_variants(WIDTHS, SEEDS, BASE_STEPS)
    )
    pairs = run_pairs(grid, h)
    png = plot(pairs, ctx.plot_path("install_rebase.png"))
    rows = [
        (
            p.variant.d_model,
            p.variant.seed,
            f"{p.dp.loss:.4f}",
            *(f"{p.runs[m].loss:.4f} ({p.ratio(m):.3f}; {overwritten(p.runs[m])})" for m in MODES),
        )
        for p in pairs
    ]
    table = md_table(
        [
            "dModel",
            "seed",
            "data-parallel",
            *(f"install: {m} (/ data-parallel; steps overwritten)" for m in MODES),
        ],
        rows,
    )
    summary_rows = []
    for d, at_d in by_width(pairs).items():
        means = {m: [p.ratio(m) for p in at_d] for m in MODES}
        gains = [p.ratio("replace") - p.ratio("rebase") for p in at_d]
        summary_rows.append(
            (
                d,
                *(
                    f"**{statistics.fmean(means[m]):.3f}** ({interval_text(means[m])})"
                    for m in MODES
                ),
                f"{statistics.fmean(gains):+.3f} ({sum(g > 0 for g in gains)} of {len(gains)})",
            )
        )
    summary = md_table(
        [
            "dModel",
            *(f"{m}: mean / data-parallel (95% interval, seeds)" for m in MODES),
            "replace - rebase (seeds where rebase is lower)",
        ],
        summary_rows,
    )
    steps = grid[0].steps
    body = f"""
The parity setting (tiny preset, M={M}, H={h}, {steps:,} steps per learner, phase-locked, outer
0.7/0.8, the 8 MB slice) at dModel {", ".join(str(d) for d in by_width(pairs))} and seeds
{", ".join(str(s) for s in sorted({v.seed for v in grid}))}; one decoupled run per mode, width and
seed (real syncer and learner processes), each read against data-parallel at equal tokens at its
own width and seed.

{summary}

{table}

![install: replace vs rebase]({ctx.link(png)})

"Steps overwritten" is the share of a learner's fragment-steps an install replaced (0 under
rebase, which keeps them). Narrower models step faster against the same merge round trip, so
more of their steps fall between a push and its install.
"""
    return Section(
        name="install",
        title="What an install keeps: replace vs rebase",
        body=body,
        command=ctx.command,
        config=f"tiny preset, M={M}, H={h}, S={steps}, dModel "
        + ", ".join(str(d) for d in by_width(pairs)),
        quick=ctx.quick,
    )

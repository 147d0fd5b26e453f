"""Where synchronous DiLoCo's gap to data-parallel goes as the run changes.

From the parity section's setting (tiny, M=4, H=30, P=4, 4,000 steps per learner, an 8 MB slice
of the corpus), the model's width moves over three sizes at the parity section's three seeds,
since a seed alone moves the ratio by about 1%; then, at seed 0, one other thing at a time:
the number of learners (M=8) and the budget (2,000 and 8,000 steps). The slice stays 8 MB in
every run (read twice at 8,000 steps and at M=8), so every row is scored on the same held-out
text. Each variant runs data-parallel and synchronous DiLoCo at equal tokens; both are
deterministic in-process runs, so they run two at a time on the two cores. The decoupled product
runs once at M=8, alone, with real processes.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from diloco_trainer.models.gpt import init_params

from bench.lib.common import BenchContext, Section, interval_text, log, md_table
from bench.lib.plots import axes, save_ratio_plot
from bench.lib.training import (
    BASE_STEPS,
    PARITY_SLICE_BYTES,
    SEEDS,
    WIDTHS,
    M,
    Outcome,
    Variant,
    decoupled,
    in_process_runs,
    width_variants,
)


def variants(quick: bool) -> tuple[list[Variant], list[Variant]]:
    """The width grid, and the one-change-at-a-time rows at seed 0 (the first is the base)."""
    if quick:
        grid = width_variants((32, 128), (0, 1), 200)
        return grid, [grid[2], Variant("M=8", learners=8, steps=200)]
    grid = width_variants(WIDTHS, SEEDS, BASE_STEPS)
    base = next(v for v in grid if v.d_model == 128 and v.seed == 0)
    return grid, [
        base,
        Variant("M=8", learners=8),
        Variant("2,000 steps", steps=2000),
        Variant("8,000 steps", steps=8000),
    ]


def parameter_count(v: Variant, h: int) -> int:
    cfg = v.config(h)
    return sum(math.prod(p.shape) for p in init_params(cfg.model, cfg.seed).values())


@dataclass(frozen=True)
class WidthRow:
    d_model: int
    params: int
    ratios: list[float]  # synchronous DiLoCo / data-parallel, one per seed


def width_rows(
    grid: list[Variant], runs: dict[tuple[Variant, str], Outcome], h: int
) -> list[WidthRow]:
    by_width: dict[int, list[Variant]] = {}
    for v in grid:
        by_width.setdefault(v.width, []).append(v)
    return [
        WidthRow(
            d,
            parameter_count(at_d[0], h),
            [runs[v, "sync"].loss / runs[v, "dp"].loss for v in at_d],
        )
        for d, at_d in sorted(by_width.items())
    ]


def plot_widths(rows: list[WidthRow], path: Path) -> Path:
    fig, ax = axes((6, 4))
    for r in rows:
        ax.scatter([r.params] * len(r.ratios), r.ratios, color="tab:blue", alpha=0.5, s=18)
    ax.plot(
        [r.params for r in rows],
        [statistics.fmean(r.ratios) for r in rows],
        marker="o",
        color="tab:blue",
        label="synchronous DiLoCo, M=4 (mean over seeds; dots: seeds)",
    )
    ax.set_xscale("log")
    return save_ratio_plot(fig, ax, path, "parameters", "The DiLoCo gap over model width")


def run(ctx: BenchContext) -> Section:
    h = 25 if ctx.quick else 30
    grid, changes = variants(ctx.quick)
    runs = in_process_runs(grid + changes, h, "parity_trend")
    m8 = next(v for v in changes if v.learners == 8)
    product = decoupled(m8.config(h), m8.steps, "decoupled DiLoCo, M=8", learners=8)
    log(f"parity_trend decoupled M=8: {product.loss:.4f} ({product.seconds:.0f}s) {product.note}")
    widths = width_rows(grid, runs, h)
    png = plot_widths(widths, ctx.plot_path("parity_trend_width.png"))
    width_table = md_table(
        [
            "dModel",
            "parameters",
            "synchronous DiLoCo / data-parallel, per seed",
            "mean",
            "95% interval (seeds)",
        ],
        [
            (
                r.d_model,
                f"{r.params:,}",
                ", ".join(f"{x:.3f}" for x in r.ratios),
                f"**{statistics.fmean(r.ratios):.3f}**",
                interval_text(r.ratios),
            )
            for r in widths
        ],
    )
    rows = []
    for v in changes:
        dp, sync = runs[v, "dp"], runs[v, "sync"]
        label = (
            f"none (the parity setting: dModel 128, M={M}, {v.steps:,} steps)"
            if v is changes[0]
            else v.label
        )
        rows.append(
            (
                label,
                f"{dp.loss:.4f}",
                f"{sync.loss:.4f}",
                f"**{sync.loss / dp.loss:.3f}**",
                f"{dp.seconds:.0f}s / {sync.seconds:.0f}s",
            )
        )
    table = md_table(
        [
            "run (seed 0)",
            "data-parallel",
            "synchronous DiLoCo",
            "/ data-parallel",
            "wall (dp / sync)",
        ],
        rows,
    )
    dp8, sync8 = runs[m8, "dp"], runs[m8, "sync"]
    base = changes[0].config(h)
    grid_seeds = ", ".join(str(s) for s in sorted({v.seed for v in grid}))
    body = f"""
From the parity section's setting (tiny preset, M={M}, batch {base.data.batch_size} x seqLen
{base.model.context} per learner, H={h}, P={base.fragments}, outer
{base.outer_optimizer.lr}/{base.outer_optimizer.momentum}; data-parallel with batch M x
{base.data.batch_size}, equal tokens). Every run reads the same
{PARITY_SLICE_BYTES / 1e6:g} MB slice of the corpus and is scored on the same held-out
batches. Data-parallel and synchronous DiLoCo are deterministic in-process runs (two at a time
on the two cores; wall times are context only).

Width, at each of seeds {grid_seeds} (a seed
sets the initial parameters and the data order, and alone moves the ratio by about 1%):

{width_table}

![DiLoCo gap over width]({ctx.link(png)})

One change at a time, at seed {changes[0].seed}:

{table}

Decoupled DiLoCo at M=8 (real syncer and 8 learner processes, phase-locked, alone on the
machine): **{product.loss:.4f}**, {product.loss / dp8.loss:.3f} of data-parallel and
{product.loss / sync8.loss:.3f} of synchronous DiLoCo at M=8 ({product.note};
{product.seconds:.0f}s). One run, one seed.
"""
    return Section(
        name="parity_trend",
        title="Parity trend: width, learners, budget",
        body=body,
        command=ctx.command,
        config=f"tiny preset, H={h}, P={base.fragments}, dModel "
        + ", ".join(str(r.d_model) for r in widths)
        + f" at seeds {grid_seeds}; at seed 0: "
        + "; ".join(v.label for v in changes[1:]),
        quick=ctx.quick,
    )

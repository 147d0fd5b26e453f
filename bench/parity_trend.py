"""Issue 21, item 2: where synchronous DiLoCo's gap to data-parallel goes as the run changes.

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
from functools import partial
from pathlib import Path

from diloco_trainer.config import TrainingConfig
from diloco_trainer.models.gpt import init_params

from bench.common import (
    BenchContext,
    Section,
    interval_text,
    log,
    md_table,
    save_ratio_plot,
    two_at_a_time,
)
from bench.parity_bench import (
    PARITY_SLICE_BYTES,
    SEEDS,
    M,
    Outcome,
    data_parallel,
    decoupled,
    parity_config,
    sync_diloco,
)

BASE_STEPS = 4000
WIDTHS = (32, 64, 128)  # dModel; 128 is the tiny preset's, the parity section's model


@dataclass(frozen=True)
class Variant:
    label: str
    learners: int = M
    steps: int = BASE_STEPS
    d_model: int | None = None  # None: the preset's width
    seed: int = 0

    @property
    def width(self) -> int:
        """dModel as the model resolves it (the preset's where `d_model` is None)."""
        return self.config(1).model.width  # any H: the period does not touch the model

    def config(self, h: int) -> TrainingConfig:
        base = parity_config(self.steps, h, seed=self.seed, learners=self.learners)
        if self.d_model is None:
            return base
        raw = base.model_dump(by_alias=True)
        raw["model"]["dModel"] = self.d_model
        return TrainingConfig.model_validate(raw)


def width_variants(widths: tuple[int, ...], seeds: tuple[int, ...], steps: int) -> list[Variant]:
    return [Variant(f"dModel {d}", steps=steps, d_model=d, seed=s) for d in widths for s in seeds]


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


def _reference(v: Variant, h: int) -> Outcome:
    return data_parallel(v.config(h), v.steps, v.learners)


def _synchronous(v: Variant, h: int) -> Outcome:
    return sync_diloco(v.config(h), v.steps, name="synchronous DiLoCo", learners=v.learners)


def in_process_runs(
    vs: list[Variant], h: int, kinds: tuple[str, ...] = ("dp", "sync")
) -> dict[tuple[Variant, str], Outcome]:
    """The in-process runs of every variant (data-parallel, synchronous DiLoCo), two at a time,
    the longest first."""
    jobs = sorted(
        [(v, kind) for v in dict.fromkeys(vs) for kind in kinds],
        key=lambda j: -j[0].steps * j[0].learners * (2 if j[1] == "dp" else 1),
    )

    def done(key: tuple[Variant, str], out: Outcome) -> None:
        v, kind = key
        log(f"parity_trend {v.label} seed {v.seed} {kind}: {out.loss:.4f} ({out.seconds:.0f}s)")

    return two_at_a_time(
        {
            (v, kind): partial(_reference if kind == "dp" else _synchronous, v, h)
            for v, kind in jobs
        },
        done,
    )


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
        WidthRow(d, parameter_count(at_d[0], h),
                 [runs[v, "sync"].loss / runs[v, "dp"].loss for v in at_d])
        for d, at_d in sorted(by_width.items())
    ]  # fmt: skip


def plot_widths(rows: list[WidthRow], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
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
    runs = in_process_runs(grid + changes, h)
    m8 = next(v for v in changes if v.learners == 8)
    product = decoupled(m8.config(h), m8.steps, "decoupled DiLoCo, M=8", learners=8)
    log(f"parity_trend decoupled M=8: {product.loss:.4f} ({product.seconds:.0f}s) {product.note}")
    widths = width_rows(grid, runs, h)
    png = plot_widths(widths, ctx.plot_path("parity_trend_width.png"))
    width_table = md_table(
        ["dModel", "parameters", "synchronous DiLoCo / data-parallel, per seed", "mean",
         "95% interval (seeds)"],
        [
            (r.d_model, f"{r.params:,}", ", ".join(f"{x:.3f}" for x in r.ratios),
             f"**{statistics.fmean(r.ratios):.3f}**", interval_text(r.ratios))
            for r in widths
        ],
    )  # fmt: skip
    rows = []
    for v in changes:
        dp, sync = runs[v, "dp"], runs[v, "sync"]
        label = (
            f"none (the parity setting: dModel 128, M={M}, {v.steps:,} steps)"
            if v is changes[0]
            else v.label
        )
        rows.append(
            (label, f"{dp.loss:.4f}", f"{sync.loss:.4f}", f"**{sync.loss / dp.loss:.3f}**",
             f"{dp.seconds:.0f}s / {sync.seconds:.0f}s")
        )  # fmt: skip
    table = md_table(
        ["run (seed 0)", "data-parallel", "synchronous DiLoCo", "/ data-parallel",
         "wall (dp / sync)"],
        rows,
    )  # fmt: skip
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

![DiLoCo gap over width]({png.relative_to(ctx.out_dir.parent).as_posix()})

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

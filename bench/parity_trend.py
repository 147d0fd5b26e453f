"""Issue 21, item 2: where synchronous DiLoCo's gap to data-parallel goes as the run changes.

From the parity section's setting at seed 0 (tiny, M=4, H=30, P=4, 4,000 steps per learner, an
8 MB slice of the corpus), one thing is changed at a time: the number of learners (M=8), the
model's width (dModel 64 against 128), and the budget (2,000 and 8,000 steps, the data slice
grown with the tokens so that every run reads it about once). Each change runs data-parallel
and synchronous DiLoCo at equal tokens; both are deterministic in-process runs, so they run two
at a time on the two cores. The decoupled product runs once at M=8, alone, with real processes.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from diloco_trainer.config import TrainingConfig

from bench.common import BenchContext, Section, log, md_table
from bench.parity_bench import (
    PARITY_SLICE_BYTES,
    M,
    Outcome,
    data_parallel,
    decoupled,
    parity_config,
    sync_diloco,
)

SEED = 0
BASE_STEPS = 4000
BYTES_PER_LEARNER_STEP = PARITY_SLICE_BYTES // (BASE_STEPS * M)  # the parity slice, read once


@dataclass(frozen=True)
class Variant:
    label: str
    learners: int = M
    steps: int = BASE_STEPS
    d_model: int | None = None  # None: the preset's width

    def config(self, h: int) -> TrainingConfig:
        base = parity_config(self.steps, h, seed=SEED, learners=self.learners)
        raw = base.model_dump(by_alias=True)
        raw["data"]["maxBytes"] = BYTES_PER_LEARNER_STEP * self.steps * self.learners
        if self.d_model is not None:
            raw["model"]["dModel"] = self.d_model
        return TrainingConfig.model_validate(raw)


def variants(quick: bool) -> list[Variant]:
    if quick:
        return [Variant("the parity setting", steps=200), Variant("M=8", learners=8, steps=200)]
    return [
        Variant("the parity setting (M=4, dModel 128, 4,000 steps)"),
        Variant("M=8", learners=8),
        Variant("dModel 64", d_model=64),
        Variant("2,000 steps", steps=2000),
        Variant("8,000 steps", steps=8000),
    ]


def _reference(v: Variant, h: int) -> Outcome:
    return data_parallel(v.config(h), v.steps, v.learners)


def _synchronous(v: Variant, h: int) -> Outcome:
    return sync_diloco(v.config(h), v.steps, name="synchronous DiLoCo", learners=v.learners)


def in_process_runs(vs: list[Variant], h: int) -> dict[tuple[Variant, str], Outcome]:
    """Both runs of every variant, two at a time, the longest first."""
    jobs = sorted(
        [(v, kind) for v in vs for kind in ("dp", "sync")],
        key=lambda j: -j[0].steps * j[0].learners * (2 if j[1] == "dp" else 1),
    )
    spawn = multiprocessing.get_context("spawn")  # a forked JAX runtime is not safe to use
    with ProcessPoolExecutor(max_workers=2, mp_context=spawn) as pool:
        futures = {
            (v, kind): pool.submit(_reference if kind == "dp" else _synchronous, v, h)
            for v, kind in jobs
        }
        results = {}
        for (v, kind), future in futures.items():
            results[v, kind] = out = future.result()
            log(f"parity_trend {v.label} {kind}: {out.loss:.4f} ({out.seconds:.0f}s)")
    return results


def run(ctx: BenchContext) -> Section:
    h = 25 if ctx.quick else 30
    vs = variants(ctx.quick)
    runs = in_process_runs(vs, h)
    m8 = next(v for v in vs if v.learners == 8)
    product = decoupled(m8.config(h), m8.steps, "decoupled DiLoCo, M=8", learners=8)
    log(f"parity_trend decoupled M=8: {product.loss:.4f} ({product.seconds:.0f}s) {product.note}")
    rows = []
    for v in vs:
        dp, sync = runs[v, "dp"], runs[v, "sync"]
        rows.append(
            (v.label, f"{dp.loss:.4f}", f"{sync.loss:.4f}", f"**{sync.loss / dp.loss:.3f}**",
             f"{dp.seconds:.0f}s / {sync.seconds:.0f}s")
        )  # fmt: skip
    table = md_table(
        ["run", "data-parallel", "synchronous DiLoCo", "/ data-parallel", "wall (dp / sync)"],
        rows,
    )
    dp8, sync8 = runs[m8, "dp"], runs[m8, "sync"]
    base = vs[0].config(h)
    body = f"""
One change at a time from the parity section's setting at seed {SEED} (tiny preset, M={M},
batch {base.data.batch_size} x seqLen {base.model.context} per learner, H={h},
P={base.fragments}, outer {base.outer_optimizer.lr}/{base.outer_optimizer.momentum}; data-parallel
with batch M x {base.data.batch_size}, equal tokens). The data slice grows with the tokens
a run reads (8 MB at M=4 and 4,000 steps), so each run reads it about once; the
held-out batches come from the slice, so losses compare only within a row. Data-parallel and
synchronous DiLoCo are deterministic in-process runs (two at a time on the two cores; wall
times are context only).

{table}

Decoupled DiLoCo at M=8 (real syncer and 8 learner processes, phase-locked, alone on the
machine): **{product.loss:.4f}**, {product.loss / dp8.loss:.3f} of data-parallel and
{product.loss / sync8.loss:.3f} of synchronous DiLoCo at M=8 ({product.note};
{product.seconds:.0f}s). One run, one seed.
"""
    return Section(
        name="parity_trend",
        title="Parity trend: learners, width, budget",
        body=body,
        command=ctx.command,
        config=f"tiny preset, seed {SEED}, H={h}, P={base.fragments}, variants: "
        + "; ".join(v.label for v in vs),
        quick=ctx.quick,
    )

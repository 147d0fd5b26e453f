"""Top-k sparse deltas (SparseLoCo-style), towards 4,000x fewer bytes per token than
data-parallel at a loss within 2% of it: synchronous DiLoCo in this process on the narrower
model of bytes_loss_narrow, every push the top k of each chunk of its delta at 2 bits per value
with error feedback; the downlink in float32, or the top k of each published step (M times the
pushes' k: as many as the M pushes' union can hold), over the parity section's three seeds.

A time-boxed experiment: the learner-syncer wire does not carry the scheme, so the decoupled
product cannot run it yet; the bytes are counted from the encoding (bench/lib/sparse_topk.py),
per fragment push and per published step, and read against data-parallel's ring all-reduce
(communication section). Synchronous DiLoCo at the same H in float32 runs beside each seed, so
the cost of the compression shows apart from DiLoCo's own.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from functools import partial

from diloco_trainer.config import TrainingConfig
from diloco_trainer.models.gpt import param_shapes

from bench.bytes.bytes_loss import in_process
from bench.bytes.communication import dp_bytes_per_token, n_params
from bench.lib.common import BenchContext, Section, interval_text, md_table
from bench.lib.sparse_topk import TopK
from bench.lib.training import SEEDS, M, Outcome, Variant, data_parallel, sync_diloco

WIDTH = 64  # bytes_loss_narrow's model
H = 30  # the parity section's period
TARGET_TIMES, TARGET_LOSS = 4000, 1.02


@dataclass(frozen=True)
class Setting:
    up: TopK
    down: TopK | None  # None: float32 published copies

    @property
    def label(self) -> str:
        return f"{self.up.label} up, {self.down.label if self.down else 'float32'} down"


SETTINGS = [
    Setting(TopK(4096, 64), None),
    Setting(TopK(4096, 64), TopK(4096, 64 * M)),
]


def config(seed: int, steps: int) -> TrainingConfig:
    return Variant(f"dModel {WIDTH}", steps=steps, d_model=WIDTH, seed=seed).config(H)


def times_fewer(cfg: TrainingConfig, code: TopK | None) -> float:
    """Data-parallel's bytes per token over this code's in one direction: every parameter goes
    out once per H steps (a push per fragment per period) and comes back once (a published
    step); float32 (None) is 4 bytes a parameter."""
    shapes = param_shapes(cfg.model).values()
    per_period = sum(code.nbytes(_size(s)) if code else 4 * _size(s) for s in shapes)
    per_token = per_period / (H * cfg.tokens_per_step)
    return dp_bytes_per_token(n_params(cfg.model), cfg.tokens_per_step) / per_token


def _size(shape: tuple[int, ...]) -> int:
    size = 1
    for d in shape:
        size *= d
    return size


@dataclass(frozen=True)
class SeedRuns:
    seed: int
    dp: Outcome
    dense: Outcome  # synchronous DiLoCo, float32, same H
    sparse: list[Outcome]  # one per setting

    def row(self) -> tuple:
        return (
            self.seed,
            f"{self.dp.loss:.4f}",
            f"{self.dense.loss / self.dp.loss:.3f}",
            *(f"**{out.loss / self.dp.loss:.3f}**" for out in self.sparse),
        )


def run(ctx: BenchContext) -> Section:
    steps = 300 if ctx.quick else 4000
    seeds = (0,) if ctx.quick else SEEDS
    configs = {seed: config(seed, steps) for seed in seeds}
    jobs: dict[tuple[str, object], partial[Outcome]] = {}
    for seed, cfg in configs.items():
        jobs["data-parallel", seed] = partial(data_parallel, cfg, steps)
        jobs["float32", seed] = partial(sync_diloco, cfg, steps, name="synchronous DiLoCo")
        for i, setting in enumerate(SETTINGS):
            jobs[f"setting {i}", seed] = partial(
                sync_diloco,
                cfg,
                steps,
                name=f"synchronous DiLoCo, {setting.label}",
                sparse=setting.up,
                sparse_down=setting.down,
            )
    done = in_process("bytes_sparse", jobs)
    per_seed = [
        SeedRuns(
            seed,
            done["data-parallel", seed],
            done["float32", seed],
            [done[f"setting {i}", seed] for i in range(len(SETTINGS))],
        )
        for seed in seeds
    ]
    cfg = configs[seeds[0]]
    return Section(
        name="bytes_sparse",
        title="Top-k sparse deltas (experiment)",
        body=_body(steps, cfg, per_seed),
        command=ctx.command,
        config=f"tiny preset at dModel {WIDTH}, M={M}, S={steps}, H={H}, "
        + "; ".join(s.label for s in SETTINGS)
        + f", synchronous DiLoCo in-process, seeds {', '.join(str(s) for s in seeds)}",
        quick=ctx.quick,
    )


def _body(steps: int, cfg: TrainingConfig, per_seed: list[SeedRuns]) -> str:
    table = md_table(
        ["seed", "data-parallel", "float32 synchronous DiLoCo / data-parallel"]
        + [f"{s.label} / data-parallel" for s in SETTINGS],
        [s.row() for s in per_seed],
    )
    lines = []
    for i, setting in enumerate(SETTINGS):
        ratios = [s.sparse[i].loss / s.dp.loss for s in per_seed]
        sent, received = times_fewer(cfg, setting.up), times_fewer(cfg, setting.down)
        met = (
            len(per_seed) == 3
            and statistics.fmean(ratios) <= TARGET_LOSS
            and min(sent, received) >= TARGET_TIMES
        )
        lines.append(
            f"- {setting.label}: **{sent:,.0f}x** fewer bytes per token sent, "
            f"**{received:,.0f}x** received; loss mean **{statistics.fmean(ratios):.3f}** of "
            f"data-parallel (95% interval over seeds {interval_text(ratios)}): target "
            f"**{'met' if met else 'NOT met'}**."
        )
    dense = [s.dense.loss / s.dp.loss for s in per_seed]
    settings = "\n".join(lines)
    return f"""
Synchronous DiLoCo on bytes_loss_narrow's model ({n_params(cfg.model):,} parameters; M={M},
{steps} steps per learner, H={H}, outer 0.7/0.8), every fragment push the k values of largest
magnitude of each chunk at 2 bits with error feedback (the learner's `PushFeedback`); the
published copies the learners install in float32, or the top k of each published step the same
way (the published copy's lag is its error feedback). Bytes from the encoding: a position of two
bytes, a 2-bit code per kept value and a float32 scale per chunk, a tensor's short last chunk
keeping at most its own size; data-parallel's are a float32 ring all-reduce's. The target:
>= {TARGET_TIMES:,}x fewer bytes per token both ways at <= {TARGET_LOSS} of data-parallel over
three seeds. Float32 synchronous DiLoCo at the same H: {statistics.fmean(dense):.3f}.

{table}

{settings}

In-process and synchronous: the product's wire does not carry the scheme.
"""

"""Bytes per token against loss where the product's parity holds, towards 1000x fewer bytes than
data-parallel at a loss within 2% of it: the bytes_loss section's H=40 int2 setting (error
feedback on the pushes, int2 steps down) on the narrower model (dModel 64), where the decoupled
product reaches data-parallel in float32 with `install: rebase` (docs/design.md, "Installs:
replace or rebase"), over the parity section's three seeds, two real decoupled runs each (single
runs spread by 1-2%).

Each run is read against data-parallel at its own seed, width and tokens; synchronous DiLoCo
with the same compression runs beside each seed, so what decoupling adds shows apart from
DiLoCo's own cost of the setting. The decoupled runs go first, alone on the machine; the
deterministic in-process runs after them, two at a time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from functools import partial

from diloco_trainer.config import TrainingConfig

from bench.bytes.bytes_loss import (
    SETTINGS,
    TARGET,
    compressed,
    decoupled_run,
    in_process,
    meets,
    plot,
    point,
    sync_job,
    times_fewer,
)
from bench.bytes.communication import dp_bytes_per_token, n_params
from bench.lib.common import BenchContext, Section, interval_text, md_table
from bench.lib.training import SEEDS, M, Outcome, Variant, data_parallel, with_install

SETTING = SETTINGS[1]  # H=40, int2 + error feedback / int2
WIDTH = 64
REPEATS = 2  # decoupled runs per seed


def narrow_config(seed: int, steps: int) -> TrainingConfig:
    variant = Variant(f"dModel {WIDTH}", steps=steps, d_model=WIDTH, seed=seed)
    return with_install(compressed(variant.config(SETTING.h), SETTING), "rebase")


@dataclass(frozen=True)
class SeedRuns:
    """The narrower model's runs at one seed."""

    seed: int
    dp: Outcome
    sync: Outcome
    runs: list[Outcome]  # decoupled, rebase
    dp_bytes: float

    @property
    def ratios(self) -> list[float]:
        return [r.loss / self.dp.loss for r in self.runs]

    @property
    def lowest_times(self) -> float:
        return min(x for r in self.runs for x in times_fewer(r, self.dp_bytes))

    def row(self) -> tuple:
        cells = "; ".join(
            f"{r.loss / self.dp.loss:.3f} ({s:,.0f}x, {x:,.0f}x)"
            for r in self.runs
            for s, x in [times_fewer(r, self.dp_bytes)]
        )
        return (
            self.seed,
            f"{self.dp.loss:.4f}",
            cells,
            f"**{statistics.fmean(self.ratios):.3f}**",
            f"{self.sync.loss / self.dp.loss:.3f}",
        )


def run(ctx: BenchContext) -> Section:
    steps = 300 if ctx.quick else 4000
    seeds, repeats = ((0, 1), 1) if ctx.quick else (SEEDS, REPEATS)
    configs = {seed: narrow_config(seed, steps) for seed in seeds}
    runs = {
        seed: [
            decoupled_run(cfg, steps, "decoupled DiLoCo, rebase", f"bytes_loss_narrow seed {seed}")
            for _ in range(repeats)
        ]
        for seed, cfg in configs.items()
    }
    jobs: dict[tuple[str, object], partial[Outcome]] = {}
    for seed, cfg in configs.items():
        jobs["data-parallel", seed] = partial(data_parallel, cfg, steps)
        jobs["synchronous", seed] = sync_job(cfg, steps, SETTING, "synchronous DiLoCo")
    done = in_process("bytes_loss_narrow", jobs)
    per_seed = [
        SeedRuns(
            seed,
            done["data-parallel", seed],
            done["synchronous", seed],
            runs[seed],
            dp_bytes_per_token(n_params(cfg.model), cfg.tokens_per_step),
        )
        for seed, cfg in configs.items()
    ]
    label = f"dModel {WIDTH}, rebase, {SETTING.name} (each run)"
    png = plot(
        [([point(r, s.dp, s.dp_bytes) for s in per_seed for r in s.runs], "tab:green", "o", label)],
        ctx.plot_path("bytes_loss_narrow.png"),
        f"Decoupled DiLoCo, M={M}, dModel {WIDTH}: bytes against loss",
    )
    return Section(
        name="bytes_loss_narrow",
        title="Bytes per token against loss on the narrower model",
        body=_body(
            steps,
            n_params(configs[seeds[0]].model),
            per_seed,
            ctx.link(png),
        ),
        command=ctx.command,
        config=f"tiny preset at dModel {WIDTH}, M={M}, S={steps}, install: rebase, "
        f"{SETTING.name}, seeds {', '.join(str(s) for s in seeds)}, "
        f"{repeats} decoupled run(s) each",
        quick=ctx.quick,
    )


def _body(steps: int, params: int, per_seed: list[SeedRuns], png: str) -> str:
    table = md_table(
        [
            "seed",
            "data-parallel",
            "decoupled, rebase: / data-parallel (DP / sent, DP / received)",
            "seed mean",
            "synchronous DiLoCo, same compression",
        ],
        [s.row() for s in per_seed],
    )
    means = [statistics.fmean(s.ratios) for s in per_seed]
    mean, lowest = statistics.fmean(means), min(s.lowest_times for s in per_seed)
    sync_mean = statistics.fmean(s.sync.loss / s.dp.loss for s in per_seed)
    verdict = "met" if meets(lowest, mean) else "NOT met"
    return f"""
The bytes_loss section's {SETTING.name} setting (block 128 both ways) on the
parity section's run narrowed to dModel {WIDTH} ({params:,} parameters; M={M}, {steps}
steps per learner, phase-locked, outer 0.7/0.8) with `install: rebase`, the width where the
product reaches data-parallel in float32 (docs/design.md, "Installs: replace or rebase"). Each
seed's runs are read against data-parallel at that seed and width
({per_seed[0].dp_bytes:,.0f} bytes per token per worker); bytes per token as in bytes_loss.

{table}

Mean of the seed means **{mean:.3f}** of data-parallel (95% interval over seeds
{interval_text(means)}; synchronous DiLoCo with the same compression {sync_mean:.3f}), every run
at **>= {lowest:,.0f}x** fewer bytes per token, sent and received: the target (>= 1000x both
ways at <= {TARGET} of data-parallel) is **{verdict}** at dModel {WIDTH} on the mean.

![bytes against loss]({png})
"""

"""Row 1 under chaos: the parity section's decoupled run, with one unit kill per unit per minute.

The same training block as the parity section (tiny, M=4, H=30, P=4, phase-locked, outer 0.7/0.8,
4,000 steps per learner), run by `diloco local run` with chaos: real learner processes killed
with SIGKILL at random (Poisson), restarted by the runtime from warm spares, rejoining the run.
The budget is the same total of inner steps, so equal tokens: the steps a killed learner made
since its last push are lost, which is the cost of chaos. Data-parallel runs beside it.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any

from bench.common import BenchContext, Section, log, md_table, mean_interval
from bench.live import local_run
from bench.parity_bench import EVAL_BATCHES, SEEDS, M, data_parallel, parity_config

SPARES = 2


def manifest(training: dict[str, Any], kill_every: float, seed: int) -> dict[str, Any]:
    return {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DilocoRun",
        "metadata": {"name": "bench-parity-chaos"},
        "spec": {
            "image": "elastic-diloco-trainer:cpu",
            "replicas": M,
            "training": training,
            "failurePolicy": {
                "maxUnitRestarts": 1000,
                "restartBackoffSeconds": 1,
                "offlineAfterSeconds": 20,
            },
            "chaos": {"seed": seed, "killEverySeconds": kill_every},
        },
    }


@dataclass(frozen=True)
class ChaosRun:
    seed: int
    loss: float
    reference: float  # data-parallel at the same seed and tokens
    summary: dict[str, Any]

    @property
    def ratio(self) -> float:
        return self.loss / self.reference


def chaos_run(steps: int, h: int, seed: int, kill_every: float) -> ChaosRun:
    reference = parity_config(steps, h, seed=seed)
    cfg = reference.model_copy(
        update={"checkpoint": reference.checkpoint.model_copy(update={"every_seconds": 30.0})}
    )
    training = cfg.model_dump(by_alias=True, mode="json")
    with local_run(manifest(training, kill_every, seed), 3600, SPARES, chaos=True) as (
        report,
        code,
    ):
        summary: dict[str, Any] = json.loads((report / "summary.json").read_text())
    log(f"parity_chaos seed {seed}: {json.dumps(summary)[:800]}")
    if summary.get("finalEvalLoss") is None:
        raise RuntimeError(f"the chaos run has no final evaluation (exit {code}): {summary}")
    dp = data_parallel(reference, steps)
    log(f"parity_chaos seed {seed} data-parallel: {dp.loss:.4f}")
    return ChaosRun(seed, float(summary["finalEvalLoss"]), dp.loss, summary)


def run(ctx: BenchContext) -> Section:
    steps, h = (300, 25) if ctx.quick else (4000, 30)
    seeds = (0, 1) if ctx.quick else SEEDS  # a seed sets the init, the data and the kills
    kill_every = 60 / M  # one kill per unit per minute on average
    runs = [chaos_run(steps, h, seed, kill_every) for seed in seeds]
    rows = [
        (
            r.seed,
            f"{r.reference:.4f}",
            f"{r.loss:.4f}",
            f"{r.ratio:.3f}",
            str(r.summary.get("unitKills", 0)),
            f"{100 * float(r.summary.get('goodput', 0.0)):.1f}%",
            f"{float(r.summary.get('wallSeconds', 0.0)):.0f}s",
        )
        for r in runs
    ]
    table = md_table(
        ["seed", "data-parallel", "under chaos", "/ data-parallel", "kills", "goodput", "wall"],
        rows,
    )
    ratios = [r.ratio for r in runs]
    mean = statistics.fmean(ratios)
    low, high = mean_interval(ratios)
    verdict = "met" if mean <= 1.03 else "NOT met"
    cfg = parity_config(steps, h)
    body = f"""
The parity section's settings ({steps} inner steps per learner, M={M}, H={h}, P={cfg.fragments},
phase-locked, outer {cfg.outer_optimizer.lr}/{cfg.outer_optimizer.momentum}; eval:
{EVAL_BATCHES} held-out batches) run by `diloco local run --chaos --spares {SPARES}`: a unit
learner is killed with SIGKILL every {kill_every:g} s on average (Poisson, seeded), restarted from a
warm spare, and rejoins. The budget is the same {cfg.total_steps:,} inner steps as the parity
run, so tokens are equal; the steps a killed learner made since its last push are lost. Final
loss: the syncer's evaluation of the global parameters once the budget is reached. One run per
seed; a seed sets the initial parameters, the data order, the held-out batches and the kill
times, and each run is read against data-parallel at its seed (deterministic: the parity
section's reference runs again, or its cached result in one bench process).

{table}

Target: decoupled loss under chaos / data-parallel <= 1.03: **{verdict}** ({mean:.3f}, the mean
over {len(seeds)} seeds; 95% interval {low:.3f} to {high:.3f}).
"""
    return Section(
        name="parity_chaos",
        title="ML parity under chaos",
        body=body,
        command=ctx.command,
        config=f"tiny preset, M={M}, B={cfg.data.batch_size}, H={h}, P={cfg.fragments}, "
        f"S={steps}, phaseLock, 1 kill / unit / min, {SPARES} warm spares, seeds "
        + ", ".join(str(s) for s in seeds),
        quick=ctx.quick,
    )

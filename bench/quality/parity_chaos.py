"""ML parity under chaos: the parity section's decoupled run, with one kill per unit per minute.

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

from bench.lib.common import BenchContext, Section, interval_text, log, md_table
from bench.lib.live import IMAGE, local_run, read_summary, run_document
from bench.lib.training import EVAL_BATCHES, SEEDS, M, data_parallel, parity_config

SPARES = 2


def manifest(training: dict[str, Any], kill_every: float, seed: int) -> dict[str, Any]:
    spec = {
        "image": IMAGE,
        "replicas": M,
        "training": training,
        "failurePolicy": {
            "maxUnitRestarts": 1000,
            "restartBackoffSeconds": 1,
            "offlineAfterSeconds": 20,
        },
        "chaos": {"seed": seed, "killEverySeconds": kill_every},
    }
    return run_document("bench-parity-chaos", spec)


@dataclass(frozen=True)
class ChaosRun:
    loss: float
    summary: dict[str, Any]

    def cell(self, reference: float) -> str:
        """One run as the table shows it: loss, ratio, kills and goodput."""
        kills = self.summary.get("unitKills", 0)
        goodput = 100 * float(self.summary.get("goodput", 0.0))
        return f"{self.loss:.4f} ({self.loss / reference:.3f}; {kills} kills, {goodput:.1f}%)"


@dataclass(frozen=True)
class SeedChaos:
    seed: int
    reference: float  # data-parallel at the same seed and tokens
    runs: list[ChaosRun]

    def mean_ratio(self) -> float:
        return statistics.fmean(r.loss / self.reference for r in self.runs)


def chaos_run(steps: int, h: int, seed: int, kill_every: float, repeat: int) -> ChaosRun:
    parity = parity_config(steps, h, seed=seed)
    cfg = parity.model_copy(
        update={"checkpoint": parity.checkpoint.model_copy(update={"every_seconds": 30.0})}
    )
    training = cfg.model_dump(by_alias=True, mode="json")
    # The repeat moves the kill times; the seed alone keeps init and data as in the parity section.
    kills = manifest(training, kill_every, seed + 1000 * repeat)
    with local_run(kills, 3600, SPARES, chaos=True) as (report, code):
        summary = read_summary(report)
    log(f"parity_chaos seed {seed} run {repeat + 1}: {json.dumps(summary)[:800]}")
    if summary.get("finalEvalLoss") is None:
        raise RuntimeError(f"the chaos run has no final evaluation (exit {code}): {summary}")
    return ChaosRun(float(summary["finalEvalLoss"]), summary)


def reference(steps: int, h: int, seed: int) -> float:
    dp = data_parallel(parity_config(steps, h, seed=seed), steps)
    log(f"parity_chaos seed {seed} data-parallel: {dp.loss:.4f}")
    return dp.loss


def run(ctx: BenchContext) -> Section:
    steps, h = (300, 25) if ctx.quick else (4000, 30)
    # A seed sets the init, the data and the kills; a repeat only the kills and the timing.
    seeds, repeats = ((0, 1), 1) if ctx.quick else (SEEDS, 2)
    kill_every = 60 / M  # one kill per unit per minute on average
    # The references first: they are deterministic, so whatever else loads the machine then
    # cannot move them, while the chaos runs' merge timing (and so their loss) depends on the load.
    references = {seed: reference(steps, h, seed) for seed in seeds}
    results = [
        SeedChaos(
            seed,
            references[seed],
            [chaos_run(steps, h, seed, kill_every, k) for k in range(repeats)],
        )
        for seed in seeds
    ]
    rows = [
        (
            r.seed,
            f"{r.reference:.4f}",
            *(run.cell(r.reference) for run in r.runs),
            f"{r.mean_ratio():.3f}",
            " / ".join(f"{float(run.summary.get('wallSeconds', 0.0)):.0f}s" for run in r.runs),
        )
        for r in results
    ]
    table = md_table(
        [
            "seed",
            "data-parallel",
            *(f"under chaos, run {k + 1} (/ DP; kills, goodput)" for k in range(repeats)),
            "mean / data-parallel",
            "wall",
        ],
        rows,
    )
    seed_means = [r.mean_ratio() for r in results]
    mean = statistics.fmean(seed_means)
    verdict = "met" if mean <= 1.03 else "NOT met"
    cfg = parity_config(steps, h)
    body = f"""
The parity section's settings ({steps} inner steps per learner, M={M}, H={h}, P={cfg.fragments},
phase-locked, outer {cfg.outer_optimizer.lr}/{cfg.outer_optimizer.momentum}; eval:
{EVAL_BATCHES} held-out batches) run by `diloco local run --chaos --spares {SPARES}`: a unit
learner is killed with SIGKILL every {kill_every:g} s on average (Poisson, seeded), restarted from a
warm spare, and rejoins. The budget is the same {cfg.total_steps:,} inner steps as the parity
run, so tokens are equal; the steps a killed learner made since its last push are lost. Final
loss: the syncer's evaluation of the global parameters once the budget is reached. Runs per
seed: {repeats}; a seed sets the initial parameters, the data order, the held-out batches and the
kill times, a repeat draws other kill times; each run is read against data-parallel at its seed
(deterministic: the parity section's reference runs again, or its cached result in one bench
process).

{table}

Target: decoupled loss under chaos / data-parallel <= 1.03: **{verdict}** ({mean:.3f}, the mean
over {len(seeds)} seeds of each seed's mean; 95% interval over the seeds
{interval_text(seed_means)}).
"""
    return Section(
        name="parity_chaos",
        title="ML parity under chaos",
        body=body,
        command=ctx.command,
        config=f"tiny preset, M={M}, B={cfg.data.batch_size}, H={h}, P={cfg.fragments}, "
        f"S={steps}, phaseLock, 1 kill / unit / min, {SPARES} warm spares, {repeats} x seeds "
        + ", ".join(str(s) for s in seeds),
        quick=ctx.quick,
    )

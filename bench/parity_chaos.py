"""Row 1 under chaos: the parity section's decoupled run, with one unit kill per unit per minute.

The same training block as the parity section (tiny, M=4, H=30, P=4, phase-locked, outer 0.7/0.8,
4,000 steps per learner), run by `diloco local run` with chaos: real learner processes killed
with SIGKILL at random (Poisson), restarted by the runtime from warm spares, rejoining the run.
The budget is the same total of inner steps, so equal tokens: the steps a killed learner made
since its last push are lost, which is the cost of chaos. Data-parallel runs beside it.
"""

from __future__ import annotations

import json
from typing import Any

from bench.common import BenchContext, Section, log, md_table
from bench.live import local_run
from bench.parity_bench import EVAL_BATCHES, M, data_parallel, parity_config

SPARES = 2


def manifest(training: dict[str, Any], kill_every: float) -> dict[str, Any]:
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
            "chaos": {"seed": 0, "killEverySeconds": kill_every},
        },
    }


def run(ctx: BenchContext) -> Section:
    steps, h = (300, 25) if ctx.quick else (4000, 30)
    cfg = parity_config(steps, h)
    cfg = cfg.model_copy(
        update={"checkpoint": cfg.checkpoint.model_copy(update={"every_seconds": 30.0})}
    )
    kill_every = 60 / M  # one kill per unit per minute on average
    training = cfg.model_dump(by_alias=True, mode="json")
    with local_run(manifest(training, kill_every), 3600, SPARES, chaos=True) as (report, code):
        summary: dict[str, Any] = json.loads((report / "summary.json").read_text())
    chaos_loss = summary.get("finalEvalLoss")
    log(f"parity_chaos: {json.dumps(summary)[:800]}")
    dp = data_parallel(cfg, steps)
    log(f"parity_chaos data-parallel: {dp.loss:.4f}")
    if chaos_loss is None:
        raise RuntimeError(f"the chaos run has no final evaluation (exit {code}): {summary}")
    ratio = float(chaos_loss) / dp.loss
    rows = [
        ("data-parallel (batch M x B)", f"{dp.loss:.4f}", "1.000", "-", "-", f"{dp.seconds:.0f}s"),
        (
            f"decoupled DiLoCo, 1 kill / unit / min ({SPARES} warm spares)",
            f"{float(chaos_loss):.4f}",
            f"{ratio:.3f}",
            str(summary.get("unitKills", 0)),
            f"{100 * float(summary.get('goodput', 0.0)):.1f}%",
            f"{float(summary.get('wallSeconds', 0.0)):.0f}s",
        ),
    ]
    table = md_table(["run", "eval loss", "/ data-parallel", "kills", "goodput", "wall"], rows)
    verdict = "met" if ratio <= 1.03 else "NOT met"
    body = f"""
The parity section's settings ({steps} inner steps per learner, M={M}, H={h}, P={cfg.fragments},
phase-locked, outer {cfg.outer_optimizer.lr}/{cfg.outer_optimizer.momentum}; eval:
{EVAL_BATCHES} held-out batches) run by `diloco local run --chaos --spares {SPARES}`: a unit
learner is killed with SIGKILL every {kill_every:g} s on average (Poisson, seeded), restarted from a
warm spare, and rejoins. The budget is the same {cfg.total_steps:,} inner steps as the parity
run, so tokens are equal; the steps a killed learner made since its last push are lost. Final
loss: the syncer's evaluation of the global parameters once the budget is reached.
Data-parallel runs beside it (deterministic: the parity section's figure again).

{table}

Target: decoupled loss under chaos / data-parallel <= 1.03: **{verdict}** ({ratio:.3f}).
One run: single real runs vary by about 1% (docs/design.md).
"""
    return Section(
        name="parity_chaos",
        title="ML parity under chaos",
        body=body,
        command=ctx.command,
        config=f"tiny preset, M={M}, B={cfg.data.batch_size}, H={h}, P={cfg.fragments}, "
        f"S={steps}, phaseLock, 1 kill / unit / min, {SPARES} warm spares, seed {cfg.seed}",
        quick=ctx.quick,
    )

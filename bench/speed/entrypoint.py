"""The model entrypoint path vs the built-in one: the same transformer, two ways in.

Built-in: the train step calls the transformer's loss directly (`make_train_step`'s default).
Entrypoint: `training.model.entrypoint: diloco_trainer.models.gpt:build`, resolved and checked by
`workload.prepare` and called through the API's `loss(params, batch, rng)` over the rebuilt
pytree, which is what every learner runs now. Both loops alternate on the same batches, round
after round (the first of the two alternating), so machine noise hits both alike.
"""

from __future__ import annotations

import jax
from diloco_trainer.config import TrainingConfig
from diloco_trainer.workload.check import prepare

from bench.lib.common import BenchContext, Section, log, md_table, median
from bench.lib.live import learner_config
from bench.speed.overhead import BareLoop


def entrypoint_config(cfg: TrainingConfig) -> TrainingConfig:
    sizes = {"preset": cfg.model.preset, "seed": cfg.seed}
    model = {**cfg.model.to_wire(), "entrypoint": "diloco_trainer.models.gpt:build", "args": sizes}
    return TrainingConfig.model_validate({**cfg.to_wire(), "model": model})


def run(ctx: BenchContext) -> Section:
    rounds, steps = (3, 40) if ctx.quick else (6, 100)
    cfg = learner_config()
    builtin = BareLoop(cfg)
    entry = BareLoop(cfg, prepare(entrypoint_config(cfg)).flat_loss())
    rates: list[tuple[float, float]] = []
    for r in range(rounds):
        # Who goes first alternates: the second loop of a round ran measurably faster or slower
        # depending on the order alone (caches, clocks), a bias of a few percent either way.
        if r % 2 == 0:
            rates.append((builtin.run(steps), entry.run(steps)))
        else:
            second = entry.run(steps)
            rates.append((builtin.run(steps), second))
        log(f"entrypoint round {r}: built-in {rates[-1][0]:.1f} steps/s, entry {rates[-1][1]:.1f}")
    tps = cfg.tokens_per_step
    ratios = [e / b for b, e in rates]
    rows = [
        (r, f"{b * tps:,.0f}", f"{e * tps:,.0f}", f"{100 * q:.1f}%")
        for r, ((b, e), q) in enumerate(zip(rates, ratios, strict=True))
    ]
    ratio = median(ratios)
    verdict = "met" if ratio >= 0.98 else "NOT met"
    body = f"""
The built-in transformer trained by the same jitted AdamW step, once called directly and once
through its model entrypoint (`diloco_trainer.models.gpt:build` via `workload.prepare`), on the
same batches, for {rounds} rounds of {steps} steps, which of the two goes first alternating
from round to round. Devices: {jax.device_count()} x
{jax.devices()[0].platform}.

{md_table(["round", "built-in tokens/s", "entrypoint tokens/s", "entrypoint / built-in"], rows)}

Median entrypoint / built-in: **{100 * ratio:.1f}%**. Target: the entrypoint path costs <= 2%
(>= 98%): **{verdict}**.
"""
    return Section(
        name="entrypoint",
        title="Model entrypoint path vs the built-in path",
        body=body,
        command=ctx.command,
        config=f"tiny preset, batch {cfg.data.batch_size}, AdamW, no syncer",
        quick=ctx.quick,
    )

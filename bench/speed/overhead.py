"""Learner tokens/s vs a bare jit train loop of the same model, batch and optimizer.

The learner runs for real (`run_learner`, its sender/poller/heartbeat threads, real HTTP to a
`diloco-syncer` process on loopback); the bare loop is the same jitted step on the same batches
with nothing else. They alternate, round after round, so machine noise hits both alike; the
learner's rate is taken from its own progress records after its first windows (compile excluded).
"""

from __future__ import annotations

import time

import jax
from diloco_trainer.config import TrainingConfig
from diloco_trainer.data.corpus import train_batches
from diloco_trainer.learner.loop import learner_horizon, run_learner
from diloco_trainer.learner.train import (
    LossFn,
    init_opt_state,
    make_mesh,
    make_optimizer,
    make_train_step,
    place_params,
    shard_batch,
)
from diloco_trainer.models.gpt import init_params

from bench.lib.common import BenchContext, Section, log, md_table, median
from bench.lib.live import learner_config, only_learner, recording, syncer
from bench.lib.training import KEY


class BareLoop:
    """The learner's train step with nothing around it: batch in, step, one step in flight."""

    def __init__(self, cfg: TrainingConfig, loss: LossFn | None = None) -> None:
        self.mesh = make_mesh()
        opt = make_optimizer(cfg.inner_optimizer, learner_horizon(cfg, 1))
        self.params = place_params(init_params(cfg.model, cfg.seed), self.mesh)
        self.opt_state = init_opt_state(opt, self.params, self.mesh)
        self.step = make_train_step(opt, self.mesh, loss)
        self.batches = train_batches(cfg, 0, 1, attempt=99)
        self.run(3)  # compile

    def run(self, steps: int) -> float:
        """Steps/s over `steps` steps."""
        start = time.perf_counter()
        prev = None
        for _ in range(steps):
            self.params, self.opt_state, loss, _ = self.step(
                self.params, self.opt_state, shard_batch(next(self.batches), self.mesh), KEY
            )
            if prev is not None:
                prev.block_until_ready()
            prev = loss
        if prev is not None:
            prev.block_until_ready()
        return steps / (time.perf_counter() - start)


def run(ctx: BenchContext) -> Section:
    rounds, steps, log_every = (2, 200, 20) if ctx.quick else (4, 600, 25)
    cfg = learner_config()
    bare = BareLoop(cfg)
    bare_rates: list[float] = []
    learner_rates: list[float] = []
    sent: list[int] = []
    with syncer(cfg) as sy:
        for r in range(rounds):
            bare_rates.append(bare.run(steps))
            opts = only_learner(
                sy.url, attempt=r, log_every=log_every, max_steps=steps + 2 * log_every
            )
            with recording() as rec:
                result = run_learner(cfg, opts)
            learner_rates.append(rec.steady_steps_per_sec(skip=2))
            sent.append(result.bytes_sent)
            log(
                f"overhead round {r}: bare {bare_rates[-1]:.1f} steps/s, "
                f"learner {learner_rates[-1]:.1f} steps/s, pushes {result.link_stats}"
            )
    tps = cfg.tokens_per_step
    ratios = [lr / br for lr, br in zip(learner_rates, bare_rates, strict=True)]
    rows = [
        (r, f"{b * tps:,.0f}", f"{lr * tps:,.0f}", f"{100 * q:.1f}%")
        for r, (b, lr, q) in enumerate(zip(bare_rates, learner_rates, ratios, strict=True))
    ]
    table = md_table(["round", "bare loop tokens/s", "learner tokens/s", "learner / bare"], rows)
    ratio = median(ratios)
    verdict = "met" if ratio >= 0.97 else "NOT met"
    body = f"""
Learner (real `run_learner`: background sender with int4 quantization, one long-poll thread per
fragment, heartbeats, real HTTP to a `diloco-syncer` process on 127.0.0.1) vs the bare jitted
AdamW step on the same batches, alternating for {rounds} rounds of {steps} steps. Devices:
{jax.device_count()} x {jax.devices()[0].platform}. The syncer process (merging each push, K=1)
shares this machine's cores; in a deployment it runs on other hosts.

{table}

Median learner / bare: **{100 * ratio:.1f}%** (overhead {100 * (1 - ratio):.1f}%). Target: overhead
<= 3% (>= 97%): **{verdict}**.
"""
    return Section(
        name="overhead",
        title="Learner overhead vs a bare jit train loop",
        body=body,
        command=ctx.command,
        config=f"tiny preset (dModel {cfg.model.width}, nLayers {cfg.model.depth}, seqLen "
        f"{cfg.model.context}), batch {cfg.data.batch_size}, H={cfg.inner_steps}, "
        f"P={cfg.fragments}, int4, AdamW",
        quick=ctx.quick,
    )

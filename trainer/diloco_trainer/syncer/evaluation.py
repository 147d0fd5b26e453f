"""The syncer's evaluations: the periodic one (skipped when the global model has not changed)
and the final one, taken once the run's budget is reached (docs/protocol.md, "Final
evaluation")."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING

from diloco_trainer.syncer import persist
from diloco_trainer.syncer.peers import model_params

if TYPE_CHECKING:
    from diloco_trainer.syncer.state import SyncerState

log = logging.getLogger("diloco.syncer")

# How long the final evaluation waits for in-flight work (a push being decoded, a merge running)
# to land once the budget is reached. Merges of these models take milliseconds to a few hundred;
# a grace window can hold one back up to grace.maxSeconds, but waiting longer than this would
# only delay every run's report, and whatever did not land is the same few steps in every run.
FINAL_SETTLE_SECONDS = 2.0
# How long the final evaluation of a sharded syncer keeps asking a shard that does not serve
# its fragments (a shard's standby takes over within a second, a recreated pod within a minute).
FINAL_PEER_PATIENCE_SECONDS = 120.0


async def run_eval(s: SyncerState) -> None:
    if s.eval_fn is None:
        return
    if not s.shard.sharded and tuple(s.versions()) == s.evaluated and s.eval_loss is not None:
        return  # same global model as last time: spare the CPU (and a shard's peers)
    params, versions = await model_params(s)
    if versions == s.evaluated and s.eval_loss is not None:
        return
    step = s.outer_step
    eval_fn, cfg = s.eval_fn, s.cfg
    loss = await asyncio.get_running_loop().run_in_executor(
        s.pools.eval, lambda: eval_fn(params, cfg, cfg.eval.batches)
    )
    s.evaluated = versions
    if math.isfinite(loss):
        s.eval_loss = float(loss)
        s.metrics.eval_loss.set(loss)
    log.info("event=eval outer_step=%d loss=%.4f", step, loss)


def check_complete(s: SyncerState) -> None:
    """Start the final evaluation the first time the budget is seen reached (called after
    every heartbeat, and at startup for a restored run that completed before its final
    evaluation finished)."""
    if s.final_eval == "waiting" and s.complete and s.final_task is None:
        s.final_eval = "running"
        s.final_task = asyncio.get_running_loop().create_task(_final_evaluation(s))
        s.background.append(s.final_task)


async def _final_evaluation(s: SyncerState) -> None:
    """Wait (at most FINAL_SETTLE_SECONDS) until no push is being decoded and no merge is
    running, evaluate the global parameters, expose the loss as `finalLoss` and checkpoint.
    Contributions left pending below the quorum, or held for a next round (phase lock), never
    merge (learners have stopped), so they are not waited for."""
    started = time.monotonic()
    while not s.settled and time.monotonic() - started < FINAL_SETTLE_SECONDS:
        await asyncio.sleep(0.02)
    settled = s.settled
    waited = time.monotonic() - started
    eval_fn, cfg = s.eval_fn, s.cfg
    if eval_fn is None:
        return
    step = s.outer_step
    try:
        params, versions = await model_params(s, patience=FINAL_PEER_PATIENCE_SECONDS)
        if versions == s.evaluated and s.eval_loss is not None:
            loss = s.eval_loss  # the periodic eval saw exactly this model already
        else:
            loss = await asyncio.get_running_loop().run_in_executor(
                s.pools.eval, lambda: eval_fn(params, cfg, cfg.eval.batches)
            )
    except Exception:
        s.final_eval = "failed"
        log.exception("event=final_eval_failed outer_step=%d", step)
        return
    if not math.isfinite(loss):
        s.final_eval = "failed"
        log.warning("event=final_eval_failed outer_step=%d loss=%s", step, loss)
        return
    s.final_loss = float(loss)
    s.final_eval = "done"
    log.info(
        "event=final_eval outer_step=%d versions=%s loss=%.4f settled=%s waited=%.3f",
        step,
        list(versions),
        loss,
        str(settled).lower(),
        waited,
    )
    await persist.save_checkpoint(s, force=True)

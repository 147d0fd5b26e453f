"""The learner: inner AdamW steps on its own shard; fragments go out and come back in the background.

    join + pull the global parameters (a fresh learner waits for the syncer, with backoff);
        the join says where the unit's LR schedule continues (its steps in earlier attempts)
    loop:
        one train step (async dispatch; at most one step in flight)
        for each fragment due now: hand (base_p, theta_p, counters_p) to the sender thread
        install new global fragments the pollers received: overwrite theta_p (AdamW state kept),
            base_p = new global, reset counters_p
        heartbeat thread reports progress; stop when the syncer says the run is complete

Once running, the loop never waits on the syncer: an unreachable syncer only means pushes are
retried (newest per fragment kept) and nothing new arrives; training goes on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from diloco_trainer.client import SyncerClient
from diloco_trainer.config import TrainingConfig
from diloco_trainer.data import train_batches
from diloco_trainer.distributed import broadcast_int, exchange_arrivals, is_leader
from diloco_trainer.fragments import FragmentCounters, PushClock, pack_fragments
from diloco_trainer.learner_metrics import start_learner_metrics
from diloco_trainer.model import init_params, param_shapes
from diloco_trainer.sync_link import PendingPush, Progress, SyncLink, retry_until
from diloco_trainer.train import (
    TrainStep,
    check_batch_divisible,
    init_opt_state,
    learning_rate_schedule,
    make_mesh,
    make_optimizer,
    make_train_step,
    place_params,
    replicated,
    resume_schedule,
    resumed_learning_rate,
    rewarmup_steps,
    shard_batch,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LearnerOptions:
    syncer: str
    token: str
    unit: int
    num_units: int
    unit_name: str = ""
    attempt: int = 0
    group: str = "default"
    slowdown: float = 1.0  # >= 1: sleep (slowdown-1) * step time after each step
    log_every: int = 50
    max_steps: int | None = None  # stop after this many local steps (benchmarks, debugging)
    metrics_port: int = 0  # > 0: the leader serves Prometheus /metrics here (learner_metrics.py)

    @property
    def name(self) -> str:
        return self.unit_name or f"unit-{self.unit}"


@dataclass
class LearnerResult:
    steps: int
    tokens: int
    seconds: float
    complete: bool
    final_loss: float | None
    versions: list[int]
    link_stats: dict[str, int] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_joined: int = 0  # of bytes_received: the join and the full pull of the parameters
    # Where the loop's time went after its first (compiling) step: "train" = dispatching the step
    # and waiting for the previous one; "slowdown" = the --slowdown sleep; "other" = the rest of
    # the loop (installing arrivals, queueing pushes' references, logging). Nothing in the loop
    # waits on other learners or the syncer, so a unit's idle time would show up under "other".
    loop_seconds: dict[str, float] = field(default_factory=dict)
    # Of the learner's steps on each fragment, the share that installs replaced before a push
    # carried them: mostly the steps made while a merge it pushed to was under way.
    overwritten_share: float = 0.0

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class StepProgram:
    """What a learner builds before training that does not depend on which unit it is: the mesh,
    the inner optimizer (its schedule depends only on the run's size) and the jit-compiled train
    step. A warm spare (`standby.py`) builds and compiles it before it knows its unit."""

    num_units: int
    mesh: Mesh
    optimizer: optax.GradientTransformation
    train_step: TrainStep


def build_step_program(cfg: TrainingConfig, num_units: int) -> StepProgram:
    mesh = make_mesh()
    check_batch_divisible(cfg.data.batch_size, mesh.devices.size)
    optimizer = make_optimizer(cfg.inner_optimizer, learner_horizon(cfg, num_units))
    return StepProgram(num_units, mesh, optimizer, make_train_step(optimizer, mesh))


def learner_horizon(cfg: TrainingConfig, num_units: int) -> int:
    """This learner's expected share of the run's inner steps (for the LR schedule)."""
    if cfg.total_steps is not None:
        total = cfg.total_steps
    else:
        assert cfg.total_tokens is not None
        total = -(-cfg.total_tokens // cfg.tokens_per_step)
    return max(1, -(-total // num_units))


@dataclass(frozen=True)
class Joined:
    layout: list[list[str]]
    params: dict[str, np.ndarray]
    versions: list[int]
    complete: bool
    resume_step: int = 0  # the unit's steps in earlier attempts (0 for a new unit)


def join_and_pull(client: SyncerClient, stop: threading.Event) -> Joined | None:
    """Join the run and fetch the current global parameters, retrying while unreachable."""
    joined = retry_until(client.join, stop, "join")
    if joined is None:
        return None
    if joined.complete:
        return Joined(joined.layout, {}, joined.versions, True, joined.resume_step)
    pulled = retry_until(client.pull_all, stop, "pull")
    if pulled is None:
        return None
    return Joined(joined.layout, pulled[0], pulled[1], False, joined.resume_step)


def run_learner(
    cfg: TrainingConfig,
    opts: LearnerOptions,
    stop: threading.Event | None = None,
    program: StepProgram | None = None,
) -> LearnerResult:
    """Train as unit `opts` until the run is complete or `stop` is set. `program`: the train step
    already built and compiled (a warm spare); None builds it here (it compiles at step 1)."""
    stop = stop or threading.Event()
    leader = is_leader()
    started = time.monotonic()
    shapes = param_shapes(cfg.model)
    client = SyncerClient(
        opts.syncer, opts.token, opts.name, opts.attempt, opts.group, compression=cfg.compression
    )

    # ---- start: the leader joins and pulls; other hosts of the unit get the same via broadcast
    layout = pack_fragments(shapes, cfg.fragments)
    global_params: dict[str, np.ndarray] = init_params(cfg.model, cfg.seed)
    versions = [0] * len(layout)
    resume_step = 0  # where this unit's LR schedule continues (its steps in earlier attempts)
    bytes_joined = 0
    if leader:
        joined = join_and_pull(client, stop)
        if joined is None:  # stopped while waiting for the syncer
            return LearnerResult(0, 0, time.monotonic() - started, False, None, versions)
        if joined.complete:
            log.info("event=already_complete unit=%s", opts.name)
            return LearnerResult(0, 0, time.monotonic() - started, True, None, joined.versions)
        layout, versions, resume_step = joined.layout, joined.versions, joined.resume_step
        bytes_joined = client.bytes_received
        global_params.update(joined.params)
        log.info(
            "event=joined unit=%s attempt=%d versions=%s resume_step=%d",
            opts.name, opts.attempt, versions, resume_step,
        )  # fmt: skip
    resume_step = broadcast_int(resume_step)
    startup = {
        p: (versions[p], {n: global_params[n] for n in layout[p]}) for p in range(len(layout))
    }
    startup, _ = exchange_arrivals(startup, layout, shapes, stop=False)
    versions = [startup[p][0] for p in range(len(layout))]

    # ---- the unit's SPMD training state
    if program is None or program.num_units != opts.num_units:
        program = build_step_program(cfg, opts.num_units)
    mesh, optimizer, train_step = program.mesh, program.optimizer, program.train_step
    params = place_params(
        {**global_params, **{n: a for _, t in startup.values() for n, a in t.items()}}, mesh
    )
    # Fresh AdamW moments; the LR schedule continues at the unit's step (short re-warmup).
    opt_state = resume_schedule(init_opt_state(optimizer, params, mesh), resume_step, mesh)
    rows = cfg.data.batch_size // jax.process_count()
    batches = train_batches(
        cfg, opts.unit, opts.num_units, opts.attempt, jax.process_index(), batch_size=rows
    )
    # Per fragment, where the next push's delta is measured from: the fragment at the last push
    # (device) or install (host), whichever came later.
    base: dict[int, Mapping[str, np.ndarray | jax.Array]] = {p: startup[p][1] for p in startup}
    counters = FragmentCounters(len(layout))
    clock = PushClock(cfg.inner_steps, len(layout), cfg.phase_lock)
    for p in range(len(layout)):
        if versions[p] > 0:
            clock.joined_running(p)
    tokens_per_step = cfg.tokens_per_step
    schedule = learning_rate_schedule(cfg.inner_optimizer, learner_horizon(cfg, opts.num_units))
    ramp = rewarmup_steps(cfg.inner_optimizer)

    progress = Progress()
    link = SyncLink(client, versions, cfg.heartbeat_seconds, progress) if leader else None
    if link is not None:
        link.start()
    metrics = None
    if link is not None and opts.metrics_port > 0:
        metrics = start_learner_metrics(
            cfg.model, opts.name, opts.group, opts.metrics_port,
            jax.devices()[0].device_kind, jax.device_count(), os.environ,
        )  # fmt: skip

    step, prev_loss, last_done = 0, None, time.monotonic()
    window_start, window_steps = last_done, 0
    loop_seconds = {"train": 0.0, "slowdown": 0.0, "other": 0.0}
    try:
        while True:
            top = time.monotonic()
            params, opt_state, loss = train_step(
                params, opt_state, shard_batch(next(batches), mesh)
            )
            step += 1
            counters.add_step(tokens_per_step)
            for p in range(len(layout)):
                if not clock.due(step, p):
                    continue
                clock.pushed(step, p)
                if link is not None:
                    c_steps, c_tokens = counters.get(p)
                    theta = {n: params[n] for n in layout[p]}
                    link.enqueue_push(
                        PendingPush(p, versions[p], base[p], theta, c_steps, c_tokens, step)
                    )
                    # The next push of p carries only what comes after this one.
                    base[p] = theta
                counters.reset(p)
            if prev_loss is not None:
                prev_loss.block_until_ready()  # keep one step in flight, no more
            prev_loss = loss
            now = time.monotonic()
            step_time, last_done = now - last_done, now
            if step == 1:  # its time is the compile (or the cache hit of a warm spare)
                log.info("event=first_step unit=%s seconds=%.2f", opts.name, now - started)
            if opts.slowdown > 1.0 and step > 2:  # the first steps' time is compilation
                time.sleep((opts.slowdown - 1.0) * step_time)
                last_done = time.monotonic()
            slept = last_done - now
            if metrics is not None:
                metrics.step(step_time if step > 1 else None, tokens_per_step)

            # ---- arrivals from the syncer (and the stop decision) reach every host at this step
            done = stop.is_set() or (opts.max_steps is not None and step >= opts.max_steps)
            newest: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
            if link is not None:
                done = done or link.complete.is_set()
                for arrival in link.drain():
                    newest[arrival.fragment] = (arrival.version, arrival.tensors)
            if link is not None:  # references of sent pushes move to host (device memory back)
                for p in range(len(layout)):
                    base[p] = link.settled(p, base[p])
            newest, done = exchange_arrivals(newest, layout, shapes, done)
            for p, (version, tensors) in sorted(newest.items()):
                if version <= versions[p]:
                    continue
                sharding = replicated(mesh)
                for name, value in tensors.items():
                    params[name] = jax.device_put(value, sharding)
                base[p], versions[p] = tensors, version
                counters.overwrite(p)
                clock.installed(step, p)

            window_steps += 1
            progress.step, progress.tokens, progress.loss = step, step * tokens_per_step, loss
            if step % opts.log_every == 0 or done:
                elapsed = time.monotonic() - window_start
                progress.tokens_per_sec = window_steps * tokens_per_step / max(elapsed, 1e-9)
                window_start, window_steps = time.monotonic(), 0
                lr = float(
                    resumed_learning_rate(schedule, resume_step + step - 1, resume_step, ramp)
                )
                overwritten = counters.overwritten_share(step)
                _log_progress(
                    opts, step, progress, versions, link, resume_step + step, lr, overwritten
                )
                if metrics is not None and link is not None:
                    metrics.progress(
                        float(loss), progress.tokens_per_sec, link.stats,
                        client.bytes_sent, client.bytes_received,
                    )  # fmt: skip
            if step > 1:
                loop_seconds["train"] += now - top
                loop_seconds["slowdown"] += slept
                loop_seconds["other"] += time.monotonic() - now - slept
            if done:
                break
    finally:
        if link is not None:
            link.stop()
        client.close()
    final = float(prev_loss) if prev_loss is not None else None
    return LearnerResult(
        steps=step,
        tokens=step * tokens_per_step,
        seconds=time.monotonic() - started,
        complete=link is not None and link.complete.is_set(),
        final_loss=final,
        versions=versions,
        link_stats=dict(link.stats) if link is not None else {},
        bytes_sent=client.bytes_sent,
        bytes_received=client.bytes_received,
        bytes_joined=bytes_joined,
        loop_seconds=loop_seconds,
        overwritten_share=counters.overwritten_share(step),
    )


def _log_progress(
    opts: LearnerOptions,
    step: int,
    progress: Progress,
    versions: list[int],
    link: Any,
    schedule_step: int,
    lr: float,
    overwritten: float,
) -> None:
    """step/tokens: this attempt's (what heartbeats report); schedule_step: the unit's step in
    its LR schedule (earlier attempts included); lr: the LR of the last step; overwritten: the
    share of its fragment-steps so far that installs replaced before a push carried them."""
    loss = float(progress.loss) if progress.loss is not None else float("nan")
    log.info(
        "event=progress unit=%s step=%d schedule_step=%d lr=%.3g tokens=%d loss=%.4f "
        "tokens_per_sec=%.0f versions=%s pending_pushes=%d overwritten_share=%.3f",
        opts.name,
        step,
        schedule_step,
        lr,
        progress.tokens,
        loss,
        progress.tokens_per_sec,
        ",".join(map(str, versions)),
        link.pending_pushes() if link is not None else 0,
        overwritten,
    )

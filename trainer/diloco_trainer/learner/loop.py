"""The learner: inner AdamW steps on its own shard; fragments go out and come back in the background.

    join + pull the global parameters (a fresh learner waits for the syncer, with backoff);
        the join says where the unit's LR schedule continues (its steps in earlier attempts)
    loop:
        one train step (async dispatch; at most one step in flight)
        for each fragment due now: hand (base_p, theta_p, counters_p) to the sender thread
        install new global fragments the pollers received: overwrite theta_p (`install: rebase`:
            plus the steps since the push; AdamW state kept), base_p = new global
        report progress (report.py); the heartbeat thread too; stop when the run is complete

Once running, the loop never waits on the syncer: an unreachable syncer only means pushes are
retried (newest per fragment kept) and nothing new arrives; training goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from diloco_trainer.api import partition_rules
from diloco_trainer.config import TrainingConfig
from diloco_trainer.fragments import pack_fragments
from diloco_trainer.layout_plan import announce, plan_of
from diloco_trainer.learner.client import SyncerClient, SyncerRejected
from diloco_trainer.learner.data_feed import unit_feed
from diloco_trainer.learner.distributed import (
    StepSignal,
    broadcast_int,
    exchange_arrivals,
    is_leader,
)
from diloco_trainer.learner.fragment_sync import FragmentBook
from diloco_trainer.learner.options import LearnerOptions, LearnerResult
from diloco_trainer.learner.report import Reporter
from diloco_trainer.learner.shard_client import ShardedClient
from diloco_trainer.learner.sharding import abstract_params
from diloco_trainer.learner.sync_link import SyncLink, retry_until
from diloco_trainer.learner.syncer_api import SyncerApi
from diloco_trainer.learner.train import (
    Metrics,
    Params,
    ScheduleClock,
    TrainStep,
    check_batch_divisible,
    init_opt_state,
    learning_rate_schedule,
    make_mesh,
    make_optimizer,
    make_train_step,
    place_params,
    resume_schedule,
    rewarmup_steps,
    shard_batch,
    step_key,
)
from diloco_trainer.phases import phase
from diloco_trainer.shards import split_addresses
from diloco_trainer.tls import ClientTrust
from diloco_trainer.wire import DataLease
from diloco_trainer.workload.check import Workload, prepare

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepProgram:
    """What a learner builds before training that does not depend on which unit it is: the mesh,
    the inner optimizer (its schedule depends only on the run's size) and the jit-compiled train
    step, and where each parameter lives (`training.sharding`). A warm spare (`standby.py`)
    builds and compiles it before it knows its unit."""

    num_units: int
    mesh: Mesh
    optimizer: optax.GradientTransformation
    train_step: TrainStep
    params_like: dict[str, jax.ShapeDtypeStruct]  # each leaf's shape, dtype and sharding
    workload: Workload

    def place(self, params: dict[str, np.ndarray]) -> Params:
        return place_params(params, self.mesh, {n: a.sharding for n, a in self.params_like.items()})


def build_step_program(
    cfg: TrainingConfig, num_units: int, workload: Workload | None = None
) -> StepProgram:
    """The mesh, the optimizer and the train step for `workload` (default: the run's, checked),
    its leaves laid out by `cfg.sharding` with the model's partition rules."""
    workload = workload or prepare(cfg)
    mesh = make_mesh()
    check_batch_divisible(cfg.data.batch_size, mesh.devices.size)
    horizon = learner_horizon(cfg, num_units, workload.tokens_per_step)
    optimizer = make_optimizer(cfg.inner_optimizer, horizon)
    rules = partition_rules(workload.model)
    like = abstract_params(workload.shapes, mesh, cfg.sharding, rules)
    step = make_train_step(optimizer, mesh, workload.flat_loss(), abstract_params=like)
    return StepProgram(num_units, mesh, optimizer, step, like, workload)


def learner_horizon(cfg: TrainingConfig, num_units: int, tokens_per_step: int | None = None) -> int:
    """This learner's expected share of the run's inner steps (for the LR schedule).
    `tokens_per_step`: the workload's (`Workload.tokens_per_step`); None: the built-in one's."""
    if cfg.total_steps is not None:
        total = cfg.total_steps
    else:
        assert cfg.total_tokens is not None
        per_step = tokens_per_step if tokens_per_step is not None else cfg.tokens_per_step
        total = -(-cfg.total_tokens // per_step)
    return max(1, -(-total // num_units))


@dataclass(frozen=True)
class Joined:
    layout: list[list[str]]
    params: dict[str, np.ndarray]
    versions: list[int]
    complete: bool
    resume_step: int = 0  # the unit's steps in earlier attempts (0 for a new unit)
    data_lease: DataLease | None = None


def join_and_pull(client: SyncerApi, stop: threading.Event) -> Joined | None:
    """Join the run and fetch the current global parameters, retrying while unreachable."""
    with phase(log, "join"):
        joined = retry_until(client.join, stop, "join")
    if joined is None:
        return None
    if joined.complete:
        return Joined(joined.layout, {}, joined.versions, True, joined.resume_step)
    with phase(log, "pull"):
        pulled = retry_until(client.pull_all, stop, "pull")
    if pulled is None:
        return None
    return Joined(joined.layout, pulled[0], pulled[1], False, joined.resume_step, joined.data_lease)


def syncer_client(cfg: TrainingConfig, opts: LearnerOptions) -> SyncerApi:
    """The unit's client: its identity, how it encodes pushes, whom it trusts over https and
    the join credential it speaks under (a unit of an away cluster). Several addresses: a
    sharded syncer, one client per shard (shard_client.py)."""
    trust = ClientTrust(opts.ca_file) if opts.ca_file else None
    clients = [
        SyncerClient(
            address,
            opts.token,
            opts.name,
            opts.attempt,
            opts.group,
            compression=cfg.compression,
            trust=trust,
            join=opts.join,
        )
        for address in split_addresses(opts.syncer)
    ]
    return clients[0] if len(clients) == 1 else ShardedClient(clients)


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
    client = syncer_client(cfg, opts)
    if program is None or program.num_units != opts.num_units:
        program = build_step_program(cfg, opts.num_units, program.workload if program else None)
    start = _start(cfg, opts, client, stop, leader, started, program.workload)
    if isinstance(start, LearnerResult):  # stopped while waiting, or nothing left to train
        return start
    mesh, train_step = program.mesh, program.train_step
    unit_key = step_key(cfg.seed, opts.unit)
    params, opt_state = _training_state(program, start)
    tokens_per_step = program.workload.tokens_per_step
    clock = schedule_clock(cfg, opts.num_units, start.resume_step, mesh, tokens_per_step)
    batches = unit_feed(cfg, program.workload.source, start.data_lease, client, stop)
    frags = FragmentBook.starting(cfg, start.layout, start.shapes, start.versions, start.fragments)
    report = Reporter.starting(cfg, opts, client, start.versions, leader, program.workload, clock)
    link = report.link

    step, prev_loss, last_done = 0, None, time.monotonic()
    loop_seconds = {"train": 0.0, "slowdown": 0.0, "other": 0.0}
    try:
        while True:
            top = time.monotonic()
            rng = jax.random.fold_in(unit_key, start.resume_step + step)
            if step == 0:  # the start's last phases
                params, opt_state, loss, metrics = _first_step(
                    train_step, params, opt_state, batches, mesh, rng
                )
            else:
                params, opt_state, loss, metrics = train_step(
                    params, opt_state, shard_batch(next(batches), mesh), rng
                )
            step += 1
            frags.push_due(step, params, link, tokens_per_step)
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
            if report.metrics is not None:
                report.metrics.step(step_time if step > 1 else None, tokens_per_step)

            # ---- arrivals from the syncer (and the stop decision) reach every host at this step
            done = stop.is_set() or (opts.max_steps is not None and step >= opts.max_steps)
            floor = clock.floor(link.budget_done) if link is not None else 0
            signal = frags.install_arrivals(step, params, link, StepSignal(done, floor))
            opt_state = clock.keep_up(step, signal.schedule_floor, opt_state)
            done = signal.stop
            report.step(step, loss, metrics, done, frags)
            if step > 1:
                loop_seconds["train"] += now - top
                loop_seconds["slowdown"] += slept
                loop_seconds["other"] += time.monotonic() - now - slept
            if done:
                break
    except SyncerRejected as exc:  # a refused data claim: a newer attempt is the unit now?
        if link is None or not link.note_superseded(exc):
            raise
    finally:
        if link is not None:
            link.stop()
        client.close()
    return _result(
        step, prev_loss, started, client, start, frags, link, loop_seconds, tokens_per_step
    )


def _first_step(
    train_step: TrainStep,
    params: Params,
    opt_state: Any,
    batches: Iterator[Any],
    mesh: Mesh,
    rng: jax.Array,
) -> tuple[Params, Any, jax.Array, Metrics]:
    """Step 1 as the start's last phases: its batch, the compile (jit traces and compiles within
    the call, then runs the step asynchronously; a warm spare's compile is a cache hit) and the
    step itself."""
    with phase(log, "first_batch"):
        batch = shard_batch(next(batches), mesh)
    with phase(log, "compile"):
        out = train_step(params, opt_state, batch, rng)
    with phase(log, "first_step"):
        out[2].block_until_ready()
    return out


@dataclass(frozen=True)
class _Start:
    """What a unit starts from, the same on every host of the unit."""

    layout: list[list[str]]
    shapes: dict[str, tuple[int, ...]]
    versions: list[int]  # the global version of each fragment in `params`
    params: dict[str, np.ndarray]  # the global parameters (initial values where none arrived)
    fragments: dict[int, dict[str, np.ndarray]]  # per fragment: its values in `params`
    resume_step: int  # where this unit's LR schedule continues (its steps in earlier attempts)
    bytes_joined: int
    data_lease: DataLease | None = None  # the leader's, from the join (None on other hosts)


def _start(
    cfg: TrainingConfig,
    opts: LearnerOptions,
    client: SyncerApi,
    stop: threading.Event,
    leader: bool,
    started: float,
    workload: Workload,
) -> _Start | LearnerResult:
    """The leader joins and pulls; other hosts of the unit get the same via broadcast. A result
    instead when stopped while waiting for the syncer, or when the run is already complete."""
    shapes = workload.shapes
    layout = pack_fragments(shapes, cfg.fragments)
    client.layout_plan = announce(plan_of(layout, shapes))  # a run of another model refuses it
    with phase(log, "initial_params"):
        global_params: dict[str, np.ndarray] = workload.initial_params()
    versions = [0] * len(layout)
    resume_step = 0
    bytes_joined = 0
    data_lease = None
    if leader:
        try:
            joined = join_and_pull(client, stop)
        except SyncerRejected as exc:
            if exc.reason != "superseded":
                raise
            log.warning("event=superseded action=stop error=%s", exc)
            elapsed = time.monotonic() - started
            return LearnerResult(0, 0, elapsed, False, None, versions, superseded=True)
        if joined is None:  # stopped while waiting for the syncer
            return LearnerResult(0, 0, time.monotonic() - started, False, None, versions)
        if joined.complete:
            log.info("event=already_complete unit=%s", opts.name)
            return LearnerResult(0, 0, time.monotonic() - started, True, None, joined.versions)
        layout, versions, resume_step = joined.layout, joined.versions, joined.resume_step
        data_lease = joined.data_lease
        bytes_joined = client.bytes_received
        global_params.update(joined.params)
        log.info(
            "event=joined unit=%s attempt=%d versions=%s resume_step=%d",
            opts.name,
            opts.attempt,
            versions,
            resume_step,
        )
    resume_step = broadcast_int(resume_step)
    startup = {
        p: (versions[p], {n: global_params[n] for n in layout[p]}) for p in range(len(layout))
    }
    startup, _ = exchange_arrivals(startup, layout, shapes, StepSignal(stop=False))
    fragments = {p: tensors for p, (_, tensors) in startup.items()}
    params = {**global_params, **{n: a for t in fragments.values() for n, a in t.items()}}
    versions = [startup[p][0] for p in range(len(layout))]
    return _Start(
        layout, shapes, versions, params, fragments, resume_step, bytes_joined, data_lease
    )


def schedule_clock(
    cfg: TrainingConfig,
    num_units: int,
    resume_step: int,
    mesh: Mesh | None = None,
    tokens_per_step: int | None = None,
) -> ScheduleClock:
    """The LR clock of one unit of a `num_units` run, continuing at `resume_step`."""
    horizon = learner_horizon(cfg, num_units, tokens_per_step)
    schedule = learning_rate_schedule(cfg.inner_optimizer, horizon)
    return ScheduleClock(schedule, horizon, rewarmup_steps(cfg.inner_optimizer), resume_step, mesh)


def _training_state(program: StepProgram, start: _Start) -> tuple[Params, Any]:
    """The unit's SPMD training state: parameters laid out on the mesh, and fresh AdamW moments
    with the LR schedule continuing at the unit's step (short re-warmup)."""
    params = program.place(start.params)
    opt_state = resume_schedule(
        init_opt_state(program.optimizer, params, program.mesh), start.resume_step, program.mesh
    )
    return params, opt_state


def _result(
    step: int,
    last_loss: jax.Array | None,
    started: float,
    client: SyncerApi,
    start: _Start,
    frags: FragmentBook,
    link: SyncLink | None,
    loop_seconds: dict[str, float],
    tokens_per_step: int,
) -> LearnerResult:
    return LearnerResult(
        steps=step,
        tokens=step * tokens_per_step,
        seconds=time.monotonic() - started,
        complete=link is not None and link.complete.is_set(),
        final_loss=float(last_loss) if last_loss is not None else None,
        versions=frags.versions,
        link_stats=dict(link.stats) if link is not None else {},
        bytes_sent=client.bytes_sent,
        bytes_received=client.bytes_received,
        bytes_joined=start.bytes_joined,
        loop_seconds=loop_seconds,
        overwritten_share=frags.counters.overwritten_share(step),
        superseded=link is not None and link.superseded.is_set(),
    )

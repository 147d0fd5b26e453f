"""Decoupled DiLoCo in one process, with a clock we control: the ablation harness of the parity row.

The real decoupled run (learner and syncer processes, `parity_bench.decoupled`) is the headline,
but its arrival pattern depends on the machine's load, so two runs of it differ in more than the
setting under study. Here M learners advance in lock step (one vmapped train step per tick; a
learner at half speed steps every other tick), each sends fragment p at its own staggered steps
(shifted by its `phase`), and the syncer's rules are applied to what arrived: a merge of every
contribution pending for `grace` ticks (grace 0: the contributions of the same tick), the merge
weights, RDA or plain mean, participation scaling, the Nesterov outer step, and the broadcast that
every live learner installs `delay` ticks later. Kills drop a learner's unsent progress and
restart it from the global parameters with fresh AdamW moments and the LR schedule continued at
the learner's step, as a restarted process does (`resumeStep`).

The merge, weights, quantization and outer step are the product's own functions; only the clock
and the transport are simulated.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from diloco_trainer.config import Scheme, TrainingConfig
from diloco_trainer.data.tokens import StreamSource
from diloco_trainer.fragments import is_due, pack_fragments
from diloco_trainer.learner.data_feed import epoch_seed
from diloco_trainer.learner.train import make_optimizer, resume_schedule
from diloco_trainer.merge import Contribution, participation_share
from diloco_trainer.models.gpt import init_params, loss_fn, param_shapes
from diloco_trainer.outer import OuterOptimizer, merge_and_step
from diloco_trainer.quantize import dequantize, quantize
from diloco_trainer.workload.evaluate import eval_loss

# What a learner does with its fragment when a new version arrives: overwrite it (the product),
# add back `keep` times its progress since it last pushed or installed ("keep-unsent"), or take
# `keep * theta + (1 - keep) * new` (Streaming DiLoCo's mixing of local and global, "mix").
Install = Literal["overwrite", "keep-unsent", "mix"]
# What a restarted learner's AdamW moments are: fresh (the product before warm restarts), those a
# live peer holds at that moment, or its own from before the kill (an upper bound: a real replacement
# has lost them).
Restart = Literal["fresh", "peer", "own"]
Host = dict[str, np.ndarray]


@dataclass(frozen=True)
class Kill:
    learner: int
    tick: int
    down_ticks: int


@dataclass(frozen=True)
class Setting:
    learners: int = 4
    phases: Sequence[int] | None = None  # default: spread evenly over H (no two learners align)
    speeds: Sequence[float] | None = None  # steps per tick, in (0, 1]; default all 1.0
    kills: Sequence[Kill] = ()
    grace: int = 0
    delay: int = 0
    method: Literal["rda", "mean"] = "rda"
    token_weighting: bool = True
    scheme: Scheme = "none"
    install: Install = "overwrite"
    keep: float = 1.0  # the share of local progress that "keep-unsent" and "mix" keep
    per_round_momentum: bool = False
    restart: Restart = "fresh"
    relock: bool = False  # a restarted learner takes a live peer's push schedule


@dataclass
class Result:
    loss: float
    seconds: float
    ticks: int
    merges: int
    contributions: int
    steps: list[int] = field(default_factory=list)

    @property
    def note(self) -> str:
        return (
            f"{self.merges} merges, {self.contributions / max(self.merges, 1):.2f} "
            f"contributions/merge, steps {self.steps}, {self.ticks} ticks"
        )


def leased_batches(cfg: TrainingConfig, unit: int, units: int) -> Iterator[np.ndarray]:
    """The batches learner `unit` of `units` in lockstep reads under the syncer's data leases:
    shards unit, unit + units, ... of each epoch through the built-in source, as the lease book
    hands them out when every learner reads at the same pace; so the in-process runs read the
    data the real decoupled ones do (a restarted learner goes on with its predecessor's lease)."""
    source = StreamSource(cfg)
    for epoch in itertools.count():
        for shard in range(unit, cfg.data.shards, units):
            yield from source(
                shard, cfg.data.shards, seed=epoch_seed(cfg.seed, epoch),
                batch_size=cfg.data.batch_size, split="train", position=0,
            )  # fmt: skip


def roundtrip(delta: Host, scheme: str, block_size: int = 128) -> Host:
    """The delta as the syncer sees it after quantization and dequantization."""
    if scheme == "none":
        return delta
    return {k: dequantize(quantize(v, scheme, block_size)) for k, v in delta.items()}  # type: ignore[arg-type]


def _speed_gate(speed: float, tick: int) -> bool:
    """Whether a learner of this speed completes a step at `tick` (1-based): evenly spaced."""
    return int(tick * speed) > int((tick - 1) * speed)


def _restarted_state(
    state: Any, fresh: Any, m: int, step: int, mode: Restart, peers: list[int]
) -> Any:
    """The stacked optimizer state with learner m's restarted as `mode` says (`peers`: the
    learners alive at the restart)."""
    if mode == "own":
        return state
    source = fresh
    if mode == "peer" and peers:
        source = jax.tree_util.tree_map(lambda a: a[peers[0]], state)
    resumed = resume_schedule(source, step)
    return jax.tree_util.tree_map(lambda a, b: a.at[m].set(b), state, resumed)


def simulate(
    cfg: TrainingConfig,
    total_steps: int,
    s: Setting,
    eval_batches: int,
    max_ticks: int | None = None,
) -> Result:
    """Run until the learners have done `total_steps` inner steps together (equal tokens), or
    for `max_ticks` ticks (equal wall-clock), whichever comes first."""
    started = time.perf_counter()
    m_count, h = s.learners, cfg.inner_steps
    phases = list(s.phases) if s.phases is not None else [m * h // m_count for m in range(m_count)]
    speeds = list(s.speeds) if s.speeds is not None else [1.0] * m_count
    opt = make_optimizer(cfg.inner_optimizer, -(-total_steps // m_count))
    init = init_params(cfg.model, cfg.seed)
    layout = pack_fragments(param_shapes(cfg.model), cfg.fragments)
    fresh_state = opt.init({k: jnp.asarray(v) for k, v in init.items()})
    params = {k: jnp.stack([jnp.asarray(v)] * m_count) for k, v in init.items()}
    state = jax.tree_util.tree_map(lambda x: jnp.stack([x] * m_count), fresh_state)

    def one(p: Any, st: Any, batch: jax.Array, active: jax.Array) -> tuple[Any, Any]:
        _, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, new_st = opt.update(grads, st, p)
        new_p = optax.apply_updates(p, updates)
        keep = lambda new, old: jnp.where(active, new, old)  # noqa: E731
        return jax.tree_util.tree_map(keep, new_p, p), jax.tree_util.tree_map(keep, new_st, st)

    step_all = jax.jit(jax.vmap(one))
    streams = [leased_batches(cfg, m, m_count) for m in range(m_count)]
    outer = OuterOptimizer(
        cfg.outer_optimizer.lr, cfg.outer_optimizer.momentum, True, s.per_round_momentum
    )
    glob: Host = {k: np.array(v) for k, v in init.items()}
    outer_states = [outer.init({n: glob[n] for n in frag}) for frag in layout]
    # ref[m][p]: where learner m's not-yet-sent progress on fragment p is measured from
    ref: list[list[Host]] = [
        [{n: glob[n] for n in frag} for frag in layout] for _ in range(m_count)
    ]
    counts = np.zeros((m_count, len(layout)), dtype=np.int64)
    steps = [0] * m_count
    down_until = [0] * m_count
    kills = {(k.tick, k.learner): k.down_ticks for k in s.kills}
    pending: list[list[tuple[int, int, Host, int]]] = [[] for _ in layout]
    arrivals: list[tuple[int, int, Host]] = []
    merges = contributions = tick = 0
    batch_shape = (cfg.data.batch_size, cfg.model.context + 1)
    tokens = cfg.tokens_per_step

    def host(m: int, names: Sequence[str]) -> Host:
        return {n: np.asarray(params[n][m]) for n in names}

    def set_leaves(m: int, values: Host) -> None:
        for n, v in values.items():
            params[n] = params[n].at[m].set(v)

    while sum(steps) < total_steps and (max_ticks is None or tick < max_ticks):
        tick += 1
        for m in range(m_count):
            if (tick, m) in kills:  # unsent progress is lost; back after the downtime
                down_until[m] = tick + kills[(tick, m)]
            elif down_until[m] == tick:  # restart: pull the global parameters, fresh AdamW
                set_leaves(m, glob)  # moments, the LR schedule continued (as `resumeStep` does)
                peers = [k for k in range(m_count) if k != m and down_until[k] <= tick]
                state = _restarted_state(state, fresh_state, m, steps[m], s.restart, peers)
                if s.relock and peers:  # as the phase lock does after the first install
                    phases[m] = steps[peers[0]] + phases[peers[0]] - steps[m]
                ref[m] = [{n: glob[n] for n in frag} for frag in layout]
                counts[m] = 0
        alive = [down_until[m] <= tick for m in range(m_count)]
        active = [a and _speed_gate(speeds[m], tick) for m, a in enumerate(alive)]
        batch = np.stack(
            [
                next(streams[m]) if active[m] else np.zeros(batch_shape, np.int32)
                for m in range(m_count)
            ]
        )
        params, state = step_all(params, state, batch, jnp.asarray(active))
        for m in range(m_count):
            if not active[m]:
                continue
            steps[m] += 1
            counts[m] += 1
            for p, frag in enumerate(layout):
                if is_due(steps[m] + phases[m], p, h, len(layout)):
                    theta = host(m, frag)
                    delta = roundtrip({n: ref[m][p][n] - theta[n] for n in frag}, s.scheme)
                    pending[p].append((tick, m, delta, int(counts[m, p])))
                    # As the product's learner does: the next push carries only later progress.
                    ref[m][p], counts[m, p] = theta, 0
        online = sum(alive)
        for p, frag in enumerate(layout):
            if not pending[p] or tick - pending[p][0][0] < s.grace:
                continue
            contribs = [Contribution(d, c, c * tokens) for _, _, d, c in pending[p] if c > 0]
            pending[p] = []
            if not contribs:
                continue
            share = participation_share(len(contribs), online)
            new, outer_states[p] = merge_and_step(
                outer,
                {n: glob[n] for n in frag},
                outer_states[p],
                contribs,
                s.method,
                s.token_weighting,
                share,
            )
            glob.update({k: np.array(v) for k, v in new.items()})
            merges, contributions = merges + 1, contributions + len(contribs)
            arrivals.append((tick + s.delay, p, {n: glob[n] for n in frag}))
        due = [a for a in arrivals if a[0] <= tick]
        arrivals = [a for a in arrivals if a[0] > tick]
        for _, p, tensors in due:
            for m in range(m_count):
                if not alive[m]:
                    continue
                if s.install == "overwrite":  # the product's learner: drop unsent progress
                    set_leaves(m, tensors)
                    counts[m, p] = 0
                elif s.install == "keep-unsent":  # unsent progress on top of the new global
                    theta = host(m, layout[p])
                    kept = {n: tensors[n] + s.keep * (theta[n] - ref[m][p][n]) for n in tensors}
                    set_leaves(m, kept)
                else:
                    theta = host(m, layout[p])
                    mixed = {n: s.keep * theta[n] + (1 - s.keep) * tensors[n] for n in tensors}
                    set_leaves(m, mixed)
                ref[m][p] = tensors
    loss = eval_loss(glob, cfg, eval_batches)
    return Result(loss, time.perf_counter() - started, tick, merges, contributions, steps)

"""Decoupled DiLoCo in one process, with a clock we control: the harness of the ablations and
bad_unit sections.

The real decoupled run (learner and syncer processes, `bench.lib.training.decoupled`) is the
headline, but its arrival pattern depends on the machine's load, so two runs of it differ in more
than the setting under study. Here M learners advance in lock step (one vmapped train step per
tick; a learner at half speed steps every other tick), each sends fragment p at its own staggered
steps (shifted by its `phase`), and the syncer's rules are applied to what arrived: a merge of
every contribution pending for `grace` ticks (grace 0: the contributions of the same tick), the
merge weights, RDA or plain mean, participation scaling, the Nesterov outer step, and the broadcast
that every live learner installs `delay` ticks later. Kills drop a learner's unsent progress and
restart it from the global parameters with fresh AdamW moments and the LR schedule continued at the
learner's step, as a restarted process does (`resumeStep`).

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
from diloco_trainer.syncer import robust
from diloco_trainer.syncer.quarantine import QuarantineBook
from diloco_trainer.syncer.trust import Implausible, Plausibility
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
Bad = Literal["none", "scaled", "long", "noise", "flipped"]
HUGE = (1 << 53) - 1


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
    # One bad learner (the last): its pushes are its delta 9.9x long with cTokens 2^53-1 on
    # cSteps 1 ("scaled"), 9.9x long with honest counters ("long"), noise of its delta's norm
    # ("noise"), or its delta with the sign flipped ("flipped").
    bad: Bad = "none"
    # The syncer's defences (trust.py, robust.py, quarantine.py with the config's defaults):
    # impossible counters refused, weights capped, outlying deltas clipped or left out, and a
    # learner quarantined for repeated outliers has its later pushes refused. Off by default,
    # so the sections measured before the defences existed measure the same model.
    defended: bool = False


@dataclass
class Result:
    loss: float
    seconds: float
    ticks: int
    merges: int
    contributions: int
    steps: list[int] = field(default_factory=list)
    defences: str = ""  # what the defences did (Defences.note)

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
                shard,
                cfg.data.shards,
                seed=epoch_seed(cfg.seed, epoch),
                batch_size=cfg.data.batch_size,
                split="train",
                position=0,
            )


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


def corrupted(
    delta: Host, c_steps: int, c_tokens: int, bad: Bad, rng: np.random.Generator
) -> tuple[Host, int, int]:
    """What a bad learner sends instead of (delta, cSteps, cTokens)."""
    if bad in ("scaled", "long"):
        delta = {n: v * np.float32(9.9) for n, v in delta.items()}
        return (delta, 1, HUGE) if bad == "scaled" else (delta, c_steps, c_tokens)
    if bad == "noise":
        norm = np.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in delta.values()))
        noise = {n: rng.normal(size=v.shape).astype(np.float32) for n, v in delta.items()}
        scale = norm / np.sqrt(
            sum(float(np.sum(np.square(v, dtype=np.float64))) for v in noise.values())
        )
        return {n: v * np.float32(scale) for n, v in noise.items()}, c_steps, c_tokens
    if bad == "flipped":
        return {n: -v for n, v in delta.items()}, c_steps, c_tokens
    return delta, c_steps, c_tokens


class Defences:
    """The syncer's checks on one simulated run: what a push's counters may be, what each
    merge's contributions are screened to, and who is quarantined."""

    def __init__(self, cfg: TrainingConfig, tokens_per_step: int) -> None:
        self.rules = Plausibility(tokens_per_step, 2 * cfg.inner_steps)
        self.screen = robust.screen(cfg.merge.robust)
        self.quarantine = QuarantineBook(
            cfg.merge.robust.quarantine_after, cfg.merge.robust.quarantine_window
        )
        self.token_weighting = cfg.merge.token_weighting
        self.typical: list[float | None] = [None] * cfg.fragments
        self.refused = self.dropped = self.clipped = 0
        self.quarantined_at: int | None = None

    def admit(
        self, m: int, step: int, previous: int, c_steps: int, c_tokens: int
    ) -> tuple[int, int] | None:
        """The push's weight counters, or None when the syncer would refuse it (impossible
        counters, or a quarantined learner). No peer step time: the time bound is not used."""
        if self.quarantine.reason(str(m), 0) is not None:
            self.refused += 1
            return None
        try:
            self.rules.check_push(step, c_steps, c_tokens, previous, None, None)
        except Implausible:
            self.refused += 1
            return None
        return self.rules.weight_counters(c_steps, c_tokens)

    def merge(
        self, p: int, units: list[int], contribs: list[Contribution], tick: int
    ) -> list[Contribution]:
        r = self.screen(
            robust.start([str(m) for m in units], contribs, self.typical[p]), self.token_weighting
        )
        for unit, verdict in r.verdicts.items():
            self.dropped += verdict.action == "dropped"
            self.clipped += verdict.action == "clipped"
            if self.quarantine.record(unit, 0, verdict) is not None and self.quarantined_at is None:
                self.quarantined_at = tick
        kept = [robust.delta_norm(c) for c in r.contributions]
        median = float(np.median(kept))
        old = self.typical[p]
        self.typical[p] = median if old is None else 0.7 * old + 0.3 * median
        return r.contributions

    def note(self) -> str:
        where = (
            "" if self.quarantined_at is None else f", quarantined at tick {self.quarantined_at}"
        )
        return f"refused {self.refused}, clipped {self.clipped}, left out {self.dropped}{where}"


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
    pending: list[list[tuple[int, int, Host, int, int]]] = [[] for _ in layout]
    arrivals: list[tuple[int, int, Host]] = []
    merges = contributions = tick = 0
    batch_shape = (cfg.data.batch_size, cfg.model.context + 1)
    tokens = cfg.tokens_per_step
    defences = Defences(cfg, tokens) if s.defended else None
    bad_rng = np.random.default_rng(cfg.seed + 1000)
    last_push = np.zeros((m_count, len(layout)), dtype=np.int64)  # step of each learner's push

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
                    c_steps, c_tokens = int(counts[m, p]), int(counts[m, p]) * tokens
                    if m == m_count - 1 and s.bad != "none":
                        delta, c_steps, c_tokens = corrupted(
                            delta, c_steps, c_tokens, s.bad, bad_rng
                        )
                    weights = (
                        (c_steps, c_tokens)
                        if defences is None
                        else defences.admit(m, steps[m], int(last_push[m, p]), c_steps, c_tokens)
                    )
                    last_push[m, p] = steps[m]
                    if weights is not None:
                        pending[p].append((tick, m, delta, *weights))
                    # As the product's learner does: the next push carries only later progress.
                    ref[m][p], counts[m, p] = theta, 0
        online = sum(alive)
        for p, frag in enumerate(layout):
            if not pending[p] or tick - pending[p][0][0] < s.grace:
                continue
            arrived = [(m, Contribution(d, c, t)) for _, m, d, c, t in pending[p] if c > 0]
            pending[p] = []
            if not arrived:
                continue
            contribs = [c for _, c in arrived]
            if defences is not None:
                contribs = defences.merge(p, [m for m, _ in arrived], contribs, tick)
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
    result = Result(loss, time.perf_counter() - started, tick, merges, contributions, steps)
    result.defences = defences.note() if defences is not None else ""
    return result

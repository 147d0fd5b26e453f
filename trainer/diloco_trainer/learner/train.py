"""The inner optimizer and the jit-compiled, data-parallel train step of one learner unit.

SPMD layout: one 1-D mesh axis ``data`` over every device of the unit (all local devices, and all
hosts' devices once ``jax.distributed`` is initialised). The batch is sharded along ``data``;
parameters and AdamW state are replicated by default, so XLA inserts one gradient all-reduce per
step inside the unit, or sharded along the same axis (FSDP, `sharding.py`), so XLA gathers weights
and reduce-scatters gradients instead. Every process feeds only its own rows (`shard_batch`),
which is what multi-host needs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_trainer.config import InnerOptimizerConfig
from diloco_trainer.learner.sharding import DATA_AXIS, opt_state_shardings, place
from diloco_trainer.models.gpt import loss_fn

Params = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
# (flat params, batch, rng) -> (scalar loss, metrics): a model's loss over the trainer's flat dict.
LossFn = Callable[[Params, Any, jax.Array], tuple[jax.Array, Metrics]]
# (params, opt_state, batch, rng) -> (params, opt_state, loss, metrics)
TrainStep = Callable[[Params, Any, Any, jax.Array], tuple[Params, Any, jax.Array, Metrics]]

log = logging.getLogger(__name__)


def learning_rate_schedule(cfg: InnerOptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to cfg.lr, then constant or cosine decay to 10% of it at `total_steps`."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    if cfg.schedule == "constant":
        after: optax.Schedule = optax.constant_schedule(cfg.lr)
    else:
        after = optax.cosine_decay_schedule(cfg.lr, max(total_steps - warmup, 1), alpha=0.1)
    if warmup == 0:
        return after
    return optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.lr, warmup), after], boundaries=[warmup]
    )


# A restarted unit re-warms for at most this many steps: its AdamW moments are fresh, and Adam's
# first updates with fresh moments are close to sign(g) (|m|/sqrt(v) ~ 1 per coordinate) until the
# second moment has averaged over some steps; 20 steps is one b2=0.95 time constant (two of b1=0.9).
REWARMUP_STEPS = 20


def rewarmup_steps(cfg: InnerOptimizerConfig) -> int:
    """Length of a resumed learner's linear re-warmup: min(warmupSteps, REWARMUP_STEPS)."""
    return min(cfg.warmup_steps, REWARMUP_STEPS)


def resumed_learning_rate(schedule: optax.Schedule, count: Any, start: Any, rewarmup: int) -> Any:
    """The LR at schedule step `count` of a learner whose optimizer started at step `start`.

    start == 0 (a new unit): exactly `schedule(count)`, whose own warmup applies. start > 0 (a
    unit resumed at the step it had reached): the schedule continues from there, times a linear
    ramp over the first `rewarmup` steps of this process, (count - start + 1) / rewarmup, so step
    `start + rewarmup - 1` and later train at the scheduled LR. Works on Python ints and jnp."""
    lr = schedule(count)
    if rewarmup <= 0:
        return lr
    ramp = jnp.clip((count - start + 1) / rewarmup, 0.0, 1.0)
    return jnp.where(start > 0, lr * ramp, lr)


class ResumableScheduleState(NamedTuple):
    step: jax.Array  # schedule step of the next update
    start: jax.Array  # schedule step this optimizer state started at (0: a new unit)


def scale_by_resumable_schedule(
    schedule: optax.Schedule, rewarmup: int
) -> optax.GradientTransformation:
    """optax.scale_by_learning_rate(schedule) whose state also holds the step it started at, so
    one compiled train step serves a new unit (start 0) and a resumed one (`resume_schedule`)."""

    def init(params: Any) -> ResumableScheduleState:
        del params
        return ResumableScheduleState(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32))

    def update(updates: Any, state: ResumableScheduleState, params: Any = None) -> Any:
        del params
        lr = resumed_learning_rate(schedule, state.step, state.start, rewarmup)
        updates = jax.tree_util.tree_map(lambda g: jnp.array(-lr, dtype=g.dtype) * g, updates)
        step = optax.safe_int32_increment(state.step)
        return updates, ResumableScheduleState(step, state.start)

    return optax.GradientTransformation(init, update)


def resume_schedule(
    opt_state: Any, step: int, mesh: Mesh | None = None, start: int | None = None
) -> Any:
    """The optimizer state with its LR schedule continuing at `step`, counted as started at
    `start` (default `step`: the re-warmup begins now); AdamW moments untouched."""

    def scalar(value: int) -> jax.Array:
        host = np.asarray(value, np.int32)
        return jax.device_put(host, replicated(mesh)) if mesh is not None else jnp.asarray(host)

    def fix(node: Any) -> Any:
        if isinstance(node, ResumableScheduleState):
            return ResumableScheduleState(scalar(step), scalar(step if start is None else start))
        return node

    is_schedule = lambda node: isinstance(node, ResumableScheduleState)  # noqa: E731
    return jax.tree_util.tree_map(fix, opt_state, is_leaf=is_schedule)


@dataclass
class ScheduleClock:
    """Where one learner process's steps fall on its unit's LR schedule, kept up with the run.

    Step `s` of the process (from 1) trains at schedule step `start + s - 1`; `start` begins at
    the unit's resume step. The horizon is the unit's share of the run's budget, but a unit that
    was down, paused or slower than the others has done less than its share when the budget is
    reached, and would end the run at a higher LR than the rest, its last deltas the largest in
    every merge. So the clock never lags the run: when the run's progress through its budget
    (`floor`) is ahead of the unit, the schedule jumps there, re-warmup ramp unchanged."""

    schedule: optax.Schedule
    horizon: int
    rewarmup: int
    start: int
    mesh: Mesh | None = None

    def floor(self, budget_done: float) -> int:
        """The schedule step the run's counted share of its budget corresponds to."""
        return int(budget_done * self.horizon)

    def position(self, step: int) -> int:
        """The schedule step of the update after `step` steps of this process."""
        return self.start + step

    def learning_rate(self, step: int) -> float:
        """The LR step `step` of this process trained at."""
        count = self.start + step - 1
        return float(resumed_learning_rate(self.schedule, count, self.start, self.rewarmup))

    def keep_up(self, step: int, floor: int, opt_state: Any) -> Any:
        """`opt_state`, its schedule moved to `floor` if the unit is behind it."""
        behind = floor - self.position(step)
        if behind <= 0:
            return opt_state
        if behind >= self.rewarmup:  # more than the drift between units of one speed
            log.info("event=schedule_caught_up step=%d schedule_step=%d by=%d", step, floor, behind)
        self.start = floor - step
        return resume_schedule(opt_state, floor, self.mesh, start=self.start)


def _decay_mask(params: Mapping[str, Any]) -> dict[str, bool]:
    # Decay matrices only: norm scales are 1-D and decaying them toward 0 hurts.
    return {name: len(value.shape) >= 2 for name, value in params.items()}


def make_optimizer(cfg: InnerOptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and warmup/cosine schedule over this learner's horizon.

    The same chain as optax.adamw, with its last stage (the LR) resumable: `resume_schedule` sets
    where the schedule continues for a restarted unit (see `resumed_learning_rate`)."""
    adamw = optax.chain(
        optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2),
        optax.add_decayed_weights(cfg.weight_decay, _decay_mask),
        scale_by_resumable_schedule(learning_rate_schedule(cfg, total_steps), rewarmup_steps(cfg)),
    )
    if cfg.grad_clip is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)


def make_mesh(devices: list[jax.Device] | None = None) -> Mesh:
    return Mesh(np.array(devices if devices is not None else jax.devices()), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(DATA_AXIS))


def place_params(
    params: Mapping[str, np.ndarray | jax.Array],
    mesh: Mesh,
    shardings: Mapping[str, NamedSharding] | None = None,
) -> Params:
    """Lay parameters out over the unit's devices: `shardings` per leaf (`sharding.py`), or
    replicated on every device when None."""
    if shardings is None:
        shardings = {name: replicated(mesh) for name in params}
    placed: Params = place(dict(params), dict(shardings))
    return placed


def shard_batch(local_batch: Any, mesh: Mesh) -> Any:
    """This process's rows of the global batch (a pytree of arrays), along the data axis."""
    sharding = batch_sharding(mesh)
    return jax.tree_util.tree_map(
        lambda rows: jax.make_array_from_process_local_data(sharding, np.asarray(rows)),
        local_batch,
    )


def check_batch_divisible(global_batch: int, devices: int) -> None:
    if global_batch % devices:
        raise ValueError(
            f"data.batchSize ({global_batch}) must be divisible by the unit's {devices} devices"
        )


def init_opt_state(optimizer: optax.GradientTransformation, params: Params, mesh: Mesh) -> Any:
    """Fresh optimizer state laid out like `params`: each moment shares its parameter's sharding."""
    return jax.jit(optimizer.init, out_shardings=opt_state_shardings(optimizer, params, mesh))(
        params
    )


def gpt_loss(compute_dtype: jnp.dtype = jnp.float32) -> LossFn:
    """The built-in transformer's loss in the LossFn form (no metrics)."""

    def loss(params: Params, batch: Any, rng: jax.Array) -> tuple[jax.Array, Metrics]:
        return loss_fn(params, batch, compute_dtype), {}

    return loss


def make_train_step(
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    loss: LossFn | None = None,
    compute_dtype: jnp.dtype = jnp.float32,
    abstract_params: Mapping[str, jax.ShapeDtypeStruct] | None = None,
) -> TrainStep:
    """(params, opt_state, batch, rng) -> (params, opt_state, loss, metrics), jit-compiled over
    the mesh. `loss`: the model's (default: the built-in transformer at `compute_dtype`).

    `abstract_params`: each leaf's shape, dtype and sharding (`sharding.abstract_params`); the
    step takes and returns parameters and optimizer state laid out that way. None: replicated.

    Buffers are not donated: the learner hands the previous step's parameter arrays to a
    background sender thread, which reads them to host while later steps run.
    """
    loss = loss or gpt_loss(compute_dtype)

    def step(
        params: Params, opt_state: Any, batch: Any, rng: jax.Array
    ) -> tuple[Params, Any, jax.Array, Metrics]:
        (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, batch, rng)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, metrics

    rep = replicated(mesh)
    params_in: Any = rep
    state_in: Any = rep
    if abstract_params is not None:
        params_in = {name: leaf.sharding for name, leaf in abstract_params.items()}
        state_in = opt_state_shardings(optimizer, dict(abstract_params), mesh)
    jitted: TrainStep = jax.jit(
        step,
        in_shardings=(params_in, state_in, batch_sharding(mesh), rep),
        out_shardings=(params_in, state_in, rep, rep),
    )
    return jitted


def step_key(seed: int, step: int) -> jax.Array:
    """The rng a model's loss gets at `step` (dropout and the like): the same on every host."""
    return jax.random.fold_in(jax.random.key(seed), step)

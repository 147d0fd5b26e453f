"""The inner optimizer and the jit-compiled, data-parallel train step of one learner unit.

SPMD layout: one 1-D mesh axis ``data`` over every device of the unit (all local devices, and all
hosts' devices once ``jax.distributed`` is initialised). The batch is sharded along ``data``;
parameters and AdamW state are replicated, so XLA inserts one gradient all-reduce per step inside
the unit. Every process feeds only its own rows (`shard_batch`), which is what multi-host needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_trainer.config import InnerOptimizerConfig
from diloco_trainer.model import loss_fn

DATA_AXIS = "data"
Params = dict[str, jax.Array]
TrainStep = Callable[[Params, Any, jax.Array], tuple[Params, Any, jax.Array]]


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


def _decay_mask(params: Mapping[str, Any]) -> dict[str, bool]:
    # Decay matrices only: norm scales are 1-D and decaying them toward 0 hurts.
    return {name: len(value.shape) >= 2 for name, value in params.items()}


def make_optimizer(cfg: InnerOptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and warmup/cosine schedule over this learner's horizon."""
    adamw = optax.adamw(
        learning_rate_schedule(cfg, total_steps),
        b1=cfg.b1,
        b2=cfg.b2,
        weight_decay=cfg.weight_decay,
        mask=_decay_mask,
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


def place_params(params: Mapping[str, np.ndarray | jax.Array], mesh: Mesh) -> Params:
    """Copy parameters onto every device of the unit (replicated)."""
    sharding = replicated(mesh)
    return {name: jax.device_put(np.asarray(value), sharding) for name, value in params.items()}


def shard_batch(local_batch: np.ndarray, mesh: Mesh) -> jax.Array:
    """This process's rows of the global batch, laid out along the data axis."""
    return jax.make_array_from_process_local_data(batch_sharding(mesh), local_batch)


def check_batch_divisible(global_batch: int, devices: int) -> None:
    if global_batch % devices:
        raise ValueError(
            f"data.batchSize ({global_batch}) must be divisible by the unit's {devices} devices"
        )


def init_opt_state(optimizer: optax.GradientTransformation, params: Params, mesh: Mesh) -> Any:
    return jax.jit(optimizer.init, out_shardings=replicated(mesh))(params)


def make_train_step(
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    compute_dtype: jnp.dtype = jnp.float32,
) -> TrainStep:
    """(params, opt_state, batch) -> (params, opt_state, loss), jit-compiled over the mesh.

    Buffers are not donated: the learner hands the previous step's parameter arrays to a
    background sender thread, which reads them to host while later steps run.
    """

    def step(params: Params, opt_state: Any, batch: jax.Array) -> tuple[Params, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, compute_dtype)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rep = replicated(mesh)
    jitted: TrainStep = jax.jit(
        step,
        in_shardings=(rep, rep, batch_sharding(mesh)),
        out_shardings=(rep, rep, rep),
    )
    return jitted

"""The outer optimizer: Nesterov SGD (optax) per fragment on the syncer.

The merged delta (base - local, averaged over learners) is the outer *gradient*: SGD subtracts it,
which moves Theta toward where the learners went. Each fragment has its own optimizer state
because fragments step at different times.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_trainer.merge import Contribution, MergeMethod, merge_outer_gradient

Params = dict[str, np.ndarray]

# Older JAX copies every host array it is given; newer can alias a 64-byte-aligned one.
_CAN_ALIAS = "may_alias" in inspect.signature(jax.device_put).parameters


def _on_device(x: np.ndarray) -> jax.Array:
    """A host array as a jax.Array without a copy where the runtime allows (CPU, 64-byte aligned:
    the merge's outputs and the previous step's params). The step only reads its inputs, and the
    caller keeps ownership: nothing is donated."""
    if _CAN_ALIAS:
        return jax.device_put(x, may_alias=True)
    return jnp.asarray(x)


class RoundMomentumState(NamedTuple):
    momentum: optax.Updates
    pending: optax.Updates  # the outer gradients of the round so far
    filled: jax.Array  # share of a round they represent


def round_nesterov(learning_rate: float, momentum: float) -> optax.GradientTransformationExtraArgs:
    """Nesterov SGD whose momentum moves once per *round* of contributions, not once per merge.

    With quorum 1 a round of H inner steps arrives as up to M merges, each scaled by its share
    (`merge.participation_share`). Each merge is applied at once as a plain SGD step; the momentum
    buffer is updated, and its Nesterov term applied, only when the shares add up to a full round,
    with the round's summed gradient. Per round this is exactly `optax.sgd(lr, momentum,
    nesterov=True)` on the round's average; a momentum driven by every single-learner merge is
    the failure mode asynchronous Local-SGD reports (Liu et al. 2024, "delayed Nesterov").
    With share 1 on every call it is identical to optax's Nesterov SGD.
    """

    def init_fn(params: optax.Params) -> RoundMomentumState:
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return RoundMomentumState(zeros, zeros, jnp.zeros([], jnp.float32))

    def update_fn(
        updates: optax.Updates,
        state: RoundMomentumState,
        params: optax.Params | None = None,
        *,
        share: float | jax.Array = 1.0,
        **extra: Any,
    ) -> tuple[optax.Updates, RoundMomentumState]:
        del params, extra
        pending = jax.tree_util.tree_map(jnp.add, state.pending, updates)
        filled = state.filled + share
        done = filled >= 1.0 - 1e-6
        mom = jax.tree_util.tree_map(
            lambda m, p: jnp.where(done, momentum * m + p, m), state.momentum, pending
        )
        step = jax.tree_util.tree_map(
            lambda g, m: -learning_rate * (g + jnp.where(done, momentum * m, 0.0)), updates, mom
        )
        pending = jax.tree_util.tree_map(lambda p: jnp.where(done, jnp.zeros_like(p), p), pending)
        return step, RoundMomentumState(mom, pending, jnp.where(done, 0.0, filled))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


Step = Callable[[Any, Any, Any, jax.Array, jax.Array], tuple[Any, Any]]


@functools.lru_cache(maxsize=16)
def _transformation(
    lr: float, momentum: float, nesterov: bool, per_round: bool
) -> tuple[optax.GradientTransformation, Step]:
    """The optax transformation and its jitted step, one per setting and process: every
    optimizer (one per syncer, several per test session) with the same setting shares the
    compiled programs."""
    tx: optax.GradientTransformation = (
        round_nesterov(lr, momentum)
        if per_round
        else optax.sgd(learning_rate=lr, momentum=momentum or None, nesterov=nesterov)
    )

    def step(
        params: Any, state: Any, grads: Any, scales: jax.Array, share: jax.Array
    ) -> tuple[Any, Any]:
        # Each leaf's merge factor (`merge.OuterGradient`), fused into the loops that read it.
        grads = {name: grads[name] * scales[i] for i, name in enumerate(sorted(grads))}
        if per_round:
            updates, new_state = tx.update(grads, state, params, share=share)
        else:
            updates, new_state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), new_state

    return tx, jax.jit(step)


class OuterOptimizer:
    """The outer optimizer with one state per fragment and a jitted update: optax Nesterov SGD,
    or `round_nesterov` (momentum once per round of contributions) when `per_round`."""

    def __init__(self, lr: float, momentum: float, nesterov: bool, per_round: bool = False) -> None:
        self.per_round = per_round and nesterov and momentum > 0
        self.tx, self._step = _transformation(lr, momentum, nesterov, self.per_round)

    def init(self, fragment_params: Mapping[str, np.ndarray]) -> Any:
        return self.tx.init({k: jnp.asarray(v) for k, v in fragment_params.items()})

    def step(
        self,
        fragment_params: Mapping[str, np.ndarray],
        state: Any,
        merged_delta: Mapping[str, np.ndarray],
        share: float = 1.0,
        grad_scale: Mapping[str, float] | None = None,
    ) -> tuple[Params, Any]:
        """One outer step on the gradient grad_scale[n] * merged_delta[n] (factor 1 where
        `grad_scale` is None); returns new numpy params (fresh arrays, never aliasing inputs;
        views of the step's output buffers, so treat them as read-only)."""
        names = sorted(fragment_params)
        if names != sorted(merged_delta):
            raise ValueError("outer step: merged delta leaves differ from the fragment's leaves")
        if grad_scale is not None and sorted(grad_scale) != names:
            raise ValueError("outer step: grad_scale leaves differ from the fragment's leaves")
        params = {k: _on_device(v) for k, v in fragment_params.items()}
        grads = {k: _on_device(np.asarray(merged_delta[k], np.float32)) for k in params}
        scales = jnp.asarray(
            [1.0 if grad_scale is None else grad_scale[k] for k in names], dtype=jnp.float32
        )
        new_params, new_state = self._step(params, state, grads, scales, jnp.float32(share))
        return {k: np.asarray(v) for k, v in new_params.items()}, new_state

    # Checkpointing: optimizer state as a flat list of arrays, restored into the tree of init().
    @staticmethod
    def state_leaves(state: Any) -> list[np.ndarray]:
        return [np.array(x) for x in jax.tree_util.tree_leaves(state)]

    def state_from_leaves(
        self, fragment_params: Mapping[str, np.ndarray], leaves: list[np.ndarray]
    ) -> Any:
        template = self.init(fragment_params)
        ref, treedef = jax.tree_util.tree_flatten(template)
        if len(ref) != len(leaves):
            raise ValueError(f"outer state: expected {len(ref)} arrays, found {len(leaves)}")
        for want, got in zip(ref, leaves, strict=True):
            if tuple(want.shape) != tuple(got.shape):
                raise ValueError(f"outer state: shape {got.shape} where {want.shape} expected")
        return jax.tree_util.tree_unflatten(
            treedef, [jnp.asarray(x, dtype=w.dtype) for x, w in zip(leaves, ref, strict=True)]
        )


def merge_and_step(
    opt: OuterOptimizer,
    fragment_params: Mapping[str, np.ndarray],
    state: Any,
    contributions: Sequence[Contribution],
    method: MergeMethod,
    token_weighting: bool,
    share: float,
) -> tuple[Params, Any]:
    """A fragment's merge and outer step, as the syncer runs them: the merge's per-leaf factors
    (RDA radius, participation share) are applied inside the jitted step, so neither takes a
    pass of its own over the merged leaves."""
    grad = merge_outer_gradient(contributions, method, token_weighting, share)
    return opt.step(fragment_params, state, grad.directions, share, grad_scale=grad.scales)

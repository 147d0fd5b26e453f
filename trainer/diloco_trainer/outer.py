"""The outer optimizer: Nesterov SGD (optax) per fragment on the syncer.

The merged delta (base - local, averaged over learners) is the outer *gradient*: SGD subtracts it,
which moves Theta toward where the learners went. Each fragment has its own optimizer state
because fragments step at different times.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_trainer.config import OuterOptimizerConfig
from diloco_trainer.merge import (
    Contribution,
    MergeMethod,
    OuterGradient,
    merge_outer_gradient,
    pack_layout,
    packed_empty,
)

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


class _DeviceViews:
    """The jax.Array behind each numpy view of a step's output: when a view comes back as the
    next step's params it is used as it is, without a device_put (about 0.1 ms per leaf, more
    than the whole step of a small leaf). Entries go when their view is garbage-collected."""

    def __init__(self) -> None:
        self._arrays: dict[int, tuple[weakref.ref[np.ndarray], jax.Array]] = {}

    def host(self, array: jax.Array) -> np.ndarray:
        view = np.asarray(array)
        key = id(view)
        self._arrays[key] = (weakref.ref(view, functools.partial(self._forget, key)), array)
        return view

    def on_device(self, x: np.ndarray) -> jax.Array:
        known = self._arrays.get(id(x))
        if known is not None and known[0]() is x:
            return known[1]
        return _on_device(x)

    def _forget(self, key: int, ref: weakref.ref[np.ndarray]) -> None:
        known = self._arrays.get(key)
        if known is not None and known[0] is ref:
            self._arrays.pop(key, None)


def _same_leaves(params: Mapping[str, np.ndarray], leaves: Mapping[str, np.ndarray]) -> list[str]:
    """The sorted leaf names, after checking that `leaves` has the params' names and shapes."""
    names = sorted(params)
    if names != sorted(leaves):
        raise ValueError("outer step: merged delta leaves differ from the fragment's leaves")
    for name in names:
        if tuple(np.shape(leaves[name])) != tuple(np.shape(params[name])):
            raise ValueError(
                f"outer step: merged delta {name!r} has shape {tuple(np.shape(leaves[name]))}, "
                f"the fragment's {tuple(np.shape(params[name]))}"
            )
    return names


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


Step = Callable[[Any, Any, jax.Array, Any, Any], tuple[Any, Any]]  # scales, share: array-likes


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
        params: Any, state: Any, packed: jax.Array, scales: jax.Array, share: jax.Array
    ) -> tuple[Any, Any]:
        # The merged leaves arrive in one buffer (`merge.pack_layout`), each with its factor
        # (`merge.OuterGradient`); slices and factors fuse into the loops that read them.
        names = sorted(params)
        starts, _ = pack_layout([params[n].shape for n in names])
        grads = {
            name: packed[start : start + params[name].size].reshape(params[name].shape) * scales[i]
            for i, (name, start) in enumerate(zip(names, starts, strict=True))
        }
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
        self._views = _DeviceViews()

    @classmethod
    def from_config(cls, cfg: OuterOptimizerConfig) -> OuterOptimizer:
        return cls(cfg.lr, cfg.momentum, cfg.nesterov, per_round=cfg.momentum_per == "round")

    def init(self, fragment_params: Mapping[str, np.ndarray]) -> Any:
        return self.tx.init({k: jnp.asarray(v) for k, v in fragment_params.items()})

    def step(
        self,
        fragment_params: Mapping[str, np.ndarray],
        state: Any,
        merged_delta: Mapping[str, np.ndarray],
        share: float = 1.0,
    ) -> tuple[Params, Any]:
        """One outer step on a merged delta given as plain arrays (copied into one packed
        buffer first; the syncer's merges come packed, `step_gradient`). Returns new numpy
        params (fresh arrays, never aliasing inputs; views of the step's output buffers, so treat
        them as read-only)."""
        names = _same_leaves(fragment_params, merged_delta)
        packed, views = packed_empty([tuple(np.shape(merged_delta[n])) for n in names])
        for name, view in zip(names, views, strict=True):
            view[...] = merged_delta[name]
        return self._run(fragment_params, state, packed, [1.0] * len(names), share)

    def step_gradient(
        self,
        fragment_params: Mapping[str, np.ndarray],
        state: Any,
        grad: OuterGradient,
        share: float = 1.0,
    ) -> tuple[Params, Any]:
        """One outer step on a merge's gradient: its packed leaves reach the step in one
        transfer, and its per-leaf factors are applied there, in the loops that read them."""
        names = _same_leaves(fragment_params, grad.directions)
        return self._run(
            fragment_params, state, grad.packed, [grad.scales[n] for n in names], share
        )

    def _run(
        self,
        fragment_params: Mapping[str, np.ndarray],
        state: Any,
        packed: np.ndarray,
        scales: list[float],
        share: float,
    ) -> tuple[Params, Any]:
        params = {k: self._views.on_device(v) for k, v in fragment_params.items()}
        # Scalars and the short factor list go to the jitted call as numpy values: its own
        # argument handling is cheaper than a device_put each.
        new_params, new_state = self._step(
            params, state, _on_device(packed), np.asarray(scales, np.float32), np.float32(share)
        )
        return {k: self._views.host(v) for k, v in new_params.items()}, new_state

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
    return opt.step_gradient(fragment_params, state, grad, share)

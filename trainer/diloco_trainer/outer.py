"""The outer optimizer: Nesterov SGD (optax) per fragment on the syncer.

The merged delta (base - local, averaged over learners) is the outer *gradient*: SGD subtracts it,
which moves Theta toward where the learners went. Each fragment has its own optimizer state
because fragments step at different times.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

Params = dict[str, np.ndarray]


class OuterOptimizer:
    """optax.sgd(lr, momentum, nesterov) with one state per fragment and a jitted update."""

    def __init__(self, lr: float, momentum: float, nesterov: bool) -> None:
        self.tx = optax.sgd(learning_rate=lr, momentum=momentum or None, nesterov=nesterov)

        def _step(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
            updates, new_state = self.tx.update(grads, state, params)
            return optax.apply_updates(params, updates), new_state

        self._step: Callable[[Any, Any, Any], tuple[Any, Any]] = jax.jit(_step)

    def init(self, fragment_params: Mapping[str, np.ndarray]) -> Any:
        return self.tx.init({k: jnp.asarray(v) for k, v in fragment_params.items()})

    def step(
        self,
        fragment_params: Mapping[str, np.ndarray],
        state: Any,
        merged_delta: Mapping[str, np.ndarray],
    ) -> tuple[Params, Any]:
        """One outer step; returns new numpy params (fresh arrays, never aliasing inputs; views of
        the step's output buffers, so treat them as read-only)."""
        if sorted(fragment_params) != sorted(merged_delta):
            raise ValueError("outer step: merged delta leaves differ from the fragment's leaves")
        params = {k: jnp.asarray(v) for k, v in fragment_params.items()}
        grads = {k: jnp.asarray(merged_delta[k], dtype=jnp.float32) for k in params}
        new_params, new_state = self._step(params, state, grads)
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

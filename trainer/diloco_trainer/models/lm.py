"""What every causal language model here shares: the next-token loss over token windows."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross entropy of float logits (B, T, V) against int targets (B, T)."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)

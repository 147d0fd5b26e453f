"""A Flax Linen causal language model through the trainer's model API (`pip install '.[flax]'`).

    training:
      model: {entrypoint: diloco_trainer.models.flax_linen:build, args: {width: 128}, seqLen: 128}

`LinenModel` adapts any Linen module mapping int tokens (B, T) to logits (B, T, V): `init` is
the module's `init` on a dummy window, so leaf names are `params.<submodule>.<param>`; `loss`
is `apply`. Use it for your own module: `LinenModel(MyLM(...), context=...)`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from diloco_trainer.models.lm import next_token_loss


class Block(nn.Module):
    width: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + nn.MultiHeadDotProductAttention(self.heads)(nn.RMSNorm()(x), mask=mask)
        hidden = nn.gelu(nn.Dense(4 * self.width)(nn.RMSNorm()(x)))
        return x + nn.Dense(self.width)(hidden)


class TinyLM(nn.Module):
    """Pre-norm decoder with tied input/output embeddings."""

    vocab: int
    width: int
    depth: int
    heads: int
    context: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab, self.width)
        x = embed(tokens) + nn.Embed(self.context, self.width)(jnp.arange(tokens.shape[1]))
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.depth):
            x = Block(self.width, self.heads)(x, mask)
        return embed.attend(nn.RMSNorm()(x))


class LinenModel:
    """Any Linen token -> logits module as a `diloco_trainer.api.Model` (next-token loss)."""

    def __init__(self, module: nn.Module, context: int) -> None:
        self.module, self.context = module, context

    def init(self, rng: jax.Array) -> Any:
        return self.module.init(rng, jnp.zeros((1, self.context), jnp.int32))

    def loss(
        self, params: Any, batch: jax.Array, rng: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        logits: jax.Array = self.module.apply(params, batch[:, :-1])  # type: ignore[assignment]
        return next_token_loss(logits, batch[:, 1:]), {}


def build(
    vocab: int = 256, width: int = 128, depth: int = 2, heads: int = 4, context: int = 128
) -> LinenModel:
    return LinenModel(TinyLM(vocab, width, depth, heads, context), context)

"""A Flax NNX causal language model through the trainer's model API (`pip install '.[flax]'`).

    training:
      model: {entrypoint: diloco_trainer.models.flax_nnx:build, args: {width: 128, depth: 2},
              seqLen: 128}

`NnxModel` adapts any NNX module factory `rngs -> nnx.Module` (the module maps int tokens
(B, T) to logits (B, T, V)): `init` splits a fresh module and returns its parameters as a
plain nested dict, so leaf names are the module's attribute paths (`blocks.0.attn.query.kernel`);
`loss` rebuilds the module from those arrays inside the traced function. Use it for your own
module: `NnxModel(lambda rngs: MyLM(..., rngs=rngs))`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from diloco_trainer.models.lm import next_token_loss


class Block(nnx.Module):
    def __init__(self, width: int, heads: int, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.RMSNorm(width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
        self.ln2 = nnx.RMSNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class TinyLM(nnx.Module):
    """Pre-norm decoder with tied input/output embeddings."""

    def __init__(
        self, vocab: int, width: int, depth: int, heads: int, context: int, rngs: nnx.Rngs
    ) -> None:
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.pos = nnx.Embed(context, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, heads, rngs) for _ in range(depth)])
        self.ln = nnx.RMSNorm(width, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.embed.attend(self.ln(x))


class NnxModel:
    """Any NNX token -> logits module as a `diloco_trainer.api.Model` (next-token loss)."""

    def __init__(self, factory: Callable[[nnx.Rngs], nnx.Module]) -> None:
        self.factory = factory
        self.graphdef, self._abstract = nnx.split(nnx.eval_shape(lambda: factory(nnx.Rngs(0))))

    def init(self, rng: jax.Array) -> dict[str, Any]:
        return nnx.to_pure_dict(nnx.state(self.factory(nnx.Rngs(params=rng))))

    def module(self, params: dict[str, Any]) -> nnx.Module:
        state = jax.tree_util.tree_map(lambda leaf: leaf, self._abstract)  # a fresh copy
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def loss(
        self, params: dict[str, Any], batch: jax.Array, rng: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        logits = self.module(params)(batch[:, :-1])
        return next_token_loss(logits, batch[:, 1:]), {}


def build(
    vocab: int = 256, width: int = 128, depth: int = 2, heads: int = 4, context: int = 128
) -> NnxModel:
    return NnxModel(lambda rngs: TinyLM(vocab, width, depth, heads, context, rngs))

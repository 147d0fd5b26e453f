"""A small causal LM and a text data source, written the way a user outside the project would."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from diloco_trainer.models.flax_nnx import NnxModel
from flax import nnx


class TransformerBlock(nnx.Module):
    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, rngs: nnx.Rngs) -> None:
        self.attention = nnx.MultiHeadAttention(
            num_heads=num_heads, in_features=embed_dim, decode=False, rngs=rngs
        )
        self.norm1 = nnx.LayerNorm(embed_dim, rngs=rngs)
        self.norm2 = nnx.LayerNorm(embed_dim, rngs=rngs)
        self.ff1 = nnx.Linear(embed_dim, ff_dim, rngs=rngs)
        self.ff2 = nnx.Linear(ff_dim, embed_dim, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = self.norm1(x + self.attention(x, mask=mask))
        return self.norm2(x + self.ff2(nnx.relu(self.ff1(x))))


class MiniGPT(nnx.Module):
    def __init__(
        self,
        vocab: int,
        maxlen: int,
        embed_dim: int,
        num_heads: int,
        ff_dim: int,
        layers: int,
        rngs: nnx.Rngs,
    ) -> None:
        self.token_emb = nnx.Embed(vocab, embed_dim, rngs=rngs)
        self.pos_emb = nnx.Embed(maxlen, embed_dim, rngs=rngs)
        self.blocks = nnx.List(
            [TransformerBlock(embed_dim, num_heads, ff_dim, rngs) for _ in range(layers)]
        )
        self.output = nnx.Linear(embed_dim, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.token_emb(tokens) + self.pos_emb(jnp.arange(tokens.shape[1]))
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.output(x)


class Bigram(nnx.Module):
    def __init__(self, vocab: int, width: int, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.out = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.out(jax.nn.gelu(self.embed(tokens)))


class WindowMlp(nnx.Module):
    """Predicts each next byte from the previous `k` (zero-padded), an MLP without norms."""

    def __init__(self, vocab: int, width: int, k: int, hidden: int, rngs: nnx.Rngs) -> None:
        self.k = k
        self.tok = nnx.Embed(vocab, width, rngs=rngs)
        self.hidden = nnx.Linear(k * width, hidden, rngs=rngs)
        self.hidden2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.head = nnx.Linear(hidden, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.tok(tokens)
        t = x.shape[1]
        padded = jnp.pad(x, ((0, 0), (self.k - 1, 0), (0, 0)))
        ctx = jnp.concatenate([padded[:, i : i + t] for i in range(self.k)], axis=-1)
        h = jnp.tanh(self.hidden(ctx))
        h = jnp.tanh(self.hidden2(h))
        return self.head(h)


def build(
    vocab: int = 256,
    maxlen: int = 16,
    embed_dim: int = 64,
    num_heads: int = 4,
    ff_dim: int = 128,
    layers: int = 2,
    tokens: int | None = None,
    kind: str = "gpt",
    k: int = 4,
) -> NnxModel:
    if kind == "bigram":
        model = NnxModel(lambda rngs: Bigram(vocab, embed_dim, rngs))
    elif kind == "mlp":
        model = NnxModel(lambda rngs: WindowMlp(vocab, embed_dim, k, ff_dim, rngs))
    else:
        model = NnxModel(
            lambda rngs: MiniGPT(vocab, maxlen, embed_dim, num_heads, ff_dim, layers, rngs)
        )
    if tokens is not None:  # only to replay the old count (batch x seqLen)
        model.tokens_per_batch = tokens  # type: ignore[attr-defined]
    return model


_TEXT: dict[int, np.ndarray] = {}


def text_bytes(limit: int) -> np.ndarray:
    if limit not in _TEXT:
        root = os.path.dirname(os.__file__)
        parts, size = [], 0
        for path in (
            sorted(glob.glob(os.path.join(root, "email", "*.py")))
            + sorted(glob.glob(os.path.join(root, "json", "*.py")))
            + sorted(glob.glob(os.path.join(root, "http", "*.py")))
        ):
            data = Path(path).read_bytes()
            parts.append(data)
            size += len(data)
            if size >= limit:
                break
        _TEXT[limit] = np.frombuffer(b"".join(parts)[:limit], np.uint8).astype(np.int32)
    return _TEXT[limit]


def batches(
    shard: int,
    num_shards: int,
    *,
    seed: int,
    batch_size: int,
    split: str,
    position: int,
    window: int = 16,
    limit: int = 400_000,
) -> Iterator[np.ndarray]:
    text = text_bytes(limit)
    cut = int(len(text) * 0.95)
    if split == "eval":
        rng = np.random.default_rng(1234)
        held = text[cut:]
        while True:
            starts = rng.integers(0, len(held) - window, size=batch_size)
            yield np.stack([held[s : s + window] for s in starts])
    starts = np.arange(shard * window, cut - window, num_shards * window)
    starts = np.random.default_rng([seed, shard]).permutation(starts)
    for b in range(position, len(starts) // batch_size):
        chosen = starts[b * batch_size : (b + 1) * batch_size]
        yield np.stack([text[s : s + window] for s in chosen])


class Mlp(nnx.Module):
    def __init__(self, features: int, hidden: int, classes: int, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(features, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.l3 = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


class Classifier:
    def __init__(self, features: int = 16, hidden: int = 32, classes: int = 10) -> None:
        self.make = lambda rngs: Mlp(features, hidden, classes, rngs)
        self.graphdef, _ = nnx.split(nnx.eval_shape(lambda: self.make(nnx.Rngs(0))))

    def init(self, rng: jax.Array) -> dict[str, Any]:
        return nnx.to_pure_dict(nnx.state(self.make(nnx.Rngs(params=rng))))

    def loss(
        self, params: dict[str, Any], batch: dict[str, Any], rng: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        _, state = nnx.split(nnx.eval_shape(lambda: self.make(nnx.Rngs(0))))
        nnx.replace_by_pure_dict(state, params)
        logits = nnx.merge(self.graphdef, state)(batch["x"])
        logp = jax.nn.log_softmax(logits)
        loss = -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))
        acc = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
        return loss, {"accuracy": acc}


def classifier(**kw: int) -> Classifier:
    return Classifier(**kw)


def clusters(
    shard: int,
    num_shards: int,
    *,
    seed: int,
    batch_size: int,
    split: str,
    position: int,
    examples: int = 20_000,
    features: int = 16,
    classes: int = 10,
    noise: float = 1.5,
) -> Iterator[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    centers = rng.normal(size=(classes, features))
    n = examples + 2000
    y = rng.integers(0, classes, size=n)
    x = (centers[y] + noise * rng.normal(size=(n, features))).astype(np.float32)
    if split == "eval":
        for b in range(10**9):
            i = np.arange(b * batch_size, (b + 1) * batch_size) % 2000 + examples
            yield {"x": x[i], "y": y[i].astype(np.int32)}
    idx = np.random.default_rng([seed, shard]).permutation(np.arange(shard, examples, num_shards))
    for b in range(position, len(idx) // batch_size):
        i = idx[b * batch_size : (b + 1) * batch_size]
        yield {"x": x[i], "y": y[i].astype(np.int32)}

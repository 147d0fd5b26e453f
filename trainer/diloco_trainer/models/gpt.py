"""Decoder-only transformer LM in plain JAX over a flat ``name -> array`` parameter dict.

Why plain JAX and not flax: DiLoCo moves parameters around by *leaf name* (fragments are lists of
leaf names, the wire format is safetensors keyed by name, the syncer merges leaf by leaf). A flat
dict with dotted names is exactly that shape, so no pytree flattening/unflattening layer sits
between the model and the sync protocol, and the syncer (CPU-only) can build the same dict with
``init_params`` without importing a module system.

Architecture (GPT-2 style, pre-norm):
- ``embed`` (V, D) token embedding, **tied** to the output head: standard for small LMs, fewer
  parameters, and it keeps every vocabulary-sized matrix in the one leaf the syncer averages
  plainly (leaves whose name starts with ``embed`` are not RDA-merged).
- ``embed_pos`` (T, D) learned positional embedding (also an ``embed*`` leaf).
- per block i: ``blocks.i.ln1.scale``, ``blocks.i.attn.wqkv`` (D, 3, H, Dh),
  ``blocks.i.attn.wo`` (H, Dh, D), ``blocks.i.ln2.scale``, ``blocks.i.mlp.w_in`` (D, R*D),
  ``blocks.i.mlp.w_out`` (R*D, D); RMSNorm, causal multi-head attention, GELU MLP, no biases.
- ``ln_f.scale`` final RMSNorm.

The head count is part of the ``wqkv`` shape, so ``loss_fn(params, tokens)`` needs no config.
Initialisation: N(0, 0.02) everywhere, residual output projections (``wo``, ``w_out``) scaled by
1/sqrt(2 * n_layers) so the residual stream variance does not grow with depth (GPT-2).
Parameters are float32; ``compute_dtype`` (e.g. bfloat16) only changes the matmul inputs.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from diloco_trainer.config import ModelConfig
from diloco_trainer.models.lm import next_token_loss

Leaf = jax.Array | np.ndarray
Params = Mapping[str, Leaf]
INIT_STD = 0.02
NORM_EPS = 1e-6


def param_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every leaf's name and shape, in a fixed order."""
    d, h, v, t = model.width, model.heads, model.vocab, model.context
    hidden = model.mlp_ratio * d
    shapes: dict[str, tuple[int, ...]] = {"embed": (v, d), "embed_pos": (t, d)}
    for i in range(model.depth):
        shapes[f"blocks.{i}.ln1.scale"] = (d,)
        shapes[f"blocks.{i}.attn.wqkv"] = (d, 3, h, d // h)
        shapes[f"blocks.{i}.attn.wo"] = (h, d // h, d)
        shapes[f"blocks.{i}.ln2.scale"] = (d,)
        shapes[f"blocks.{i}.mlp.w_in"] = (d, hidden)
        shapes[f"blocks.{i}.mlp.w_out"] = (hidden, d)
    shapes["ln_f.scale"] = (d,)
    return shapes


def _leaf_rng(seed: int, name: str) -> np.random.Generator:
    # crc32, not hash(): str hashes are salted per process, and learner and syncer must agree.
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def init_params(model: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Float32 parameters, identical for the same (model, seed) in every process and machine."""
    residual_scale = 1.0 / np.sqrt(2.0 * model.depth)
    params: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(model).items():
        if name.endswith(".scale"):
            params[name] = np.ones(shape, np.float32)
            continue
        std = INIT_STD * (residual_scale if name.endswith(("attn.wo", "mlp.w_out")) else 1.0)
        params[name] = (_leaf_rng(seed, name).standard_normal(shape) * std).astype(np.float32)
    return params


def param_count(model: ModelConfig) -> int:
    """Parameters of the bundled GPT (param_shapes, counted without building them)."""
    d, v, t, hidden = model.width, model.vocab, model.context, model.mlp_ratio * model.width
    per_block = 2 * d + 3 * d * d + d * d + 2 * d * hidden
    return v * d + t * d + model.depth * per_block + d


def flops_per_token(model: ModelConfig) -> float:
    """Training FLOPs per token: 6 N for the weight matmuls (forward + backward) plus the
    attention score and value matmuls, 12 x layers x context x width."""
    return 6.0 * param_count(model) + 12.0 * model.depth * model.context * model.width


def count_params(params: Mapping[str, np.ndarray | jax.Array]) -> int:
    return sum(int(np.prod(p.shape)) for p in params.values())


def _rms_norm(x: jax.Array, scale: Leaf) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + NORM_EPS)
    return (normed * scale).astype(x.dtype)


def _attention(x: jax.Array, wqkv: Leaf, wo: Leaf) -> jax.Array:
    seq = x.shape[1]
    qkv = jnp.einsum("btd,dkhe->kbhte", x, wqkv.astype(x.dtype))
    q, k, v = qkv[0], qkv[1], qkv[2]
    scores = jnp.einsum("bhqe,bhke->bhqk", q, k).astype(jnp.float32) / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqk,bhke->bhqe", weights, v)
    return jnp.einsum("bhte,hed->btd", out, wo.astype(x.dtype))


def _num_blocks(params: Params) -> int:
    return sum(1 for name in params if name.endswith(".attn.wqkv"))


def logits_fn(
    params: Params, inputs: jax.Array, compute_dtype: jnp.dtype = jnp.float32
) -> jax.Array:
    """Next-token logits (B, T, V) in float32 for int32 token ids (B, T), T <= seq_len."""
    seq = inputs.shape[1]
    embed = params["embed"]
    x = (embed[inputs] + params["embed_pos"][:seq]).astype(compute_dtype)
    for i in range(_num_blocks(params)):
        pre = f"blocks.{i}."
        x = x + _attention(
            _rms_norm(x, params[pre + "ln1.scale"]),
            params[pre + "attn.wqkv"],
            params[pre + "attn.wo"],
        )
        hidden = _rms_norm(x, params[pre + "ln2.scale"]) @ params[pre + "mlp.w_in"].astype(x.dtype)
        x = x + jax.nn.gelu(hidden) @ params[pre + "mlp.w_out"].astype(x.dtype)
    x = _rms_norm(x, params["ln_f.scale"])
    return jnp.einsum("btd,vd->btv", x, embed.astype(x.dtype)).astype(jnp.float32)


def loss_fn(params: Params, tokens: jax.Array, compute_dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Mean next-token cross entropy over all positions of int32 windows (B, T+1)."""
    return next_token_loss(logits_fn(params, tokens[:, :-1], compute_dtype), tokens[:, 1:])


class Gpt:
    """The built-in transformer as a `diloco_trainer.api.Model`.

    `init` ignores its key: every leaf is drawn from (seed, crc32 of its name) with numpy, so the
    syncer builds the same starting parameters as the learners without compiling anything."""

    def __init__(self, config: ModelConfig, seed: int, compute_dtype: jnp.dtype = jnp.float32):
        self.config, self.seed, self.compute_dtype = config, seed, compute_dtype

    def init(self, rng: jax.Array | None = None) -> dict[str, np.ndarray]:
        return init_params(self.config, self.seed)

    def loss(
        self, params: Params, batch: jax.Array, rng: jax.Array | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        return loss_fn(params, batch, self.compute_dtype), {}

    @property
    def flops_per_token(self) -> float:
        return flops_per_token(self.config)


def build(seed: int = 0, **sizes: object) -> Gpt:
    """Entrypoint form (`diloco_trainer.models.gpt:build`): sizes as in `training.model`
    (`preset`, `vocabSize`, `dModel`, ...)."""
    return Gpt(ModelConfig.model_validate(sizes), seed)

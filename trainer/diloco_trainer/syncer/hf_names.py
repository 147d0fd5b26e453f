"""Hugging Face names for the bundled GPT's leaves: what `diloco export --names hf` writes.

The bundled GPT (`diloco_trainer.models.gpt`) has learned position embeddings, one fused q/k/v
projection, a plain (not gated) tanh-GELU MLP and an output head tied to the token embedding:
the layout of Hugging Face's GPT-2, not Llama's (rotary positions, separate q/k/v, gated MLP,
none of which it has). Its matrices are stored as ``x @ W``, (in, out), which is the orientation
of GPT-2's ``Conv1D`` weights, so no matrix is transposed: ``wqkv`` (D, 3, H, Dh) flattens to
``c_attn.weight`` (D, 3D) in GPT-2's q | k | v, head-major order and ``wo`` (H, Dh, D) to
``c_proj.weight`` (D, D).

It is not GPT-2 itself: its norms are RMSNorm (a scale, no mean subtraction, no bias, eps 1e-6)
where GPT-2 has LayerNorm with a bias, and no layer has a bias. No weights can express that, so
the export writes only the tensors the model has (no zero biases that would let transformers'
``GPT2LMHeadModel`` load the file and silently compute another function), and `hf_config`
says what the model is under a ``model_type`` transformers does not know.

Pure functions over numpy arrays: an export imports no JAX.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

NAMES = "hf-gpt2"
# The bundled GPT's constants (models/gpt.py, which imports JAX): a test keeps them equal.
NORM_EPS = 1e-6
ACTIVATION = "gelu_new"  # jax.nn.gelu's default, the tanh approximation, as GPT-2's gelu_new
HINT = (
    "--names hf covers only the bundled GPT (diloco_trainer.models.gpt); "
    "export other models with --names pytree"
)


class HfNamingError(ValueError):
    """Parameters that are not the bundled GPT's; the message names the leaf."""


@dataclass(frozen=True)
class GptSizes:
    vocab: int
    context: int
    width: int
    heads: int
    depth: int
    hidden: int


def _block(i: int, leaf: str) -> str:
    return f"blocks.{i}.{leaf}"


def gpt_layout(s: GptSizes) -> dict[str, tuple[int, ...]]:
    """Every leaf of the bundled GPT of these sizes (as `models.gpt.param_shapes` builds it)."""
    d, h = s.width, s.heads
    shapes: dict[str, tuple[int, ...]] = {"embed": (s.vocab, d), "embed_pos": (s.context, d)}
    for i in range(s.depth):
        shapes[_block(i, "ln1.scale")] = (d,)
        shapes[_block(i, "attn.wqkv")] = (d, 3, h, d // h)
        shapes[_block(i, "attn.wo")] = (h, d // h, d)
        shapes[_block(i, "ln2.scale")] = (d,)
        shapes[_block(i, "mlp.w_in")] = (d, s.hidden)
        shapes[_block(i, "mlp.w_out")] = (s.hidden, d)
    shapes["ln_f.scale"] = (d,)
    return shapes


def _dims(params: Mapping[str, Any], name: str, rank: int) -> tuple[int, ...]:
    if name not in params:
        raise HfNamingError(f"leaf {name} is missing: {HINT}")
    shape = tuple(int(n) for n in np.shape(params[name]))
    if len(shape) != rank:
        raise HfNamingError(f"leaf {name} has shape {shape}, not {rank}-dimensional: {HINT}")
    return shape


def gpt_sizes(params: Mapping[str, Any]) -> GptSizes:
    """The sizes of the bundled GPT that `params` is, read off its tree; HfNamingError naming
    the first leaf that is unknown, missing or of another shape than those sizes give."""
    # Unknown names first: another model is told which of its leaves has no counterpart,
    # rather than that `embed` is missing.
    matches = {name: LEAF.fullmatch(name) for name in params}
    for name, match in matches.items():
        if match is None:
            raise HfNamingError(f"leaf {name} has no Hugging Face GPT-2 counterpart: {HINT}")
    depth = 1 + max((int(m.group(1)) for m in matches.values() if m and m.group(1)), default=-1)
    vocab, width = _dims(params, "embed", 2)
    _, _, heads, _ = _dims(params, _block(0, "attn.wqkv"), 4)
    sizes = GptSizes(
        vocab=vocab,
        context=_dims(params, "embed_pos", 2)[0],
        width=width,
        heads=heads,
        depth=depth,
        hidden=_dims(params, _block(0, "mlp.w_in"), 2)[1],
    )
    layout = gpt_layout(sizes)
    for name, leaf in params.items():
        if name not in layout:
            raise HfNamingError(f"leaf {name} has no Hugging Face GPT-2 counterpart: {HINT}")
        if tuple(np.shape(leaf)) != layout[name]:
            raise HfNamingError(
                f"leaf {name} has shape {tuple(np.shape(leaf))}, the bundled GPT of width "
                f"{width} and {heads} heads has {layout[name]}: {HINT}"
            )
    for name in layout:
        if name not in params:
            raise HfNamingError(f"leaf {name} is missing: {HINT}")
    return sizes


def _flat_in_out(leaf: np.ndarray) -> np.ndarray:
    """(in..., out) -> (in, out) for wqkv (D, 3, H, Dh) and wo (H, Dh, D): a reshape, not a
    transpose, because both already keep GPT-2's element order."""
    if leaf.ndim == 4:  # wqkv: the input axis first, then q|k|v, heads, head dims
        return leaf.reshape(leaf.shape[0], -1)
    return leaf.reshape(-1, leaf.shape[-1])  # wo: heads and head dims are the input axis


def _same(leaf: np.ndarray) -> np.ndarray:
    return leaf


BLOCK_NAMES: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
    "ln1.scale": ("ln_1.weight", _same),
    "attn.wqkv": ("attn.c_attn.weight", _flat_in_out),
    "attn.wo": ("attn.c_proj.weight", _flat_in_out),
    "ln2.scale": ("ln_2.weight", _same),
    "mlp.w_in": ("mlp.c_fc.weight", _same),
    "mlp.w_out": ("mlp.c_proj.weight", _same),
}
TOP_NAMES = {"embed": "transformer.wte.weight", "embed_pos": "transformer.wpe.weight"}
# Any leaf name the bundled GPT can have; group 1 is a block's index.
LEAF = re.compile(
    r"embed|embed_pos|ln_f\.scale|blocks\.(\d+)\.(?:"
    + "|".join(re.escape(leaf) for leaf in BLOCK_NAMES)
    + ")"
)


def hf_gpt2_tensors(params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The bundled GPT's leaves under Hugging Face GPT-2 names, in GPT-2's order. There is no
    ``lm_head.weight``: the head is tied to ``transformer.wte.weight``, as in GPT-2's own
    files. HfNamingError when `params` is not the bundled GPT."""
    sizes = gpt_sizes(params)
    out = {hf: np.asarray(params[name]) for name, hf in TOP_NAMES.items()}
    for i in range(sizes.depth):
        for leaf, (hf, reshape) in BLOCK_NAMES.items():
            out[f"transformer.h.{i}.{hf}"] = reshape(np.asarray(params[_block(i, leaf)]))
    out["transformer.ln_f.weight"] = np.asarray(params["ln_f.scale"])
    return out


def hf_config(sizes: GptSizes) -> dict[str, Any]:
    """config.json for the exported tensors: GPT-2's field names for the sizes, and a
    ``model_type`` transformers does not know, so that `AutoConfig` refuses the directory
    instead of building a GPT-2 (LayerNorm, biases) that would compute something else."""
    return {
        "model_type": "diloco-gpt",
        "diloco_names": NAMES,
        "description": (
            "Tensor names and shapes follow Hugging Face GPT-2 (Conv1D weights are (in, out); "
            "lm_head tied to transformer.wte). Not GPT-2: every norm is RMSNorm (scale only, no "
            "mean subtraction, no bias) and no layer has a bias."
        ),
        "vocab_size": sizes.vocab,
        "n_positions": sizes.context,
        "n_embd": sizes.width,
        "n_layer": sizes.depth,
        "n_head": sizes.heads,
        "n_inner": sizes.hidden,
        "activation_function": ACTIVATION,
        "normalization": "rmsnorm",
        "layer_norm_epsilon": NORM_EPS,
        "bias": False,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }

"""Hugging Face GPT-2 names for the bundled GPT (`diloco export --names hf`).

transformers is not a dependency, so the layout is checked by a forward pass written here
against GPT-2's tensors as transformers' GPT-2 uses them (Conv1D: ``x @ W``, c_attn split into
q, k, v, heads by a view), with RMSNorm where GPT-2 has LayerNorm: it must give the bundled
model's own logits.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from diloco_trainer.config import ModelConfig
from diloco_trainer.models import gpt
from diloco_trainer.syncer.hf_names import (
    NORM_EPS,
    GptSizes,
    HfNamingError,
    gpt_layout,
    gpt_sizes,
    hf_config,
    hf_gpt2_tensors,
)

MODEL = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, seq_len=8, mlp_ratio=3)


def _params(model: ModelConfig = MODEL) -> dict[str, np.ndarray]:
    """Values far from the init's small ones, so that any misplaced element shows."""
    rng = np.random.default_rng(0)
    return {
        name: (rng.standard_normal(shape) * 0.3 + (1.0 if name.endswith("scale") else 0.0)).astype(
            np.float32
        )
        for name, shape in gpt.param_shapes(model).items()
    }


def _norm(x: np.ndarray, weight: np.ndarray, layer_norm: bool) -> np.ndarray:
    if layer_norm:  # GPT-2's: mean subtracted (its bias, zero here, would be added)
        x = x - x.mean(-1, keepdims=True)
        return x / np.sqrt(x.var(-1, keepdims=True) + NORM_EPS) * weight
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + NORM_EPS) * weight


def _gelu_new(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _gpt2_logits(
    hf: dict[str, np.ndarray], tokens: np.ndarray, n_head: int, layer_norm: bool = False
) -> np.ndarray:
    """GPT-2's forward over its own tensor names, without biases."""
    x = hf["transformer.wte.weight"][tokens] + hf["transformer.wpe.weight"][: tokens.shape[1]]
    b, t, d = x.shape
    causal = np.tril(np.ones((t, t), bool))
    layers = sum(1 for name in hf if name.endswith(".attn.c_attn.weight"))
    for i in range(layers):
        p = f"transformer.h.{i}."
        qkv = _norm(x, hf[p + "ln_1.weight"], layer_norm) @ hf[p + "attn.c_attn.weight"]
        q, k, v = (
            part.reshape(b, t, n_head, d // n_head).transpose(0, 2, 1, 3)
            for part in np.split(qkv, 3, axis=-1)
        )
        scores = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // n_head), -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        heads = (weights @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        x = x + heads @ hf[p + "attn.c_proj.weight"]
        hidden = _norm(x, hf[p + "ln_2.weight"], layer_norm) @ hf[p + "mlp.c_fc.weight"]
        x = x + _gelu_new(hidden) @ hf[p + "mlp.c_proj.weight"]
    x = _norm(x, hf["transformer.ln_f.weight"], layer_norm)
    return x @ hf["transformer.wte.weight"].T  # the tied head


def _tokens() -> np.ndarray:
    return np.random.default_rng(1).integers(0, MODEL.vocab, (2, MODEL.context))


def test_gpt2_names_computed_as_gpt2_with_rmsnorm_give_the_models_logits() -> None:
    params = _params()
    hf = {k: v.astype(np.float64) for k, v in hf_gpt2_tensors(params).items()}
    ours = np.asarray(gpt.logits_fn(params, jax.numpy.asarray(_tokens())))
    np.testing.assert_allclose(_gpt2_logits(hf, _tokens(), MODEL.heads), ours, atol=2e-4)


def test_gpt2s_own_layernorm_would_compute_another_function() -> None:
    """Why the export does not call itself GPT-2 (and writes no zero biases to load as one)."""
    params = _params()
    hf = {k: v.astype(np.float64) for k, v in hf_gpt2_tensors(params).items()}
    ours = np.asarray(gpt.logits_fn(params, jax.numpy.asarray(_tokens())))
    as_gpt2 = _gpt2_logits(hf, _tokens(), MODEL.heads, layer_norm=True)
    assert np.abs(as_gpt2 - ours).max() > 1e-2


def test_the_names_shapes_and_order_are_gpt2s_with_no_head_and_no_biases() -> None:
    hf = hf_gpt2_tensors(_params())
    d, hidden = MODEL.width, MODEL.mlp_ratio * MODEL.width
    block = {
        "ln_1.weight": (d,),
        "attn.c_attn.weight": (d, 3 * d),
        "attn.c_proj.weight": (d, d),
        "ln_2.weight": (d,),
        "mlp.c_fc.weight": (d, hidden),
        "mlp.c_proj.weight": (hidden, d),
    }
    assert {name: leaf.shape for name, leaf in hf.items()} == {
        "transformer.wte.weight": (MODEL.vocab, d),
        "transformer.wpe.weight": (MODEL.context, d),
        **{f"transformer.h.{i}.{n}": s for i in range(MODEL.depth) for n, s in block.items()},
        "transformer.ln_f.weight": (d,),
    }


def test_the_layout_and_constants_are_the_bundled_models() -> None:
    for model in (MODEL, ModelConfig(preset="small"), ModelConfig(preset="100m")):
        sizes = GptSizes(
            model.vocab,
            model.context,
            model.width,
            model.heads,
            model.depth,
            model.mlp_ratio * model.width,
        )
        assert gpt_layout(sizes) == gpt.param_shapes(model)
    assert NORM_EPS == gpt.NORM_EPS
    assert gpt_sizes(_params()) == GptSizes(32, 8, 16, 4, 2, 48)


def test_the_config_gives_the_sizes_and_is_not_a_gpt2_config() -> None:
    config = hf_config(gpt_sizes(_params()))
    assert config["model_type"] != "gpt2" and "architectures" not in config
    sizes = {k: config[k] for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")}
    assert sizes == {"vocab_size": 32, "n_positions": 8, "n_embd": 16, "n_layer": 2, "n_head": 4}
    assert (config["n_inner"], config["normalization"], config["bias"]) == (48, "rmsnorm", False)
    assert config["layer_norm_epsilon"] == NORM_EPS and config["tie_word_embeddings"] is True


def _without(name: str) -> dict[str, np.ndarray]:
    params = _params()
    del params[name]
    return params


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (
            {"params.Dense_0.kernel": np.zeros((2, 3), np.float32)},
            "leaf params.Dense_0.kernel has no Hugging Face GPT-2 counterpart",
        ),
        (
            {**_params(), "blocks.0.attn.bias": np.zeros(3, np.float32)},
            "leaf blocks.0.attn.bias has no Hugging Face GPT-2 counterpart",
        ),
        (_without("blocks.1.mlp.w_out"), "leaf blocks.1.mlp.w_out is missing"),
        (_without("ln_f.scale"), "leaf ln_f.scale is missing"),
        (
            {**_params(), "blocks.1.attn.wo": np.zeros((2, 8, 16), np.float32)},
            "leaf blocks.1.attn.wo has shape (2, 8, 16), the bundled GPT of width 16 and 4 "
            "heads has (4, 4, 16)",
        ),
        (
            {**_params(), "embed": np.zeros(16, np.float32)},
            "leaf embed has shape (16,), not 2-dimensional",
        ),
    ],
)
def test_anything_but_the_bundled_gpt_is_refused_naming_the_leaf(
    params: dict[str, np.ndarray], message: str
) -> None:
    with pytest.raises(HfNamingError) as err:
        hf_gpt2_tensors(params)
    assert message in str(err.value)
    assert "--names hf covers only the bundled GPT" in str(err.value)

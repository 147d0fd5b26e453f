"""The transformer: deterministic init, shapes, causality, tied head, dtype option."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from diloco_trainer.config import ModelConfig
from diloco_trainer.models.gpt import count_params, init_params, logits_fn, loss_fn, param_shapes

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16)


def test_init_is_deterministic_per_seed_and_float32() -> None:
    a, b, c = init_params(TINY, 7), init_params(TINY, 7), init_params(TINY, 8)
    assert list(a) == list(b) == list(param_shapes(TINY))
    for name in a:
        assert a[name].dtype == np.float32
        np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(a["embed"], c["embed"])


def test_leaf_names_shapes_and_embedding_prefix() -> None:
    params = init_params(TINY, 0)
    assert params["embed"].shape == (256, 32)
    assert params["embed_pos"].shape == (16, 32)
    assert params["blocks.1.attn.wqkv"].shape == (32, 3, 4, 8)
    assert params["blocks.1.mlp.w_in"].shape == (32, 128)
    # Only the two embedding tables may start with "embed": the syncer averages those plainly.
    assert sorted(n for n in params if n.startswith("embed")) == ["embed", "embed_pos"]
    expected = 256 * 32 + 16 * 32 + 2 * (32 * 96 + 32 * 32 + 2 * 32 * 128 + 2 * 32) + 32
    assert count_params(params) == expected


def test_residual_projections_are_scaled_down() -> None:
    params = init_params(ModelConfig(d_model=64, n_layers=8, n_heads=4, seq_len=16), 0)
    assert params["blocks.0.attn.wo"].std() < 0.5 * params["blocks.0.attn.wqkv"].std()


def test_future_tokens_do_not_change_earlier_logits() -> None:
    params = init_params(TINY, 0)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
    changed = tokens.copy()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    before = np.asarray(logits_fn(params, jnp.asarray(tokens)))
    after = np.asarray(logits_fn(params, jnp.asarray(changed)))
    assert before.shape == (2, 16, 256)
    np.testing.assert_allclose(before[:, :10], after[:, :10], atol=1e-6)
    assert np.abs(before[:, 10:] - after[:, 10:]).max() > 1e-4


def test_initial_loss_is_near_uniform_and_bf16_agrees() -> None:
    params = init_params(TINY, 0)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (4, 17)), dtype=jnp.int32)
    loss = float(jax.jit(loss_fn)(params, tokens))
    assert loss == pytest.approx(np.log(256), rel=0.05)
    loss_bf16 = float(jax.jit(loss_fn, static_argnums=2)(params, tokens, jnp.bfloat16))
    assert loss_bf16 == pytest.approx(loss, rel=0.02)

"""Held-out loss of a parameter dict (used by the syncer on the global model, and by tests)."""

from __future__ import annotations

import json
from collections.abc import Mapping

import jax
import numpy as np

from diloco_trainer.config import TrainingConfig
from diloco_trainer.data.corpus import eval_batches
from diloco_trainer.models.gpt import loss_fn

# One jitted function per process; XLA caches one executable per (param shapes, batch shape).
_jit_loss = jax.jit(loss_fn)
_batch_cache: dict[str, list[np.ndarray]] = {}


def _cached_eval_batches(cfg: TrainingConfig, count: int) -> list[np.ndarray]:
    # Only the fields that change which tokens are drawn key the cache.
    key = json.dumps([cfg.data.to_wire(), cfg.model.to_wire(), cfg.seed, count], sort_keys=True)
    if key not in _batch_cache:
        _batch_cache[key] = eval_batches(cfg, count)
    return _batch_cache[key]


def eval_loss(
    params: Mapping[str, np.ndarray | jax.Array], cfg: TrainingConfig, batches: int | None = None
) -> float:
    """Mean next-token loss over `batches` (default cfg.eval.batches) fixed held-out batches."""
    count = batches or cfg.eval.batches
    device_params = {name: jax.numpy.asarray(value) for name, value in params.items()}
    losses = [_jit_loss(device_params, batch) for batch in _cached_eval_batches(cfg, count)]
    return float(np.mean([float(loss) for loss in losses]))

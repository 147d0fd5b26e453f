"""Held-out loss of flat parameters (the syncer on the global model; tests; benches)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from diloco_trainer.api import Batch
from diloco_trainer.config import TrainingConfig
from diloco_trainer.workload.check import Workload, prepared
from diloco_trainer.workload.entrypoints import eval_batches


class Evaluator:
    """The mean loss over the run's first `count` held-out batches, the same ones every time
    (fetched once); the loss jit-compiled once per process."""

    def __init__(self, workload: Workload, cfg: TrainingConfig) -> None:
        self.workload, self.cfg = workload, cfg
        self._loss = jax.jit(workload.flat_loss())
        self._key = jax.random.key(cfg.seed)
        self._batches: list[Batch] = []

    def batches(self, count: int) -> list[Batch]:
        if len(self._batches) < count:
            self._batches = eval_batches(self.workload.source, count, self.cfg)
        return self._batches[:count]

    def __call__(self, params: Mapping[str, Any], count: int | None = None) -> float:
        device_params = {name: jax.numpy.asarray(value) for name, value in params.items()}
        losses = [
            float(self._loss(device_params, batch, self._key)[0])
            for batch in self.batches(count or self.cfg.eval.batches)
        ]
        return float(np.mean(losses))


_evaluators: dict[str, Evaluator] = {}


def eval_loss(
    params: Mapping[str, np.ndarray | jax.Array], cfg: TrainingConfig, batches: int | None = None
) -> float:
    """Mean held-out loss of `params` under `cfg`'s model and data (one evaluator per config)."""
    key = cfg.model_dump_json()
    if key not in _evaluators:
        _evaluators[key] = Evaluator(prepared(cfg), cfg)
    return _evaluators[key](params, batches)

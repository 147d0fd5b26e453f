"""Everything about a run's model and data that can be wrong, found before anything starts.

`prepare(cfg)` builds the model and data source and checks them by abstract evaluation
(`jax.eval_shape`: shapes only, nothing compiled, no device memory): `init` gives the same
leaves on a second call, every leaf has a unique dotted name, one held-out batch has
`data.batchSize` rows, and `loss` returns a scalar and a dict of scalars. The learner, the syncer
and `diloco local run` call it first, so a bad entrypoint is one message and exit code 2.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from diloco_trainer.api import Batch, DataSource, EntrypointError, Model
from diloco_trainer.config import TrainingConfig
from diloco_trainer.workload.entrypoints import (
    DATA_FIELD,
    MODEL_FIELD,
    build_data_source,
    build_model,
    data_field,
    first_batches,
)
from diloco_trainer.workload.pytree import LeafNameError, flatten, unflatten

Shapes = dict[str, tuple[int, ...]]
FlatLoss = Callable[[Mapping[str, Any], Batch, Any], tuple[Any, Any]]


@dataclass(frozen=True)
class Workload:
    """A checked model and data source, and what the trainer needs to know of them."""

    model: Model
    source: DataSource
    template: Any  # the params pytree of ShapeDtypeStructs: unflatten's template
    shapes: Shapes  # leaf name -> shape, in the pytree's leaf order
    seed: int

    def initial_params(self) -> dict[str, np.ndarray]:
        """The starting global parameters, flat, as float32 numpy (what the syncer serves)."""
        tree = self.model.init(jax.random.key(self.seed))
        return {name: np.asarray(leaf, np.float32) for name, leaf in flatten(tree).items()}

    def placeholders(self) -> dict[str, np.ndarray]:
        """Zero-stride float32 stand-ins for the parameters (no memory), with the names of
        `initial_params` (not its order: `eval_shape` sorts dict keys): for a process that takes
        every value from elsewhere."""
        return {
            name: np.broadcast_to(np.float32(0), tuple(leaf.shape))
            for name, leaf in flatten(self.template).items()
        }

    def flat_loss(self) -> FlatLoss:
        """The model's loss over the flat `name -> array` dict the trainer keeps."""
        model, template = self.model, self.template

        def loss(params: Mapping[str, Any], batch: Batch, rng: Any) -> tuple[Any, Any]:
            return model.loss(unflatten(template, params), batch, rng)

        return loss

    @property
    def flops_per_token(self) -> float | None:
        value = getattr(self.model, "flops_per_token", None)
        return float(value) if value else None


def _abstract(fn: Any, field: str, what: str, *args: Any) -> Any:
    try:
        return jax.eval_shape(fn, *args)
    except EntrypointError:
        raise
    except Exception as exc:
        raise EntrypointError(f"{field}: {what} failed: {type(exc).__name__}: {exc}") from exc


def _shapes(tree: Any, spec: str) -> Shapes:
    try:
        named = flatten(tree)
    except LeafNameError as exc:
        raise EntrypointError(f"{MODEL_FIELD}: {spec}: {exc}") from exc
    if not named:
        raise EntrypointError(f"{MODEL_FIELD}: {spec}: init returned no parameters")
    return {name: tuple(int(d) for d in leaf.shape) for name, leaf in named.items()}


def _check_batch(batch: Batch, rows: int) -> None:
    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves:
        raise EntrypointError(f"{DATA_FIELD}: a batch has no arrays")
    for leaf in leaves:
        shape = np.shape(leaf)
        if not shape or shape[0] != rows:
            raise EntrypointError(
                f"{DATA_FIELD}: batch arrays need data.batchSize={rows} rows on axis 0; "
                f"one has shape {tuple(shape)}"
            )


def _check_loss(out: Any, spec: str) -> None:
    ok = isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping)
    if not ok:
        raise EntrypointError(
            f"{MODEL_FIELD}: {spec}: loss must return (scalar loss, dict of metrics), got "
            f"{type(out).__name__}"
        )
    loss, metrics = out
    if getattr(loss, "shape", None) != ():
        raise EntrypointError(
            f"{MODEL_FIELD}: {spec}: loss must be a scalar, got shape {getattr(loss, 'shape', '?')}"
        )
    bad = [k for k, v in metrics.items() if getattr(v, "shape", None) != ()]
    if bad:
        raise EntrypointError(f"{MODEL_FIELD}: {spec}: metrics must be scalars; not: {bad[:5]}")


def prepare(cfg: TrainingConfig) -> Workload:
    """The run's checked workload, or an `EntrypointError` naming the field at fault."""
    spec = cfg.model.entrypoint or "the built-in model"
    model, source = build_model(cfg), build_data_source(cfg)
    key = jax.random.key(cfg.seed)
    template = _abstract(model.init, MODEL_FIELD, f"{spec}: init", key)
    shapes = _shapes(template, spec)
    again = _shapes(_abstract(model.init, MODEL_FIELD, f"{spec}: init", key), spec)
    if again != shapes:
        raise EntrypointError(
            f"{MODEL_FIELD}: {spec}: init returned different parameters on a second call "
            "(names or shapes changed); the structure must be fixed"
        )
    (batch,) = first_batches(
        source, 1, data_field(cfg), shard=0, num_shards=1, seed=cfg.seed,
        batch_size=cfg.data.batch_size, split="eval", position=0,
    )  # fmt: skip
    _check_batch(batch, cfg.data.batch_size)
    _check_loss(_abstract(model.loss, MODEL_FIELD, f"{spec}: loss", template, batch, key), spec)
    return Workload(model, source, template, shapes, cfg.seed)


_prepared: dict[str, Workload] = {}


def prepared(cfg: TrainingConfig) -> Workload:
    """`prepare(cfg)` once per process and config: the syncer's starting parameters and its
    evaluations share one checked workload instead of importing and checking it twice."""
    key = cfg.model_dump_json()
    if key not in _prepared:
        _prepared[key] = prepare(cfg)
    return _prepared[key]

"""Everything about a run's model and data that can be wrong, found before anything starts.

`prepare(cfg)` builds the model and data source and checks them by abstract evaluation
(`jax.eval_shape`: shapes only, nothing compiled, no device memory): `init` gives the same
leaves on a second call, every leaf has a unique dotted name, one held-out batch has
`data.batchSize` rows, and `loss` returns a scalar and a dict of scalars. The learner, the syncer
and `diloco local run` call it first, so a bad entrypoint is one message and exit code 2.

The same held-out batch says how many tokens a step trains on (`batch_tokens`): learners count
their steps' tokens with it and the syncer checks pushes against it, so both take it from
`Workload.tokens_per_step` and get the same integer.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import jax
import numpy as np

from diloco_trainer.api import Batch, DataSource, EntrypointError, Model
from diloco_trainer.config import TrainingConfig
from diloco_trainer.phases import phase
from diloco_trainer.workload.entrypoints import (
    DATA_FIELD,
    MODEL_FIELD,
    build_data_source,
    build_model,
    eval_batches,
)
from diloco_trainer.workload.pytree import LeafNameError, flatten, unflatten

log = logging.getLogger(__name__)
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
    tokens_per_step: int  # `batch_tokens` of one batch of `data.batchSize` rows

    def initial_params(self, only: Collection[str] | None = None) -> dict[str, np.ndarray]:
        """The starting global parameters, flat, as float32 numpy (what the syncer serves).
        `only`: just these leaves (a syncer shard), computed under `jit` so that the others are
        never materialised: XLA drops the work whose results are not returned. The values are
        the eager init's, bit for bit (the random bits and the ops are the same)."""
        key = jax.random.key(self.seed)
        if only is None:
            tree = self.model.init(key)
            return {name: np.asarray(leaf, np.float32) for name, leaf in flatten(tree).items()}
        wanted = sorted(only)

        def pick(key: Any) -> dict[str, Any]:
            flat = flatten(self.model.init(key))
            return {name: flat[name] for name in wanted}

        return {name: np.asarray(leaf, np.float32) for name, leaf in jax.jit(pick)(key).items()}

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


TOKENS_ATTRIBUTE = "tokens_per_batch"


def _declared_tokens(owner: Any, batch: Batch, field: str) -> int | None:
    """What `owner` (the model, or the data source: for one with bound args, the callable
    inside) says a batch holds, or None when it says nothing."""
    if isinstance(owner, functools.partial):
        owner = owner.func
    declared = getattr(owner, TOKENS_ATTRIBUTE, None)
    if declared is None:
        return None
    what = TOKENS_ATTRIBUTE
    if callable(declared):
        what = f"{TOKENS_ATTRIBUTE}(batch)"
        try:
            declared = declared(batch)
        except Exception as exc:
            raise EntrypointError(f"{field}: {what} failed: {type(exc).__name__}: {exc}") from exc
    # numpy integers count as ints, bools do not (a True would silently mean 1 token).
    if isinstance(declared, bool) or not isinstance(declared, Integral) or int(declared) < 1:
        raise EntrypointError(
            f"{field}: {what} gave {declared!r}; it must be a positive int (the tokens one "
            "batch of data.batchSize rows holds)"
        )
    return int(declared)


def batch_tokens(model: Model, source: DataSource, batch: Batch, rows: int) -> int:
    """The tokens one step trains on, from one batch of `rows` rows, the first rule that applies:

    1. the model's `tokens_per_batch` (an int, or a method taking the batch);
    2. the data source's `tokens_per_batch` (the built-in source: rows x seqLen);
    3. the number of elements of the batch's integer arrays (token ids), all of the same size;
       integer arrays of different sizes are refused as ambiguous;
    4. with no integer array (features, not tokens): one token per row.
    """
    for owner, field in ((model, MODEL_FIELD), (source, DATA_FIELD)):
        declared = _declared_tokens(owner, batch, field)
        if declared is not None:
            return declared
    paths_leaves, _ = jax.tree_util.tree_flatten_with_path(batch)
    integer = {
        jax.tree_util.keystr(path) or "the batch": tuple(int(d) for d in np.shape(leaf))
        for path, leaf in paths_leaves
        if np.issubdtype(np.asarray(leaf).dtype, np.integer)
    }
    sizes = {math.prod(shape) for shape in integer.values()}
    if len(sizes) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in list(integer.items())[:5])
        raise EntrypointError(
            f"{DATA_FIELD}: the batch's integer arrays differ in size ({listed}), so which of "
            f"them are its tokens is ambiguous; give the model or the data source "
            f"`{TOKENS_ATTRIBUTE}(batch) -> int` (docs/library.md, 'Tokens per step')"
        )
    return sizes.pop() if sizes else rows


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


def _check_model(cfg: TrainingConfig, spec: str, key: Any) -> tuple[Model, Any, Shapes]:
    model = build_model(cfg)
    template = _abstract(model.init, MODEL_FIELD, f"{spec}: init", key)
    shapes = _shapes(template, spec)
    again = _shapes(_abstract(model.init, MODEL_FIELD, f"{spec}: init", key), spec)
    if again != shapes:
        raise EntrypointError(
            f"{MODEL_FIELD}: {spec}: init returned different parameters on a second call "
            "(names or shapes changed); the structure must be fixed"
        )
    return model, template, shapes


def _check_data(cfg: TrainingConfig) -> tuple[DataSource, Batch]:
    source = build_data_source(cfg)
    (batch,) = eval_batches(source, 1, cfg)
    _check_batch(batch, cfg.data.batch_size)
    return source, batch


def prepare(cfg: TrainingConfig) -> Workload:
    """The run's checked workload, or an `EntrypointError` naming the field at fault. Logged as
    phase `workload_check`, holding `model_build` (the model entrypoint and its abstract init)
    and `data_index` (the data source's first call, where a source builds its index, up to
    its first held-out batch)."""
    spec = cfg.model.entrypoint or "the built-in model"
    key = jax.random.key(cfg.seed)
    with phase(log, "workload_check"):
        with phase(log, "model_build"):
            model, template, shapes = _check_model(cfg, spec, key)
        with phase(log, "data_index"):
            source, batch = _check_data(cfg)
        loss = _abstract(model.loss, MODEL_FIELD, f"{spec}: loss", template, batch, key)
        _check_loss(loss, spec)
        tokens = batch_tokens(model, source, batch, cfg.data.batch_size)
    return Workload(model, source, template, shapes, cfg.seed, tokens)


_prepared: dict[str, Workload] = {}


def prepared(cfg: TrainingConfig) -> Workload:
    """`prepare(cfg)` once per process and config: the syncer's starting parameters and its
    evaluations share one checked workload instead of importing and checking it twice."""
    key = cfg.model_dump_json()
    if key not in _prepared:
        _prepared[key] = prepare(cfg)
    return _prepared[key]


def tokens_per_step(cfg: TrainingConfig) -> int:
    """The tokens of one inner step of one unit (`batch_tokens`): what learners count and what the
    syncer holds their counts to."""
    return prepared(cfg).tokens_per_step

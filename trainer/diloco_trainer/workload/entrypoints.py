"""The run's model and data source, from the manifest's entrypoints or the built-in ones.

`training.model.entrypoint: my_pkg.models:build` imports `my_pkg.models` and calls `build(**args)`;
it must return an object with `init` and `loss` (`diloco_trainer.api.Model`). A data entrypoint
names the data source itself (a callable), whose `args` are bound here. Without entrypoints the
built-in transformer (`models.gpt.Gpt`) and token source (`data.tokens.StreamSource`) serve, through the same
interfaces. Every failure is an `EntrypointError` whose message starts with the manifest field.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from diloco_trainer.api import Batch, DataSource, EntrypointError, Model
from diloco_trainer.config import TrainingConfig
from diloco_trainer.data.tokens import StreamSource
from diloco_trainer.models.gpt import Gpt

MODEL_FIELD = "training.model.entrypoint"
DATA_FIELD = "training.data.entrypoint"


def resolve(spec: str, field: str) -> Any:
    """The object `module:attr.sub` names, or an error naming `field` and what went wrong."""
    module_name, _, attr_path = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code is the user's to see
        raise EntrypointError(
            f"{field}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError:
            raise EntrypointError(
                f"{field}: {spec!r}: module {module_name!r} has no attribute {attr_path!r}"
            ) from None
    return target


def _call(factory: Any, args: dict[str, Any], field: str, spec: str) -> Any:
    if not callable(factory):
        raise EntrypointError(f"{field}: {spec!r} is a {type(factory).__name__}, not callable")
    try:
        return factory(**args)
    except Exception as exc:
        raise EntrypointError(
            f"{field}: {spec}(**args) failed: {type(exc).__name__}: {exc}"
        ) from exc


def build_model(cfg: TrainingConfig) -> Model:
    spec = cfg.model.entrypoint
    if spec is None:
        return Gpt(cfg.model, cfg.seed)
    model = _call(resolve(spec, MODEL_FIELD), cfg.model.args, MODEL_FIELD, spec)
    missing = [m for m in ("init", "loss") if not callable(getattr(model, m, None))]
    if missing:
        raise EntrypointError(
            f"{MODEL_FIELD}: {spec} returned a {type(model).__name__} without "
            f"{', '.join(m + '()' for m in missing)}; a model needs init(rng) and "
            "loss(params, batch, rng)"
        )
    return model


def build_data_source(cfg: TrainingConfig) -> DataSource:
    spec = cfg.data.entrypoint
    if spec is None:
        return StreamSource(cfg)
    target = resolve(spec, DATA_FIELD)
    if not callable(target):
        raise EntrypointError(f"{DATA_FIELD}: {spec!r} is a {type(target).__name__}, not callable")
    return functools.partial(target, **cfg.data.args)


def data_field(cfg: TrainingConfig) -> str:
    """Where a data problem is reported: the user's entrypoint, or the built-in source's block
    (whose own errors already name their field and pass through unchanged)."""
    return DATA_FIELD if cfg.data.entrypoint else "training.data"


def first_batches(source: Callable[..., Any], count: int, field: str, **call: Any) -> list[Batch]:
    """`count` batches of one call of `source`, or an error naming `field` when it has fewer."""
    try:
        out = []
        for batch in source(**call):
            out.append(batch)
            if len(out) == count:
                return out
    except ValueError as exc:
        if field != DATA_FIELD:  # the built-in source's own message names its field
            raise
        raise EntrypointError(f"{field}: the data source failed: {exc}") from exc
    except Exception as exc:
        raise EntrypointError(
            f"{field}: the data source failed: {type(exc).__name__}: {exc}"
        ) from exc
    raise EntrypointError(
        f"{field}: the {call.get('split')} split gave {len(out)} batches, {count} needed"
    )


def eval_batches(source: Callable[..., Any], count: int, cfg: TrainingConfig) -> list[Batch]:
    """The first `count` batches of the held-out split, the whole of it (shard 0 of 1) from its
    start: the same batches for every caller, or an error naming where the data comes from."""
    return first_batches(
        source,
        count,
        data_field(cfg),
        shard=0,
        num_shards=1,
        seed=cfg.seed,
        batch_size=cfg.data.batch_size,
        split="eval",
        position=0,
    )

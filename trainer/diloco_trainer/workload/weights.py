"""Weights in and out: `training.model.initFrom` and the safetensors file `diloco export` writes.

Both sides speak the flat ``name -> array`` form of the wire (`workload.pytree`): a leaf's name
is its pytree path joined by dots. Reading takes a safetensors file, or an orbax checkpoint
directory when `orbax-checkpoint` is installed (an optional dependency, imported only then),
from a local path (a `gs://` URL is fetched to a temporary copy by `syncer.bucket_weights`).
Checking compares what was read with the leaves the model expects and reports every kind of
mismatch in one error that names the manifest field and the file; values are cast to the
model's dtype (the syncer keeps float32). Writing is atomic: a temporary file beside the target,
fsynced, then renamed over it; an orbax export is written by orbax, which renames a temporary
directory into place itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from diloco_trainer.config import TrainingConfig

log = logging.getLogger("diloco.weights")

FIELD = "training.model.initFrom"
SHOWN = 5  # offending leaves named in one error; the rest are counted
InitFn = Callable[[TrainingConfig], dict[str, np.ndarray]]


class WeightsError(ValueError):
    """Weights that cannot be read or do not fit the model; the message names field and file."""


class WeightsUnavailable(WeightsError):
    """The storage holding the weights failed (not the setting): a later start may read them."""


ORBAX_MISSING = "install orbax-checkpoint, or export the weights to a safetensors file"


def read_weights(
    path: str | Path, field: str = FIELD, shown: str | None = None
) -> dict[str, np.ndarray]:
    """A flat ``name -> array`` dict from a local safetensors file or orbax checkpoint directory;
    messages name it as `shown` (the URL it was fetched from, if it was). A `gs://` URL is the
    syncer's to fetch first (syncer/bucket_weights.py)."""
    return _read_local(Path(path), field, shown or str(path))


def _read_local(source: Path, field: str, shown: str) -> dict[str, np.ndarray]:
    """Read `source`; messages name it as `shown` (the URL it was fetched from, if it was)."""
    if source.is_dir():
        return _read_orbax(source, field, shown)
    if not source.exists():
        raise WeightsError(f"{field}: {shown}: no such file or directory")
    try:
        return dict(load_file(source))
    except (SafetensorError, OSError, ValueError, TypeError) as exc:
        raise WeightsError(f"{field}: {shown}: not a readable safetensors file: {exc}") from exc


def _orbax_item_dir(root: Path) -> Path:
    """`root` itself, or its newest numeric step (a CheckpointManager directory), and inside a
    step its `default` item when there is one."""
    steps = [e for e in root.iterdir() if e.is_dir() and e.name.isdigit()]
    chosen = max(steps, key=lambda e: int(e.name)) if steps else root
    return chosen / "default" if (chosen / "default").is_dir() else chosen


def _import_orbax() -> Any:
    """`orbax.checkpoint`, imported only when an orbax checkpoint is read or written (it is
    large and pulls in JAX); ImportError when it is not installed."""
    import orbax.checkpoint as ocp

    return ocp


def _read_orbax(root: Path, field: str, shown: str) -> dict[str, np.ndarray]:
    try:
        ocp = _import_orbax()
    except ImportError as exc:
        raise WeightsError(
            f"{field}: {shown} is a directory (an orbax checkpoint?): reading one needs the "
            f"orbax-checkpoint package; {ORBAX_MISSING}"
        ) from exc
    from diloco_trainer.workload.pytree import LeafNameError, flatten  # JAX, as orbax is

    item = _orbax_item_dir(root)
    where = shown if item == root else f"{shown.rstrip('/')}/{item.relative_to(root)}"
    try:
        tree = ocp.StandardCheckpointer().restore(item.resolve())
    except Exception as exc:  # orbax raises many types (ValueError, FileNotFoundError, ...)
        raise WeightsError(f"{field}: {where}: not a readable orbax checkpoint: {exc}") from exc
    try:
        return {name: np.asarray(leaf) for name, leaf in flatten(tree).items()}
    except LeafNameError as exc:
        raise WeightsError(f"{field}: {where}: {exc}") from exc


def _listed(items: list[str]) -> str:
    more = f" (and {len(items) - SHOWN} more)" if len(items) > SHOWN else ""
    return "; ".join(items[:SHOWN]) + more


def mismatches(
    loaded: Mapping[str, np.ndarray], expected: Mapping[str, tuple[int, ...]]
) -> list[str]:
    """One line per leaf that is missing, unexpected, of the wrong shape or not floating point."""
    problems = [f"{name} is missing" for name in expected if name not in loaded]
    problems += [
        f"{name} has shape {tuple(loaded[name].shape)}, the model expects {tuple(shape)}"
        for name, shape in expected.items()
        if name in loaded and tuple(loaded[name].shape) != tuple(shape)
    ]
    problems += [
        f"{name} has dtype {loaded[name].dtype}, not a floating-point type"
        for name in expected
        if name in loaded and not _is_float(loaded[name].dtype)
    ]
    problems += [f"{name} is not a leaf of the model" for name in loaded if name not in expected]
    return problems


def _is_float(dtype: np.dtype[Any]) -> bool:
    # bfloat16 and float8 (ml_dtypes) are not np.floating subtypes: known by name.
    return np.issubdtype(dtype, np.floating) or dtype.name.startswith(("bfloat16", "float8"))


def fit_to_model(
    loaded: Mapping[str, np.ndarray],
    template: Mapping[str, np.ndarray],
    source: str | Path,
    field: str = FIELD,
) -> dict[str, np.ndarray]:
    """`loaded` in the template's leaf order and dtypes; WeightsError on any mismatch."""
    expected = {name: tuple(int(d) for d in leaf.shape) for name, leaf in template.items()}
    problems = mismatches(loaded, expected)
    if problems:
        raise WeightsError(f"{field}: {source}: {_listed(problems)}")
    cast = sorted({str(loaded[n].dtype) for n in template if loaded[n].dtype != template[n].dtype})
    if cast:
        log.info("event=init_from_cast source=%s from=%s to=float32", source, ",".join(cast))
    return {
        name: np.ascontiguousarray(loaded[name], dtype=leaf.dtype)
        for name, leaf in template.items()
    }


def init_from(
    path: str | Path,
    base: InitFn,
    read: Callable[[str | Path], dict[str, np.ndarray]] = read_weights,
) -> InitFn:
    """An init function giving the weights at `path` (read now, by `read`) in place of `base`'s
    values; `base` supplies the expected names, shapes and dtypes."""
    loaded = read(path)

    def init(cfg: TrainingConfig) -> dict[str, np.ndarray]:
        fitted = fit_to_model(loaded, base(cfg), path)
        log.info("event=init_from source=%s leaves=%d", path, len(fitted))
        return fitted

    return init


def write_safetensors(
    tensors: Mapping[str, np.ndarray], out: str | Path, metadata: Mapping[str, str]
) -> Path:
    """Write `tensors` to `out` atomically (temp file beside it, fsync, rename). OSError when
    the place cannot be written."""
    target = Path(out)
    if target.is_dir():
        raise IsADirectoryError(f"{target} is a directory")
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        save_file(
            {name: np.ascontiguousarray(leaf) for name, leaf in tensors.items()},
            tmp,
            metadata=dict(metadata),
        )
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def write_orbax(
    tensors: Mapping[str, np.ndarray], out: str | Path, metadata: Mapping[str, str]
) -> Path:
    """Write `tensors` as one orbax `StandardCheckpointer` checkpoint at `out`, which must not
    exist, with `metadata` as its custom metadata. The tree is nested by the dotted names
    (``params.Dense_0.kernel`` -> ``{"params": {"Dense_0": {"kernel": ...}}}``): the user's own
    pytree for a flax-style model, and what `read_weights` flattens back to the same names.
    ImportError without orbax-checkpoint; FileExistsError when `out` exists."""
    target = Path(out).resolve()  # orbax wants an absolute path
    if target.exists():
        raise FileExistsError(f"{target} exists")
    ocp = _import_orbax()
    from diloco_trainer.workload.pytree import nest  # JAX, as orbax is

    tree = nest({name: np.asarray(leaf) for name, leaf in tensors.items()})
    with ocp.StandardCheckpointer() as checkpointer:  # leaving it waits for the save
        checkpointer.save(target, tree, custom_metadata=dict(metadata))
    return target

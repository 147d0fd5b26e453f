"""The public contract between a user's model and data and the trainer.

A **model** is any object with

    init(rng) -> params                      # any pytree of arrays
    loss(params, batch, rng) -> (loss, metrics)   # a scalar, and a dict of scalars

and, optionally, `partition_rules`: `(regex, PartitionSpec-like tuple)` pairs matched against
each leaf's path name, used to shard parameters inside a unit (FSDP); `flops_per_token`, used for
MFU. A **data source** is a callable

    source(shard, num_shards, *, seed, batch_size, split, position, **args) -> iterable of batches

where a batch is a pytree of numpy arrays with `batch_size` rows on its leading axis; `split` is
"train" or "eval" (the held-out part, the same on every call); `position` is how many batches of
this shard were already consumed (a restarted unit resumes there).

The manifest names both as `module:attribute` entrypoints (`training.model.entrypoint`,
`training.data.entrypoint`) called with their `args`; see `diloco_trainer.workload`.

Parameters cross the wire as a flat `name -> array` dict: a leaf's name is its pytree path,
dict keys and attribute names joined by dots (`blocks.0.attn.wqkv`), so fragments, the syncer and
safetensors exports need nothing from the model beyond the pytree.

This module imports no JAX: the operator and the syncer's config checks import it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

PyTree = Any
Batch = Any  # a pytree of numpy arrays, rows on the leading axis
Split = Literal["train", "eval"]
PartitionRule = tuple[str, tuple[str | None, ...]]


@runtime_checkable
class Model(Protocol):
    def init(self, rng: Any) -> PyTree: ...

    def loss(self, params: PyTree, batch: Batch, rng: Any) -> tuple[Any, Mapping[str, Any]]: ...


class DataSource(Protocol):
    def __call__(
        self,
        shard: int,
        num_shards: int,
        *,
        seed: int,
        batch_size: int,
        split: Split,
        position: int,
        **args: Any,
    ) -> Iterable[Batch]: ...


def partition_rules(model: Model) -> Sequence[PartitionRule]:
    """The model's sharding rules, or none (replicated)."""
    return tuple(getattr(model, "partition_rules", ()) or ())


class EntrypointError(ValueError):
    """A model or data entrypoint that cannot be used; the message names the manifest field.
    A ValueError, as every other bad-config error the learner and syncer exit 2 on."""

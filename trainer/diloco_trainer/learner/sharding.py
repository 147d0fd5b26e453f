"""Where a unit's parameters and optimizer state live on its devices: replicated, or FSDP.

The unit's mesh has one axis, ``data``, over all its devices (every host's). The batch is always
split along it. With ``training.sharding.mode: fsdp`` each large parameter leaf is split along the
same axis too, and so are its optimizer moments; XLA's SPMD partitioner then gathers a weight
where a matmul needs it and reduce-scatters its gradient, so each device holds about 1/N of the
parameters and AdamW state (FSDP / ZeRO-3 over one axis).

Which axis of a leaf: the model's `partition_rules` (`(regex, spec)` pairs, the first whose regex
`re.search`es the leaf's name wins; a spec is a tuple of ``"data"`` or None per leading axis, ``()``
= replicated), else the leaf's largest axis that the device count divides (the first on a tie);
a leaf with no such axis, or smaller than `minShardBytes`, stays replicated.

Fragments cross the wire whole: a push gathers one fragment's leaves to replicated arrays on the
device (an all-gather every host of the unit runs at the same step), and the sender reads the
leader's local copy; an arriving fragment is scattered back to each leaf's own sharding.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_trainer.api import PartitionRule
from diloco_trainer.config import ShardingConfig

DATA_AXIS = "data"
Spec = tuple[str | None, ...]
CompiledRules = list[tuple[re.Pattern[str], Spec]]


def path_name(path: Sequence[Any]) -> str:
    """A leaf's wire name: its pytree path's keys joined by dots (a flat dict keeps its keys)."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        else:
            parts.append(str(key))
    return ".".join(parts)


def compile_rules(rules: Sequence[PartitionRule]) -> CompiledRules:
    """The model's partition rules, checked: a valid regex, and a spec naming only the mesh's
    one axis, at most once."""
    compiled: CompiledRules = []
    for i, rule in enumerate(rules):
        try:
            pattern, spec = rule
            regex = re.compile(pattern)
        except (TypeError, ValueError, re.error) as exc:
            raise ValueError(f"partition_rules[{i}]: not a (regex, spec) pair: {exc}") from None
        spec = tuple(spec)
        if any(axis not in (None, DATA_AXIS) for axis in spec) or spec.count(DATA_AXIS) > 1:
            raise ValueError(
                f"partition_rules[{i}] ({pattern!r}): spec {spec} may name only the unit's mesh "
                f"axis {DATA_AXIS!r}, at most once (or None)"
            )
        compiled.append((regex, spec))
    return compiled


def largest_axis_spec(shape: Sequence[int], devices: int) -> Spec:
    """The default FSDP spec: the largest axis `devices` divides (the first on a tie), else ()."""
    fits = [axis for axis, size in enumerate(shape) if size >= devices and size % devices == 0]
    if not fits:
        return ()
    axis = max(fits, key=lambda a: (shape[a], -a))
    return tuple(DATA_AXIS if a == axis else None for a in range(axis + 1))


def leaf_spec(
    name: str,
    shape: Sequence[int],
    nbytes: int,
    devices: int,
    cfg: ShardingConfig,
    rules: CompiledRules,
) -> Spec:
    """How one leaf is laid over a unit of `devices` devices (see the module docstring)."""
    if cfg.mode == "replicated" or devices == 1:
        return ()
    for regex, spec in rules:
        if regex.search(name):
            _check_rule_fits(name, shape, devices, regex.pattern, spec)
            return spec
    if nbytes < cfg.min_shard_bytes:
        return ()
    return largest_axis_spec(shape, devices)


def _check_rule_fits(
    name: str, shape: Sequence[int], devices: int, pattern: str, spec: Spec
) -> None:
    if len(spec) > len(shape):
        raise ValueError(
            f"partition rule {pattern!r}: spec {spec} has more axes than leaf {name} {tuple(shape)}"
        )
    for axis, mesh_axis in enumerate(spec):
        if mesh_axis is not None and shape[axis] % devices:
            raise ValueError(
                f"partition rule {pattern!r}: leaf {name} axis {axis} (size {shape[axis]}) "
                f"does not divide over the unit's {devices} devices"
            )


def param_shardings(
    params: Any, mesh: Mesh, cfg: ShardingConfig, rules: Sequence[PartitionRule] = ()
) -> Any:
    """A NamedSharding per leaf of `params` (arrays or jax.ShapeDtypeStruct), same structure."""
    compiled = compile_rules(rules)
    devices = mesh.devices.size

    def one(path: Sequence[Any], leaf: Any) -> NamedSharding:
        shape = tuple(leaf.shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
        spec = leaf_spec(path_name(path), shape, nbytes, devices, cfg, compiled)
        return NamedSharding(mesh, P(*spec))

    return jax.tree_util.tree_map_with_path(one, params)


def abstract_params(
    shapes: Mapping[str, tuple[int, ...]],
    mesh: Mesh,
    cfg: ShardingConfig,
    rules: Sequence[PartitionRule] = (),
    dtype: Any = np.float32,
) -> dict[str, jax.ShapeDtypeStruct]:
    """Each leaf's shape, dtype and sharding: what the train step is compiled for."""
    structs = {name: jax.ShapeDtypeStruct(shape, dtype) for name, shape in shapes.items()}
    shardings = param_shardings(structs, mesh, cfg, rules)
    return {
        name: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[name])
        for name, s in structs.items()
    }


def opt_state_shardings(optimizer: optax.GradientTransformation, params: Any, mesh: Mesh) -> Any:
    """A NamedSharding per leaf of `optimizer.init(params)`: a leaf that mirrors a parameter
    (AdamW's moments: its path ends with that parameter's path, same shape) shares the
    parameter's sharding; counters and other state are replicated. `params`: arrays or
    ShapeDtypeStructs that carry their sharding."""
    by_path = {
        tuple(path): (tuple(leaf.shape), leaf.sharding)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    state = jax.eval_shape(optimizer.init, params)
    everywhere = NamedSharding(mesh, P())

    def one(path: Sequence[Any], leaf: Any) -> NamedSharding:
        for start in range(len(path)):
            hit = by_path.get(tuple(path[start:]))
            if hit is not None and hit[0] == tuple(leaf.shape):
                sharding: NamedSharding = hit[1]
                return sharding
        return everywhere

    return jax.tree_util.tree_map_with_path(one, state)


def scatter_leaf(value: np.ndarray | jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host value (the same on every host of the unit) laid out with `sharding`: each device
    receives only its slice. Works across hosts."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place(params: Any, shardings: Any) -> Any:
    """Host parameters laid out over the unit's devices, one leaf at a time."""
    return jax.tree_util.tree_map(scatter_leaf, params, shardings)


@functools.lru_cache(maxsize=64)
def _to_replicated(sharding: NamedSharding) -> Any:
    return jax.jit(lambda leaves: leaves, out_shardings=sharding)


def gather_fragment(params: Mapping[str, jax.Array], names: Iterable[str]) -> dict[str, jax.Array]:
    """The leaves `names`, each replicated on every device of its mesh: a sharded leaf is
    all-gathered (dispatched, not waited for), a replicated one is returned as it is. With
    sharded leaves this is a collective: every host of the unit calls it at the same step."""
    leaves = {name: params[name] for name in names}
    sharded = {n: leaf for n, leaf in leaves.items() if not leaf.sharding.is_fully_replicated}
    if not sharded:
        return leaves
    first = next(iter(sharded.values())).sharding
    assert isinstance(first, NamedSharding), first
    gathered: dict[str, jax.Array] = _to_replicated(NamedSharding(first.mesh, P()))(sharded)
    return {**leaves, **gathered}


def fragment_to_host(params: Mapping[str, jax.Array], names: Iterable[str]) -> dict[str, Any]:
    """The leaves `names` as host numpy arrays, on every host (a collective when sharded)."""
    gathered = gather_fragment(params, names)
    return {name: np.asarray(leaf.addressable_data(0)) for name, leaf in gathered.items()}


def bytes_per_device(*trees: Any) -> dict[int, int]:
    """Bytes each local device holds of the arrays in `trees` (its addressable shards)."""
    held: dict[int, int] = {}
    for tree in trees:
        for leaf in jax.tree_util.tree_leaves(tree):
            for shard in leaf.addressable_shards:
                held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held

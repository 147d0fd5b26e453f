"""A model's parameter pytree <-> the flat ``name -> leaf`` dict that crosses the wire.

A leaf's name is its pytree path: dict keys, attribute names and sequence indices joined by
``"."`` (``{"params": {"Dense_0": {"kernel": k}}}`` -> ``params.Dense_0.kernel``). A flat
mapping of leaves (the built-in GPT's ``blocks.0.attn.wqkv`` dict) keeps its keys and their
order, so its names are unchanged. Below the top level a key holding ``"."`` is refused: the
name could no longer be told apart from a deeper path. Two leaves that end up with the same name
(the int key ``0`` and the str key ``"0"``) are refused too.

Pure functions; only ``jax.tree_util``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

PyTree = Any
SEPARATOR = "."


class LeafNameError(ValueError):
    """A pytree whose leaves cannot be given distinct, unambiguous dotted names."""


def _key_name(key: Any) -> str:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def _is_single_leaf(value: Any) -> bool:
    return value is not None and jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value))


def is_flat_mapping(tree: PyTree) -> bool:
    """A dict whose every value is one leaf: its keys are the names as they stand."""
    return isinstance(tree, Mapping) and all(_is_single_leaf(v) for v in tree.values())


def path_name(path: tuple[Any, ...]) -> str:
    """One leaf's dotted name. Only a top-level key may hold the separator (a flat dict)."""
    parts = [_key_name(key) for key in path]
    if len(parts) > 1:
        for part in parts:
            if SEPARATOR in part:
                raise LeafNameError(
                    f"pytree key {part!r} (under {parts[0]!r}) contains {SEPARATOR!r}: leaf "
                    f"names join keys with {SEPARATOR!r}, so its name would be ambiguous; "
                    "rename the key"
                )
    return SEPARATOR.join(parts)


def _named_leaves(tree: PyTree) -> tuple[list[str], list[Any]]:
    names: list[str] = []
    leaves: list[Any] = []
    seen: set[str] = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = path_name(path)
        if name in seen:
            raise LeafNameError(f"two leaves of the parameter pytree are both named {name!r}")
        seen.add(name)
        names.append(name)
        leaves.append(leaf)
    return names, leaves


def flatten(tree: PyTree) -> dict[str, Any]:
    """``name -> leaf`` for every leaf of ``tree``.

    A flat dict keeps its own key order; any other tree comes out in jax's leaf order.
    """
    names, leaves = _named_leaves(tree)
    flat = dict(zip(names, leaves, strict=True))
    if is_flat_mapping(tree):
        return {str(key): flat[str(key)] for key in tree}
    return flat


def leaf_names(tree: PyTree) -> list[str]:
    return list(flatten(tree))


def unflatten(template: PyTree, flat: Mapping[str, Any]) -> PyTree:
    """``template``'s structure with each leaf replaced by ``flat[its name]``.

    ``flat`` must name exactly the template's leaves; a missing or extra name is an error.
    """
    names, _ = _named_leaves(template)
    missing = [name for name in names if name not in flat]
    extra = sorted(set(flat) - set(names))
    if missing or extra:
        raise LeafNameError(
            f"the flat parameters do not match the pytree: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    treedef = jax.tree_util.tree_structure(template)
    return jax.tree_util.tree_unflatten(treedef, [flat[name] for name in names])


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Nested dicts from dotted names, for a caller with no template (every key a str).

    ``{"params.Dense_0.kernel": k}`` -> ``{"params": {"Dense_0": {"kernel": k}}}``. A name that
    is both a leaf and a prefix of another (``a`` and ``a.b``) is an error.
    """
    root: dict[str, Any] = {}
    for name, leaf in flat.items():
        *parents, last = name.split(SEPARATOR)
        node = root
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise LeafNameError(f"{name!r} goes below the leaf {part!r}")
            node = child
        if last in node:
            raise LeafNameError(f"{name!r} is both a leaf and a subtree")
        node[last] = leaf
    return root

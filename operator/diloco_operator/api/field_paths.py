"""Dotted field paths over manifest-shaped dicts: `spec.containers[].ports[].hostPort`, where
`[]` walks each item of a list. A rule stated once as a path is checked alike in Python
(`values_at`, by the models) and in CEL (`cel_all`, `cel_joined`: the CRD and the chart's
admission policy), so the two refuse the same manifests naming the same field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _segments(path: str) -> list[tuple[str, bool]]:
    """`a.b[].c` -> [(a, False), (b, True), (c, False)]: `[]` walks each item of a list."""
    return [(s.removesuffix("[]"), s.endswith("[]")) for s in path.split(".")]


def values_at(doc: Any, path: str) -> list[tuple[str, Any]]:
    """Each value at `path` in a manifest-shaped dict, with its concrete path (list indices
    filled in); absent or null fields yield nothing."""
    found: list[tuple[str, Any]] = [("", doc)]
    for field, many in _segments(path):
        step: list[tuple[str, Any]] = []
        for where, node in found:
            if not isinstance(node, dict) or node.get(field) is None:
                continue
            here = f"{where}.{field}" if where else field
            if not many:
                step.append((here, node[field]))
            elif isinstance(node[field], list):
                step += [(f"{here}[{i}]", item) for i, item in enumerate(node[field])]
        found = step
    return found


def _rest(segments: list[tuple[str, bool]]) -> str:
    return ".".join(field + ("[]" if many else "") for field, many in segments)


def cel_all(
    root: str, path: str, ok: Callable[[str], str], absent: bool = False, depth: int = 0
) -> str:
    """CEL: `ok(value)` holds for every value at `path` below `root` (absent values pass), or
    with `absent` no value is there at all. has() guards, not optional selection (`a.?b`): an
    optional's orValue() loses the maxItems and maxLength the CRD's cost estimate needs."""
    expr = root
    guards: list[str] = []
    segments = _segments(path)
    for i, (field, many) in enumerate(segments):
        expr = f"{expr}.{field}"
        if absent and i == len(segments) - 1:
            return "(" + " || ".join([*guards, f"!has({expr})"]) + ")"
        guards.append(f"!has({expr})")
        if many:
            var, rest = f"x{depth}", _rest(segments[i + 1 :])
            inner = cel_all(var, rest, ok, absent, depth + 1) if rest else ok(var)
            return "(" + " || ".join([*guards, f"{expr}.all({var}, {inner})"]) + ")"
    return "(" + " || ".join([*guards, ok(expr)]) + ")"


def cel_joined(root: str, path: str, depth: int = 0) -> str:
    """CEL: the strings at `path` below `root` joined by commas (empty items where a field is
    absent). Joining and splitting flattens nested lists without the lists library of
    Kubernetes 1.34+, so an admission policy built on it works from 1.30 on."""
    expr = root
    segments = _segments(path)
    for i, (field, many) in enumerate(segments):
        expr = f"{expr}.?{field}"
        if many:
            var, rest = f"x{depth}", _rest(segments[i + 1 :])
            inner = cel_joined(var, rest, depth + 1) if rest else var
            return f"{expr}.orValue([]).map({var}, {inner}).join(',')"
    return f"{expr}.orValue('')"

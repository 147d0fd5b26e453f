"""The fragment plan a learner joins with: per fragment, its leaves' names, shapes and dtypes.

A unit whose model differs from the run's (another image, another `training.model`, another
`fragments`) must be refused at its join, before anything of it reaches the global model: the
syncer's layout is authoritative, and a learner that installs fragments into leaves of other
shapes fails later and far from the cause. So the learner sends its plan at join
(`{"fingerprint", "fragments"}`); the syncer compares fingerprints and, when they differ, names
the first difference (docs/protocol.md, "Layout check at join"). Pure functions: both sides
compute the plan.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

Leaf = tuple[str, tuple[int, ...], str]  # name, shape, dtype
Plan = list[list[Leaf]]

EXCHANGE_DTYPE = "float32"  # what every leaf travels and is merged as (wire.py)
# A plan's JSON beyond this goes out as its fingerprint alone: the join body stays bounded
# (http_api.JOIN_BODY_LIMIT) whatever the model's leaf count; the syncer then says only that
# the fingerprints differ.
MAX_PLAN_BYTES = 512 * 1024
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


def plan_of(
    layout: Sequence[Sequence[str]],
    shapes: Mapping[str, Sequence[int]],
    dtypes: Mapping[str, str] | None = None,
) -> Plan:
    """The plan of `layout` (fragments of leaf names) over leaves of `shapes` and `dtypes`
    (default: the exchange dtype for every leaf)."""
    dtypes = dtypes or {}
    return [
        [(n, tuple(int(d) for d in shapes[n]), dtypes.get(n, EXCHANGE_DTYPE)) for n in names]
        for names in layout
    ]


def fingerprint(plan: Plan) -> str:
    """SHA-256 over the plan's canonical JSON: equal exactly when the plans are."""
    raw = json.dumps(_plan_json(plan), separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()


def announce(plan: Plan) -> dict[str, Any]:
    """What a join carries: the fingerprint, and the plan itself while it is not too large."""
    doc: dict[str, Any] = {"fingerprint": fingerprint(plan)}
    fragments = _plan_json(plan)
    if len(json.dumps(fragments, separators=(",", ":"))) <= MAX_PLAN_BYTES:
        doc["fragments"] = fragments
    return doc


def read_announcement(raw: Any) -> tuple[str, Plan | None]:
    """The fingerprint and (when sent) the plan of a join's `layout`; ValueError naming the
    field otherwise."""
    if not isinstance(raw, dict):
        raise ValueError("layout: expected an object with fingerprint and fragments")
    fp = raw.get("fingerprint")
    if not isinstance(fp, str) or not _FINGERPRINT.fullmatch(fp):
        raise ValueError("layout.fingerprint: expected 64 lowercase hex digits")
    fragments = raw.get("fragments")
    if fragments is None:
        return fp, None
    if not isinstance(fragments, list) or not all(isinstance(f, list) for f in fragments):
        raise ValueError("layout.fragments: expected a list of fragments, each a list of leaves")
    return fp, [[_leaf(entry, p) for entry in frag] for p, frag in enumerate(fragments)]


def difference(learner: Plan, syncer: Plan) -> str | None:
    """The first way the learner's plan differs from the syncer's, in words (None: the same).
    Leaves come first (a model change shows as a leaf, whatever it does to the packing), then
    the fragment count, then which leaves each fragment holds."""
    ours = {name: (shape, dtype) for frag in learner for name, shape, dtype in frag}
    theirs = {name: (shape, dtype) for frag in syncer for name, shape, dtype in frag}
    counts = f"(learner {len(ours)} leaves, syncer {len(theirs)})"
    for name in sorted(ours.keys() | theirs.keys()):
        mine, run = ours.get(name), theirs.get(name)
        if run is None:
            return f"leaf {name!r} is in the learner's model, not in the run's {counts}"
        if mine is None:
            return f"leaf {name!r} of the run's model is missing from the learner's {counts}"
        if mine[0] != run[0]:
            return f"leaf {name!r}: learner shape {list(mine[0])}, run shape {list(run[0])}"
        if mine[1] != run[1]:
            return f"leaf {name!r}: learner dtype {mine[1]}, run dtype {run[1]}"
    if len(learner) != len(syncer):
        return f"fragments: learner {len(learner)}, run {len(syncer)} (training.fragments)"
    for p, (mine_f, run_f) in enumerate(zip(learner, syncer, strict=True)):
        a, b = {n for n, _, _ in mine_f}, {n for n, _, _ in run_f}
        if a != b:
            only = min(a ^ b)
            side = "learner's" if only in a else "run's"
            return (
                f"fragment {p} holds other leaves: {only!r} is only in the {side} (the same "
                "leaves packed another way: a learner of another version?)"
            )
    return None


def _plan_json(plan: Plan) -> list[list[list[Any]]]:
    return [[[name, list(shape), dtype] for name, shape, dtype in frag] for frag in plan]


def _leaf(entry: Any, p: int) -> Leaf:
    ok = (
        isinstance(entry, list)
        and len(entry) == 3
        and isinstance(entry[0], str)
        and isinstance(entry[1], list)
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[1])
        and isinstance(entry[2], str)
    )
    if not ok:
        raise ValueError(f"layout.fragments[{p}]: a leaf must be [name, [dims], dtype]")
    return entry[0], tuple(entry[1]), entry[2]

"""The fragment journal: each fragment's newest published state, one file per fragment.

A checkpoint is taken every `checkpoint.everySeconds`; a fragment may be merged several times
in between. Before a new version of fragment p is announced, `fragment-<p>.safetensors` is
replaced (atomically, as the version journal is) with that version's parameters and outer
optimizer state. A syncer that restarts (or a standby that takes over) installs each fragment
from its journal when the journal is newer than the checkpoint, so no version a learner has seen
is lost: the restarted syncer serves exactly what the learners already hold.

The files are plain safetensors; the header's metadata carries the version, the time of the
merge, the number of outer-state leaves and the keys of the pushes merged into recent versions
(so that a push replayed after a restart is recognised, not merged twice). They are small next to a checkpoint (one fragment
each), and only the newest version is kept, so the journal never grows.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

from diloco_trainer.syncer.fragment import PushKey

log = logging.getLogger("diloco.checkpoint")

FORMAT = "diloco-fragment-journal/1"
_NAME = re.compile(r"^fragment-(\d{3,})\.safetensors$")


def fragment_file(index: int) -> str:
    return f"fragment-{index:03d}.safetensors"


def fragment_index(name: str) -> int | None:
    """The fragment a journal file name is of, None for any other name."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def is_journal_entry(name: str) -> bool:
    """A journal file or its in-flight temporary (`.<name>.tmp`)."""
    return _NAME.match(name.removeprefix(".").removesuffix(".tmp")) is not None


@dataclass(frozen=True)
class JournaledFragment:
    index: int
    version: int
    params: dict[str, np.ndarray]
    outer_leaves: list[np.ndarray]
    last_merge: float | None
    merged: dict[PushKey, int] = field(default_factory=dict)  # FragmentState.merged


def encode(entry: JournaledFragment) -> bytes:
    tensors = {f"params/{name}": np.ascontiguousarray(v) for name, v in entry.params.items()}
    tensors |= {f"outer/{i}": np.ascontiguousarray(v) for i, v in enumerate(entry.outer_leaves)}
    meta = {
        "format": FORMAT,
        "index": entry.index,
        "version": entry.version,
        "outerLeaves": len(entry.outer_leaves),
        "lastMerge": entry.last_merge,
        "merged": merged_to_json(entry.merged),
    }
    return save(tensors, metadata={"journal": json.dumps(meta)})


def decode(data: bytes, index: int) -> JournaledFragment:
    """The entry in `data`; ValueError when it is not fragment `index`'s journal."""
    try:
        tensors = load(data)
        meta = json.loads(_metadata(data)["journal"])
        if meta.get("format") != FORMAT or int(meta["index"]) != index:
            raise ValueError(f"not the journal of fragment {index}")
        leaves = int(meta["outerLeaves"])
        params = {
            k.removeprefix("params/"): v for k, v in tensors.items() if k.startswith("params/")
        }
        outer = [tensors[f"outer/{i}"] for i in range(leaves)]
        last = meta.get("lastMerge")
        return JournaledFragment(
            index,
            int(meta["version"]),
            params,
            outer,
            None if last is None else float(last),
            merged_from_json(meta.get("merged")),  # absent from journals that predate it
        )
    except (SafetensorError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"fragment {index} journal unreadable: {exc!r}") from exc


def _metadata(data: bytes) -> Mapping[str, str]:
    """The safetensors header's `__metadata__` (an 8-byte little-endian length, then JSON)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    return dict(header.get("__metadata__") or {})


def fits(entry: JournaledFragment, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """None when the entry's leaves are exactly `shapes`, else what differs."""
    if set(entry.params) != set(shapes):
        return f"leaves differ from the fragment's: {sorted(set(entry.params) ^ set(shapes))[:4]}"
    for name, value in entry.params.items():
        if tuple(value.shape) != shapes[name]:
            return f"leaf {name}: shape {tuple(value.shape)}, the fragment has {shapes[name]}"
    return None


def merged_to_json(merged: Mapping[PushKey, int]) -> list[list[Any]]:
    return [[*key, version] for key, version in merged.items()]


def merged_from_json(raw: Any) -> dict[PushKey, int]:
    """Keys written by `merged_to_json`; malformed rows are dropped (a damaged row can only
    make a replay of that one push merge again, never refuse a new push)."""
    out: dict[PushKey, int] = {}
    for row in raw if isinstance(raw, list) else ():
        if (
            isinstance(row, list)
            and len(row) == 5
            and isinstance(row[0], str)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in row[1:])
        ):
            out[(row[0], row[1], row[2], row[3])] = row[4]
    return out

"""Per-fragment state of the syncer and the pure checks on a push (no I/O, no event loop)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from diloco_trainer.config import ModelConfig, TrainingConfig
from diloco_trainer.downlink import Publication
from diloco_trainer.wire import PushHeader

InitFn = Callable[[ModelConfig, int], dict[str, np.ndarray]]
EvalFn = Callable[[Mapping[str, np.ndarray], TrainingConfig, int], float]
MAX_POLL_WAIT = 60.0
SEEN_PER_FRAGMENT = 4096  # recent push keys remembered for idempotent retries


def default_init(model: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    from diloco_trainer.model import init_params

    return init_params(model, seed)


def default_eval(params: Mapping[str, np.ndarray], cfg: TrainingConfig, batches: int) -> float:
    from diloco_trainer.evaluate import eval_loss

    return eval_loss(params, cfg, batches)


class Reject(Exception):
    """A request refused with an HTTP status; never applied."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


@dataclass
class Pending:
    header: PushHeader
    delta: dict[str, np.ndarray]
    arrived: float

    def plus(self, later: Pending) -> Pending:
        """Two unmerged pushes of one unit as one contribution. A push carries only the progress
        since the learner's previous push of the fragment, so two of one attempt add up. So do
        a dead attempt's last push and its successor's: the new attempt started from global
        parameters that did not contain the unmerged push, so their progress is disjoint. The
        header is the newer attempt's (the later one's on a tie), with the counters of both."""
        newest = later if later.header.attempt >= self.header.attempt else self
        header = replace(
            newest.header,
            c_steps=self.header.c_steps + later.header.c_steps,
            c_tokens=self.header.c_tokens + later.header.c_tokens,
        )
        delta = {name: value + later.delta[name] for name, value in self.delta.items()}
        return Pending(header, delta, self.arrived)


@dataclass
class FragmentState:
    index: int
    names: list[str]
    params: dict[str, np.ndarray]
    opt_state: Any
    version: int = 0
    last_merge: float | None = None
    max_body: int = 0
    pending: dict[str, Pending] = field(default_factory=dict)
    first_arrival: float | None = None
    first_unit: str | None = None
    quorum_time: float | None = None
    last_push: dict[str, float] = field(default_factory=dict)  # unit -> arrival of its last push
    merge_task: asyncio.Task[None] | None = None
    all_in: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    seen: OrderedDict[tuple[str, int, int, int], int] = field(default_factory=OrderedDict)
    # The current version's downloads, encoded once: as a step (True) and as values (False).
    encoded: dict[bool, tuple[int, asyncio.Future[bytes]]] = field(default_factory=dict)
    # What learners hold (downlink.py); None: the downlink sends `params` themselves.
    publication: Publication | None = None

    def published(self) -> dict[str, np.ndarray]:
        return self.publication.tensors if self.publication is not None else self.params


def validate_push(
    f: FragmentState,
    header: PushHeader,
    delta: Mapping[str, np.ndarray],
    shapes: Mapping[str, tuple[int, ...]],
    max_staleness: int,
) -> None:
    """Everything that makes a decoded push unusable; raises Reject, changes nothing."""
    if header.fragment != f.index:
        raise Reject(
            400, "malformed", f"payload fragment {header.fragment} != URL fragment {f.index}"
        )
    missing, extra = sorted(set(f.names) - set(delta)), sorted(set(delta) - set(f.names))
    if missing or extra:
        raise Reject(
            422,
            "mismatch",
            f"fragment {f.index} tensors: missing {missing}, unexpected {extra}",
        )
    for name in f.names:
        arr = delta[name]
        if arr.dtype != np.float32:
            raise Reject(422, "mismatch", f"tensor {name}: dtype {arr.dtype}, expected float32")
        if tuple(arr.shape) != shapes[name]:
            raise Reject(
                422,
                "mismatch",
                f"tensor {name}: shape {tuple(arr.shape)}, expected {shapes[name]}",
            )
        if not np.all(np.isfinite(arr)):
            raise Reject(422, "non_finite", f"tensor {name}: contains NaN or Inf")
    if header.base_version > f.version:
        raise Reject(
            409,
            "future_base",
            f"base version {header.base_version} is newer than fragment {f.index}'s "
            f"version {f.version} (syncer restored from a checkpoint): pull again",
        )
    if header.base_version < f.version - max_staleness:
        raise Reject(
            409,
            "stale",
            f"base version {header.base_version} is older than {f.version} - "
            f"maxStaleness {max_staleness}: pull fragment {f.index} again",
        )


def expected_arrival(
    last_push: float | None, step_time: float | None, inner_steps: int, now: float
) -> float | None:
    """Seconds until a learner is expected to push a fragment again: its last push of it plus H
    steps at its EMA step time. None when unknown, or overdue (it may arrive any moment)."""
    if last_push is None or step_time is None:
        return None
    eta = last_push + inner_steps * step_time - now
    return eta if eta >= 0 else None

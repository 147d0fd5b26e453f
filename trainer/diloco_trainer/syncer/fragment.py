"""Per-fragment state of the syncer and the pure checks on a push (no I/O, no event loop)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from diloco_trainer.config import TrainingConfig
from diloco_trainer.downlink import Publication
from diloco_trainer.phases import phase
from diloco_trainer.wire import PushHeader, decode_push, parse_count

log = logging.getLogger("diloco.syncer")
InitFn = Callable[[TrainingConfig], dict[str, np.ndarray]]
EvalFn = Callable[[Mapping[str, np.ndarray], TrainingConfig, int], float]
MAX_POLL_WAIT = 60.0
SEEN_PER_FRAGMENT = 4096  # recent push keys remembered for idempotent retries
# (unit, attempt, -1 or base version, step or cSteps): names one push (push.py)
PushKey = tuple[str, int, int, int]
# Per-value magnitude below which a fragment's norm is not trusted as the push bound's reference
# (half the init std of the model's matrices; its norm scales are ones).
NORM_FLOOR = 0.01


def default_init(cfg: TrainingConfig) -> dict[str, np.ndarray]:
    """The run's starting parameters from its model (checked first: a bad entrypoint is a
    ValueError naming the field, before the syncer serves anything)."""
    from diloco_trainer.workload.check import prepared

    return prepared(cfg).initial_params()


def model_shaped(cfg: TrainingConfig) -> dict[str, np.ndarray]:
    """Placeholders of the model's parameters (shapes by `jax.eval_shape`, no memory): for a
    syncer that takes every value from its checkpoint or initFrom weights, which must fit them."""
    from diloco_trainer.workload.check import prepared

    return prepared(cfg).placeholders()


def start_params(
    cfg: TrainingConfig,
    init_fn: InitFn,
    fresh: bool,
    keep: Callable[[Mapping[str, tuple[int, ...]]], Collection[str]] | None = None,
) -> dict[str, np.ndarray]:
    """What a syncer builds its fragments from, as start-up phase `initial_params`; or, for a run
    resuming with the model's own init (every value comes from the checkpoint), `placeholders`.
    `keep`: given every leaf's shape, the leaves this process holds (a syncer shard); the others
    come back as zero-stride placeholders, and with the model's own init are never computed."""
    if not (fresh or init_fn is not default_init):
        with phase(log, "placeholders"):
            return model_shaped(cfg)
    with phase(log, "initial_params"):
        if keep is None:
            return init_fn(cfg)
        if init_fn is default_init:
            from diloco_trainer.workload.check import prepared

            shaped = model_shaped(cfg)
            wanted = keep({n: tuple(v.shape) for n, v in shaped.items()})
            return {**shaped, **prepared(cfg).initial_params(wanted)}
        full = init_fn(cfg)
        wanted = keep({n: tuple(v.shape) for n, v in full.items()})
        return {n: v if n in wanted else placeholder(v.shape) for n, v in full.items()}


def placeholder(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 stand-in of `shape` that takes no memory."""
    return np.broadcast_to(np.float32(0), tuple(shape))


def default_eval(params: Mapping[str, np.ndarray], cfg: TrainingConfig, batches: int) -> float:
    from diloco_trainer.workload.evaluate import eval_loss

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
    norms: dict[str, float] | None = None  # each leaf's L2 norm, measured when decoded
    keys: tuple[PushKey, ...] = ()  # the pushes it holds (two of one unit add up)

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
        # The sum's norms are measured by the merge.
        return Pending(header, delta, self.arrived, keys=self.keys + later.keys)


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
    seen: OrderedDict[PushKey, int] = field(default_factory=OrderedDict)
    # The pushes merged into recent versions (key -> version), journaled with the fragment so
    # that a replay after a restart or a standby's take-over is still a duplicate. Only those a
    # replay of which would not be refused as stale are kept (`recent_merges`).
    merged: dict[PushKey, int] = field(default_factory=dict)
    # The current version's quantized step, encoded once for every learner that polls for it
    # (values are sent from the arrays themselves: payload.py).
    step_payload: tuple[int, asyncio.Future[bytes]] | None = None
    # What learners hold (downlink.py); None: the downlink sends `params` themselves.
    publication: Publication | None = None
    # L2 norm of `params`, the reference of the push norm bound (kept current by the syncer).
    norm: float = 0.0
    merge_failures: int = 0  # consecutive failed merges (their retries back off)
    # The median delta norm of recent merges: the clip reference of rounds too small to
    # have a median of their own (robust.py).
    typical_norm: float | None = None
    # False: another syncer shard holds this fragment; this process knows only its names.
    held: bool = True

    def published(self) -> dict[str, np.ndarray]:
        return self.publication.tensors if self.publication is not None else self.params


def validate_content(
    f: FragmentState,
    header: PushHeader,
    delta: Mapping[str, np.ndarray],
    shapes: Mapping[str, tuple[int, ...]],
    max_norm_ratio: float | None,
    norm: float | None = None,
) -> None:
    """What makes a decoded push unusable whatever the syncer's state: wrong fragment or tensors,
    non-finite values, a delta too large for the fragment. `norm`: the delta's L2 norm if known
    (`decode_measured` takes it off the event loop). Raises Reject, changes nothing."""
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
    if max_norm_ratio is not None:
        reference = norm_reference(f)
        norm = l2_norm(delta) if norm is None else norm
        bound = max_norm_ratio * reference
        if not norm <= bound:
            raise Reject(
                422,
                "norm_bound",
                f"delta L2 norm {norm:.4g} exceeds merge.maxPushNorm {max_norm_ratio:g} x "
                f"fragment {f.index}'s norm {reference:.4g} = {bound:.4g}",
            )


def validate_version(f: FragmentState, header: PushHeader, max_staleness: int) -> None:
    """Whether the push's base version can still be merged into `f` (checked after the retry
    check: a retry of a push that was accepted is answered as such even once it is stale)."""
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


def validate_push(
    f: FragmentState,
    header: PushHeader,
    delta: Mapping[str, np.ndarray],
    shapes: Mapping[str, tuple[int, ...]],
    max_staleness: int,
    max_norm_ratio: float | None = None,
) -> None:
    """Everything that makes a decoded push unusable; raises Reject, changes nothing."""
    validate_content(f, header, delta, shapes, max_norm_ratio)
    validate_version(f, header, max_staleness)


def squared_norms(tensors: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Each tensor's sum of squares, in float64 (a float32 sum of squares of large finite values
    overflows to inf)."""
    return {name: float(np.sum(np.square(v, dtype=np.float64))) for name, v in tensors.items()}


def leaf_norms(tensors: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Each tensor's L2 norm, as a push's are measured when it is decoded."""
    return {name: math.sqrt(sq) for name, sq in squared_norms(tensors).items()}


def l2_norm(tensors: Mapping[str, np.ndarray]) -> float:
    """The L2 norm of all tensors together."""
    return math.sqrt(sum(squared_norms(tensors).values()))


@dataclass(frozen=True)
class MeasuredPush:
    header: PushHeader
    delta: dict[str, np.ndarray]
    norms: dict[str, float]  # each leaf's L2 norm (the merge's RDA uses them)
    norm: float  # the whole delta's


def decode_measured(body: bytes) -> MeasuredPush:
    """A push body decoded and measured (run in a worker thread): the push norm bound and the
    merge both need the norms, and this is the one pass that reads every value anyway."""
    header, delta = decode_push(body)
    norms = leaf_norms(delta)
    return MeasuredPush(header, delta, norms, math.sqrt(sum(n * n for n in norms.values())))


def norm_reference(f: FragmentState) -> float:
    """What a push's norm is compared with: the fragment's L2 norm, but at least that of a
    fragment whose values all had magnitude NORM_FLOOR (a fragment near zero would otherwise
    refuse every push)."""
    elements = sum(v.size for v in f.params.values())
    return max(f.norm, NORM_FLOOR * math.sqrt(elements))


def finite_norm(tensors: Mapping[str, np.ndarray]) -> float | None:
    """The L2 norm of float32 tensors, or None when any value is NaN or Inf (in float64 the
    squares of finite float32 values cannot overflow, so a finite sum means finite values)."""
    norm = l2_norm(tensors)
    return norm if math.isfinite(norm) else None


def parse_fragment_index(raw: str, count: int) -> int | None:
    """The fragment index in a URL: ASCII digits only, no sign or space, in 0..count-1."""
    value = parse_count(raw)
    return value if value is not None and value < count else None


def put_back(f: FragmentState, taken: dict[str, Pending]) -> None:
    """Return the contributions a failed merge took to `f.pending`, ahead of any that arrived
    meanwhile (a unit's two add up, as unmerged pushes always do), so nothing is lost and a
    retry of one of them is rightly answered as a duplicate of a pending push."""
    merged = dict(taken)
    for unit, later in f.pending.items():
        merged[unit] = merged[unit].plus(later) if unit in merged else later
    f.pending = merged
    if merged:
        first = min(merged.values(), key=lambda p: p.arrived)
        f.first_arrival, f.first_unit = first.arrived, first.header.unit


def expected_arrival(
    last_push: float | None, step_time: float | None, inner_steps: int, now: float
) -> float | None:
    """Seconds until a learner is expected to push a fragment again: its last push of it plus H
    steps at its EMA step time. None when unknown, or overdue (it may arrive any moment)."""
    if last_push is None or step_time is None:
        return None
    eta = last_push + inner_steps * step_time - now
    return eta if eta >= 0 else None


def recent_merges(
    merged: Mapping[PushKey, int], keys: Iterable[PushKey], version: int, max_staleness: int
) -> dict[PushKey, int]:
    """`merged` with `keys` merged into `version`, less the pushes merged into a version at or
    below `version - max_staleness`: their base is older than `version - max_staleness`, so a
    replay of one is refused as stale without being looked up (validate_version)."""
    out = {k: v for k, v in merged.items() if v > version - max_staleness}
    out.update(dict.fromkeys(keys, version))
    while len(out) > SEEN_PER_FRAGMENT:
        del out[next(iter(out))]
    return out

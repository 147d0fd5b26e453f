"""The syncer's push intake: decode a fragment push off the loop, check who sent it and what it
holds, drop exact repeats, and queue it for the fragment's next merge (docs/protocol.md)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from diloco_trainer.syncer.fragment import (
    SEEN_PER_FRAGMENT,
    FragmentState,
    MeasuredPush,
    Pending,
    Reject,
    decode_measured,
    validate_content,
    validate_version,
)
from diloco_trainer.syncer.rounds import schedule_merge
from diloco_trainer.syncer.trust import Implausible
from diloco_trainer.wire import PayloadMismatch, PushHeader, WireError

if TYPE_CHECKING:
    from diloco_trainer.syncer.state import SyncerState

log = logging.getLogger("diloco.syncer")


async def accept_push(
    s: SyncerState, f: FragmentState, body: bytes, caller: str | None = None
) -> dict[str, Any]:
    """Decode, check and queue one push. `caller`: the authenticated unit, which must be
    the payload's (None skips that check: in-process callers)."""
    measured = await decode_body(s, f, body)
    header, delta = measured.header, measured.delta
    check_sender(s, header, caller)
    # Content first: a payload that can never be merged is refused even when its key
    # repeats an accepted push's.
    validate_content(f, header, delta, s.shapes, s.cfg.merge.max_push_norm, measured.norm)
    # A retry repeats the same push exactly: the learner's step names it. (A learner that
    # predates the field sends step 0; then a later push on the same base has more c_steps.)
    key = (
        (header.unit, header.attempt, -1, header.step)  # -1: no base version is negative
        if header.step > 0
        else (header.unit, header.attempt, header.base_version, header.c_steps)
    )
    if key in f.seen and header.fragment == f.index:
        return _accepted(f, duplicate=True)
    now = time.time()
    header = check_counters(s, header, now)
    validate_version(f, header, s.cfg.max_staleness)
    f.seen[key] = f.version
    while len(f.seen) > SEEN_PER_FRAGMENT:
        f.seen.popitem(last=False)
    s.learners.seen(header.unit, header.attempt, s.learners.get(header.unit).group, now)
    lag = f.version - header.base_version
    s.learners.pushed(header.unit, header.attempt, header.step, f.index, lag)
    # The merge weighs the push by counters no larger than an honest push's (trust.py).
    w_steps, w_tokens = s.gate.trust.weight_counters(header.c_steps, header.c_tokens)
    weighed = replace(header, c_steps=w_steps, c_tokens=w_tokens)
    if not f.pending:
        f.first_arrival, f.first_unit = now, header.unit
    pending = Pending(weighed, delta, now, measured.norms, keys=(key,))
    earlier = f.pending.get(header.unit)
    if earlier is not None:
        pending = earlier.plus(pending)  # unmerged pushes of one unit add up
    f.pending[header.unit] = pending
    f.last_push[header.unit] = now
    if header.quant_error is not None:
        s.metrics.quant_error.observe(header.quant_error)
    log.info(
        "event=push_accepted fragment=%d unit=%s attempt=%d base=%d version=%d c_steps=%d "
        "c_tokens=%d pending=%d scheme=%s",
        f.index,
        header.unit,
        header.attempt,
        header.base_version,
        f.version,
        header.c_steps,
        header.c_tokens,
        len(f.pending),
        header.scheme,
    )
    schedule_merge(s, f)
    return _accepted(f, duplicate=False)


async def decode_body(s: SyncerState, f: FragmentState, body: bytes) -> MeasuredPush:
    """The push body decoded and measured off the event loop; Reject when it is larger than the
    fragment allows, or unreadable."""
    if len(body) > f.max_body:
        raise Reject(
            413,
            "too_large",
            f"body of {len(body)} bytes exceeds {f.max_body} for fragment {f.index}",
        )
    loop = asyncio.get_running_loop()
    s.decoding += 1
    try:
        return await loop.run_in_executor(s.pools.decode, decode_measured, body)
    except PayloadMismatch as exc:
        raise Reject(422, "mismatch", str(exc)) from exc
    except WireError as exc:
        raise Reject(400, "malformed", str(exc)) from exc
    finally:
        s.decoding -= 1


def _accepted(f: FragmentState, duplicate: bool) -> dict[str, Any]:
    """The reply to an accepted push: the fragment's version and queue as they stand."""
    return {
        "accepted": True,
        "duplicate": duplicate,
        "version": f.version,
        "pending": len(f.pending),
    }


def check_sender(s: SyncerState, header: PushHeader, caller: str | None) -> None:
    """The payload's unit is the caller, its attempt joined, and not quarantined."""
    if caller is not None and header.unit != caller:
        raise Reject(403, "identity_mismatch", f"payload unit {header.unit!r} != caller {caller!r}")
    record = s.learners.records.get(header.unit)
    if record is None or header.attempt not in record.joined:
        raise Reject(
            409,
            "not_joined",
            f"unit {header.unit!r} attempt {header.attempt} has not joined: join first",
        )
    s.learners.check_current(header.unit, header.attempt)
    s.gate.quarantined(header.unit, header.attempt)


def check_counters(s: SyncerState, header: PushHeader, now: float) -> PushHeader:
    """The push's counters checked against what its attempt could have done (trust.py); the
    header with its step filled in when the sender left it 0 (a learner that predates the
    field: its push is taken to follow the fragment's previous one without a gap). Raises
    Reject(422) and counts the refusal when they are impossible."""
    previous = s.learners.previous_push(header.unit, header.attempt, header.fragment)
    if header.step == 0:
        header = replace(header, step=previous + header.c_steps)
    elapsed, peers = s.learners.reach(header.unit, header.attempt, now)
    try:
        s.gate.trust.check_push(
            header.step, header.c_steps, header.c_tokens, previous, elapsed, peers
        )
    except Implausible as exc:
        raise s.gate.refused(header.unit, "push", exc) from exc
    return header

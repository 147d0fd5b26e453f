"""The syncer's merge rounds: when a fragment's pending pushes merge (quorum, then a grace window
for the learners still expected), and the merge itself: outer step off the loop, journal the new
version, advance the downlink publication, then install it on the loop thread."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from diloco_trainer.downlink import Publication
from diloco_trainer.merge import Contribution, participation_share
from diloco_trainer.outer import OuterOptimizer
from diloco_trainer.syncer import robust
from diloco_trainer.syncer.fragment import (
    FragmentState,
    Pending,
    PushKey,
    expected_arrival,
    finite_norm,
    put_back,
    recent_merges,
)
from diloco_trainer.syncer.grace import grace_window, slack_seconds
from diloco_trainer.syncer.health import retry_delay
from diloco_trainer.syncer.journal import JournaledFragment

if TYPE_CHECKING:
    from diloco_trainer.syncer.checkpoint import CheckpointStore
    from diloco_trainer.syncer.state import SyncerState

log = logging.getLogger("diloco.syncer")


def contributors(s: SyncerState, f: FragmentState, now: float) -> list[str]:
    """The learners a merge of `f` waits for and is a share of. Phase-locked: those in step
    with the others on `f` (`LearnerRegistry.in_phase`); a unit killed a heartbeat or two
    ago, or one that joined since f's last merge, would only hold the merge back for the
    whole grace window and make its step smaller. Otherwise: every online learner."""
    if s.cfg.phase_lock:
        return s.learners.in_phase(now, 2 * s.cfg.heartbeat_seconds, f.last_merge)
    return s.learners.online(now)


def schedule_merge(s: SyncerState, f: FragmentState) -> None:
    if len(f.pending) < s.cfg.quorum:
        return
    now = time.time()
    missing = [u for u in contributors(s, f, now) if u not in f.pending]
    if f.merge_task is not None:
        if not missing:
            f.all_in.set()
        return
    if (
        s.cfg.phase_lock
        and missing
        and all(p.header.base_version < f.version for p in f.pending.values())
    ):
        # Only pushes that missed the last merge: they ride along with the next round's. A
        # merge of them alone would be a version in mid-round, and installing it overwrites
        # every learner's progress on f since the round's merge.
        return
    f.quorum_time = now
    first = s.learners.get(f.first_unit) if f.first_unit else None
    # Phase-locked learners push p together. One that misses the merge sends a delta from
    # the old version into the next one (stale), which costs more than the few steps the
    # others drop while the merge waits: the bound is maxSeconds, not the overlap slack.
    slack = (
        s.cfg.grace.max_seconds
        if s.cfg.phase_lock
        else slack_seconds(
            s.cfg.overlap,
            first.step_time.value if first else None,
            now - (f.first_arrival or now),
            s.sync_time.value or 0.0,
            s.cfg.grace.max_seconds,
        )
    )
    lateness = [
        expected_arrival(
            f.last_push.get(u), s.learners.get(u).step_time.value, s.cfg.inner_steps, now
        )
        for u in missing
    ]
    grace = grace_window(
        s.cfg.grace.mode,
        s.cfg.grace.max_seconds,
        lateness,
        slack,
        whole_slack=s.cfg.phase_lock,
    )
    s.metrics.grace_seconds.observe(grace)
    f.all_in = asyncio.Event()
    f.merge_task = asyncio.get_running_loop().create_task(_merge_after(s, f, grace))


async def _merge_after(s: SyncerState, f: FragmentState, grace: float) -> None:
    try:
        if grace > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(f.all_in.wait(), grace)
        await _merge(s, f)
        f.merge_failures = 0
        if all(g.merge_failures == 0 for g in s.frags):  # no other fragment failing
            s.health.recovered("merge")
    except Exception as exc:
        f.merge_failures += 1
        s.failed("merge", exc)
        delay = retry_delay(f.merge_failures)
        log.exception(
            "event=merge_failed fragment=%d failures=%d retry_in=%.1f pending=%d",
            f.index,
            f.merge_failures,
            delay,
            len(f.pending),
        )
        await asyncio.sleep(delay)  # still the fragment's merge task: no merge meanwhile
    finally:
        f.merge_task = None
    if len(f.pending) >= s.cfg.quorum:
        schedule_merge(s, f)


async def _merge(s: SyncerState, f: FragmentState) -> None:
    pending, f.pending = f.pending, {}
    f.first_arrival = f.first_unit = f.quorum_time = None
    try:
        screened = await _screened(s, f, pending)
    except BaseException:
        put_back(f, pending)
        raise
    contributions = screened.contributions
    share = 1.0
    if s.cfg.merge.participation_scaling:
        online = set(contributors(s, f, time.time())) | set(pending)
        share = participation_share(len(contributions), len(online))
    keys = [key for p in pending.values() for key in p.keys]
    merged = recent_merges(f.merged, keys, f.version + 1, s.cfg.max_staleness)
    started = time.perf_counter()
    try:
        computed = await _merge_steps(s, f, contributions, share, merged)
    except BaseException:
        put_back(f, pending)  # nothing was installed: the round merges on the next try
        raise
    if computed is None:
        s.metrics.merges_refused.labels(str(f.index)).inc()
        log.error(
            "event=merge_refused fragment=%d version=%d reason=non_finite units=%s "
            "action=contributions_dropped",
            f.index,
            f.version,
            ",".join(sorted(pending)),
        )
        return
    new_params, new_state, publication, norm = computed
    new_version = f.version + 1
    elapsed = time.perf_counter() - started
    f.params, f.opt_state, f.publication, f.norm = new_params, new_state, publication, norm
    f.version, f.merged = new_version, merged
    f.last_merge = time.time()
    s.sync_time.update(elapsed)
    s.metrics.merges.labels(str(f.index)).inc()
    s.metrics.merge_seconds.observe(elapsed)
    s.metrics.merge_contributions.observe(len(contributions))
    judge(s, f, pending, screened)
    s.publish_gauges()
    f.changed.set()
    f.changed = asyncio.Event()
    log.info(
        "event=merged fragment=%d version=%d contributions=%d share=%.3f units=%s seconds=%.4f "
        "screens=%s",
        f.index,
        f.version,
        len(contributions),
        share,
        ",".join(sorted(pending)),
        elapsed,
        verdict_summary(screened),
    )


async def _screened(s: SyncerState, f: FragmentState, pending: dict[str, Pending]) -> robust.Round:
    """The round's contributions through the robust screens (robust.py), in the merge thread."""
    units = list(pending)
    contributions = [
        Contribution(p.delta, p.header.c_steps, p.header.c_tokens, p.norms)
        for p in pending.values()
    ]
    first = robust.start(units, contributions, f.typical_norm)
    job = functools.partial(s.gate.screen, first, s.cfg.merge.token_weighting)
    return await asyncio.get_running_loop().run_in_executor(s.pools.merge, job)


def judge(s: SyncerState, f: FragmentState, pending: dict[str, Pending], r: robust.Round) -> None:
    """After a merge landed: count each push's verdict, quarantine the attempts that keep
    sending outliers, and remember the fragment's typical delta norm for small rounds."""
    for unit, verdict in r.verdicts.items():
        s.metrics.screened.labels(verdict.action).inc()
        attempt = pending[unit].header.attempt
        silences = s.learners.get(unit).silences
        reason = s.gate.quarantine.record(unit, attempt, verdict, silences)
        if reason is not None:
            s.metrics.quarantined.inc()
            log.warning(
                "event=quarantined unit=%s attempt=%d fragment=%d reason=%r",
                unit,
                attempt,
                f.index,
                reason,
            )
    kept = [robust.delta_norm(c) for c in r.contributions]
    if kept:
        median = float(np.median(kept))
        f.typical_norm = median if f.typical_norm is None else 0.7 * f.typical_norm + 0.3 * median


def verdict_summary(r: robust.Round) -> str:
    return ",".join(
        f"{u}:{v.action}"
        + ("" if v.norm_ratio is None else f"/{v.norm_ratio:.2f}")
        + ("" if v.cosine is None else f"/{v.cosine:.2f}")
        for u, v in sorted(r.verdicts.items())
    )


async def _merge_steps(
    s: SyncerState,
    f: FragmentState,
    contributions: list[Contribution],
    share: float,
    merged: dict[PushKey, int],
) -> tuple[dict[str, np.ndarray], Any, Publication | None, float] | None:
    """The merge's new parameters, optimizer state, publication and norm, with the new
    version journaled (and `merged`, the pushes it and its recent predecessors hold); None
    (nothing journaled) when the parameters are not finite."""
    loop = asyncio.get_running_loop()
    new_params, new_state = await loop.run_in_executor(
        s.pools.merge, s.merge_compute, f.params, f.opt_state, contributions, share
    )
    norm = await loop.run_in_executor(s.pools.merge, finite_norm, new_params)
    if norm is None:
        return None
    new_version = f.version + 1
    if s.store is not None:
        # Journal first, announce second: neither a number nor the content a learner has seen
        # is lost by a crash (journal.py).
        s.published[f.index] = max(s.published[f.index], new_version)
        entry = functools.partial(
            journal_entry, f.index, new_version, new_params, new_state, merged
        )
        await loop.run_in_executor(s.pools.journal, _record, s.store, entry, list(s.published))
    publication = f.publication
    if publication is not None:
        comp = s.cfg.compression
        publication = await loop.run_in_executor(
            s.pools.merge,
            publication.advance,
            new_params,
            new_version,
            comp.downlink,
            comp.block_size,
        )
    return new_params, new_state, publication, norm


def journal_entry(
    index: int,
    version: int,
    params: dict[str, np.ndarray],
    state: Any,
    merged: dict[PushKey, int] | None = None,
) -> JournaledFragment:
    return JournaledFragment(
        index,
        version,
        params,
        OuterOptimizer.state_leaves(state),
        last_merge=time.time(),
        merged=dict(merged or {}),
    )


def _record(
    store: CheckpointStore, entry: functools.partial[JournaledFragment], published: list[int]
) -> None:
    """The content first, then the number (in the journal thread): a version number on record
    always has its content on record, or an older checkpoint's at a lower number."""
    store.record_fragment(entry())
    store.record_versions(published)

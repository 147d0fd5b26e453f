"""The run's queue, checked against the cluster: a run labelled with a LocalQueue that does not
exist (or a cluster without Kueue) gets the condition QueueFound=False and a Warning Event,
instead of units that only look Pending forever. The lookup is cached per run for a while."""

from __future__ import annotations

import logging
import time
from typing import Any

import kopf

from diloco_operator.api import DilocoRunStatus
from diloco_operator.k8s import builders, kube
from diloco_operator.k8s.kueue import QueueLookup, queue_found_condition, queue_name

log = logging.getLogger("diloco_operator")

# Seconds a lookup is trusted: a queue created after the run is seen within this long.
LOOKUP_TTL = 10.0
_lookups: dict[tuple[str, str, str], tuple[float, QueueLookup]] = {}


async def _lookup(namespace: str, queue: str, run: str) -> QueueLookup:
    key = (namespace, run, queue)
    cached = _lookups.get(key)
    if cached is not None and time.monotonic() - cached[0] < LOOKUP_TTL:
        return cached[1]
    result = await kube.local_queue(namespace, queue)
    if len(_lookups) > 10_000:
        _lookups.clear()
    _lookups[key] = (time.monotonic(), result)
    return result


def forget(namespace: str, run: str) -> None:
    for key in [k for k in _lookups if k[:2] == (namespace, run)]:
        _lookups.pop(key, None)


async def report_queue(
    run: builders.Run,
    status: DilocoRunStatus,
    before: DilocoRunStatus | None,
    body: Any,
    generation: int | None,
) -> DilocoRunStatus:
    """Set QueueFound for a run with a queue label; post a Warning when it turns False or its
    message changes. Runs without the label are returned unchanged."""
    queue = queue_name(run.labels)
    if queue is None:
        return status
    try:
        lookup = await _lookup(run.namespace, queue, run.name)
    except kube.ApiException as exc:  # e.g. 403: say nothing rather than something wrong
        log.warning("queue lookup failed run=%s queue=%s status=%s", run.name, queue, exc.status)
        return status
    conditions, warning = queue_found_condition(
        list(status.conditions), queue, lookup, time.time(), generation
    )
    old = next((c for c in (before.conditions if before else []) if c.type == "QueueFound"), None)
    if warning is not None and (old is None or old.message != warning):
        reason = next(c.reason for c in conditions if c.type == "QueueFound")
        kopf.event(body, type="Warning", reason=reason, message=warning)
        log.warning("event run=%s reason=%s message=%s", run.name, reason, warning)
    conditions.sort(key=lambda c: c.type)
    return status.model_copy(update={"conditions": conditions})

"""The syncer's one middleware: who may call what (bearer auth on /v1/*), the per-unit rate
limits, and the one place a Reject becomes a 4xx and a log line (docs/protocol.md)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from diloco_trainer.auth import SPARE_PREFIX, UNIT_HEADER, Caller
from diloco_trainer.syncer.admission import authenticate
from diloco_trainer.syncer.conn import CONNECTIONS_KEY
from diloco_trainer.syncer.core import Syncer
from diloco_trainer.syncer.fragment import Reject
from diloco_trainer.syncer.http_common import (
    CALLER_KEY,
    ROSTER_PATH,
    SPARE_COVER_PATH,
    SPARE_WAIT_PATH,
    STATUS_PATH,
    SYNCER_KEY,
    json_error,
)
from diloco_trainer.syncer.limits import kind_of, retry_after

log = logging.getLogger("diloco.syncer")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# What the operator's run secret may do besides reading (GET).
OPERATOR_WRITES = frozenset({("PUT", ROSTER_PATH), ("POST", SPARE_COVER_PATH)})


def _allowed(caller: Caller, method: str, path: str) -> None:
    """Refuse (403) a call outside what the caller's kind of credential is for."""
    if caller.operator:
        if method != "GET" and (method, path) not in OPERATOR_WRITES:
            raise Reject(
                403,
                "forbidden",
                "the run token is for status reads, the roster and covers; a learner sends its "
                f"unit token and {UNIT_HEADER}",
            )
    elif caller.observer:
        if (method, path) != ("GET", STATUS_PATH):
            raise Reject(403, "forbidden", "a join credential's observer reads the status only")
    elif path == SPARE_COVER_PATH:
        raise Reject(403, "forbidden", "covers are asked for with the run token")
    elif (caller.unit or "").startswith(SPARE_PREFIX) != (path == SPARE_WAIT_PATH):
        raise Reject(
            403,
            "forbidden",
            "a spare's token is for waiting on a unit to cover, and only a spare waits",
        )


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bearer auth on /v1/*, and one place that turns Reject into a 4xx + log line."""
    syncer = request.app[SYNCER_KEY]
    request.app[CONNECTIONS_KEY].served(request)
    try:
        if request.path.startswith("/v1/"):
            caller = authenticate(syncer, request.headers)
            _allowed(caller, request.method, request.path)
            request[CALLER_KEY] = caller
            unit = caller.unit
            if unit is not None and not caller.observer and not unit.startswith(SPARE_PREFIX):
                syncer.gate.admit(unit)
                throttled = _throttle(syncer, unit, request)
                if throttled is not None:
                    return throttled
        return await handler(request)
    except Reject as exc:
        if request.path.endswith("/push"):
            syncer.metrics.pushes.labels("rejected", exc.reason).inc()
        log.warning(
            "event=rejected method=%s path=%s status=%d reason=%s message=%r peer=%s",
            request.method,
            request.path,
            exc.status,
            exc.reason,
            exc.message,
            request.remote,
        )
        return json_error(exc.status, exc.reason, exc.message)
    except web.HTTPRequestEntityTooLarge as exc:
        syncer.metrics.pushes.labels("rejected", "too_large").inc()
        log.warning("event=rejected path=%s status=413 reason=too_large", request.path)
        return json_error(413, "too_large", exc.text or "request body too large")


def _throttle(syncer: Syncer, unit: str, request: web.Request) -> web.Response | None:
    """A 429 with Retry-After when `unit` sends requests of this kind faster than any honest
    learner does (limits.py), else None."""
    kind = kind_of(request.method, request.path)
    if kind is None:
        return None
    now = time.monotonic()
    wait = syncer.gate.limits.take(unit, kind, now)
    if wait <= 0:
        return None
    syncer.metrics.limited.labels(kind).inc()
    if syncer.gate.limits.should_log(unit, now):
        log.warning(
            "event=rate_limited unit=%s kind=%s retry_after=%.2f peer=%s (logged once a minute)",
            unit,
            kind,
            wait,
            request.remote,
        )
    response = json_error(
        429, "rate_limited", f"{kind} requests of unit {unit!r} too frequent: retry in {wait:.2f}s"
    )
    response.headers["Retry-After"] = retry_after(wait)
    return response

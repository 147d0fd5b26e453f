"""HTTP surface of the syncer (aiohttp): auth, request parsing, error mapping. See docs/protocol.md."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from diloco_trainer.syncer import Syncer
from diloco_trainer.syncer_fragment import MAX_POLL_WAIT, Reject
from diloco_trainer.wire import encode_params

log = logging.getLogger("diloco.syncer")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SYNCER_KEY = web.AppKey("syncer", Syncer)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, text=json.dumps(data), content_type="application/json")


def _tensors(payload: bytes, **headers: str) -> web.Response:
    return web.Response(body=payload, content_type="application/octet-stream", headers=headers)


def json_error(status: int, reason: str, message: str) -> web.Response:
    return web.Response(
        status=status,
        text=json.dumps({"error": message, "reason": reason}),
        content_type="application/json",
    )


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bearer auth on /v1/*, and one place that turns Reject into a 4xx + log line."""
    syncer = request.app[SYNCER_KEY]
    try:
        if request.path.startswith("/v1/"):
            auth = request.headers.get("Authorization", "")
            given = auth[7:] if auth.startswith("Bearer ") else ""
            if not given or not hmac.compare_digest(given.encode(), syncer.token.encode()):
                raise Reject(401, "unauthorized", "missing or wrong bearer token")
        return await handler(request)
    except Reject as exc:
        if request.path.endswith("/push"):
            syncer.metrics.pushes.labels("rejected", exc.reason).inc()
        log.warning(
            "event=rejected method=%s path=%s status=%d reason=%s message=%r peer=%s",
            request.method, request.path, exc.status, exc.reason, exc.message, request.remote,
        )  # fmt: skip
        return json_error(exc.status, exc.reason, exc.message)
    except web.HTTPRequestEntityTooLarge as exc:
        syncer.metrics.pushes.labels("rejected", "too_large").inc()
        log.warning("event=rejected path=%s status=413 reason=too_large", request.path)
        return json_error(413, "too_large", exc.text or "request body too large")


async def _json_body(request: web.Request) -> dict[str, Any]:
    body = await request.read()
    request.app[SYNCER_KEY].bytes_received += len(body)
    try:
        data = json.loads(body or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Reject(400, "malformed", f"body is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise Reject(400, "malformed", "body must be a JSON object")
    return data


def _field(
    data: dict[str, Any], name: str, kind: type, default: Any = ..., minimum: float | None = None
) -> Any:
    if name not in data or data[name] is None:
        if default is ...:
            raise Reject(400, "bad_request", f"{name}: required")
        return default
    value = data[name]
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok:
        raise Reject(400, "bad_request", f"{name}: expected {kind.__name__}, got {value!r}")
    if minimum is not None and value < minimum:
        raise Reject(400, "bad_request", f"{name}: must be >= {minimum}, got {value}")
    return float(value) if kind is float else value


def _identity(data: dict[str, Any]) -> tuple[str, int, str]:
    unit = _field(data, "unit", str)
    if not unit:
        raise Reject(400, "bad_request", "unit: must not be empty")
    return unit, _field(data, "attempt", int, 0, 0), _field(data, "group", str, "default")


async def join(request: web.Request) -> web.Response:
    s = request.app[SYNCER_KEY]
    unit, attempt, group = _identity(await _json_body(request))

    s.learners.seen(unit, attempt, group, time.time())
    resume_step = s.learners.resume_step(unit, attempt)  # where its LR schedule continues
    log.info(
        "event=join unit=%s attempt=%d group=%s versions=%s resume_step=%d",
        unit, attempt, group, s.versions(), resume_step,
    )  # fmt: skip
    # The learner holds the same config (compression, innerSteps, ...); the reply carries only
    # what the run's state decides.
    return _json(
        {
            "run": s.run,
            "layout": [f.names for f in s.frags],
            "versions": s.versions(),
            "complete": s.complete,
            "outerStep": s.outer_step,
            "resumeStep": resume_step,
            "shapes": {k: list(v) for k, v in s.shapes.items()},
        }
    )


async def heartbeat(request: web.Request) -> web.Response:
    s = request.app[SYNCER_KEY]
    data = await _json_body(request)
    unit, attempt, group = _identity(data)

    s.learners.heartbeat(
        unit,
        attempt,
        group,
        step=_field(data, "step", int, minimum=0),
        tokens=_field(data, "tokens", int, minimum=0),
        tokens_per_sec=_field(data, "tokensPerSec", float, 0.0, 0.0),
        loss=_field(data, "loss", float, None),
        now=time.time(),
    )
    s._publish_gauges()
    s.check_complete()
    return _json({"complete": s.complete, "versions": s.versions(), "outerStep": s.outer_step})


async def params(request: web.Request) -> web.Response:
    s = request.app[SYNCER_KEY]
    snap: dict[str, Any] = {}
    for f in s.frags:
        snap.update(f.published())
    versions = s.versions()
    payload = await asyncio.get_running_loop().run_in_executor(
        None, encode_params, snap, versions, None, s.epoch
    )
    s.bytes_sent += len(payload)
    s.metrics.bytes_out.inc(len(payload))
    return _tensors(payload, **{"X-Diloco-Versions": json.dumps(versions)})


async def push(request: web.Request) -> web.Response:
    s = request.app[SYNCER_KEY]
    f = s.fragment(request.match_info["p"])
    length = request.content_length
    if length is not None and length > f.max_body:
        raise Reject(
            413, "too_large", f"body of {length} bytes exceeds {f.max_body} for fragment {f.index}"
        )
    body = await request.read()
    s.bytes_received += len(body)
    s.metrics.bytes_in.inc(len(body))
    reply = await s.accept_push(f, body)
    s.metrics.pushes.labels("accepted", "duplicate" if reply["duplicate"] else "ok").inc()
    return _json(reply)


async def poll(request: web.Request) -> web.Response:
    s = request.app[SYNCER_KEY]
    f = s.fragment(request.match_info["p"])
    try:
        after = int(request.query.get("after", "-1"))
        wait = float(request.query.get("wait", "0"))
    except ValueError as exc:
        raise Reject(400, "bad_request", f"after/wait: {exc}") from exc
    if not math.isfinite(wait) or wait < 0:
        raise Reject(400, "bad_request", f"wait: must be a finite number >= 0, got {wait}")
    if not await s.wait_for_change(f, after, min(wait, MAX_POLL_WAIT)):
        return web.Response(status=204, headers={"X-Diloco-Version": str(f.version)})
    payload = await s.fragment_payload(f, after, request.query.get("epoch", ""))
    s.bytes_sent += len(payload)
    s.metrics.bytes_out.inc(len(payload))
    return _tensors(payload, **{"X-Diloco-Version": str(f.version)})


async def status(request: web.Request) -> web.Response:
    return _json(request.app[SYNCER_KEY].status().to_json())


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def metrics(request: web.Request) -> web.Response:
    s = request.app[SYNCER_KEY]
    s._publish_gauges()
    return web.Response(
        body=generate_latest(s.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


def build_app(syncer: Syncer) -> web.Application:
    # The global cap is the largest fragment's bound; each push is checked against its own.
    app = web.Application(
        middlewares=[guard], client_max_size=max(f.max_body for f in syncer.frags) + 1
    )
    app[SYNCER_KEY] = syncer
    app.router.add_post("/v1/join", join)
    app.router.add_post("/v1/heartbeat", heartbeat)
    app.router.add_get("/v1/params", params)
    app.router.add_post("/v1/fragments/{p}/push", push)
    app.router.add_get("/v1/fragments/{p}", poll)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.on_startup.append(syncer.start_background)
    app.on_shutdown.append(syncer.wake_pollers)
    app.on_cleanup.append(syncer.stop_background)
    return app

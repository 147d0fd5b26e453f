"""HTTP surface of the syncer (aiohttp): auth, request parsing, error mapping. See docs/protocol.md."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from diloco_trainer.auth import Caller
from diloco_trainer.payload import Pieces
from diloco_trainer.syncer import spare_api
from diloco_trainer.syncer.admission import check_layout
from diloco_trainer.syncer.conn import (
    CONNECTIONS_KEY,
    KEEPALIVE_SECONDS,
    ConnectionGuard,
    ServerLog,
    read_body,
)
from diloco_trainer.syncer.core import Syncer
from diloco_trainer.syncer.fields import counter, field_of
from diloco_trainer.syncer.fragment import MAX_POLL_WAIT, Reject
from diloco_trainer.syncer.http_common import (
    CALLER_KEY,
    JOIN_BODY_LIMIT,
    ROSTER_PATH,
    STATUS_PATH,
    SYNCER_KEY,
    json_body,
    json_response,
)
from diloco_trainer.syncer.http_guard import guard
from diloco_trainer.syncer.roster import Roster
from diloco_trainer.syncer.storage import CheckpointError
from diloco_trainer.tls import ServerTls
from diloco_trainer.wire import (
    DATA_POSITION_HEADER,
    MAX_COUNTER,
    DataLease,
    WireError,
    data_lease_from_json,
    params_pieces,
    parse_count,
    parse_data_position,
)

log = logging.getLogger("diloco.syncer")


async def _tensors(request: web.Request, payload: Pieces, **headers: str) -> web.StreamResponse:
    """Write a payload a slice at a time, straight from the arrays it points into. A learner
    that went away meanwhile (a cut or reset link, a restart; a long poll's answer finds it
    gone most often) is no error of the syncer's: one line, and aiohttp closes the connection."""
    s = request.app[SYNCER_KEY]
    response = web.StreamResponse(headers=headers)
    response.content_type = "application/octet-stream"
    response.content_length = payload.size
    try:
        await response.prepare(request)
        for piece in payload.slices():
            await response.write(piece)
        await response.write_eof()
    except ConnectionError as exc:
        log.info("event=reply_dropped path=%s peer=%s error=%r", request.path, request.remote, exc)
        return response
    s.bytes_sent += payload.size
    s.metrics.bytes_out.inc(payload.size)
    return response


def _identity(request: web.Request, data: dict[str, Any]) -> tuple[str, int, str]:
    """The learner a JSON request speaks for: it must be the authenticated unit, and a unit new
    to the run only while the run has room for it."""
    unit = field_of(data, "unit", str)
    if not unit:
        raise Reject(400, "bad_request", "unit: must not be empty")
    caller: Caller = request[CALLER_KEY]
    if unit != caller.unit:
        raise Reject(403, "identity_mismatch", f"unit {unit!r} != caller {caller.unit!r}")
    group = field_of(data, "group", str, "default")
    if len(group) > 63:  # a DNS label, like every group name; status and logs carry it
        raise Reject(400, "bad_request", f"group: at most 63 characters, got {len(group)}")
    syncer = request.app[SYNCER_KEY]
    syncer.gate.admit(unit, group)
    attempt = counter(data, "attempt", 0)
    syncer.learners.check_current(unit, attempt)  # a newer process is the unit: 409 superseded
    return unit, attempt, group


async def join(request: web.Request) -> web.Response:
    s = request.app[SYNCER_KEY]
    data = await json_body(request, JOIN_BODY_LIMIT)
    unit, attempt, group = _identity(request, data)
    check_layout(s, data, unit)  # before anything of the unit is recorded
    s.learners.seen(unit, attempt, group, time.time()).joined.add(attempt)
    for spare in s.spares.release(unit, attempt):
        log.info("event=cover_over unit=%s attempt=%d spare=%s", unit, attempt, spare)
    resume_step = s.learners.resume_step(unit, attempt)  # where its LR schedule continues
    lease = None
    if s.shard.leads:  # the data lease book is shard 0's alone
        moves = s.leases.moves
        lease = s.leases.join(unit, _alive(s))
        await _journal_leases(s, moves)
    log.info(
        "event=join unit=%s attempt=%d group=%s versions=%s resume_step=%d credential=%s",
        unit,
        attempt,
        group,
        s.versions(),
        resume_step,
        request[CALLER_KEY].credential or "-",
    )
    # The learner holds the same config (compression, innerSteps, ...); the reply carries only
    # what the run's state decides.
    return json_response(
        {
            "run": s.run,
            "layout": [f.names for f in s.frags],
            "versions": s.versions(),
            "complete": s.complete,
            "outerStep": s.outer_step,
            "resumeStep": resume_step,
            "shapes": {k: list(v) for k, v in s.shapes.items()},
            "dataLease": None if lease is None else lease.to_json(),
            "shard": {"index": s.shard.index, "count": s.shard.count, "owners": s.owners},
        }
    )


def _alive(s: Syncer) -> list[str]:
    """Units whose data leases stay theirs (heard from recently)."""
    return s.learners.online(time.time(), s.lease_orphan_after)


async def _journal_leases(s: Syncer, moves_before: int) -> None:
    """After a lease was given, taken or finished (or after a failed journal write: the retry
    of a request changes nothing), and before the unit hears of it: journal the book, so that
    a syncer restarted from an older checkpoint hands no shard out twice."""
    behind = s.health.failing("lease_journal")  # the last write failed: the journal is behind
    if s.store is None or (s.leases.moves == moves_before and not behind):
        return
    book = s.leases.to_json()  # on the loop thread: the book as of this change
    try:
        await asyncio.get_running_loop().run_in_executor(
            s.pools.journal, s.store.record_leases, book
        )
    except (OSError, CheckpointError) as exc:
        # A full or failing disk: the unit asks again (5xx is retried) and is given the same
        # lease, already in the book; readiness says what fails meanwhile.
        s.failed("lease_journal", exc)
        raise Reject(
            503, "not_persisted", f"the data lease book cannot be journaled: {exc}"
        ) from exc
    s.health.recovered("lease_journal")


async def claim_data(request: web.Request) -> web.Response:
    """The unit read its shard to the end: its next lease (docs/protocol.md, "Data leases")."""
    s = request.app[SYNCER_KEY]
    if not s.shard.leads:
        raise Reject(
            421, "wrong_shard", f"data leases are syncer shard 0's; this is shard {s.shard.index}"
        )
    data = await json_body(request)
    unit, attempt, group = _identity(request, data)
    try:
        finished = data_lease_from_json(data.get("finished"), s.cfg.data.shards, "finished")
    except WireError as exc:
        raise Reject(400, "bad_request", str(exc)) from exc
    s.learners.seen(unit, attempt, group, time.time())
    moves = s.leases.moves
    lease = s.leases.claim(unit, finished, _alive(s))
    await _journal_leases(s, moves)
    return json_response({"dataLease": lease.to_json()})


def _data_position(request: web.Request) -> DataLease | None:
    raw = request.headers.get(DATA_POSITION_HEADER)
    if raw is None:
        return None
    try:
        return parse_data_position(raw, request.app[SYNCER_KEY].cfg.data.shards)
    except WireError as exc:
        raise Reject(400, "bad_request", str(exc)) from exc


async def heartbeat(request: web.Request) -> web.Response:
    s = request.app[SYNCER_KEY]
    data = await json_body(request)
    unit, attempt, group = _identity(request, data)
    step, tokens, now = counter(data, "step"), counter(data, "tokens"), time.time()
    s.gate.check_heartbeat(unit, attempt, step, tokens, now)
    s.learners.heartbeat(
        unit,
        attempt,
        group,
        step=step,
        tokens=tokens,
        tokens_per_sec=field_of(data, "tokensPerSec", float, 0.0, 0.0, float(MAX_COUNTER)),
        loss=field_of(data, "loss", float, None),
        now=now,
    )
    s.publish_gauges()
    s.check_complete()
    return json_response(
        {
            "complete": s.complete,
            "versions": s.versions(),
            "outerStep": s.outer_step,
            "budgetDone": round(s.budget_done, 6),
        }
    )


async def params(request: web.Request) -> web.StreamResponse:
    s = request.app[SYNCER_KEY]
    snap: dict[str, Any] = {}
    for f in s.frags:
        snap.update(f.published())
    versions = s.versions()
    payload = params_pieces(snap, versions, None, s.epoch)
    return await _tensors(request, payload, **{"X-Diloco-Versions": json.dumps(versions)})


async def push(request: web.Request) -> web.Response:
    s = request.app[SYNCER_KEY]
    f = s.fragment(request.match_info["p"])
    body = await read_body(request, f.max_body)
    s.bytes_received += len(body)
    s.metrics.bytes_in.inc(len(body))
    caller: Caller = request[CALLER_KEY]
    if caller.unit is None:  # unreachable: the guard lets the run token only GET
        raise Reject(403, "forbidden", "pushes need a unit token")
    at = _data_position(request)  # before the push: a bad header refuses both
    reply = await s.accept_push(f, body, caller.unit)
    if at is not None and s.shard.leads:
        moves = s.leases.moves
        s.leases.report(caller.unit, at)
        await _journal_leases(s, moves)
    s.metrics.pushes.labels("accepted", "duplicate" if reply["duplicate"] else "ok").inc()
    return json_response(reply)


async def poll(request: web.Request) -> web.StreamResponse:
    s = request.app[SYNCER_KEY]
    f = s.fragment(request.match_info["p"])
    raw_after = request.query.get("after", "-1")
    after = -1 if raw_after == "-1" else parse_count(raw_after)
    if after is None:
        raise Reject(400, "bad_request", f"after: not a version (-1 or 0..): {raw_after[:40]!r}")
    try:
        wait = float(request.query.get("wait", "0"))
    except ValueError as exc:
        raise Reject(400, "bad_request", f"wait: {exc}") from exc
    if not math.isfinite(wait) or wait < 0:
        raise Reject(400, "bad_request", f"wait: must be a finite number >= 0, got {wait}")
    if not await s.wait_for_change(f, after, min(wait, MAX_POLL_WAIT)):
        return web.Response(status=204, headers={"X-Diloco-Version": str(f.version)})
    version = f.version  # the payload's, whatever a merge does while it is written
    payload = await s.fragment_payload(f, after, request.query.get("epoch", ""))
    return await _tensors(request, payload, **{"X-Diloco-Version": str(version)})


async def put_roster(request: web.Request) -> web.Response:
    """The operator's unit roster (roster.py): taken when at least as new as the one held."""
    s = request.app[SYNCER_KEY]
    if not request[CALLER_KEY].operator:
        raise Reject(403, "forbidden", "the roster is set with the run token")
    try:
        roster = Roster.from_json(await json_body(request), "body")
    except ValueError as exc:
        raise Reject(400, "bad_request", str(exc)) from exc
    taken = s.take_roster(roster)
    if taken:
        await _write_roster(s)
    held = s.gate.roster_revision
    return json_response({"taken": taken, "revision": held}, status=200 if taken else 409)


async def _write_roster(s: Syncer) -> None:
    """Checkpoint a new roster before answering, so that a failover cannot bring back the one
    before it (a revocation undone, a changed budget restored). A failed write is already in
    readiness and the logs; the roster stays held and goes into the next checkpoint."""
    try:
        await s.save_checkpoint()
    except Exception as exc:
        log.warning("event=roster_not_checkpointed reason=%r", str(exc))


async def status(request: web.Request) -> web.Response:
    return json_response(request.app[SYNCER_KEY].status().to_json())


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process serves requests (a restart would not fix a full disk)."""
    return web.Response(text="ok")


async def readyz(request: web.Request) -> web.Response:
    """Readiness: 200 while the syncer can merge and write checkpoints, else 503 naming what
    fails (docs/protocol.md, "Readiness")."""
    health = request.app[SYNCER_KEY].health
    if health.ready:
        return web.Response(text="ready")
    return json_response(health.to_json(), status=503)


async def metrics(request: web.Request) -> web.Response:
    s = request.app[SYNCER_KEY]
    s.publish_gauges()
    return web.Response(
        body=generate_latest(s.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


def build_app(syncer: Syncer) -> web.Application:
    # The global cap is the largest fragment's bound; each push is checked against its own.
    app = web.Application(
        middlewares=[guard], client_max_size=max(f.max_body for f in syncer.frags) + 1
    )
    app[SYNCER_KEY] = syncer
    app[CONNECTIONS_KEY] = ConnectionGuard()
    app.router.add_post("/v1/join", join)
    app.router.add_post("/v1/heartbeat", heartbeat)
    app.router.add_post("/v1/data/claim", claim_data)
    app.router.add_get("/v1/params", params)
    app.router.add_post("/v1/fragments/{p}/push", push)
    app.router.add_get("/v1/fragments/{p}", poll)
    app.router.add_get(STATUS_PATH, status)
    app.router.add_put(ROSTER_PATH, put_roster)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    spare_api.add_routes(app)
    app.on_startup.append(syncer.start_background)
    app.on_shutdown.append(syncer.wake_pollers)
    app.on_cleanup.append(syncer.stop_background)
    return app


async def start_server(
    syncer: Syncer, host: str, port: int, tls: ServerTls | None = None
) -> tuple[web.AppRunner, int]:
    """Serve `syncer` on host:port (0: any free port) with the connection time limits of
    syncer_conn.py, over HTTPS only when `tls` is given (probes and /metrics too); returns the
    runner (`cleanup()` stops it) and the bound port."""
    app = build_app(syncer)
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        keepalive_timeout=KEEPALIVE_SECONDS,
        logger=ServerLog(lambda reason: syncer.metrics.malformed.labels(reason).inc()),
    )
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=tls.context if tls else None).start()
    # A background task of the syncer: stop_background (app cleanup) cancels it.
    syncer.background.append(asyncio.create_task(app[CONNECTIONS_KEY].watch(runner)))
    bound = [addr[1] for addr in runner.addresses if isinstance(addr, tuple)]
    return runner, int(bound[0]) if bound else port

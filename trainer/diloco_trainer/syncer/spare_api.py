"""The two requests of warm spares (spares.py; docs/protocol.md, "Warm spares"):

    POST /v1/spares/wait   a spare, with its own token: {"spare", "group", "wait"} -> 200 with
                           the unit identity to take, or 204 when none came within `wait`
    POST /v1/spares/cover  the operator, with the run secret: {"unit", "index", "numUnits",
                           "group", "attempt"} -> 200 {"spare"}, or 409 (no_spare, superseded,
                           cover_spent)

Both are shard 0's: the other shards of a sharded syncer answer 421 wrong_shard. A cover hands
the spare the unit's own token, which the syncer derives from the run secret it holds.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

from diloco_trainer.auth import SPARE_PREFIX, unit_token
from diloco_trainer.syncer.fields import counter, field_of
from diloco_trainer.syncer.fragment import MAX_POLL_WAIT, Reject
from diloco_trainer.syncer.http_common import (
    CALLER_KEY,
    SPARE_COVER_PATH,
    SPARE_WAIT_PATH,
    SYNCER_KEY,
    json_body,
    json_response,
)
from diloco_trainer.syncer.spares import Cover

log = logging.getLogger("diloco.syncer")


def _lead_shard(request: web.Request) -> None:
    s = request.app[SYNCER_KEY]
    if not s.shard.leads:
        raise Reject(
            421, "wrong_shard", f"warm spares wait at syncer shard 0; this is shard {s.shard.index}"
        )


def _label(data: dict[str, object], name: str) -> str:
    value = field_of(data, name, str)
    if not value or len(value) > 63:
        raise Reject(400, "bad_request", f"{name}: 1 to 63 characters, got {len(value)}")
    return value


async def wait_for_cover(request: web.Request) -> web.Response:
    _lead_shard(request)
    s = request.app[SYNCER_KEY]
    data = await json_body(request)
    name = field_of(data, "spare", str)
    caller = request[CALLER_KEY].unit or ""
    if SPARE_PREFIX + name != caller:
        raise Reject(403, "identity_mismatch", f"spare {name!r} != caller {caller!r}")
    group = _label(data, "group")
    seconds = field_of(data, "wait", float, 0.0, 0.0, MAX_POLL_WAIT)
    cover = await s.spares.wait(name, group, seconds)
    if cover is None:
        return web.Response(status=204)
    log.info("event=cover_handed spare=%s unit=%s attempt=%d", name, cover.unit_name, cover.attempt)
    return json_response(cover.identity(unit_token(s.token, cover.unit_name)))


async def cover_unit(request: web.Request) -> web.Response:
    _lead_shard(request)
    s = request.app[SYNCER_KEY]
    data = await json_body(request)
    unit, group = _label(data, "unit"), _label(data, "group")
    s.gate.admit(unit, group)  # only a unit of the run, in its own group
    num_units = counter(data, "numUnits", 1)
    index = counter(data, "index")
    if index >= num_units:
        raise Reject(400, "bad_request", f"index: {index} is not below numUnits {num_units}")
    wanted = Cover(unit, index, num_units, group, counter(data, "attempt"), time.time())
    spare = s.spares.cover(wanted, s.learners.newest_joined(unit))
    log.info("event=cover unit=%s attempt=%d spare=%s", unit, wanted.attempt, spare)
    return json_response({"spare": spare})


def add_routes(app: web.Application) -> None:
    app.router.add_post(SPARE_WAIT_PATH, wait_for_cover)
    app.router.add_post(SPARE_COVER_PATH, cover_unit)

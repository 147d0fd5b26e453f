"""What every part of the syncer's HTTP surface shares: the app and request keys, the paths the
guard treats apart, JSON bodies in and out, and the error shape of docs/protocol.md."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from diloco_trainer.auth import Caller
from diloco_trainer.syncer.conn import read_body
from diloco_trainer.syncer.core import Syncer
from diloco_trainer.syncer.fragment import Reject
from diloco_trainer.wire import loads_json

SYNCER_KEY = web.AppKey("syncer", Syncer)
CALLER_KEY = web.RequestKey("caller", Caller)
ROSTER_PATH = "/v1/units"
STATUS_PATH = "/v1/status"
# Warm spares wait here for a unit to cover; the operator asks for a cover here (spare_api.py).
SPARE_WAIT_PATH = "/v1/spares/wait"
SPARE_COVER_PATH = "/v1/spares/cover"

# Heartbeat and claim bodies are a few hundred bytes; a join carries the learner's fragment plan
# (layout_plan.py: up to MAX_PLAN_BYTES, else its fingerprint alone).
JSON_BODY_LIMIT = 64 * 1024
JOIN_BODY_LIMIT = 1024 * 1024


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, text=json.dumps(data), content_type="application/json")


def json_error(status: int, reason: str, message: str) -> web.Response:
    return web.Response(
        status=status,
        text=json.dumps({"error": message, "reason": reason}),
        content_type="application/json",
    )


async def json_body(request: web.Request, limit: int | None = None) -> dict[str, Any]:
    body = await read_body(request, limit or JSON_BODY_LIMIT)
    request.app[SYNCER_KEY].bytes_received += len(body)
    try:
        data = loads_json(body or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Reject(400, "malformed", f"body is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise Reject(400, "malformed", "body must be a JSON object")
    return data

"""Time limits on the syncer's connections, so a slow or stalled client cannot hold one open.

aiohttp closes a kept-alive connection that stays idle (or only part-sends its next request
head) for `keepalive_timeout`, but only after a first response: a fresh connection that
dribbles its request head byte by byte is never closed by it, and a request body is read for
as long as the client keeps it coming. So:

- head: a connection with no request started `HEADER_SECONDS` after it was accepted is closed
  (`ConnectionGuard`, a sweep over the server's connections); later heads on a kept-alive
  connection fall under `KEEPALIVE_SECONDS`;
- body: `read_body` answers 408 when no byte came for `BODY_IDLE_SECONDS`, or when the whole
  body took longer than `BODY_BASE_SECONDS` plus its length at `BODY_MIN_RATE`.

Requests that are not HTTP at all (a request line or header over aiohttp's 8 KiB limit, a bad
request line, TLS spoken to the plain port) get aiohttp's 400 and one WARNING line naming the peer
and the reason (`ServerLog`): aiohttp's own ERROR with a traceback per request would bury the
errors that matter under what any port scanner sends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError, LineTooLong

from diloco_trainer.syncer.fragment import Reject

HEADER_SECONDS = 10.0
KEEPALIVE_SECONDS = 15.0
BODY_IDLE_SECONDS = 10.0
BODY_BASE_SECONDS = 30.0
BODY_MIN_RATE = 1 << 20  # bytes per second: a largest push (100m model, fp32) in ~6 minutes
SWEEP_SECONDS = 0.5


class ConnectionGuard:
    """Closes connections that have not started a request `header_seconds` after they were
    first seen. The app's middleware calls `served` for each request."""

    def __init__(self, header_seconds: float = HEADER_SECONDS) -> None:
        self.header_seconds = header_seconds
        # Keyed by aiohttp's RequestHandler (no weak references: it has __slots__); each sweep
        # forgets the connections that are gone.
        self._first_seen: dict[Any, float] = {}
        self._served: set[Any] = set()
        self.closed = 0

    def served(self, request: web.BaseRequest) -> None:
        self._served.add(request.protocol)

    def sweep(self, connections: Iterable[Any], now: float) -> None:
        live = set(connections)
        self._served &= live
        self._first_seen = {h: t for h, t in self._first_seen.items() if h in live}
        for handler in live:
            first = self._first_seen.setdefault(handler, now)
            if handler in self._served or now - first < self.header_seconds:
                continue
            transport = handler.transport
            if transport is not None and not transport.is_closing():
                transport.close()
                self.closed += 1

    async def watch(self, runner: web.BaseRunner) -> None:
        """Sweep `runner`'s connections until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            server = runner.server
            if server is not None:
                self.sweep(server.connections, loop.time())
            await asyncio.sleep(SWEEP_SECONDS)


CONNECTIONS_KEY = web.AppKey("connections", ConnectionGuard)


def malformed_reason(exc: HttpProcessingError) -> str:
    """A short name for why a request could not be parsed as HTTP."""
    if isinstance(exc, LineTooLong):
        return "line_too_long"
    if isinstance(exc, BadHttpMethod):
        # aiohttp recognises a TLS handshake and says so in the message.
        return "tls_on_plain_port" if "HTTPS" in (exc.message or "") else "bad_method"
    return type(exc).__name__


class ServerLog(logging.Logger):
    """The logger aiohttp's request handler reports to (`AppRunner(logger=...)`). A request
    that is not HTTP becomes one WARNING line (`event=malformed_request`) and a count; any
    other error keeps its traceback, on the syncer's logger."""

    def __init__(self, count: Callable[[str], None]) -> None:
        super().__init__("diloco.syncer.http")
        self.count, self.target = count, logging.getLogger("diloco.syncer")

    def _malformed(self, args: tuple[Any, ...], exc: object) -> bool:
        if not isinstance(exc, HttpProcessingError):
            return False
        reason = malformed_reason(exc)
        self.count(reason)
        peer = args[0] if args else "?"
        detail = (exc.message or "").strip().split("\n")[0][:120]
        self.target.warning(
            "event=malformed_request peer=%s status=400 reason=%s detail=%r", peer, reason, detail
        )
        return True

    def exception(self, msg: object, *args: Any, exc_info: Any = True, **kw: Any) -> None:
        if not self._malformed(args, exc_info):
            self.target.exception(msg, *args, exc_info=exc_info, **kw)

    def debug(self, msg: object, *args: Any, exc_info: Any = None, **kw: Any) -> None:
        # aiohttp reports a bad method on a connection's first request at DEBUG: TLS or
        # another protocol sent to this port, which is worth one line too.
        if not self._malformed(args, exc_info):
            self.target.debug(msg, *args, exc_info=exc_info, **kw)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, at most `limit` bytes (413 beyond), within the time limits above
    (408 when it does not come in time)."""
    loop = asyncio.get_running_loop()
    declared = request.content_length or 0
    if declared > limit:  # refused before a byte of it is read
        raise Reject(413, "too_large", f"body of {declared} bytes exceeds {limit}")
    deadline = loop.time() + BODY_BASE_SECONDS + min(declared, limit) / BODY_MIN_RATE
    chunks: list[bytes] = []
    size = 0
    while True:
        left = deadline - loop.time()
        try:
            chunk = await asyncio.wait_for(
                request.content.readany(), max(0.0, min(BODY_IDLE_SECONDS, left))
            )
        except TimeoutError:
            raise Reject(
                408, "timeout", f"request body not received in time ({size} bytes came)"
            ) from None
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise Reject(413, "too_large", f"body exceeds {limit} bytes")
        chunks.append(chunk)

"""Synchronous client of the syncer (stdlib http.client), safe to use from several threads.

Each thread gets its own keep-alive connection, so a long-poll in one thread never blocks a push
in another. Errors: `SyncerUnavailable` (connection trouble or 5xx: retry with backoff; its
`SyncerUntrusted` when an https syncer's certificate does not verify, naming the address and
why) and `SyncerRejected` (4xx: the server's message; retrying the same request will not help).
"""

from __future__ import annotations

import http.client
import json
import math
import ssl
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any, cast

import numpy as np

from diloco_trainer.auth import UNIT_HEADER
from diloco_trainer.config import CompressionConfig
from diloco_trainer.downlink import apply_step, checksum
from diloco_trainer.feedback import push_feedback
from diloco_trainer.join_credentials import JOIN_HEADER
from diloco_trainer.learner.syncer_api import (
    HeartbeatReply,
    JoinReply,
    PushReply,
    ShardLayout,
)
from diloco_trainer.status import SyncerStatus
from diloco_trainer.tls import ClientTrust
from diloco_trainer.wire import (
    DATA_POSITION_HEADER,
    MAX_COUNTER,
    DataLease,
    PushHeader,
    WireError,
    data_lease_from_json,
    decode_download,
    decode_params,
    encode_push,
    parse_count,
)


class SyncerError(Exception):
    """Base of the client's errors."""


class SyncerUnavailable(SyncerError):
    """The syncer could not be reached or failed (5xx); retry later, at the earliest after
    `retry_after` seconds."""

    retry_after: float = 0.0


class SyncerBusy(SyncerUnavailable):
    """429: this unit sends too often; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class SyncerUntrusted(SyncerUnavailable):
    """The syncer's certificate does not verify (another CA, another name, expired). Retried,
    not fatal: a rotated CA bundle or certificate may fix it without a restart; slowly,
    because until someone fixes it every try fails the same way."""

    retry_after = 10.0


class SyncerRejected(SyncerError):
    """The syncer refused the request (4xx)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message

    @property
    def shut_out(self) -> bool:
        """The unit's join credential is refused (expired, revoked, of another run or group, or
        the token is not its own). Nothing the learner sends can succeed until the home run lifts
        the refusal or the unit is recreated with a new credential, so the learner waits, unheard,
        rather than crash and restart into the same refusal."""
        return self.reason.startswith("credential_") or self.reason == "bad_token"


# How long a unit the syncer does not know yet keeps asking to join (client.join).
ROSTER_WAIT_SECONDS = 120.0


class SyncerClient:
    def __init__(
        self,
        base_url: str,
        token: str,
        unit: str,
        attempt: int,
        group: str = "default",
        timeout: float = 10.0,
        compression: CompressionConfig | None = None,
        trust: ClientTrust | None = None,
        join: str = "",
    ) -> None:
        """`trust`: whom an https syncer must prove itself to (None: the system trust store);
        `join`: the public part of a join credential, sent with every request of a unit of an
        away cluster (join_credentials.py)."""
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"syncer address must be http(s)://host:port, got {base_url!r}")
        self.scheme, self.host = url.scheme, url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.prefix = url.path.rstrip("/")
        self.address = f"{url.scheme}://{url.hostname}:{self.port}"
        self.trust = trust or (ClientTrust() if url.scheme == "https" else None)
        self.join_header = join
        # The learner's fragment plan, sent at join (layout_plan.announce); None: not sent.
        self.layout_plan: dict[str, Any] | None = None
        self.token, self.unit, self.attempt, self.group, self.timeout = (
            token,
            unit,
            attempt,
            group,
            timeout,
        )
        # How pushes are encoded: the run's config, which the learner and the syncer share.
        self.compression = compression or CompressionConfig()
        self.feedback = push_feedback(self.compression.scheme, self.compression.error_feedback)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._first_join: float | None = None
        self._lock = threading.Lock()
        self._local = threading.local()
        # The downlink (downlink.py): per fragment, the syncer process (epoch) that published
        # the copy this client holds, its version and values, so that the syncer can send the
        # next version as a quantized step. One poller thread per fragment touches its entry.
        self._layout: list[list[str]] = []
        self._held: dict[int, tuple[str, int, dict[str, np.ndarray]]] = {}
        # The unit's data lease and position, sent with every push (the data feed sets it).
        self.data_position: DataLease | None = None
        # Which syncer shard this client expects to reach, of how many (shard_client.py).
        self.slot = (0, 1)

    # ---------------------------------------------------------------- transport
    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            if self.trust is not None and self.scheme == "https":
                # A new connection takes the newest CA bundle (tls.ClientTrust).
                context = self.trust.context()
                conn = http.client.HTTPSConnection(
                    self.host, self.port, timeout=timeout, context=context
                )
            else:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
            self._local.conn = conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def _drop_conn(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def close(self) -> None:
        self._drop_conn()

    def _request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        content_type: str = "application/json",
        timeout: float | None = None,
        extra_headers: Mapping[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        headers = {"Authorization": f"Bearer {self.token}", **(extra_headers or {})}
        if self.unit:
            headers[UNIT_HEADER] = self.unit  # the token is good only with its unit's name
        if self.join_header:
            headers[JOIN_HEADER] = self.join_header  # the token is derived from its key
        if body is not None:
            headers["Content-Type"] = content_type
        # One retry on a fresh connection: a kept-alive socket may have been closed by the server.
        for fresh in (False, True):
            if fresh:
                self._drop_conn()
            conn = self._conn(timeout or self.timeout)
            try:
                conn.request(method, self.prefix + path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except ssl.SSLError as exc:  # before OSError, which it is
                # On a kept-alive connection: the syncer went away mid-stream (SSLEOFError),
                # as a plain connection's RemoteDisconnected. On a fresh one: the handshake.
                self._drop_conn()
                if fresh or isinstance(exc, ssl.SSLCertVerificationError):
                    raise self._tls_error(method, path, exc) from exc
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                self._drop_conn()
                if fresh:
                    raise SyncerUnavailable(f"{method} {path}: {exc!r}") from exc
            except (OSError, http.client.HTTPException) as exc:
                self._drop_conn()
                raise SyncerUnavailable(f"{method} {path}: {exc!r}") from exc
        with self._lock:
            self.bytes_sent += len(body or b"")
            self.bytes_received += len(data)
        if resp.status >= 500:
            raise SyncerUnavailable(f"{method} {path}: HTTP {resp.status}: {data[:200]!r}")
        if resp.status == 429:
            wait = parse_count(resp.getheader("Retry-After") or "") or 1
            raise SyncerBusy(f"{method} {path}: HTTP 429 rate limited", float(wait))
        if resp.status >= 400:
            try:
                err = json.loads(data)
                reason, message = str(err.get("reason", "")), str(err.get("error", data[:200]))
            except (ValueError, AttributeError):
                reason, message = "", data[:200].decode(errors="replace")
            raise SyncerRejected(resp.status, reason, message)
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data

    def _tls_error(self, method: str, path: str, exc: ssl.SSLError) -> SyncerUnavailable:
        if isinstance(exc, ssl.SSLCertVerificationError):
            trusted = self.trust.describe() if self.trust else "nothing"
            return SyncerUntrusted(
                f"{method} {path}: the certificate of {self.address} does not verify against "
                f"{trusted}: {exc.verify_message}"
            )
        return SyncerUnavailable(f"{method} {path}: TLS with {self.address} failed: {exc!r}")

    def _post_json(self, path: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        _, _, data = self._request("POST", path, json.dumps(payload).encode())
        return cast(dict[str, Any], json.loads(data))

    def _identity(self) -> dict[str, Any]:
        return {"unit": self.unit, "attempt": self.attempt, "group": self.group}

    # ---------------------------------------------------------------- protocol
    def link_of(self, fragment: int) -> int:
        return 0  # one process serves every fragment

    def join(self) -> JoinReply:
        """Join the run. A unit not on the syncer's roster yet is retried (as unavailable) for
        ROSTER_WAIT_SECONDS from the first try: after a scale-up the operator may create the
        unit moments before it hands the syncer the new roster."""
        try:
            body = self._identity()
            if self.layout_plan is not None:
                body["layout"] = self.layout_plan
            r = self._post_json("/v1/join", body)
        except SyncerRejected as exc:
            now = time.monotonic()
            first = self._first_join = self._first_join or now
            if exc.reason != "unknown_unit" or now - first > ROSTER_WAIT_SECONDS:
                raise
            raise SyncerUnavailable(f"not on the run's roster yet: {exc.message}") from exc
        self._layout = [list(names) for names in r["layout"]]
        shard = _shard_layout(r.get("shard"), len(r["layout"]))
        if shard is not None and (shard.index, shard.count) != self.slot:
            raise SyncerRejected(
                409,
                "shard_mismatch",
                f"{self.address} is syncer shard {shard.index} of {shard.count}, this learner "
                f"expects shard {self.slot[0]} of {self.slot[1]}: give it every shard's address, "
                "shard 0's first, comma-separated",
            )
        return JoinReply(
            run=r["run"],
            layout=r["layout"],
            versions=r["versions"],
            complete=bool(r["complete"]),
            outer_step=int(r.get("outerStep", 0)),
            resume_step=int(r.get("resumeStep", 0)),
            shapes={k: tuple(v) for k, v in r.get("shapes", {}).items()},
            data_lease=_lease(r.get("dataLease"), "join"),
            shard=shard,
        )

    def claim_data(self, finished: DataLease) -> DataLease:
        """The unit read all of `finished`: the syncer's next lease for it."""
        r = self._post_json("/v1/data/claim", {**self._identity(), "finished": finished.to_json()})
        lease = _lease(r.get("dataLease"), "claim")
        if lease is None:
            raise SyncerUnavailable("POST /v1/data/claim: reply without dataLease")
        return lease

    def wait_for_cover(self, spare: str, wait: float) -> dict[str, Any] | None:
        """A warm spare's long-poll (the client's unit is "spare:<spare>"): the identity of the
        unit to cover, or None when none came within `wait` seconds."""
        body = json.dumps({"spare": spare, "group": self.group, "wait": wait}).encode()
        status, _, data = self._request("POST", "/v1/spares/wait", body, timeout=wait + 10.0)
        return None if status == 204 else cast(dict[str, Any], json.loads(data))

    def pull_all(self) -> tuple[dict[str, np.ndarray], list[int]]:
        _, _, data = self._request("GET", "/v1/params", timeout=max(self.timeout, 60.0))
        try:
            got = decode_params(data)
        except WireError as exc:
            raise SyncerUnavailable(f"GET /v1/params: bad payload: {exc}") from exc
        self._held = {
            p: (got.epoch, got.versions[p], {n: got.tensors[n] for n in names})
            for p, names in enumerate(self._layout)
            if p < len(got.versions) and all(n in got.tensors for n in names)
        }
        return got.tensors, got.versions

    def push(
        self,
        fragment: int,
        base_version: int,
        delta: Mapping[str, np.ndarray],
        c_steps: int,
        c_tokens: int,
        step: int = 0,
    ) -> PushReply:
        header = PushHeader(
            fragment,
            base_version,
            c_steps,
            c_tokens,
            self.compression.scheme,
            self.unit,
            self.attempt,
            step=step,
        )
        sent = self.feedback.compensated(fragment, delta) if self.feedback else delta
        body, quant_error, applied = encode_push(header, sent, self.compression.block_size)
        path = f"/v1/fragments/{fragment}/push"
        at = self.data_position  # one read: the feed replaces it from the training thread
        extra = {DATA_POSITION_HEADER: at.header()} if at is not None else None
        try:
            _, _, data = self._request("POST", path, body, "application/octet-stream", None, extra)
        except SyncerRejected as exc:
            if exc.reason != "not_joined":
                raise
            # The syncer does not know this attempt joined (it restarted from a checkpoint
            # older than the join): join again, then send the same push.
            self.join()
            _, _, data = self._request("POST", path, body, "application/octet-stream", None, extra)
        r = json.loads(data)
        if self.feedback and r["accepted"]:
            self.feedback.settle(fragment, sent, applied)
        return PushReply(
            bool(r["accepted"]),
            bool(r.get("duplicate", False)),
            int(r["version"]),
            len(body),
            quant_error,
        )

    def poll(
        self, fragment: int, after_version: int, wait: float
    ) -> tuple[int, dict[str, np.ndarray]] | None:
        """The fragment's next version after `after_version` (None when none came within
        `wait`). When this client holds `after_version`, the syncer may answer with a quantized
        step from it instead of the values; either way the values are returned."""
        query = f"after={after_version}&wait={wait:g}"
        held = self._held.get(fragment)
        if held is not None and held[1] == after_version and held[0]:
            query += f"&epoch={held[0]}"
        status, _, data = self._request(
            "GET", f"/v1/fragments/{fragment}?{query}", timeout=wait + self.timeout
        )
        if status == 204:
            return None
        try:
            got = decode_download(data)
            if got.step:
                if held is None or (got.epoch, got.from_version) != held[:2]:
                    raise WireError(f"step from version {got.from_version} does not apply here")
                tensors = apply_step(held[2], got.tensors)
                if checksum(tensors) != got.checksum:
                    raise WireError("fragment rebuilt from a step fails its checksum")
            else:
                tensors = got.tensors
        except (WireError, KeyError) as exc:
            self._held.pop(fragment, None)  # the next poll asks for the values
            raise SyncerUnavailable(f"GET fragment {fragment}: bad payload: {exc}") from exc
        self._held[fragment] = (got.epoch, got.versions[0], tensors)
        return got.versions[0], tensors

    def heartbeat(
        self, step: int, tokens: int, tokens_per_sec: float, loss: float | None
    ) -> HeartbeatReply:
        if loss is not None and not math.isfinite(loss):
            loss = None  # JSON has no NaN; a diverged loss shows as unknown
        r = self._post_json(
            "/v1/heartbeat",
            {
                **self._identity(),
                "step": step,
                "tokens": tokens,
                "tokensPerSec": tokens_per_sec,
                "loss": loss,
            },
        )
        return HeartbeatReply(
            bool(r["complete"]),
            list(r["versions"]),
            int(r["outerStep"]),
            _share(r.get("budgetDone", 0.0), "heartbeat.budgetDone"),
        )

    def status(self) -> SyncerStatus:
        _, _, data = self._request("GET", "/v1/status")
        return SyncerStatus.from_json(json.loads(data))


def _share(raw: Any, what: str) -> float:
    """A share in [0, 1] in a reply; anything else is the server's fault (5xx-like)."""
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not 0.0 <= raw <= 1.0:
        raise SyncerUnavailable(f"{what}: bad reply: expected a number in [0, 1], got {raw!r}")
    return float(raw)


def _lease(raw: Any, what: str) -> DataLease | None:
    """A lease in a reply (None when absent); a malformed one is the server's fault (5xx-like)."""
    if raw is None:
        return None
    try:
        return data_lease_from_json(raw, MAX_COUNTER + 1, f"{what}.dataLease")
    except WireError as exc:
        raise SyncerUnavailable(f"{what}: bad reply: {exc}") from exc


def _shard_layout(raw: Any, fragments: int) -> ShardLayout | None:
    """The join reply's shard block (None when absent); a malformed one is the server's fault."""
    if raw is None:
        return None
    try:
        index, count, owners = int(raw["index"]), int(raw["count"]), raw["owners"]
        if not isinstance(owners, list) or len(owners) != fragments:
            raise ValueError(f"owners: expected {fragments} entries")
        placed = tuple(int(o) for o in owners)
        if not 0 <= index < count or any(not 0 <= o < count for o in placed):
            raise ValueError("shard index out of range")
    except (KeyError, TypeError, ValueError) as exc:
        raise SyncerUnavailable(f"join: bad reply: shard: {exc}") from exc
    return ShardLayout(index, count, placed)

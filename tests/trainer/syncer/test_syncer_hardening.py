"""The syncer, hardened: hostile but well-formed requests and ordinary faults (a full disk, a
damaged checkpoint, a slow client) must neither poison the global model nor lose a round nor
crash the syncer. The sections below group the tests by the kind of fault."""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from diloco_trainer.auth import DOMAIN, UNIT_HEADER, identify, unit_token
from diloco_trainer.learner.client import SyncerRejected
from diloco_trainer.syncer import conn as syncer_conn
from diloco_trainer.syncer import http_api as syncer_http
from diloco_trainer.syncer.checkpoint import CheckpointStore
from diloco_trainer.syncer.conn import CONNECTIONS_KEY
from diloco_trainer.syncer.core import Syncer
from diloco_trainer.syncer.health import retry_delay
from diloco_trainer.wire import PushHeader, encode_push, encode_tensors
from test_syncer import (
    TOKEN,
    LiveSyncer,
    assert_unchanged,
    fragment_delta,
    global_state,
    tiny_cfg,
    wait_until,
)


@pytest.fixture
def live(request: pytest.FixtureRequest) -> Iterator[LiveSyncer]:
    params = dict(getattr(request, "param", {}))
    max_units = params.pop("max_units", None)
    cfg = tiny_cfg(**params)
    syncer = Syncer(cfg, TOKEN, run="test-run", store=None, eval_fn=None, max_units=max_units)
    server = LiveSyncer(syncer)
    yield server
    server.close()


def push_body(
    live: LiveSyncer,
    p: int = 0,
    scale: float = 0.01,
    step: int = 3,
    unit: str = "unit-0",
    delta: dict[str, np.ndarray] | None = None,
    attempt: int = 0,
) -> bytes:
    header = PushHeader(p, 0, 3, 96, "none", unit, attempt, step=step)
    return encode_push(header, delta or fragment_delta(live, p, scale=scale), 32)[0]


def metric(live: LiveSyncer, line: str) -> float | None:
    text = live.raw("GET", "/metrics")[1]["raw"].decode()
    found = re.search(rf"^{re.escape(line)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


# ---------------------------------------------------------------- norm bound, finiteness


def test_a_huge_finite_delta_is_refused_by_the_norm_bound(live: LiveSyncer) -> None:
    live.client("unit-0").join()
    before = global_state(live)
    status, reply = live.raw(
        "POST", "/v1/fragments/0/push", push_body(live, scale=1e17), unit="unit-0"
    )
    assert (status, reply["reason"]) == (422, "norm_bound")
    assert "maxPushNorm" in reply["error"]
    assert_unchanged(live, before)
    # An ordinary push (far below the bound) still goes through.
    status, reply = live.raw("POST", "/v1/fragments/0/push", push_body(live), unit="unit-0")
    assert status == 200 and reply["accepted"]


@pytest.mark.parametrize("live", [dict(merge={"maxPushNorm": None})], indirect=True)
def test_a_merge_whose_result_is_not_finite_is_refused_and_reported(
    live: LiveSyncer, caplog: pytest.LogCaptureFixture
) -> None:
    """With the norm bound off, a delta near float32's maximum passes validation; the outer step
    (lr 0.7 x 1.9 x 3e38) overflows to inf. That result must not become a version."""
    live.client("unit-0").join()
    before = global_state(live)
    delta = {n: np.full(v.shape, 3e38, np.float32) for n, v in fragment_delta(live, 0).items()}
    with caplog.at_level(logging.ERROR, logger="diloco.syncer"):
        status, _ = live.raw(
            "POST", "/v1/fragments/0/push", push_body(live, delta=delta), unit="unit-0"
        )
        assert status == 200
        wait_until(lambda: metric(live, 'diloco_syncer_merges_refused_total{fragment="0"}') == 1)
    assert_unchanged(live, before)
    assert any("event=merge_refused fragment=0" in r.message for r in caplog.records)
    # The fragment merges again afterwards.
    live.client("unit-0").push(0, 0, fragment_delta(live, 0), 1, 8, step=9)
    wait_until(lambda: live.syncer.frags[0].version == 1)


# ---------------------------------------------------------------- bounded counters


def test_out_of_range_counters_are_refused_at_the_wire_and_never_stored(
    live: LiveSyncer,
) -> None:
    def beat(**fields: Any) -> tuple[int, dict[str, Any]]:
        body = {"unit": "unit-0", "attempt": 0, "step": 1, "tokens": 1, **fields}
        return live.raw("POST", "/v1/heartbeat", json.dumps(body).encode(), unit="unit-0")

    for field, value in [
        ("tokens", 10**400),  # as a float: OverflowError, the 500s of the issue
        ("tokens", 10**30),
        ("tokens", 2**53),
        ("step", 2**64),
        ("attempt", 10**20),
        ("tokensPerSec", 1e300),
        ("loss", 10**400),
    ]:
        status, reply = beat(**{field: value})
        assert (status, reply["reason"]) == (400, "bad_request"), field
        assert field in reply["error"]
    assert beat(step=2**53 - 1, tokens=2**53 - 1)[0] == 200  # the largest accepted values
    status, body = live.raw("GET", "/v1/status")
    # Counted up to 2H steps past the last accepted push (none), pro rata (trust.py).
    lead = 2 * live.syncer.cfg.inner_steps
    assert status == 200 and body["steps"] == lead and body["tokens"] == lead
    assert live.raw("GET", "/metrics")[0] == 200
    live.client("unit-0").join()
    meta = {
        "kind": "push",
        "fragment": "0",
        "baseVersion": "0",
        "cSteps": str(10**20),
        "cTokens": "8",
        "scheme": "none",
        "unit": "unit-0",
        "attempt": "0",
    }
    status, reply = live.raw(
        "POST", "/v1/fragments/0/push", encode_tensors(fragment_delta(live, 0), meta), unit="unit-0"
    )
    assert (status, reply["reason"]) == (400, "malformed") and "cSteps" in reply["error"]


def test_a_checkpoint_holding_an_out_of_range_counter_still_restarts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = tiny_cfg()
    store = CheckpointStore(tmp_path)
    first = Syncer(cfg, TOKEN, store=store, eval_fn=None)
    first.learners.heartbeat("unit-0", 0, "default", 10, 640, 1.0, None, now=1.0)
    first.learners.heartbeat("unit-1", 0, "default", 5, 320, 1.0, None, now=1.0)
    snap = first.snapshot()
    first.close()
    snap.learners["unit-1"]["attempts"]["0"] = [5, 10**400]  # what an unbounded syncer wrote
    snap.learners["unit-1"]["startStep"] = "many"
    store.save(snap)
    with caplog.at_level(logging.ERROR, logger="diloco.syncer"):
        restarted = Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=None)
    try:
        status = restarted.status()
        assert status.tokens == 640  # unit-0's counters kept, unit-1's bogus attempt dropped
        assert status.learners["unit-0"].step == 10
        lines = [r.message for r in caplog.records if r.levelno == logging.ERROR]
        assert any("unit=unit-1 field=attempts.0.tokens" in m for m in lines), lines
        assert any("unit=unit-1 field=startStep" in m for m in lines), lines
    finally:
        restarted.close()


# ---------------------------------------------------------------- failed merges, readiness


class FullDisk:
    """A version journal writer that fails with ENOSPC while `full` is set."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store, self.full = store, True
        self.real = store.record_versions

    def __call__(self, versions: list[int]) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.real(versions)


def test_a_failed_merge_puts_its_contributions_back_and_readiness_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Retries 2 s apart: the checks below run between two attempts (while one runs, its
    # contributions are out of `pending`), with room to spare on a loaded machine.
    monkeypatch.setattr("diloco_trainer.syncer.health.RETRY_SECONDS", 2.0)
    cfg = tiny_cfg(checkpoint={"path": str(tmp_path), "everySeconds": 3600})
    store = CheckpointStore(tmp_path)
    server = LiveSyncer(Syncer(cfg, TOKEN, store=store, eval_fn=None))
    disk = FullDisk(store)
    store.record_versions = disk  # type: ignore[method-assign]
    try:
        learner = server.client("unit-0")
        learner.join()
        before = global_state(server)
        delta = fragment_delta(server, 0, seed=4)
        assert not learner.push(0, 0, delta, 3, 96, step=3).duplicate
        wait_until(lambda: metric(server, 'diloco_syncer_failing{what="merge"}') == 1)
        assert server.raw("GET", "/readyz")[0] == 503
        health = server.client("x").status().health
        assert health is not None and not health.ready and "merge" in health.problems
        assert server.raw("GET", "/healthz")[0] == 200  # alive: a restart would not help
        assert server.syncer.frags[0].version == 0
        # The retry is a duplicate of a contribution that is still pending, not a dropped one.
        assert learner.push(0, 0, delta, 3, 96, step=3).duplicate
        assert "unit-0" in server.syncer.frags[0].pending
        disk.full = False
        wait_until(lambda: server.syncer.frags[0].version == 1)
        assert server.raw("GET", "/readyz")[0] == 200
        assert metric(server, 'diloco_syncer_failing{what="merge"}') == 0
        merged, _ = global_state(server)
        moved = [n for n in delta if not np.array_equal(merged[n], before[0][n])]
        assert sorted(moved) == sorted(delta)  # the contribution reached the model
    finally:
        server.close()


def test_a_checkpoint_that_cannot_be_written_makes_the_syncer_not_ready(tmp_path: Path) -> None:
    cfg = tiny_cfg(checkpoint={"path": str(tmp_path), "everySeconds": 3600})
    store = CheckpointStore(tmp_path)
    server = LiveSyncer(Syncer(cfg, TOKEN, store=store, eval_fn=None))
    real_save = store.save

    def no_space(snap: Any) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device")

    try:
        store.save = no_space  # type: ignore[method-assign]
        with pytest.raises(OSError):
            server.run(server.syncer.save_checkpoint(force=True))
        status, body = server.raw("GET", "/readyz")
        assert status == 503 and "No space left" in body["problems"]["checkpoint"]
        assert metric(server, 'diloco_syncer_failing{what="checkpoint"}') == 1
        assert metric(server, 'diloco_syncer_failures_total{what="checkpoint"}') == 1
        store.save = real_save  # type: ignore[method-assign]
        server.run(server.syncer.save_checkpoint(force=True))
        assert server.raw("GET", "/readyz")[0] == 200
    finally:
        server.close()


def test_a_fresh_syncer_whose_first_checkpoint_cannot_be_written_serves_and_retries(
    tmp_path: Path,
) -> None:
    """Found by the soak bench: the disk filled while a fresh syncer warmed up, its first
    checkpoint raised, and the syncer exited before serving (the local run aborted). A full
    disk is a readiness problem, not a reason to exit: it serves, says so, and the periodic
    save writes the checkpoint once there is room."""
    cfg = tiny_cfg(checkpoint={"path": str(tmp_path), "everySeconds": 1})
    store = CheckpointStore(tmp_path)
    real_save = store.save

    def no_space(snap: Any) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device")

    store.save = no_space  # type: ignore[method-assign]
    server = LiveSyncer(Syncer(cfg, TOKEN, store=store, eval_fn=None))
    try:
        assert server.raw("GET", "/healthz")[0] == 200
        status, body = server.raw("GET", "/readyz")
        assert status == 503 and "No space left" in body["problems"]["checkpoint"]
        assert store.load_latest() is None
        store.save = real_save  # type: ignore[method-assign]
        wait_until(lambda: server.raw("GET", "/readyz")[0] == 200)
        assert store.load_latest() is not None
    finally:
        server.close()


def test_a_syncer_starting_on_a_full_disk_waits_for_room_instead_of_exiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the soak bench: a syncer that starts (a restart, or a standby taking over)
    while the disk is full could not journal its versions and exited; restarted, it exited
    again until the disk had room, 13-28 s a time. It now retries until the journal is
    written, then serves."""
    monkeypatch.setattr("diloco_trainer.syncer.health.RETRY_SECONDS", 0.05)
    cfg = tiny_cfg(checkpoint={"path": str(tmp_path), "everySeconds": 3600})
    store = CheckpointStore(tmp_path)
    disk = FullDisk(store)
    store.record_versions = disk  # type: ignore[method-assign]
    built: list[Syncer] = []
    failed: list[BaseException] = []

    def start() -> None:
        try:
            built.append(Syncer(cfg, TOKEN, store=store, eval_fn=None))
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(timeout=1.0)
    assert failed == [] and thread.is_alive()  # still waiting for room, not exited
    disk.full = False
    thread.join(timeout=30)
    assert failed == [] and len(built) == 1
    assert store.recorded_versions() == built[0].versions()


def test_merge_retries_back_off_up_to_a_cap() -> None:
    delays = [retry_delay(n) for n in range(1, 12)]
    assert delays[0] == 0.5 and delays == sorted(delays) and delays[-1] == 30.0


# ---------------------------------------------------------------- per-unit identity


def test_a_unit_token_is_the_hmac_of_the_run_secret_and_the_unit_name() -> None:
    want = hmac.new(b"s3cret", DOMAIN + b"run-default-3", hashlib.sha256).hexdigest()
    assert unit_token("s3cret", "run-default-3") == want
    assert unit_token("s3cret", "run-default-3") != unit_token("s3cret", "run-default-4")
    assert unit_token("other", "run-default-3") != want
    assert identify("s3cret", f"Bearer {want}", "run-default-3") is not None
    assert identify("s3cret", f"Bearer {want}", "run-default-4") is None
    assert identify("s3cret", "Bearer s3cret", None) is not None  # the operator
    assert identify("s3cret", "Bearer caf\udcc3", "u") is None  # undecodable header bytes


def test_a_unit_is_heard_only_with_its_own_token(live: LiveSyncer) -> None:
    join = json.dumps({"unit": "unit-0", "attempt": 0}).encode()

    def post(path: str, body: bytes, token: str, unit: str | None) -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {token}", **({UNIT_HEADER: unit} if unit else {})}
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=10)
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        reason = json.loads(resp.read() or b"{}").get("reason", "")
        conn.close()
        return resp.status, reason

    unit1 = unit_token(TOKEN, "unit-1")
    assert post("/v1/join", join, unit1, "unit-0") == (401, "unauthorized")  # someone else's
    assert post("/v1/join", join, TOKEN, None) == (403, "forbidden")  # the run secret
    assert post("/v1/join", join, TOKEN, "unit-0") == (403, "forbidden")
    assert post("/v1/join", join, unit1, "unit-1") == (403, "identity_mismatch")
    assert post("/v1/join", join, unit_token(TOKEN, "unit-0"), "unit-0")[0] == 200
    assert live.raw("GET", "/v1/status")[0] == 200  # the run secret reads status
    body = push_body(live, unit="unit-0")
    assert post("/v1/fragments/0/push", body, unit1, "unit-1") == (403, "identity_mismatch")
    assert post("/v1/fragments/0/push", body, TOKEN, None) == (403, "forbidden")
    assert set(live.syncer.learners.records) == {"unit-0"}


def test_a_push_needs_a_prior_join_of_that_attempt(live: LiveSyncer) -> None:
    before = global_state(live)
    status, reply = live.raw("POST", "/v1/fragments/0/push", push_body(live), unit="unit-0")
    assert (status, reply["reason"]) == (409, "not_joined")
    assert_unchanged(live, before)
    live.client("unit-0").join()
    status, _ = live.raw("POST", "/v1/fragments/0/push", push_body(live), unit="unit-0")
    assert status == 200
    # Another attempt's join does not count for this one's pushes; once it joined, this older
    # attempt's pushes are refused outright (another process is the unit now).
    status, reply = live.raw(
        "POST", "/v1/fragments/1/push", push_body(live, 1, attempt=1), unit="unit-0"
    )
    assert (status, reply["reason"]) == (409, "not_joined")
    live.client("unit-0", attempt=1).join()
    status, reply = live.raw("POST", "/v1/fragments/1/push", push_body(live, 1), unit="unit-0")
    assert (status, reply["reason"]) == (409, "superseded")
    # The client joins by itself when told it has not (a syncer restarted from an older
    # checkpoint than its join), then sends the same push.
    assert live.client("unit-1").push(1, 0, fragment_delta(live, 1), 1, 8).accepted
    assert 0 in live.syncer.learners.records["unit-1"].joined


@pytest.mark.parametrize("live", [dict(max_units=2)], indirect=True)
def test_the_number_of_learner_units_is_bounded_by_the_runs_units(live: LiveSyncer) -> None:
    live.client("unit-0").join()
    live.client("unit-1").heartbeat(1, 8, 1.0, None)
    with pytest.raises(SyncerRejected) as err:
        live.client("unit-2").join()
    assert (err.value.status, err.value.reason) == (403, "too_many_units")
    with pytest.raises(SyncerRejected):
        live.client("unit-2").heartbeat(1, 8, 1.0, None)
    live.client("unit-0", attempt=1).join()  # a known unit's new attempt is the same learner
    assert sorted(live.syncer.learners.records) == ["unit-0", "unit-1"]


def test_learners_are_bounded_across_a_restart(tmp_path: Path) -> None:
    cfg = tiny_cfg(checkpoint={"path": str(tmp_path), "everySeconds": 3600})
    first = LiveSyncer(Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=None))
    first.client("unit-0").join()
    first.close()  # writes the final checkpoint, with unit-0's join
    again = LiveSyncer(
        Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=None, max_units=1)
    )
    try:
        status, _ = again.raw("POST", "/v1/fragments/0/push", push_body(again), unit="unit-0")
        assert status == 200  # its join was checkpointed
        with pytest.raises(SyncerRejected):
            again.client("unit-1").join()
    finally:
        again.close()


# ---------------------------------------------------------------- smaller things


def test_a_nan_payload_reusing_a_seen_push_key_is_refused(live: LiveSyncer) -> None:
    live.client("unit-0").join()
    status, reply = live.raw("POST", "/v1/fragments/0/push", push_body(live, step=5), unit="unit-0")
    assert status == 200 and not reply["duplicate"]
    poisoned = {n: np.full_like(v, np.nan) for n, v in fragment_delta(live, 0).items()}
    status, reply = live.raw(
        "POST", "/v1/fragments/0/push", push_body(live, step=5, delta=poisoned), unit="unit-0"
    )
    assert (status, reply["reason"]) == (422, "non_finite")


@pytest.mark.parametrize("raw", [" 1", "1 ", "+1", "\u0661", "1_0", "0x1", "-0", "１"])
def test_fragment_ids_parse_strictly(live: LiveSyncer, raw: str) -> None:
    from urllib.parse import quote

    status, reply = live.raw("GET", f"/v1/fragments/{quote(raw)}?after=0&wait=0")
    assert (status, reply["reason"]) == (404, "unknown_fragment")


def test_deeply_nested_json_is_a_400(live: LiveSyncer) -> None:
    status, reply = live.raw("POST", "/v1/join", b"[" * 20_000 + b"]" * 20_000, unit="unit-0")
    assert (status, reply["reason"]) == (400, "malformed")
    huge = b'{"unit": "unit-0", "attempt": ' + b"9" * 5000 + b"}"  # json: ValueError
    status, reply = live.raw("POST", "/v1/join", huge, unit="unit-0")
    assert (status, reply["reason"]) == (400, "malformed")
    header = b'{"__metadata__": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    body = len(header).to_bytes(8, "little") + header
    live.client("unit-0").join()
    status, reply = live.raw("POST", "/v1/fragments/0/push", body, unit="unit-0")
    assert (status, reply["reason"]) == (400, "malformed")


def test_a_non_utf8_authorization_header_is_a_401(live: LiveSyncer) -> None:
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
        sock.sendall(
            b"GET /v1/status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xc3\r\n"
            b"Connection: close\r\n\r\n"
        )
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]


# ---------------------------------------------------------------- slow clients


def _dribble_until_closed(sock: socket.socket, data: bytes, every: float, limit: float) -> float:
    """Send `data` one byte per `every` seconds until the server closes; seconds it took."""
    started = time.monotonic()
    sock.settimeout(every)
    for i in range(10**6):
        if time.monotonic() - started > limit:
            raise AssertionError(f"connection still open after {limit} s")
        try:
            sock.sendall(data[i % len(data) : i % len(data) + 1])
            if sock.recv(65536) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - started
    raise AssertionError("unreachable")


def test_a_client_sending_its_request_head_slowly_is_disconnected(live: LiveSyncer) -> None:
    live.runner.app[CONNECTIONS_KEY].header_seconds = 1.0
    with socket.create_connection(("127.0.0.1", live.port), timeout=5) as sock:
        head = b"GET /healthz HTTP/1.1\r\n" + b"X-Slow: " + b"a" * 10_000
        took = _dribble_until_closed(sock, head, 0.1, limit=10.0)
    assert 0.9 < took < 3.0
    assert live.raw("GET", "/healthz")[0] == 200  # others are served meanwhile


def test_a_kept_alive_connection_dribbling_its_next_head_is_disconnected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(syncer_http, "KEEPALIVE_SECONDS", 1.0)
    server = LiveSyncer(Syncer(tiny_cfg(), TOKEN, store=None, eval_fn=None))
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            took = _dribble_until_closed(sock, b"GET /healthz HTTP/1.1\r\nX-Slow: aaaa", 0.1, 10.0)
        assert took < 3.0
    finally:
        server.close()


def test_a_request_body_sent_too_slowly_gets_a_408(
    live: LiveSyncer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(syncer_conn, "BODY_IDLE_SECONDS", 0.5)
    token = unit_token(TOKEN, "unit-0")
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
        sock.sendall(
            f"POST /v1/join HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            f"{UNIT_HEADER}: unit-0\r\nContent-Length: 1000\r\n\r\n".encode()
            + b'{"unit"'
        )
        started = time.monotonic()
        reply = sock.recv(65536)
        took = time.monotonic() - started
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert took < 3.0


# ---------------------------------------------------------------- checkpoints (items 2 and 10)


def test_rotation_never_deletes_the_newest_checkpoint_that_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that garbles what was written (after it was hashed): with keep=1 the damaged new
    checkpoint would otherwise have rotated the last good one out."""
    import diloco_trainer.syncer.storage as checkpoint

    store = CheckpointStore(tmp_path, keep=1)
    syncer = Syncer(tiny_cfg(), TOKEN, store=None, eval_fn=None)
    good = store.save(syncer.snapshot())
    real_fsync = checkpoint._fsync_file

    def garbling_fsync(path: Path) -> None:
        if path.name == "params.safetensors":
            path.write_bytes(b"garbage")
        real_fsync(path)

    monkeypatch.setattr(checkpoint, "_fsync_file", garbling_fsync)
    store.save(syncer.snapshot())
    store.save(syncer.snapshot())
    monkeypatch.setattr(checkpoint, "_fsync_file", real_fsync)
    assert good.exists()
    loaded = CheckpointStore(tmp_path).load_latest()
    assert loaded is not None and loaded.seq == 1
    store.save(syncer.snapshot())  # a good one again: now the old one may go
    assert not good.exists()
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-0000000004"]
    syncer.close()


def test_a_rollback_past_a_corrupt_newest_checkpoint_is_an_error_in_log_status_and_metric(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    first = Syncer(tiny_cfg(), TOKEN, store=None, eval_fn=None)
    store.save(first.snapshot())
    newest = store.save(first.snapshot())
    first.close()
    (newest / "outer.safetensors").write_bytes(b"bit rot")
    with caplog.at_level(logging.INFO):
        restarted = LiveSyncer(Syncer(tiny_cfg(), TOKEN, store=CheckpointStore(tmp_path)))
    try:
        errors = [r.message for r in caplog.records if r.levelno == logging.ERROR]
        assert any("event=checkpoint_skipped seq=2" in m for m in errors), errors
        assert any("event=checkpoint_loaded seq=1" in m for m in errors), errors
        checkpoint = restarted.client("x").status().checkpoint
        assert checkpoint is not None
        skipped = checkpoint.skipped_at_start
        assert len(skipped) == 1 and "checksum mismatch" in skipped[0]
        assert metric(restarted, "diloco_syncer_checkpoints_skipped") == 1
    finally:
        restarted.close()


def test_the_version_journal_is_fsynced_with_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    CheckpointStore(tmp_path).record_versions([3, 1])
    assert synced == [str(tmp_path / ".versions.json.tmp"), str(tmp_path)]
    assert json.loads((tmp_path / "versions.json").read_text()) == {"versions": [3, 1]}


def test_readiness_stays_down_while_any_fragment_cannot_merge(
    live: LiveSyncer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merge of another fragment succeeding does not clear a fragment's failure."""
    syncer = live.syncer
    broken = set(syncer.frags[0].names)
    real = syncer.merge_compute

    def fails_for_fragment_0(params: Any, *rest: Any) -> Any:
        if set(params) == broken:
            raise OSError(errno.EIO, "Input/output error")
        return real(params, *rest)

    monkeypatch.setattr(syncer, "merge_compute", fails_for_fragment_0)
    learner = live.client("unit-0")
    learner.join()
    learner.push(0, 0, fragment_delta(live, 0), 1, 8)
    wait_until(lambda: live.raw("GET", "/readyz")[0] == 503)
    learner.push(1, 0, fragment_delta(live, 1), 1, 8)
    wait_until(lambda: syncer.frags[1].version == 1)
    assert live.raw("GET", "/readyz")[0] == 503  # fragment 0 still fails
    monkeypatch.setattr(syncer, "merge_compute", real)
    wait_until(lambda: syncer.frags[0].version == 1)
    assert live.raw("GET", "/readyz")[0] == 200


# ---------------------------------------------------------------- a learner gone mid-answer


def test_a_long_poll_whose_learner_hung_up_is_dropped_in_one_line_not_an_error(
    live: LiveSyncer, caplog: pytest.LogCaptureFixture
) -> None:
    # Over a WAN this is routine: a cut or reset link ends a learner's long poll, and the answer
    # that the next version brings has nobody to go to. It is not a syncer error.
    c = live.client()
    c.join()
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=10)
    head = (
        "GET /v1/fragments/1?after=0&wait=30 HTTP/1.1\r\nHost: syncer\r\n"
        f"Authorization: Bearer {unit_token(TOKEN, 'unit-0')}\r\n{UNIT_HEADER}: unit-0\r\n\r\n"
    )
    sock.sendall(head.encode())
    server = live.runner.server
    assert server is not None
    wait_until(lambda: len(server.connections) == 2)  # the learner's own, and the held poll
    # Hung up with a reset, as a cut link or a proxy does (a plain close would only half-close:
    # the syncer may still write to it), and seen by the syncer before the answer comes.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    wait_until(lambda: any(h.transport is None for h in server.connections))
    with caplog.at_level(logging.INFO, logger="diloco.syncer"):
        reply = c.push(1, 0, fragment_delta(live, 1), c_steps=5, c_tokens=320)
        assert reply.accepted
        wait_until(lambda: "event=reply_dropped" in caplog.text)
    dropped = [r for r in caplog.records if "event=reply_dropped" in r.getMessage()]
    assert dropped[0].levelno == logging.INFO and "/v1/fragments/1" in dropped[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert c.poll(1, 0, wait=5) is not None  # and the syncer answers the next poll as ever

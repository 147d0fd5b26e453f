"""The syncer in-process on a loopback port, driven through the real HTTP client.

Every bad input must get its 4xx and leave the global parameters and versions untouched.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import re
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from diloco_trainer.auth import UNIT_HEADER, unit_token
from diloco_trainer.config import TrainingConfig
from diloco_trainer.fragments import pack_fragments
from diloco_trainer.learner.client import SyncerClient, SyncerRejected, SyncerUnavailable
from diloco_trainer.merge import Contribution, merge_fragment
from diloco_trainer.models.gpt import init_params
from diloco_trainer.outer import OuterOptimizer
from diloco_trainer.syncer.checkpoint import CheckpointStore
from diloco_trainer.syncer.core import Syncer
from diloco_trainer.syncer.http_api import start_server
from diloco_trainer.wire import PushHeader, decode_download, encode_push, encode_tensors

T = TypeVar("T")
TOKEN = "test-token"


def tiny_cfg(**overrides: Any) -> TrainingConfig:
    raw: dict[str, Any] = {
        "model": {"preset": "tiny", "dModel": 16, "nLayers": 1, "nHeads": 2, "seqLen": 8},
        "fragments": 3,
        "quorum": 1,
        "maxStaleness": 1,
        "grace": {"mode": "none", "maxSeconds": 0.5},
        "totalSteps": 100,
        "eval": {"everySeconds": None},
    }
    raw.update(overrides)
    return TrainingConfig.model_validate(raw)


class LiveSyncer:
    """A Syncer served by aiohttp on 127.0.0.1 from a background event-loop thread."""

    def __init__(self, syncer: Syncer) -> None:
        self.syncer = syncer
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, self.port = self.run(start_server(syncer, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.port}"

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def client(
        self, unit: str = "unit-0", attempt: int = 0, token: str | None = None
    ) -> SyncerClient:
        # A learner encodes its pushes as its own config says: the run's config, as here.
        compression = self.syncer.cfg.compression
        token = token or unit_token(TOKEN, unit)
        return SyncerClient(self.url, token, unit, attempt, compression=compression)

    def raw(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        token: str | None = TOKEN,
        unit: str | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """A request with `token`, or with `unit`'s token and name when `unit` is given."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        if unit is not None:
            headers = {"Authorization": f"Bearer {unit_token(TOKEN, unit)}", UNIT_HEADER: unit}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        try:
            parsed = json.loads(data)
        except ValueError:
            parsed = {"raw": data}
        return resp.status, parsed

    def close(self) -> None:
        self.run(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.syncer.close()


@pytest.fixture
def live(request: pytest.FixtureRequest) -> Iterator[LiveSyncer]:
    cfg = tiny_cfg(**getattr(request, "param", {}))
    server = LiveSyncer(Syncer(cfg, TOKEN, run="test-run", store=None, eval_fn=None))
    yield server
    server.close()


def fragment_delta(
    live: LiveSyncer, p: int, scale: float = 0.01, seed: int = 0
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        n: (rng.normal(size=live.syncer.shapes[n]) * scale).astype(np.float32)
        for n in live.syncer.frags[p].names
    }


def global_state(live: LiveSyncer) -> tuple[dict[str, np.ndarray], list[int]]:
    return live.client("observer").pull_all()


def assert_unchanged(live: LiveSyncer, before: tuple[dict[str, np.ndarray], list[int]]) -> None:
    params, versions = global_state(live)
    assert versions == before[1]
    for k, v in before[0].items():
        np.testing.assert_array_equal(params[k], v)
    assert all(not f.pending for f in live.syncer.frags)


def wait_until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def test_join_and_pull_give_the_initial_model(live: LiveSyncer) -> None:
    cfg = live.syncer.cfg
    reply = live.client().join()
    init = init_params(cfg.model, cfg.seed)
    assert reply.run == "test-run" and reply.versions == [0, 0, 0] and not reply.complete
    assert reply.layout == pack_fragments({k: v.shape for k, v in init.items()}, 3)
    params, versions = live.client().pull_all()
    assert versions == [0, 0, 0]
    for k, v in init.items():
        np.testing.assert_array_equal(params[k], v)


def test_push_merges_and_long_poll_delivers(live: LiveSyncer) -> None:
    c = live.client()
    c.join()
    assert c.poll(1, 0, wait=0.2) is None  # nothing new: 204 after the wait
    before, _ = c.pull_all()
    delta = fragment_delta(live, 1)
    reply = c.push(1, 0, delta, c_steps=5, c_tokens=320)
    assert reply.accepted and not reply.duplicate
    got = c.poll(1, 0, wait=5)
    assert got is not None and got[0] == 1
    # K=1, one learner: the merged delta is the delta itself; Nesterov first step = lr*(1+mu)*delta.
    lr, mu = 0.7, 0.9
    for name, value in got[1].items():
        np.testing.assert_allclose(
            value, before[name] - lr * (1 + mu) * delta[name], rtol=1e-5, atol=1e-7
        )
    assert live.client("x").status().fragments[1].version == 1


def _valid_push(
    live: LiveSyncer, p: int = 0, base: int = 0, unit: str = "unit-0", scheme: str = "none"
) -> bytes:
    header = PushHeader(p, base, 3, 96, scheme, unit, 0)  # type: ignore[arg-type]
    return encode_push(header, fragment_delta(live, p), 32)[0]


def _meta(p: int = 0, base: int = 0) -> dict[str, str]:
    return {
        "kind": "push",
        "fragment": str(p),
        "baseVersion": str(base),
        "cSteps": "1",
        "cTokens": "8",
        "scheme": "none",
        "unit": "unit-0",
        "attempt": "0",
    }


def _with(live: LiveSyncer, p: int, **changes: np.ndarray | None) -> bytes:
    delta: dict[str, np.ndarray] = dict(fragment_delta(live, p))
    for k, v in changes.items():
        if v is None:
            delta.pop(k.replace("__", "."))
        else:
            delta[k.replace("__", ".")] = v
    return encode_tensors(delta, _meta(p))


def bad_requests(live: LiveSyncer) -> list[tuple[str, str, bytes | None, str | None, int, str]]:
    """(label, path, body, token, expected status, expected reason)."""
    names = live.syncer.frags[0].names
    first = names[0]
    shape = live.syncer.shapes[first]
    good = _valid_push(live)

    def replace(value: np.ndarray) -> bytes:
        delta = fragment_delta(live, 0)
        delta[first] = value
        return encode_tensors(delta, _meta())

    nan = np.zeros(shape, np.float32)
    nan.flat[0] = np.nan
    inf = np.zeros(shape, np.float32)
    inf.flat[-1] = np.inf
    missing = fragment_delta(live, 0)
    missing.pop(first)
    extra = {**fragment_delta(live, 0), "not.a.leaf": np.zeros(3, np.float32)}
    quant_nan = bytearray(_valid_push(live, scheme="int8"))
    return [
        ("no token", "/v1/fragments/0/push", good, None, 401, "unauthorized"),
        ("wrong token", "/v1/fragments/0/push", good, "nope", 401, "unauthorized"),
        ("unknown fragment", "/v1/fragments/7/push", good, TOKEN, 404, "unknown_fragment"),
        ("non-numeric fragment", "/v1/fragments/x/push", good, TOKEN, 404, "unknown_fragment"),
        (
            "shape mismatch",
            "/v1/fragments/0/push",
            replace(np.zeros((*shape, 2), np.float32)),
            TOKEN,
            422,
            "mismatch",
        ),
        (
            "dtype mismatch",
            "/v1/fragments/0/push",
            replace(np.zeros(shape, np.float64)),
            TOKEN,
            422,
            "mismatch",
        ),
        (
            "missing tensor",
            "/v1/fragments/0/push",
            encode_tensors(missing, _meta()),
            TOKEN,
            422,
            "mismatch",
        ),
        (
            "extra tensor",
            "/v1/fragments/0/push",
            encode_tensors(extra, _meta()),
            TOKEN,
            422,
            "mismatch",
        ),
        ("NaN", "/v1/fragments/0/push", replace(nan), TOKEN, 422, "non_finite"),
        ("Inf", "/v1/fragments/0/push", replace(inf), TOKEN, 422, "non_finite"),
        (
            "future base",
            "/v1/fragments/0/push",
            _valid_push(live, base=5),
            TOKEN,
            409,
            "future_base",
        ),
        (
            "oversized",
            "/v1/fragments/0/push",
            b"\0" * (live.syncer.frags[0].max_body + 1),
            TOKEN,
            413,
            "too_large",
        ),
        ("garbage", "/v1/fragments/0/push", b"this is not safetensors", TOKEN, 400, "malformed"),
        ("truncated", "/v1/fragments/0/push", good[: len(good) // 2], TOKEN, 400, "malformed"),
        ("fragment differs from URL", "/v1/fragments/1/push", good, TOKEN, 400, "malformed"),
        (
            "quantized NaN scale",
            "/v1/fragments/0/push",
            _nan_scale(bytes(quant_nan)),
            TOKEN,
            422,
            "non_finite",
        ),
    ]


def _nan_scale(payload: bytes) -> bytes:
    from diloco_trainer.wire import decode_tensors

    tensors, meta = decode_tensors(payload)
    key = next(k for k in tensors if k.startswith("s/"))
    tensors[key] = tensors[key].copy()
    tensors[key][0] = np.nan
    return encode_tensors(tensors, {k: v for k, v in meta.items() if k != "format"})


def test_every_bad_push_is_refused_and_never_applied(live: LiveSyncer) -> None:
    live.client("unit-0").join()
    before = global_state(live)
    for label, path, body, token, status, reason in bad_requests(live):
        # TOKEN in the table: unit-0's own credentials (the payloads speak for unit-0).
        if token == TOKEN:
            got_status, reply = live.raw("POST", path, body, unit="unit-0")
        else:
            got_status, reply = live.raw("POST", path, body, token)
        assert (got_status, reply.get("reason")) == (status, reason), label
        assert reply.get("error"), f"{label}: the 4xx must carry a message"
    assert_unchanged(live, before)
    text = live.raw("GET", "/healthz")[1]  # still serving
    assert text == {"raw": b"ok"} or text == "ok"


def test_stale_base_is_refused(live: LiveSyncer) -> None:
    c = live.client()
    c.join()
    for base in (0, 1):  # two merges of fragment 0: version 2; maxStaleness 1 -> base 0 too old
        c.push(0, base, fragment_delta(live, 0, seed=base), 2, 64)
        assert c.poll(0, base, wait=5) is not None
    before = global_state(live)
    with pytest.raises(SyncerRejected) as err:
        c.push(0, 0, fragment_delta(live, 0, seed=9), 3, 96)  # more steps: not a retry
    assert (
        err.value.status == 409
        and err.value.reason == "stale"
        and "maxStaleness" in err.value.message
    )
    assert_unchanged(live, before)
    assert c.status().learners[c.unit].version_lag == 0  # its last accepted push: base 1 of 1
    assert c.push(0, 1, fragment_delta(live, 0, seed=3), 3, 96).accepted  # within the bound: fine
    # One version behind (base 1, fragment at 2): what the status tells an away cluster.
    assert c.status().learners[c.unit].version_lag == 1


def test_bad_json_endpoints_name_the_field(live: LiveSyncer) -> None:
    status, reply = live.raw(
        "POST",
        "/v1/heartbeat",
        json.dumps({"unit": "u", "step": "many", "tokens": 1}).encode(),
        unit="u",
    )
    assert status == 400 and "step" in reply["error"]
    status, reply = live.raw("POST", "/v1/join", b"{not json", unit="u")
    assert status == 400 and reply["reason"] == "malformed"
    status, reply = live.raw("POST", "/v1/join", json.dumps({"attempt": 0}).encode(), unit="u")
    assert status == 400 and "unit" in reply["error"]
    status, _ = live.raw("GET", "/v1/fragments/0?after=0&wait=-1")
    assert status == 400
    status, _ = live.raw("GET", "/v1/params", token="wrong")
    assert status == 401


@pytest.mark.parametrize("live", [dict(quorum=2)], indirect=True)
def test_duplicate_push_is_idempotent_and_unmerged_pushes_of_a_learner_add_up(
    live: LiveSyncer,
) -> None:
    """A retry (same unit, attempt and step) is recognised and not applied twice; two different
    pushes of one learner before a merge carry disjoint progress, so they are summed."""
    c = live.client()
    c.join()
    body = _valid_push(live)
    s1, r1 = live.raw("POST", "/v1/fragments/0/push", body, unit="unit-0")
    s2, r2 = live.raw("POST", "/v1/fragments/0/push", body, unit="unit-0")
    assert (s1, r1["duplicate"], s2, r2["duplicate"]) == (200, False, 200, True)
    assert len(live.syncer.frags[0].pending) == 1
    first = live.syncer.frags[0].pending["unit-0"].delta
    later = fragment_delta(live, 0, seed=42)
    assert not c.push(0, 0, later, c_steps=6, c_tokens=192, step=9).duplicate
    assert c.push(0, 0, later, c_steps=6, c_tokens=192, step=9).duplicate  # its retry
    pending = live.syncer.frags[0].pending
    assert list(pending) == ["unit-0"]
    assert (pending["unit-0"].header.c_steps, pending["unit-0"].header.c_tokens) == (9, 288)
    for name, value in pending["unit-0"].delta.items():
        np.testing.assert_allclose(value, first[name] + later[name], rtol=1e-6)
    # The same counters at a different step are a different push (no longer taken for a retry).
    assert not c.push(0, 0, later, c_steps=6, c_tokens=192, step=15).duplicate
    assert pending["unit-0"].header.c_steps == 15
    assert live.syncer.frags[0].version == 0  # one learner is not a quorum of 2


@pytest.mark.parametrize("live", [dict(quorum=2)], indirect=True)
def test_a_dead_attempts_unmerged_push_adds_to_its_successors(live: LiveSyncer) -> None:
    """A restarted unit (attempt+1) started from global parameters without its dead attempt's
    unmerged push, so the two carry disjoint progress: both count, under the newest attempt's
    header. A push of the old attempt arriving after the successor joined is refused: the
    successor reads that data again from the unit's lease."""
    dead, successor = live.client("unit-0", attempt=0), live.client("unit-0", attempt=1)
    d_dead, d_new = fragment_delta(live, 0, seed=7), fragment_delta(live, 0, seed=8)
    dead.push(0, 0, d_dead, c_steps=5, c_tokens=320, step=5)
    successor.push(0, 0, d_new, c_steps=3, c_tokens=192, step=3)
    late = fragment_delta(live, 0, seed=9)  # a push of the old attempt, arriving last
    with pytest.raises(SyncerRejected) as refused:
        dead.push(0, 0, late, c_steps=2, c_tokens=128, step=7)
    assert (refused.value.status, refused.value.reason) == (409, "superseded")
    pending = live.syncer.frags[0].pending["unit-0"]
    assert (pending.header.attempt, pending.header.c_steps, pending.header.c_tokens) == (
        1,
        8,
        512,
    )
    for name, value in pending.delta.items():
        np.testing.assert_allclose(value, d_dead[name] + d_new[name], rtol=1e-6)
    assert live.syncer.frags[0].version == 0  # still one unit: below the quorum of 2


@pytest.mark.parametrize(
    "live", [dict(quorum=2, grace={"mode": "fixed", "maxSeconds": 20.0})], indirect=True
)
def test_quorum_two_waits_for_a_straggler_within_grace(live: LiveSyncer) -> None:
    units = ["unit-0", "unit-1", "unit-2"]
    clients = {u: live.client(u) for u in units}
    for c in clients.values():
        c.join()
        c.heartbeat(1, 64, 100.0, 3.0)  # online
    base, _ = clients["unit-0"].pull_all()
    deltas = {u: fragment_delta(live, 2, seed=i) for i, u in enumerate(units)}
    counters = {"unit-0": (4, 256), "unit-1": (4, 128), "unit-2": (2, 128)}
    clients["unit-0"].push(2, 0, deltas["unit-0"], *counters["unit-0"])
    assert live.syncer.frags[2].merge_task is None  # below quorum
    clients["unit-1"].push(2, 0, deltas["unit-1"], *counters["unit-1"])
    time.sleep(0.3)  # quorum met: the grace window is open, nothing merged yet
    assert live.syncer.frags[2].version == 0 and live.syncer.frags[2].merge_task is not None
    t0 = time.monotonic()
    clients["unit-2"].push(2, 0, deltas["unit-2"], *counters["unit-2"])
    got = clients["unit-0"].poll(2, 0, wait=5)
    # Everyone online has pushed: the merge does not sit out the 20 s grace window (the
    # bound is loose because the first outer step of a fragment includes its jit compile).
    assert got is not None and got[0] == 1 and time.monotonic() - t0 < 10.0
    expected = merge_fragment(
        [Contribution(deltas[u], *counters[u]) for u in units], method="rda", token_weighting=True
    )
    opt = OuterOptimizer(0.7, 0.9, True)
    frag_base = {n: base[n] for n in live.syncer.frags[2].names}
    want, _ = opt.step(frag_base, opt.init(frag_base), expected)
    for n, v in want.items():
        np.testing.assert_allclose(got[1][n], v, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "live", [dict(quorum=2, grace={"mode": "fixed", "maxSeconds": 0.4})], indirect=True
)
def test_grace_expires_without_the_straggler(live: LiveSyncer) -> None:
    for u in ("unit-0", "unit-1", "unit-2"):
        live.client(u).heartbeat(1, 64, 100.0, None)
    live.client("unit-0").push(1, 0, fragment_delta(live, 1, seed=1), 1, 64)
    live.client("unit-1").push(1, 0, fragment_delta(live, 1, seed=2), 1, 64)
    t0 = time.monotonic()
    got = live.client("unit-0").poll(1, 0, wait=5)
    waited = time.monotonic() - t0
    assert got is not None and got[0] == 1
    assert 0.2 < waited < 2.0


def test_heartbeats_count_across_attempts_and_complete_the_run(live: LiveSyncer) -> None:
    a0, a1, other = live.client("unit-0", 0), live.client("unit-0", 1), live.client("unit-1")
    a0.join()
    a0.heartbeat(40, 40 * 64, 1000.0, 3.0)
    a0.heartbeat(30, 30 * 64, 1000.0, 3.0)  # out of order: maxima per attempt are kept
    # Pushed at its last step: all 40 still count once attempt 1 supersedes it (registry.py).
    a0.push(0, 0, fragment_delta(live, 0), 40, 40 * 64, step=40)
    a1.heartbeat(20, 20 * 64, 900.0, 2.5)  # restarted unit: attempt 1 counts from zero again
    r = other.heartbeat(30, 30 * 64, 1100.0, float("nan"))
    assert not r.complete
    status = other.status()
    _, served = live.raw("GET", "/v1/status")  # the wire document the model is read from
    assert set(served) == {
        "run",
        "outerStep",
        "steps",
        "tokens",
        "loss",
        "trainLoss",
        "complete",
        "finalLoss",
        "finalEval",
        "time",
        "fragments",
        "learners",
        "bytesReceived",
        "bytesSent",
        "health",
        "checkpoint",
        "rosterRevision",
        "shard",
        "spares",
    }
    assert status.steps == 90 and status.tokens == 90 * 64
    assert status.learners["unit-0"].step == 60 and status.learners["unit-0"].attempt == 1
    assert set(served["learners"]["unit-0"]) == {
        "attempt",
        "group",
        "lastHeartbeat",
        "ageSeconds",
        "step",
        "tokens",
        "tokensPerSec",
        "loss",
        "refused",
        "lastRefusal",
        "quarantined",
        "versionLag",
    }
    assert status.learners["unit-1"].loss is None
    assert status.train_loss == pytest.approx(2.5)
    assert status.loss is None and status.complete is False
    assert other.heartbeat(40, 40 * 64, 1100.0, 2.0).complete  # 100 = totalSteps
    assert live.client("late").join().complete


def test_metrics_count_rejections_and_merges(live: LiveSyncer) -> None:
    c = live.client()
    c.join()
    live.raw("POST", "/v1/fragments/0/push", b"junk", unit="unit-0")
    c.push(0, 0, fragment_delta(live, 0), 1, 8)
    wait_until(lambda: live.syncer.frags[0].version == 1)
    status, _ = live.raw(
        "POST", "/v1/fragments/1/push", _valid_push(live, p=1, scheme="int8"), unit="unit-0"
    )
    assert status == 200
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=5)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    assert 'diloco_syncer_pushes_total{reason="malformed",result="rejected"} 1.0' in text
    assert 'diloco_syncer_merges_total{fragment="0"} 1.0' in text
    assert "diloco_syncer_push_quant_error_count 1.0" in text
    assert re.search(r"^diloco_syncer_outer_step [12]\.0$", text, re.M)  # 2 once frag 1 merged


def crash_after_one_merge(
    tmp_path: Path,
) -> tuple[TrainingConfig, dict[str, np.ndarray], tuple[int, dict[str, np.ndarray]], list[Any]]:
    """A syncer that merged fragment 0 once after its startup checkpoint, then died with no
    cleanup (no final checkpoint). Returns the config, the initial parameters, the version and
    content the learner got from the merge, and fragment 0's outer state leaves at the crash."""
    cfg = tiny_cfg(checkpoint={"path": str(tmp_path), "everySeconds": 3600})
    crashed = LiveSyncer(Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=None))
    learner = crashed.client()
    learner.join()
    initial, _ = learner.pull_all()
    learner.push(0, 0, fragment_delta(crashed, 0), 2, 64)
    got = learner.poll(0, 0, wait=10)
    assert got is not None and got[0] == 1  # the learner now holds version 1 of fragment 0
    outer = OuterOptimizer.state_leaves(crashed.syncer.frags[0].opt_state)
    crashed.loop.call_soon_threadsafe(crashed.loop.stop)
    crashed.thread.join(10)
    snap = CheckpointStore(tmp_path).load_latest()
    assert snap is not None and snap.versions == [0, 0, 0]  # the merge is not checkpointed
    return cfg, initial, got, outer


def test_a_version_published_after_the_last_checkpoint_survives_a_crash(tmp_path: Path) -> None:
    """The fragment journal: the restarted syncer serves the very version the learner holds
    (same number, same values, same outer momentum), so nothing it learned is lost."""
    cfg, _, (version, held), outer = crash_after_one_merge(tmp_path)
    restarted = LiveSyncer(Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=None))
    try:
        learner = restarted.client()
        assert learner.join().versions == [version, 0, 0]
        assert learner.poll(0, version, wait=0.5) is None  # nothing newer than what it holds
        served = learner.poll(0, 0, wait=10)
        assert served is not None and served[0] == version
        for name, value in held.items():
            np.testing.assert_array_equal(served[1][name], value)
        for want, got in zip(
            outer, OuterOptimizer.state_leaves(restarted.syncer.frags[0].opt_state), strict=True
        ):
            np.testing.assert_array_equal(got, want)
        learner.push(0, version, fragment_delta(restarted, 0, seed=5), 2, 64)
        assert learner.poll(0, version, wait=10) is not None
        assert CheckpointStore(tmp_path).recorded_versions() == [version + 1, 0, 0]
    finally:
        restarted.close()


def test_versions_lost_in_a_crash_are_never_reissued(tmp_path: Path) -> None:
    """Without a readable fragment journal, a version published after the last checkpoint dies
    with the process; the restarted syncer numbers above it, so a learner that saw it installs
    the restored content as a newer version."""
    cfg, initial, _, _ = crash_after_one_merge(tmp_path)
    (tmp_path / "fragment-000.safetensors").write_bytes(b"\x00" * 64)  # damaged

    restarted = LiveSyncer(Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=None))
    try:
        learner = restarted.client()
        assert learner.join().versions == [2, 0, 0]
        again = learner.poll(0, 1, wait=10)  # returns at once: 2 is newer than what it holds
        assert again is not None and again[0] == 2
        for name, value in again[1].items():
            np.testing.assert_array_equal(value, initial[name])  # the checkpointed content
        learner.push(0, 2, fragment_delta(restarted, 0, seed=5), 2, 64)
        assert learner.poll(0, 2, wait=10) is not None
        assert CheckpointStore(tmp_path).recorded_versions() == [3, 0, 0]
    finally:
        restarted.close()


def test_periodic_eval_reports_the_global_models_held_out_loss() -> None:
    from diloco_trainer.workload.evaluate import eval_loss

    cfg = tiny_cfg(
        eval={"everySeconds": 0.2, "batches": 1}, data={"maxBytes": 65536, "batchSize": 2}
    )
    server = LiveSyncer(Syncer(cfg, TOKEN, store=None))  # the real default eval_fn
    try:
        observer = server.client()
        wait_until(lambda: observer.status().loss is not None, timeout=120)
        expected = eval_loss(init_params(cfg.model, cfg.seed), cfg, 1)
        assert observer.status().loss == pytest.approx(expected, rel=1e-5)
        assert 4.0 < expected < 7.0  # ~ln(256) for an untrained byte-level model
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        conn.request("GET", "/metrics")
        assert "diloco_syncer_eval_loss " in conn.getresponse().read().decode()
    finally:
        server.close()


def test_joined_learner_shows_a_sign_of_life_before_its_first_heartbeat(live: LiveSyncer) -> None:
    live.client("unit-5").join()
    entry = live.client("x").status().learners["unit-5"]
    assert entry.last_heartbeat is not None
    assert entry.age_seconds is not None and 0 <= entry.age_seconds < 5
    assert entry.step == 0


@pytest.mark.parametrize(
    "live",
    [
        dict(  # the unlocked rule; the phase-locked one is the next test
            quorum=1,
            overlap=100000,
            innerSteps=300,
            phaseLock=False,
            grace={"mode": "adaptive", "maxSeconds": 30.0},
        )
    ],
    indirect=True,
)
def test_adaptive_grace_waits_for_unknown_learners_but_not_the_whole_window_for_predicted_ones(
    live: LiveSyncer,
) -> None:
    a, b = live.client("unit-0"), live.client("unit-1")
    for c in (a, b):
        c.heartbeat(0, 0, 100.0, None)
    time.sleep(0.1)
    for c in (a, b):
        c.heartbeat(10, 640, 100.0, None)  # step time ~0.01 s each, so H=300 steps ~3 s
    contributions = live.syncer.metrics.registry

    def merged_contributions() -> float:
        return contributions.get_sample_value("diloco_syncer_merge_contributions_sum") or 0.0

    # Round 1: unit-0 has never pushed fragment 0, so after the quorum (K=1) the syncer waits.
    b.push(0, 0, fragment_delta(live, 0, seed=1), 10, 640)
    time.sleep(0.3)
    assert live.syncer.frags[0].version == 0
    a.push(0, 0, fragment_delta(live, 0, seed=2), 10, 640)
    wait_until(lambda: live.syncer.frags[0].version == 1)
    assert merged_contributions() == 2.0
    # Round 2: unit-0 is expected H steps after its last push (at its measured step time, ~3 s;
    # long enough that the first merge's jit compile does not make it overdue), well inside the
    # 30 s window; the merge goes ahead after that expectation, not after the whole window.
    step_time = live.syncer.learners.get("unit-0").step_time.value
    assert step_time is not None
    expected_wait = 1.25 * 300 * step_time
    t0 = time.monotonic()
    b.push(0, 1, fragment_delta(live, 0, seed=3), 10, 640)
    wait_until(lambda: live.syncer.frags[0].version == 2, timeout=30)
    assert time.monotonic() - t0 < min(expected_wait, 30.0) + 3.0 < 25.0
    assert merged_contributions() == 3.0


def _locked(lock: bool) -> dict[str, object]:
    grace = {"mode": "adaptive", "maxSeconds": 10.0}
    return dict(quorum=1, overlap=1, phaseLock=lock, grace=grace)


@pytest.mark.parametrize(
    ("live", "locked"), [(_locked(lock), lock) for lock in (False, True)], indirect=["live"]
)
def test_phase_locked_grace_waits_beyond_the_overlap_slack(live: LiveSyncer, locked: bool) -> None:
    """With an overlap of one ~10 ms step the slack is gone at once and a straggler misses the
    merge; phase-locked learners push together, so the syncer waits up to maxSeconds for one
    it has no expectation for."""
    a, b = live.client("unit-0"), live.client("unit-1")
    for c in (a, b):
        c.heartbeat(0, 0, 100.0, None)
    time.sleep(0.1)
    for c in (a, b):
        c.heartbeat(10, 640, 100.0, None)  # ~10 ms steps
    b.push(0, 0, fragment_delta(live, 0, seed=1), 10, 640)
    time.sleep(0.8)
    a.push(0, 0, fragment_delta(live, 0, seed=2), 10, 640)
    wait_until(lambda: not live.syncer.frags[0].pending and live.syncer.frags[0].merge_task is None)
    # Locked: one merge of both (long before the 10 s bound). Not locked: one merge each.
    assert live.syncer.frags[0].version == (1 if locked else 2)


def test_validate_push_is_pure_and_ordered_by_severity() -> None:
    from diloco_trainer.syncer.fragment import FragmentState, Reject, validate_push

    f = FragmentState(0, ["w"], {"w": np.zeros(3, np.float32)}, None, version=5)
    ok = {"w": np.ones(3, np.float32)}
    header = PushHeader(0, 5, 1, 8, "none", "u", 0)
    validate_push(f, header, ok, {"w": (3,)}, max_staleness=2)  # fine: no exception
    cases = [
        (PushHeader(1, 5, 1, 8, "none", "u", 0), ok, 400, "malformed"),
        (header, {"v": np.ones(3, np.float32)}, 422, "mismatch"),
        (header, {"w": np.array([1, np.inf, 0], np.float32)}, 422, "non_finite"),
        (PushHeader(0, 6, 1, 8, "none", "u", 0), ok, 409, "future_base"),
        (PushHeader(0, 2, 1, 8, "none", "u", 0), ok, 409, "stale"),
    ]
    for h, delta, status, reason in cases:
        with pytest.raises(Reject) as err:
            validate_push(f, h, delta, {"w": (3,)}, max_staleness=2)
        assert (err.value.status, err.value.reason) == (status, reason)
    assert f.version == 5 and not f.pending


def test_final_eval_after_the_budget_waits_for_the_last_merge_and_survives_a_restart(
    tmp_path: Path,
) -> None:
    """Once `complete`, the syncer evaluates the global model after the in-flight merge has
    landed (even with periodic eval off), reports it as finalLoss and checkpoints it; a restarted
    syncer reports it again without evaluating."""
    calls: list[float] = []

    def fake_eval(params: Any, cfg: TrainingConfig, batches: int) -> float:
        value = float(sum(float(np.sum(v, dtype=np.float64)) for v in params.values()))
        calls.append(value)
        return value

    cfg = tiny_cfg(
        checkpoint={"path": str(tmp_path), "everySeconds": 3600},
        grace={"mode": "fixed", "maxSeconds": 0.5},
    )
    first = LiveSyncer(Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=fake_eval))
    try:
        learner, other = first.client("unit-0"), first.client("unit-1")
        learner.join()
        other.join()  # online and silent: the merge of unit-0's push waits out the 0.5 s grace
        status = learner.status()
        assert status.final_loss is None and status.final_eval == "waiting"
        learner.push(0, 0, fragment_delta(first, 0, scale=0.1), 100, 6400)
        assert learner.heartbeat(100, 6400, 1000.0, 3.0).complete  # merge still in its grace
        wait_until(lambda: learner.status().final_eval == "done")
        status = learner.status()
        assert status.complete and [f.version for f in status.fragments] == [1, 0, 0]
        params, _ = learner.pull_all()
        assert status.final_loss == pytest.approx(fake_eval(params, cfg, 1))
        assert status.loss is None  # the periodic curve (off here) is untouched
        final = status.final_loss
        learner.heartbeat(101, 6464, 1000.0, 3.0)
        assert learner.status().final_loss == final  # evaluated once, at the first completion
        assert len(calls) == 2  # the syncer's one evaluation plus ours above
    finally:
        first.close()

    calls.clear()
    second = LiveSyncer(Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=fake_eval))
    try:
        status = second.client("observer").status()
        assert status.complete and status.final_loss == final
        assert status.final_eval == "done" and calls == []
    finally:
        second.close()


def test_a_run_restored_complete_without_a_final_eval_evaluates_at_startup(
    tmp_path: Path,
) -> None:
    cfg = tiny_cfg(checkpoint={"path": str(tmp_path), "everySeconds": 3600})
    first = LiveSyncer(Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=None))
    try:
        assert first.client("unit-0").heartbeat(100, 6400, 1000.0, 3.0).complete
        assert first.client("observer").status().final_eval == "off"  # no eval function
        first.run(first.syncer.save_checkpoint(force=True))
    finally:
        first.close()
    second = LiveSyncer(
        Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=lambda p, c, b: 4.25)
    )
    try:
        observer = second.client("observer")
        wait_until(lambda: observer.status().final_eval == "done")
        assert observer.status().final_loss == 4.25
    finally:
        second.close()


def test_join_reply_carries_the_units_step_across_restarts(tmp_path: Path) -> None:
    """resumeStep: 0 for the first unit; a unit new to a running run starts at the mean of the
    known units' steps (where the run is); after a restart of the unit (attempt+1), the steps its
    earlier attempts count: up to the step of each one's last accepted push, where its data
    resumes (registry.py); after a restart of the syncer, the same from its checkpoint
    (per-attempt counters are checkpointed, so the token total and the schedule agree)."""
    cfg = tiny_cfg(checkpoint={"path": str(tmp_path), "everySeconds": 3600}, totalSteps=10_000)
    first = LiveSyncer(Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=None))

    def push_at(client: SyncerClient, step: int) -> None:
        version = first.syncer.frags[0].version
        assert client.push(0, version, fragment_delta(first, 0), 10, 640, step=step).accepted

    try:
        attempt0 = first.client("unit-0")
        assert attempt0.join().resume_step == 0  # a new unit
        push_at(attempt0, 100)
        attempt0.heartbeat(120, 120 * 64, 1.0, 3.0)  # steps 101-120 die with the attempt
        restarted = first.client("unit-0", attempt=1)
        assert restarted.join().resume_step == 100
        restarted.heartbeat(30, 30 * 64, 1.0, 3.0)  # counts from 0 again within its attempt
        push_at(restarted, 30)
        assert restarted.join().resume_step == 100  # its own attempt is not counted twice
        assert first.client("unit-0", attempt=2).join().resume_step == 130
        # A unit new to the run starts where the run is: the mean position of the known units
        # (unit-0 alone: 130), the same on every join of that attempt.
        assert first.client("unit-1").join().resume_step == 130
        assert first.client("unit-1").join().resume_step == 130
        first.client("unit-1").heartbeat(10, 10 * 64, 1.0, 3.0)
        push_at(first.client("unit-1"), 10)
        assert first.client("unit-1", attempt=1).join().resume_step == 140
        assert first.client("observer").status().learners["unit-0"].tokens == 130 * 64
        first.run(first.syncer.save_checkpoint(force=True))
    finally:
        first.close()

    second = LiveSyncer(Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=None))
    try:
        assert second.client("unit-0", attempt=3).join().resume_step == 130
        assert second.client("unit-1", attempt=2).join().resume_step == 140
        assert second.client("observer").status().tokens == 140 * 64
    finally:
        second.close()


@pytest.mark.parametrize("live", [{"totalSteps": 10_000, "heartbeatSeconds": 0.1}], indirect=True)
def test_a_restarted_learner_continues_its_lr_schedule_and_counts_its_own_steps(
    live: LiveSyncer, caplog: pytest.LogCaptureFixture
) -> None:
    """Attempt 1 of a unit whose attempt 0 reported and pushed 120 steps: the learner continues
    its schedule at 120 (re-warming), while its heartbeats count this attempt's steps from 0, so
    the syncer's total for the unit is 120 + the new steps (nothing counted twice)."""
    import logging

    from diloco_trainer.learner.loop import run_learner
    from diloco_trainer.learner.options import LearnerOptions

    cfg = live.syncer.cfg
    first = live.client("unit-0")
    first.join()
    tokens = 120 * cfg.tokens_per_step
    first.push(0, 0, fragment_delta(live, 0), 120, tokens, step=120)
    first.heartbeat(120, tokens, 1.0, 3.0)
    opts = LearnerOptions(
        syncer=live.url,
        token=unit_token(TOKEN, "unit-0"),
        unit=0,
        num_units=1,
        unit_name="unit-0",
        attempt=1,
        log_every=2,
        max_steps=40,
        slowdown=3.0,
    )
    with caplog.at_level(logging.INFO, logger="diloco_trainer.learner"):
        result = run_learner(cfg, opts)
    assert result.steps == 40 and result.tokens == 40 * cfg.tokens_per_step
    text = caplog.text
    assert "resume_step=120" in text
    assert re.search(r"event=progress unit=unit-0 step=2 schedule_step=122 ", text), text
    # Heartbeats carried this attempt's own steps (the last few may not have been reported).
    wait_until(lambda: live.syncer.learners.get("unit-0").steps > 120)
    counted = live.syncer.learners.get("unit-0").steps
    assert counted <= 160 and live.syncer.learners.resume_step("unit-0", 2) == counted


@pytest.mark.parametrize("live", [{"totalSteps": 10_000, "heartbeatSeconds": 0.1}], indirect=True)
def test_a_learner_behind_the_run_moves_its_lr_schedule_up_to_the_runs_progress(
    live: LiveSyncer, caplog: pytest.LogCaptureFixture
) -> None:
    """Two units; unit-1 has counted 3,000 steps while unit-0 counted 120 before it restarted.
    The run is 31.2% through its budget of 10,000 steps, so attempt 1 of unit-0 (horizon 5,000)
    trains at schedule step 1,560 or later, not at 120 + its steps: a unit that was down must
    not end the run at a higher LR than the others."""
    import logging

    from diloco_trainer.learner.loop import learner_horizon, run_learner
    from diloco_trainer.learner.options import LearnerOptions
    from diloco_trainer.learner.train import learning_rate_schedule

    cfg = live.syncer.cfg
    clients = {unit: live.client(unit) for unit in ("unit-1", "unit-0")}
    for client in clients.values():
        client.join()  # both start the run (a unit joining later starts at the run's position)
    time.sleep(0.05)  # 3,000 steps need 30 ms at the fastest speed the syncer believes (trust.py)
    for unit, steps, run_share in (("unit-1", 3000, 0.3), ("unit-0", 120, 0.312)):
        client = clients[unit]
        tokens = steps * cfg.tokens_per_step
        client.push(0, 0, fragment_delta(live, 0), steps, tokens, step=steps)
        assert client.heartbeat(steps, tokens, 1.0, 3.0).budget_done == pytest.approx(run_share)
    opts = LearnerOptions(
        syncer=live.url,
        token=unit_token(TOKEN, "unit-0"),
        unit=0,
        num_units=2,
        unit_name="unit-0",
        attempt=1,
        log_every=2,
        max_steps=40,
        slowdown=3.0,
    )
    with caplog.at_level(logging.INFO, logger="diloco_trainer.learner"):
        assert run_learner(cfg, opts).steps == 40
    text = caplog.text
    assert "resume_step=120" in text
    caught_up = re.search(r"event=schedule_caught_up step=\d+ schedule_step=(\d+)", text)
    assert caught_up is not None and int(caught_up.group(1)) >= 1560, text
    last = re.findall(r"event=progress unit=unit-0 step=40 schedule_step=(\d+) lr=(\S+) ", text)
    assert last, text
    position = int(last[0][0])
    assert 1560 + 40 > position >= 1560  # at the floor, then its own steps (the floor moves less)
    schedule = learning_rate_schedule(cfg.inner_optimizer, learner_horizon(cfg, 2))
    assert float(last[0][1]) == pytest.approx(float(schedule(position - 1)), rel=1e-2)


@pytest.mark.parametrize("live", [{"compression": {"downlink": "int4"}}], indirect=True)
def test_compressed_downlink_sends_a_step_to_a_learner_holding_the_previous_version(
    live: LiveSyncer,
) -> None:
    follower, newcomer = live.client("unit-0"), live.client("unit-1")
    for c in (follower, newcomer):
        c.join()
    follower.pull_all()  # holds version 0 of every fragment
    follower.push(1, 0, fragment_delta(live, 1), c_steps=5, c_tokens=320)
    received = follower.bytes_received
    got = follower.poll(1, 0, wait=5)
    step_bytes = follower.bytes_received - received
    fresh = newcomer.poll(1, -1, wait=5)  # holds nothing: gets the values
    values_bytes = newcomer.bytes_received
    assert got is not None and fresh is not None and got[0] == fresh[0] == 1
    frag = live.syncer.frags[1]
    for name in frag.names:
        np.testing.assert_array_equal(got[1][name], frag.published()[name])
        np.testing.assert_array_equal(fresh[1][name], frag.published()[name])
        # The published copy is the global fragment up to int4 rounding of one outer update.
        np.testing.assert_allclose(got[1][name], frag.params[name], atol=2e-3)
    assert step_bytes < values_bytes / 4, (step_bytes, values_bytes)
    # A copy from another syncer process (or none at all) never gets a step: values.
    status, body = live.raw("GET", "/v1/fragments/1?after=0&epoch=elsewhere")
    assert status == 200 and not decode_download(body["raw"]).step
    metrics = live.raw("GET", "/metrics")[1]["raw"].decode()
    assert 'diloco_syncer_fragment_downloads_total{kind="step"} 1.0' in metrics
    assert 'diloco_syncer_fragment_downloads_total{kind="values"} 2.0' in metrics


@pytest.mark.parametrize("live", [{"compression": {"downlink": "int8"}}], indirect=True)
def test_a_copy_that_a_step_does_not_rebuild_is_refetched_as_values(live: LiveSyncer) -> None:
    c = live.client()
    c.join()
    params, _ = c.pull_all()
    name = live.syncer.frags[0].names[0]
    params[name].flat[0] += 1.0  # the client's copy of version 0 no longer matches the syncer's
    c.push(0, 0, fragment_delta(live, 0), c_steps=5, c_tokens=320)
    with pytest.raises(SyncerUnavailable, match="checksum"):
        c.poll(0, 0, wait=5)
    got = c.poll(0, 0, wait=5)  # the bad copy was dropped: this answer is the values
    assert got is not None and got[0] == 1
    for n, value in got[1].items():
        np.testing.assert_array_equal(value, live.syncer.frags[0].published()[n])


@pytest.mark.parametrize("live", [dict(_locked(True), heartbeatSeconds=0.5)], indirect=True)
def test_phase_locked_merge_neither_waits_for_nor_shares_with_a_joiner_or_a_silent_unit(
    live: LiveSyncer, caplog: pytest.LogCaptureFixture
) -> None:
    """A unit that joined after the fragment's last merge pushes it only a round later, and a
    killed one never again: a locked merge would wait the whole 10 s for either and scale its
    step by the share of those present. It goes ahead with the units in step, as a full step."""
    a, b = live.client("unit-0"), live.client("unit-1")
    for c in (a, b):
        c.heartbeat(0, 0, 100.0, None)
    a.push(0, 0, fragment_delta(live, 0, seed=1), 10, 640)
    b.push(0, 0, fragment_delta(live, 0, seed=2), 10, 640)
    wait_until(lambda: live.syncer.frags[0].version == 1)
    live.client("unit-2").join()  # a replacement or a new unit, after the merge
    caplog.set_level(logging.INFO, logger="diloco.syncer")
    t0 = time.monotonic()
    a.heartbeat(10, 640, 100.0, None)
    b.heartbeat(10, 640, 100.0, None)
    a.push(0, 1, fragment_delta(live, 0, seed=3), 10, 640)
    b.push(0, 1, fragment_delta(live, 0, seed=4), 10, 640)
    wait_until(lambda: live.syncer.frags[0].version == 2)
    assert time.monotonic() - t0 < 5.0
    # unit-1 goes silent (killed): after 2 heartbeat periods unit-0's push merges alone.
    time.sleep(1.2)
    a.heartbeat(20, 1280, 100.0, None)
    t0 = time.monotonic()
    a.push(0, 2, fragment_delta(live, 0, seed=5), 10, 640)
    wait_until(lambda: live.syncer.frags[0].version == 3)
    assert time.monotonic() - t0 < 5.0
    merged = [r.getMessage() for r in caplog.records if "event=merged" in r.getMessage()]
    assert [m.split(" share=")[1].split()[0] for m in merged] == ["1.000", "1.000"]
    assert "units=unit-0,unit-1 " in merged[0] and "units=unit-0 " in merged[1]


@pytest.mark.parametrize(
    "live",
    [dict(quorum=1, phaseLock=True, grace={"mode": "fixed", "maxSeconds": 0.3})],
    indirect=True,
)
def test_phase_locked_push_that_missed_the_merge_rides_with_the_next_round(
    live: LiveSyncer,
) -> None:
    """Merged alone, a late push would publish a version in mid-round, and every learner that
    installs it loses its progress on the fragment since the round's merge."""
    a, b = live.client("unit-0"), live.client("unit-1")
    for c in (a, b):
        c.heartbeat(0, 0, 100.0, None)
    a.push(0, 0, fragment_delta(live, 0, seed=1), 10, 640)
    wait_until(lambda: live.syncer.frags[0].version == 1)  # b missed the 0.3 s window
    b.push(0, 0, fragment_delta(live, 0, seed=2), 10, 640)
    time.sleep(1.0)
    assert live.syncer.frags[0].version == 1 and list(live.syncer.frags[0].pending) == ["unit-1"]
    a.push(0, 1, fragment_delta(live, 0, seed=3), 10, 640)
    wait_until(lambda: live.syncer.frags[0].version == 2)
    contributions = live.syncer.metrics.registry.get_sample_value(
        "diloco_syncer_merge_contributions_sum"
    )
    assert contributions == 3.0  # 1 in the first merge, then a's and b's together


@pytest.mark.parametrize(
    "live", [{"compression": {"scheme": "int4", "blockSize": 64}}], indirect=True
)
def test_pushes_are_encoded_as_the_learners_own_config_says(live: LiveSyncer) -> None:
    """The join reply carries no compression: the learner reads it from the config it holds."""
    _, joined = live.raw(
        "POST", "/v1/join", json.dumps({"unit": "unit-0", "attempt": 0}).encode(), unit="unit-0"
    )
    assert set(joined) == {
        "run",
        "layout",
        "versions",
        "complete",
        "outerStep",
        "resumeStep",
        "shapes",
        "dataLease",
        "shard",
    }
    quantized = live.client("unit-0")
    plain = SyncerClient(live.url, unit_token(TOKEN, "unit-1"), "unit-1", 0)  # no compression
    delta = fragment_delta(live, 0)
    first = quantized.push(0, 0, delta, c_steps=1, c_tokens=64)
    assert first.accepted and first.quant_error > 0  # int4 with 64 values per scale
    second = plain.push(1, 0, fragment_delta(live, 1), c_steps=1, c_tokens=64)
    assert second.accepted and second.quant_error == 0.0  # no config given: float32


@pytest.mark.parametrize(
    "live", [{"compression": {"scheme": "int2", "errorFeedback": True}}], indirect=True
)
def test_error_feedback_owes_what_accepted_pushes_dropped_and_nothing_for_a_refused_one(
    live: LiveSyncer,
) -> None:
    c = live.client()
    c.join()
    assert c.feedback is not None
    for base in (0, 1):  # two merges of fragment 0: version 2; maxStaleness 1 -> base 0 too old
        reply = c.push(0, base, fragment_delta(live, 0, seed=base), 2, 64)
        assert reply.accepted and reply.quant_error > 0.1  # ternary drops a lot
        assert c.poll(0, base, wait=5) is not None
    owed = c.feedback.owed_norm(0)
    assert owed > 0 and c.feedback.owed_norm(1) == 0.0
    with pytest.raises(SyncerRejected):
        c.push(0, 0, fragment_delta(live, 0, seed=9), 3, 96)
    assert c.feedback.owed_norm(0) == owed  # the refused push's error is not owed
    plain = SyncerClient(live.url, unit_token(TOKEN, "unit-1"), "unit-1", 0)
    assert plain.feedback is None  # a client without the config: float32, nothing owed

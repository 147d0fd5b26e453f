"""One unit, with a valid credential, must not be able to wreck a run: what a buggy, silently
corrupted or hostile unit can send (absurd counters, replays, leases it never held, floods,
garbage on the port) is refused or bounded, and the others' work is untouched."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from diloco_trainer.auth import unit_token
from diloco_trainer.budget import Budget
from diloco_trainer.learner import client as client_module
from diloco_trainer.learner.client import (
    SyncerBusy,
    SyncerClient,
    SyncerRejected,
    SyncerUnavailable,
)
from diloco_trainer.syncer.checkpoint import CheckpointStore
from diloco_trainer.syncer.core import Syncer
from diloco_trainer.syncer.limits import rates_for
from diloco_trainer.syncer.roster import Roster
from diloco_trainer.syncer.trust import Implausible, Plausibility
from diloco_trainer.wire import MAX_COUNTER, PushHeader, encode_push
from test_syncer import TOKEN, LiveSyncer, fragment_delta, global_state, tiny_cfg, wait_until

HUGE = MAX_COUNTER  # 2^53 - 1: the largest counter the wire takes


def serve(store: CheckpointStore | None = None, **overrides: object) -> LiveSyncer:
    cfg = tiny_cfg(**{"totalSteps": 100_000, "innerSteps": 5, **overrides})
    return LiveSyncer(Syncer(cfg, TOKEN, run="trust", store=store, eval_fn=None))


@pytest.fixture
def live() -> Iterator[LiveSyncer]:
    server = serve()
    yield server
    server.close()


def steady(live: LiveSyncer, unit: str, steps: int = 3, step_seconds: float = 0.05) -> None:
    """`unit` joins and heartbeats a few honest steps, so the syncer measures its step time."""
    c = live.client(unit)
    c.join()
    tps = live.syncer.tokens_per_step
    for step in range(1, steps + 1):
        c.heartbeat(step, step * tps, 100.0, 3.0)
        time.sleep(step_seconds)


# ------------------------------------------------------------------ counters: heartbeats


def test_one_heartbeat_of_2_53_steps_neither_ends_the_run_nor_moves_the_schedules(
    live: LiveSyncer,
) -> None:
    hostile = live.client("hostile")
    hostile.join()
    steady(live, "honest")
    budget = hostile.heartbeat(1, live.syncer.tokens_per_step, 100.0, 3.0).budget_done
    # 2^53 steps a moment after joining: beyond any real speed (100,000 steps/s).
    with pytest.raises(SyncerRejected) as refused:
        hostile.heartbeat(HUGE, HUGE, 1e9, 3.0)
    assert (refused.value.status, refused.value.reason) == (422, "implausible")
    assert "beyond reach" in refused.value.message
    status = live.client("observer").status()
    assert not status.complete and status.steps <= 3 + 2 * 5
    assert status.learners["hostile"].refused == 1
    assert "heartbeat" in (status.learners["hostile"].last_refusal or "")
    reply = live.client("honest").heartbeat(4, 4 * live.syncer.tokens_per_step, 100.0, 3.0)
    assert not reply.complete and reply.budget_done == pytest.approx(budget, abs=1e-4)
    assert live.syncer.learners.resume_step("late", 0) <= 3 + 2 * 5


def test_a_possible_but_unpushed_heartbeat_counts_only_up_to_the_lead() -> None:
    live = serve()
    try:
        hostile = live.client("hostile")
        hostile.join()
        time.sleep(0.5)
        # 20,000 steps in half a second is within the absolute bound, so not refused, but no
        # push carried any of them: counted up to lead (2H) steps past no push at all.
        reply = hostile.heartbeat(20_000, 20_000, 1e9, 3.0)
        assert not reply.complete
        assert live.client("x").status().steps == 2 * 5  # lead = 2H, no accepted push
    finally:
        live.close()


def test_a_heartbeat_with_more_tokens_than_its_steps_hold_is_refused(live: LiveSyncer) -> None:
    c = live.client("unit-0")
    c.join()
    with pytest.raises(SyncerRejected) as refused:
        c.heartbeat(10, 10 * live.syncer.tokens_per_step + 1, 100.0, 3.0)
    assert refused.value.status == 422 and "exceed its steps" in refused.value.message
    assert live.client("x").status().tokens == 0


# ------------------------------------------------------------------ counters: pushes


def hostile_push(live: LiveSyncer, c_steps: int, c_tokens: int, step: int, scale: float) -> bytes:
    delta = {k: v * scale for k, v in fragment_delta(live, 0, seed=5).items()}
    return encode_push(PushHeader(0, 0, c_steps, c_tokens, "none", "hostile", 0, step=step), delta)[
        0
    ]


def test_a_push_claiming_more_tokens_or_steps_than_it_could_hold_is_refused(
    live: LiveSyncer,
) -> None:
    live.client("hostile").join()
    steady(live, "honest")
    before = global_state(live)
    tps = live.syncer.tokens_per_step
    cases = [
        (1, HUGE, 1, "exceed its steps"),  # cTokens 2^53-1 on one step: share 1.0 before
        (HUGE, HUGE, HUGE, "beyond reach"),  # 2^53 steps a moment after joining (any speed)
        (6, 6 * tps, 3, "exceed the 3 steps"),  # more steps than from its start to the push
    ]
    for c_steps, c_tokens, step, why in cases:
        body = hostile_push(live, c_steps, c_tokens, step, scale=9.9)
        status, reply = live.raw("POST", "/v1/fragments/0/push", body, unit="hostile")
        assert (status, reply["reason"]) == (422, "implausible"), (c_steps, reply)
        assert why in reply["error"]
    assert live.syncer.frags[0].pending == {}
    assert global_state(live)[1] == before[1]
    assert live.client("x").status().learners["hostile"].refused == len(cases)


def test_an_accepted_push_weighs_at_most_as_two_honest_ones() -> None:
    live = serve(quorum=5)  # nothing merges: the pending push is looked at
    try:
        live.client("hostile").join()
        time.sleep(0.1)
        tps = live.syncer.tokens_per_step
        # 5,000 steps since joining: possible at 100,000 steps/s, so taken, but weighed as 2H.
        body = hostile_push(live, 5000, 5000 * tps, 5000, scale=1.0)
        status, _ = live.raw("POST", "/v1/fragments/0/push", body, unit="hostile")
        assert status == 200
        header = live.syncer.frags[0].pending["hostile"].header
        assert (header.c_steps, header.c_tokens) == (10, 10 * tps)  # lead = 2H = 10 steps
    finally:
        live.close()


def test_plausibility_rules_hold_for_honest_counters() -> None:
    absolute = Plausibility(tokens_per_step=64, lead=100)
    assert absolute.reachable(10.0, 0.05) == 100 + 1_000_000  # 100,000 steps/s, peers aside
    assert absolute.reachable(None, 0.05) == -1  # a restored record: its start is unknown
    rules = Plausibility(tokens_per_step=64, lead=100, max_speed_ratio=8.0)
    # A learner 4x faster than the others (0.05 s a step), 10 s into its attempt, whose held-
    # back pushes arrive in a burst: the step bound does not depend on when they arrive.
    rules.check_push(800, 50, 3200, 750, 10.0, peer_step_time=0.05)
    rules.check_step(800, 10.0, 0.05, "heartbeat")
    assert rules.reachable(10.0, 0.05) == 100 + 1600
    assert rules.reachable(1.0, None) == 100 + 100_000  # no peer measured: the absolute bound
    with pytest.raises(Implausible, match="beyond reach"):
        rules.check_step(1701, 10.0, 0.05, "heartbeat")
    assert rules.weight_counters(400, 400 * 64) == (100, 6400)
    assert rules.weight_counters(7, 100) == (7, 100)


# ------------------------------------------------------------------ replays


def test_a_push_replayed_after_a_restart_is_a_duplicate_not_merged_again(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck")
    first = serve(store)
    try:
        first.client("unit-0").join()
        body = encode_push(
            PushHeader(0, 0, 3, 3 * first.syncer.tokens_per_step, "none", "unit-0", 0, step=3),
            fragment_delta(first, 0, scale=0.05),
        )[0]
        assert first.raw("POST", "/v1/fragments/0/push", body, unit="unit-0")[0] == 200
        wait_until(lambda: first.syncer.frags[0].version == 1)
        first.run(first.syncer.save_checkpoint())
    finally:
        first.close()
    # From the checkpoint taken after the merge, then with that checkpoint gone, so that the
    # version comes back from the fragment journal alone (as after a crash, or for a standby).
    for source in ("checkpoint", "journal"):
        if source == "journal":
            shutil.rmtree(max((tmp_path / "ck").glob("ckpt-*")))
        again = serve(CheckpointStore(tmp_path / "ck"))
        try:
            before = global_state(again)
            assert before[1][0] >= 1
            if source == "journal":  # the checkpoint left predates the join: the learner's
                again.client("unit-0").join()  # client joins again and resends (client.push)
            status, reply = again.raw("POST", "/v1/fragments/0/push", body, unit="unit-0")
            assert (status, reply.get("duplicate")) == (200, True), (source, reply)
            time.sleep(0.3)
            params, versions = global_state(again)
            assert versions == before[1]
            for name, value in before[0].items():
                np.testing.assert_array_equal(params[name], value)
        finally:
            again.close()


# ------------------------------------------------------------------ malformed HTTP


def test_malformed_http_is_one_warning_line_per_request_without_a_traceback(
    live: LiveSyncer, caplog: pytest.LogCaptureFixture
) -> None:
    payloads = {
        "line_too_long": b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        "bad_method": b"BLAH / HTTP/1.1\r\n\r\n",
        "tls_on_plain_port": b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 40,
    }
    caplog.set_level(logging.DEBUG)
    for payload in payloads.values():
        with socket.create_connection(("127.0.0.1", live.port), timeout=5) as sock:
            sock.sendall(payload)
            assert sock.recv(64).startswith(b"HTTP/1.0 400 Bad Request")
    wait_until(lambda: len([r for r in caplog.records if "malformed_request" in r.message]) == 3)
    lines = [r for r in caplog.records if "malformed_request" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.WARNING] * 3
    assert all(r.exc_info is None and "peer=127.0.0.1" in r.getMessage() for r in lines)
    assert [r.getMessage().split("reason=")[1].split()[0] for r in lines] == list(payloads)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    metrics = live.raw("GET", "/metrics")[1]["raw"].decode()
    for reason in payloads:
        assert f'diloco_syncer_malformed_requests_total{{reason="{reason}"}} 1.0' in metrics


# ------------------------------------------------------------------ identities


ROSTER = {"revision": 1, "units": {"unit-0": "default", "unit-1": "default"}}


def test_only_the_rosters_units_are_admitted_however_many_names_the_secret_mints() -> None:
    live = LiveSyncer(
        Syncer(tiny_cfg(), TOKEN, run="r", eval_fn=None, roster=Roster.from_json(ROSTER))
    )
    try:
        live.client("unit-0").join()
        for i in range(100):  # identities minted from the run secret, none on the roster
            with pytest.raises(SyncerRejected) as refused:
                live.client(f"minted-{i}").heartbeat(1, 8, 1.0, None)
            assert (refused.value.status, refused.value.reason) == (403, "unknown_unit")
        with pytest.raises(SyncerRejected) as refused:
            SyncerClient(live.url, unit_token(TOKEN, "unit-1"), "unit-1", 0, "gpu").join()
        assert refused.value.reason == "wrong_group"
        assert set(live.client("x-observer", token=TOKEN).status().learners) == {"unit-0"}
    finally:
        live.close()


def test_the_operator_hands_over_a_new_roster_and_a_unit_of_it_joins(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck")
    live = LiveSyncer(
        Syncer(
            tiny_cfg(), TOKEN, run="r", store=store, eval_fn=None, roster=Roster.from_json(ROSTER)
        )
    )
    try:
        grown = {"revision": 2, "units": {**ROSTER["units"], "unit-2": "default"}}  # scaled
        body = json.dumps(grown).encode()
        assert live.raw("PUT", "/v1/units", body, unit="unit-0")[0] == 403  # not a unit's call
        assert live.raw("PUT", "/v1/units", body)[1] == {"taken": True, "revision": 2}
        older = json.dumps(ROSTER).encode()
        assert live.raw("PUT", "/v1/units", older) == (409, {"taken": False, "revision": 2})
        assert live.raw("PUT", "/v1/units", b'{"revision": "x"}')[0] == 400
        live.client("unit-2").join()
        assert live.client("o", token=TOKEN).status().roster_revision == 2
        live.run(live.syncer.save_checkpoint())
    finally:
        live.close()
    # A restart keeps the newest roster it was handed, whatever older file it is started with.
    again = LiveSyncer(
        Syncer(
            tiny_cfg(), TOKEN, run="r", store=store, eval_fn=None, roster=Roster.from_json(ROSTER)
        )
    )
    try:
        assert again.syncer.gate.roster_revision == 2
        again.client("unit-2").join()
    finally:
        again.close()


def test_a_unit_not_on_the_roster_yet_keeps_asking_to_join(monkeypatch: pytest.MonkeyPatch) -> None:
    live = LiveSyncer(
        Syncer(tiny_cfg(), TOKEN, run="r", eval_fn=None, roster=Roster.from_json(ROSTER))
    )
    try:
        late = live.client("unit-2")
        with pytest.raises(SyncerUnavailable, match="not on the run's roster yet"):
            late.join()  # retried by the learner (retry_until) while the operator catches up
        monkeypatch.setattr(client_module, "ROSTER_WAIT_SECONDS", 0.0)
        with pytest.raises(SyncerRejected, match="unknown_unit"):
            late.join()  # after the wait: a stranger, refused for good
    finally:
        live.close()


# ------------------------------------------------------------------ floods


def test_a_flood_of_heartbeats_is_answered_429_and_the_others_are_served(
    live: LiveSyncer, caplog: pytest.LogCaptureFixture
) -> None:
    for unit in ("flood", "calm"):
        live.client(unit).join()
    tps = live.syncer.tokens_per_step
    codes: dict[int, int] = {}
    retry = None
    started = time.monotonic()
    for _ in range(2000):
        status, reply = live.raw(
            "POST",
            "/v1/heartbeat",
            json.dumps({"unit": "flood", "step": 1, "tokens": tps}).encode(),
            unit="flood",
        )
        codes[status] = codes.get(status, 0) + 1
        retry = retry or (reply if status == 429 else None)
    rate = rates_for(live.syncer.cfg)["heartbeat"]
    allowed = rate.burst + rate.per_second * (time.monotonic() - started) + 1
    assert codes.get(200, 0) <= allowed and codes[429] >= 2000 - allowed
    assert retry is not None and retry["reason"] == "rate_limited"
    assert live.client("calm").heartbeat(1, tps, 1.0, None).versions is not None
    limited = [r for r in caplog.records if "rate_limited" in r.getMessage()]
    assert len([r for r in limited if "event=rate_limited" in r.getMessage()]) == 1
    metrics = live.raw("GET", "/metrics")[1]["raw"].decode()
    assert f'diloco_syncer_requests_limited_total{{kind="heartbeat"}} {codes[429]}.0' in metrics
    # The learner's client sees a 429 as busy, with the wait it was told. (The bucket refills
    # at its rate meanwhile: send until it is empty again, at most burst + a few requests
    # unless each took longer than a refill.)
    flood = live.client("flood")
    with pytest.raises(SyncerBusy) as busy:
        for _ in range(int(rate.burst) + 40):
            flood.heartbeat(1, tps, 1.0, None)
    assert busy.value.retry_after >= 1


def test_the_operator_puts_the_specs_roster_when_the_syncers_is_older() -> None:
    import aiohttp
    from diloco_operator.api import parse_spec
    from diloco_operator.k8s import builders, state, syncer_calls

    spec = parse_spec({"image": "t", "replicas": 3, "training": {"totalSteps": 5}})
    run = builders.Run("r", "ns", "uid", spec)
    initial = Roster.from_json(json.loads(builders.config_map(run)["data"]["units.json"]))
    assert set(initial.units) == {"r-default-0", "r-default-1", "r-default-2"}
    live = LiveSyncer(Syncer(tiny_cfg(), TOKEN, run="r", eval_fn=None, roster=initial))

    async def scenario() -> tuple[bool, bool, int | None]:
        state.STATE.options = state.Options(syncer_url=live.url)
        state.STATE.tokens[("ns", "r")] = TOKEN
        state.STATE.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        try:
            first = await syncer_calls.hand_roster(run, await syncer_calls.syncer_report(run), 4)
            report = await syncer_calls.syncer_report(run)
            again = await syncer_calls.hand_roster(run, report, 4)
            return first, again, None if report is None else report.roster_revision
        finally:
            await state.STATE.http.close()
            state.STATE.http = None
            state.STATE.tokens.clear()

    try:
        assert asyncio.run(scenario()) == (True, True, 4)
        assert live.syncer.budget == Budget(total_steps=5)  # the spec's, not the config's 100
        live.client("r-default-2").join()
        with pytest.raises(SyncerRejected, match="unknown_unit"):
            live.client("r-default-3").heartbeat(1, 8, 1.0, None)
    finally:
        live.close()


# ------------------------------------------------------------------ outliers


def test_a_unit_sending_flipped_deltas_is_left_out_then_quarantined() -> None:
    live = serve(quorum=4)
    units = ["u0", "u1", "u2", "flip"]
    try:
        for unit in units:
            live.client(unit).join()
        rng = np.random.default_rng(3)
        shapes = {n: live.syncer.shapes[n] for n in live.syncer.frags[0].names}
        tps = live.syncer.tokens_per_step
        replies = []
        for rnd in range(4):
            signal = {
                n: rng.normal(scale=0.01, size=s).astype(np.float32) for n, s in shapes.items()
            }
            for unit in units:
                own = {
                    n: v + rng.normal(scale=0.01, size=v.shape).astype(np.float32)
                    for n, v in signal.items()
                }
                delta = {n: -v for n, v in own.items()} if unit == "flip" else own
                header = PushHeader(0, rnd, 5, 5 * tps, "none", unit, 0, step=5 * (rnd + 1))
                body = encode_push(header, delta)[0]
                replies.append(live.raw("POST", "/v1/fragments/0/push", body, unit=unit))
            if rnd < 3:  # a round of four merges; the fourth lacks the quarantined unit
                wait_until(lambda v=rnd + 1: live.syncer.frags[0].version == v)
        assert [status for status, _ in replies[:15]] == [200] * 15
        assert (replies[15][0], replies[15][1]["reason"]) == (403, "quarantined")
        learner = live.client("o", token=TOKEN).status().learners["flip"]
        assert learner.quarantined is not None and "3 of attempt 0's last 3" in learner.quarantined
        metrics = live.raw("GET", "/metrics")[1]["raw"].decode()
        assert 'diloco_syncer_screened_pushes_total{action="dropped"} 3.0' in metrics
        assert "diloco_syncer_quarantined_total 1.0" in metrics
    finally:
        live.close()

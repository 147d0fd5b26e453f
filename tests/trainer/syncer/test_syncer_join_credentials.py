"""Units of an away cluster join with a join credential (join_credentials.py): a live syncer
accepts a good one for exactly its run, group, lifetime and until revoked, and refuses the rest
with a reason of its own, a log line and a count."""

from __future__ import annotations

import http.client
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from diloco_trainer.auth import unit_token
from diloco_trainer.join_credentials import (
    OBSERVER,
    JoinCredential,
    mint_join_credential,
    parse_join_credential,
    unit_token_from_credential,
)
from diloco_trainer.learner.client import SyncerClient, SyncerRejected
from diloco_trainer.syncer.checkpoint import CheckpointStore
from diloco_trainer.syncer.core import Syncer
from diloco_trainer.syncer.roster import Roster
from test_syncer import TOKEN, LiveSyncer, fragment_delta, tiny_cfg

RUN = "multi"
UNITS = {"home-0": "default", "eu-0": "gpu-eu", "eu-1": "gpu-eu"}
ROSTER = {"revision": 1, "units": UNITS}
DAY = 86_400


def mint(group: str = "gpu-eu", expires: float | None = None, **kw: str) -> str:
    when = int(expires if expires is not None else time.time() + DAY)
    return mint_join_credential(
        kw.get("secret", TOKEN), kw.get("run", RUN), group, when, kw.get("id")
    )


def away(
    live: LiveSyncer, credential: str, unit: str = "eu-0", group: str = "gpu-eu"
) -> SyncerClient:
    """A learner of the away cluster: its token derived from the credential (what the away
    operator hands it) and the credential's public part."""
    public = parse_join_credential(credential).public
    token = unit_token_from_credential(credential, unit)
    return SyncerClient(live.url, token, unit, 0, group, join=public)


def serve(
    store: CheckpointStore | None = None, roster: dict[str, object] | None = ROSTER
) -> LiveSyncer:
    held = Roster.from_json(roster) if roster is not None else None
    return LiveSyncer(Syncer(tiny_cfg(), TOKEN, run=RUN, store=store, eval_fn=None, roster=held))


@pytest.fixture
def live() -> Iterator[LiveSyncer]:
    server = serve()
    yield server
    server.close()


def refusal(client: SyncerClient) -> tuple[int, str, str]:
    with pytest.raises(SyncerRejected) as refused:
        client.join()
    return refused.value.status, refused.value.reason, refused.value.message


def refused_count(live: LiveSyncer, reason: str) -> float:
    value = live.syncer.metrics.registry.get_sample_value(
        "diloco_syncer_credential_refusals_total", {"reason": reason}
    )
    return value or 0.0


def test_a_unit_of_an_away_cluster_joins_pushes_and_heartbeats_with_its_credential(
    live: LiveSyncer, caplog: pytest.LogCaptureFixture
) -> None:
    credential = mint(id="eu-cred-1")
    learner = away(live, credential)
    with caplog.at_level(logging.INFO, logger="diloco.syncer"):
        learner.join()
    assert any(
        "event=join unit=eu-0" in r.message and "credential=eu-cred-1" in r.message
        for r in caplog.records
    )
    learner.heartbeat(1, 8, 10.0, 3.0)
    assert learner.push(0, 0, fragment_delta(live, 0), 1, 8).accepted
    assert live.client("o", token=TOKEN).status().learners["eu-0"].group == "gpu-eu"
    # The home units keep their own tokens alongside.
    live.client("home-0").join()


@pytest.mark.parametrize(
    ("case", "status", "reason"),
    [
        ("expired", 403, "credential_expired"),
        ("revoked", 403, "credential_revoked"),
        ("foreign_run", 403, "credential_foreign_run"),
        ("wrong_group", 403, "credential_wrong_group"),
        ("tampered", 401, "bad_token"),
        ("home_token", 401, "bad_token"),
    ],
)
def test_each_refusal_has_its_reason_a_log_line_and_a_count(
    case: str, status: int, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    live = serve(roster={**ROSTER, "revokedCredentials": ["gone"]})
    try:
        credential, unit = mint(), "eu-0"
        if case == "expired":
            credential = mint(expires=time.time() - 3600)
        elif case == "revoked":
            credential = mint(id="gone")
        elif case == "foreign_run":
            credential = mint(run="another-run")
        elif case == "wrong_group":
            unit = "home-0"  # a home unit: the gpu-eu credential cannot speak for it
        learner = away(live, credential, unit)
        if case == "tampered":  # its expiry pushed out by a day, the key left as it was
            c = parse_join_credential(credential)
            learner.join_header = JoinCredential(c.run, c.group, c.expires + DAY, c.id).public
        elif case == "home_token":  # a home unit's token with a credential's header
            learner.token = unit_token(TOKEN, unit)
        with caplog.at_level(logging.WARNING, logger="diloco.syncer"):
            got = refusal(learner)
        assert got[:2] == (status, reason), got
        assert any(f"reason={reason}" in r.message for r in caplog.records)
        assert refused_count(live, reason) == 1
        assert not live.syncer.learners.records  # nothing of it was recorded
    finally:
        live.close()


def test_a_credential_cannot_act_as_a_unit_of_another_group_or_run(live: LiveSyncer) -> None:
    credential = mint()
    # Its own group's unit joins; a home unit, named with a token from the same key, does not.
    away(live, credential, "eu-1").join()
    assert refusal(away(live, credential, "home-0", "default"))[1] == "credential_wrong_group"
    # A credential from another run's secret, relabelled to this run, proves nothing here.
    other = mint(secret="another-runs-secret")
    assert refusal(away(live, other))[1] == "bad_token"
    # The credential's key is no run secret: with it as a bearer token, nothing is allowed.
    key = parse_join_credential(credential).key
    assert live.raw("GET", "/v1/status", token=key)[0] == 401
    assert live.raw("PUT", "/v1/units", json.dumps(ROSTER).encode(), token=key)[0] == 401


def test_a_revocation_with_the_roster_cuts_a_unit_off_at_once_and_survives_a_restart(
    tmp_path: Path,
) -> None:
    store = CheckpointStore(tmp_path / "ck")
    live = serve(store)
    credential = mint(id="leaked")
    try:
        learner = away(live, credential)
        learner.join()
        revoked = {**ROSTER, "revision": 2, "revokedCredentials": ["leaked"]}
        assert live.raw("PUT", "/v1/units", json.dumps(revoked).encode())[0] == 200
        with pytest.raises(SyncerRejected, match="credential_revoked"):
            learner.heartbeat(1, 8, 10.0, None)
        live.run(live.syncer.save_checkpoint())
    finally:
        live.close()
    # Restarted with the older roster file the operator's ConfigMap still holds: the
    # checkpoint's newer roster, revocation included, wins.
    again = serve(CheckpointStore(tmp_path / "ck"))
    try:
        assert again.syncer.gate.roster is not None
        assert again.syncer.gate.roster.revoked == {"leaked"}
        assert refusal(away(again, credential))[1] == "credential_revoked"
        away(again, mint(id="fresh")).join()  # a new credential for the group works
    finally:
        again.close()


def test_without_a_roster_a_credential_is_refused() -> None:
    live = serve(roster=None)
    try:
        status, reason, message = refusal(away(live, mint()))
        assert (status, reason) == (403, "credential_wrong_group") and "roster" in message
        live.client("home-0").join()  # home units as before
    finally:
        live.close()


def test_rosters_without_revocations_still_load_and_bad_ids_are_refused() -> None:
    old = Roster.from_json(ROSTER)
    assert old.revoked == frozenset() and old.to_json() == ROSTER
    new = Roster.from_json({**ROSTER, "revokedCredentials": ["b", "a"]})
    assert new.to_json() == {**ROSTER, "revokedCredentials": ["a", "b"]}
    assert Roster.from_json(new.to_json()) == new
    with pytest.raises(ValueError, match=r"roster.revokedCredentials: bad credential id 'a b'"):
        Roster.from_json({**ROSTER, "revokedCredentials": ["a b"]})
    with pytest.raises(ValueError, match="expected a list"):
        Roster.from_json({**ROSTER, "revokedCredentials": "a"})


def test_the_away_operator_reads_the_status_as_its_credentials_observer_and_nothing_more(
    live: LiveSyncer,
) -> None:
    credential = mint(id="eu-cred")
    observer = away(live, credential, OBSERVER)
    away(live, credential).join()
    assert set(observer.status().learners) == {"eu-0"}  # GET /v1/status
    for call in (observer.join, lambda: observer.heartbeat(1, 8, 1.0, None), observer.pull_all):
        with pytest.raises(SyncerRejected) as refused:
            call()
        assert (refused.value.status, refused.value.reason) == (403, "forbidden")
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=10)
    headers = {
        "Authorization": f"Bearer {observer.token}",
        "X-Diloco-Unit": OBSERVER,
        "X-Diloco-Join": parse_join_credential(credential).public,
    }
    conn.request("PUT", "/v1/units", json.dumps(ROSTER).encode(), headers)
    assert conn.getresponse().status == 403  # never the roster
    conn.close()
    # Revoked or expired, it reads nothing either.
    revoked = {**ROSTER, "revision": 2, "revokedCredentials": ["eu-cred"]}
    assert live.raw("PUT", "/v1/units", json.dumps(revoked).encode())[0] == 200
    with pytest.raises(SyncerRejected, match="credential_revoked"):
        observer.status()
    with pytest.raises(SyncerRejected, match="credential_expired"):
        away(live, mint(expires=time.time() - 3600), OBSERVER).status()

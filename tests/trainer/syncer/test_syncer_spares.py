"""Warm spares at a live syncer over real HTTP: a spare waits, the operator asks for a cover,
the spare becomes the unit, the unit's newer attempt takes over and the cover's is refused."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from diloco_trainer.attempts import cover_attempt, wire_attempt
from diloco_trainer.auth import SPARE_PREFIX, spare_token
from diloco_trainer.learner.client import SyncerClient, SyncerRejected
from diloco_trainer.syncer.core import Syncer
from test_syncer import TOKEN, LiveSyncer, fragment_delta, tiny_cfg, wait_until

UNIT = "run-default-0"


@pytest.fixture
def live() -> Iterator[LiveSyncer]:
    server = LiveSyncer(Syncer(tiny_cfg(), TOKEN, run="test-run", store=None, eval_fn=None))
    yield server
    server.close()


def spare_client(
    live: LiveSyncer, name: str = "run-default-spare0", group: str = "default"
) -> SyncerClient:
    return SyncerClient(live.url, spare_token(TOKEN, name), SPARE_PREFIX + name, 0, group)


def cover_request(unit: str = UNIT, attempt: int = cover_attempt(0), **extra: Any) -> bytes:
    body = {"unit": unit, "index": 0, "numUnits": 2, "group": "default", "attempt": attempt}
    return json.dumps({**body, **extra}).encode()


class Waiting:
    """A spare's long-poll on a thread of its own, as the spare process makes it."""

    def __init__(
        self,
        live: LiveSyncer,
        name: str = "run-default-spare0",
        wait: float = 20.0,
        group: str = "default",
    ) -> None:
        self.client = spare_client(live, name, group)
        self.got: dict[str, Any] | None = None
        self.thread = threading.Thread(target=self._wait, args=(name, wait), daemon=True)
        self.thread.start()
        wait_until(lambda: live.client("x").status().spares.get(name) is not None)
        wait_until(lambda: live.client("x").status().spares[name].state == "Waiting")

    def _wait(self, name: str, wait: float) -> None:
        self.got = self.client.wait_for_cover(name, wait)

    def result(self) -> dict[str, Any] | None:
        self.thread.join(30)
        return self.got


def test_a_waiting_spare_is_handed_the_unit_and_joins_as_it(live: LiveSyncer) -> None:
    waiting = Waiting(live)
    status, reply = live.raw("POST", "/v1/spares/cover", cover_request())
    assert (status, reply) == (200, {"spare": "run-default-spare0"})
    identity = waiting.result()
    assert identity is not None
    assert identity["unitName"] == UNIT and identity["attempt"] == cover_attempt(0)
    assert (identity["unit"], identity["numUnits"], identity["group"]) == (0, 2, "default")
    # The token handed over is the unit's own: the spare joins and pushes as the unit.
    cover = SyncerClient(live.url, identity["token"], UNIT, identity["attempt"])
    cover.join()
    cover.pull_all()
    assert cover.push(0, 0, fragment_delta(live, 0), c_steps=1, c_tokens=8).accepted
    spare = live.client("x").status().spares["run-default-spare0"]
    assert (spare.state, spare.unit, spare.attempt) == ("Covering", UNIT, cover_attempt(0))
    # Asked again (the operator's next pass before it saw the report): the same spare.
    assert live.raw("POST", "/v1/spares/cover", cover_request()) == (200, reply)


def test_the_recreated_unit_takes_over_and_the_cover_is_refused(live: LiveSyncer) -> None:
    waiting = Waiting(live)
    assert live.raw("POST", "/v1/spares/cover", cover_request())[0] == 200
    identity = waiting.result()
    assert identity is not None
    cover = SyncerClient(live.url, identity["token"], UNIT, identity["attempt"])
    cover.join()
    recreated = live.client(UNIT, wire_attempt(1, 0))
    recreated.join()
    assert live.client("x").status().spares["run-default-spare0"].state != "Covering"
    for call in (
        lambda: cover.heartbeat(5, 40, 1.0, None),
        lambda: cover.push(0, 0, fragment_delta(live, 0), c_steps=1, c_tokens=8),
        cover.join,
    ):
        with pytest.raises(SyncerRejected) as refused:
            call()
        assert (refused.value.status, refused.value.reason) == (409, "superseded")
    # No second cover under an attempt older than the unit's newest.
    status, reply = live.raw("POST", "/v1/spares/cover", cover_request())
    assert (status, reply["reason"]) == (409, "superseded")


def test_a_cover_that_ended_is_not_handed_out_again(live: LiveSyncer) -> None:
    waiting = Waiting(live)
    assert live.raw("POST", "/v1/spares/cover", cover_request())[0] == 200
    assert waiting.result() is not None
    # The cover's learner crashed: the spare waits again, and its cover is spent.
    again = Waiting(live)
    status, reply = live.raw("POST", "/v1/spares/cover", cover_request())
    assert (status, reply["reason"]) == (409, "cover_spent")
    # A later cover of the same unit (its next pod lost too) goes to the waiting spare.
    assert live.raw("POST", "/v1/spares/cover", cover_request(attempt=cover_attempt(1)))[0] == 200
    got = again.result()
    assert got is not None and got["attempt"] == cover_attempt(1)


def test_no_cover_without_a_waiting_spare_of_the_group(live: LiveSyncer) -> None:
    status, reply = live.raw("POST", "/v1/spares/cover", cover_request())
    assert (status, reply["reason"]) == (409, "no_spare")
    assert spare_client(live).wait_for_cover("run-default-spare0", 0.1) is None  # 204
    Waiting(live, "run-other-spare0", wait=2.0, group="other")
    status, reply = live.raw("POST", "/v1/spares/cover", cover_request())
    assert (status, reply["reason"]) == (409, "no_spare")


@pytest.mark.parametrize(
    ("path", "body", "who", "reason"),
    [
        ("/v1/spares/wait", {"spare": UNIT, "group": "default"}, "unit", "forbidden"),
        (
            "/v1/spares/wait",
            {"spare": "run-default-spare0", "group": "default"},
            "run",
            "forbidden",
        ),
        ("/v1/spares/cover", json.loads(cover_request()), "unit", "forbidden"),
        ("/v1/join", {"unit": "spare:run-default-spare0"}, "spare", "forbidden"),
        (
            "/v1/spares/wait",
            {"spare": "run-default-spare1", "group": "default"},
            "spare",
            "identity_mismatch",
        ),
        ("/v1/spares/cover", json.loads(cover_request(index=2)), "run", "bad_request"),
        ("/v1/spares/cover", json.loads(cover_request(group="x" * 64)), "run", "bad_request"),
    ],
)
def test_spare_requests_are_for_spares_and_covers_for_the_operator(
    live: LiveSyncer, path: str, body: dict[str, Any], who: str, reason: str
) -> None:
    data = json.dumps(body).encode()
    if who == "spare":
        client = spare_client(live)
        with pytest.raises(SyncerRejected) as refused:
            client._request("POST", path, data)
        got = (refused.value.status, refused.value.reason)
    else:
        status, reply = live.raw("POST", path, data, unit=UNIT if who == "unit" else None)
        got = (status, reply.get("reason"))
    assert got[1] == reason and 400 <= got[0] < 500
    assert live.syncer.spares.spares.get("run-default-spare1") is None

"""Data leases over real HTTP: the join's lease, claims, the push's position header, and the
lease book in checkpoints. A bad header or claim gets its 4xx and changes nothing."""

from __future__ import annotations

import errno
import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from diloco_trainer.auth import UNIT_HEADER, unit_token
from diloco_trainer.learner.client import SyncerClient
from diloco_trainer.syncer.checkpoint import CheckpointStore
from diloco_trainer.syncer.core import Syncer
from diloco_trainer.wire import (
    DATA_POSITION_HEADER,
    MAX_COUNTER,
    DataLease,
    PushHeader,
    WireError,
    encode_push,
    parse_data_position,
)
from test_syncer import TOKEN, LiveSyncer, fragment_delta, global_state, tiny_cfg, wait_until


@pytest.fixture
def live() -> Iterator[LiveSyncer]:
    server = LiveSyncer(Syncer(tiny_cfg(data={"shards": 4}), TOKEN, store=None, eval_fn=None))
    yield server
    server.close()


def request(
    live: LiveSyncer,
    path: str,
    body: bytes,
    unit: str | None = "unit-0",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=10)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    if unit is not None:
        auth = {"Authorization": f"Bearer {unit_token(TOKEN, unit)}", UNIT_HEADER: unit}
    conn.request("POST", path, body=body, headers={**auth, **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data) if data else {}


def push_body(live: LiveSyncer, unit: str = "unit-0") -> bytes:
    header = PushHeader(0, 0, 1, 64, "none", unit, 0, step=1)
    return encode_push(header, fragment_delta(live, 0))[0]


@pytest.mark.parametrize(
    "raw",
    ["", "1.2", "1.2.3.4", "-1.0.0", "0.4.0", "0.0.x", "0. 1.2", "0.0.٣", f"0.0.{MAX_COUNTER + 1}"],
)
def test_a_bad_position_header_is_refused(raw: str) -> None:
    with pytest.raises(WireError, match=DATA_POSITION_HEADER):
        parse_data_position(raw, 4)


def test_a_good_position_header_parses() -> None:
    assert parse_data_position("3.1.17", 4) == DataLease(3, 1, 17)
    assert parse_data_position(DataLease(2, 3, 0).header(), 4) == DataLease(2, 3, 0)


def test_the_join_carries_the_units_lease(live: LiveSyncer) -> None:
    assert live.client("unit-0").join().data_lease == DataLease(0, 0, 0)
    assert live.client("unit-1").join().data_lease == DataLease(0, 1, 0)
    # A restart of unit-0 (attempt 1) gets its own lease back.
    assert live.client("unit-0", attempt=1).join().data_lease == DataLease(0, 0, 0)


def test_pushes_report_the_position_and_a_restart_resumes_there(live: LiveSyncer) -> None:
    client = live.client("unit-0")
    client.join()
    client.data_position = DataLease(0, 0, 12)
    client.push(0, 0, fragment_delta(live, 0), 12, 12 * 64, step=12)
    assert live.syncer.leases.lease_of("unit-0") == DataLease(0, 0, 12)
    assert live.client("unit-0", attempt=1).join().data_lease == DataLease(0, 0, 12)


def test_a_push_with_a_bad_position_header_is_refused_whole(live: LiveSyncer) -> None:
    live.client("unit-0").join()
    before = global_state(live)
    for raw in ("0.0.-3", "0.9.1", "zero"):
        status, reply = request(
            live, "/v1/fragments/0/push", push_body(live), headers={DATA_POSITION_HEADER: raw}
        )
        assert status == 400 and DATA_POSITION_HEADER in reply["error"], reply
    assert live.syncer.leases.lease_of("unit-0") == DataLease(0, 0, 0)
    assert all(not f.pending for f in live.syncer.frags) and global_state(live)[1] == before[1]


def test_claims_hand_out_the_next_shard_and_repeat_their_answer(live: LiveSyncer) -> None:
    client = live.client("unit-0")
    client.join()
    nxt = client.claim_data(DataLease(0, 0, 5))
    assert nxt == DataLease(0, 1, 0)
    assert client.claim_data(DataLease(0, 0, 5)) == nxt  # a retry: the same answer
    assert live.syncer.leases.finished == {0}


@pytest.mark.parametrize(
    "finished",
    [
        None,
        {"epoch": 0, "shard": 4, "position": 0},
        {"epoch": -1, "shard": 0, "position": 0},
        {"epoch": 0, "shard": True, "position": 0},
        {"epoch": 0, "shard": 0},
        [0, 0, 0],
    ],
)
def test_a_bad_claim_is_refused_and_changes_nothing(live: LiveSyncer, finished: Any) -> None:
    live.client("unit-0").join()
    body = json.dumps({"unit": "unit-0", "attempt": 0, "finished": finished}).encode()
    status, reply = request(live, "/v1/data/claim", body)
    assert status == 400 and "finished" in reply["error"], reply
    assert live.syncer.leases.lease_of("unit-0") == DataLease(0, 0, 0)
    assert live.syncer.leases.finished == set()


def test_a_claim_needs_the_units_own_token(live: LiveSyncer) -> None:
    body = json.dumps({"unit": "unit-0", "finished": DataLease(0, 0, 1).to_json()}).encode()
    assert request(live, "/v1/data/claim", body, unit=None)[0] == 403  # the run token: reads only
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=10)
    conn.request("POST", "/v1/data/claim", body=body)
    assert conn.getresponse().status == 401
    conn.close()
    assert request(live, "/v1/data/claim", body, unit="unit-1")[0] == 403  # someone else's name
    assert live.syncer.leases.held == {}


def test_leases_survive_a_restart_from_checkpoint(tmp_path: Path) -> None:
    cfg = tiny_cfg(data={"shards": 4})
    first = LiveSyncer(Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=None))
    try:
        client = first.client("unit-0")
        client.join()
        client.claim_data(DataLease(0, 0, 3))
        client.data_position = DataLease(0, 1, 7)
        client.push(0, 0, fragment_delta(first, 0), 7, 7 * 64, step=7)
        first.run(first.syncer.save_checkpoint())
    finally:
        first.close()
    second = LiveSyncer(Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=None))
    try:
        assert second.client("unit-0", attempt=1).join().data_lease == DataLease(0, 1, 7)
        assert second.client("unit-1").join().data_lease == DataLease(0, 2, 0)  # 0 done, 1 held
    finally:
        second.close()


def test_a_checkpoint_from_before_leases_still_loads(tmp_path: Path) -> None:
    cfg = tiny_cfg(data={"shards": 4})
    syncer = Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=None)
    snap = syncer.snapshot()
    del snap.extra["dataLeases"]
    CheckpointStore(tmp_path).save(snap)
    syncer.close()
    again = Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=None)
    assert again.leases.held == {} and again.leases.epoch == 0
    again.close()


def test_a_checkpoint_of_another_shard_count_is_refused(tmp_path: Path) -> None:
    syncer = Syncer(tiny_cfg(data={"shards": 4}), TOKEN, store=CheckpointStore(tmp_path))
    CheckpointStore(tmp_path).save(syncer.snapshot())
    syncer.close()
    with pytest.raises(ValueError, match=r"data\.shards"):
        Syncer(tiny_cfg(data={"shards": 8}), TOKEN, store=CheckpointStore(tmp_path))


def test_an_unjoined_client_sends_no_header(live: LiveSyncer) -> None:
    """Old learners (no data feed) push as before; the book is left alone."""
    client: SyncerClient = live.client("unit-0")
    client.join()
    client.push(0, 0, fragment_delta(live, 0), 1, 64, step=1)
    wait_until(lambda: live.syncer.frags[0].version == 1)
    assert live.syncer.leases.lease_of("unit-0") == DataLease(0, 0, 0)
    assert np.isfinite(live.syncer.frags[0].norm or 0.0)


def test_a_claim_after_the_last_checkpoint_is_remembered(tmp_path: Path) -> None:
    """The lease journal: a syncer killed after a claim but before its next checkpoint does not
    hand the claimed shard out again."""
    cfg = tiny_cfg(data={"shards": 4}, checkpoint={"everySeconds": 3600})
    first = LiveSyncer(Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=None))
    try:
        first.run(first.syncer.save_checkpoint(force=True))
        client = first.client("unit-0")
        assert client.join().data_lease == DataLease(0, 0, 0)
        assert client.claim_data(DataLease(0, 0, 3)) == DataLease(0, 1, 0)
        checkpointed = CheckpointStore(tmp_path).load_latest(remove_stray=False)
        assert checkpointed is not None and checkpointed.extra["dataLeases"]["held"] == {}
    finally:
        first.loop.call_soon_threadsafe(first.loop.stop)  # no clean shutdown, no last save
        first.thread.join(10)
    second = LiveSyncer(Syncer(cfg, TOKEN, store=CheckpointStore(tmp_path), eval_fn=None))
    try:
        assert second.client("unit-0", attempt=1).join().data_lease == DataLease(0, 1, 0)
        assert second.client("unit-1").join().data_lease == DataLease(0, 2, 0)
    finally:
        second.close()


def test_a_lease_book_that_cannot_be_journaled_is_a_503_and_the_retry_gets_the_same_lease(
    tmp_path: Path,
) -> None:
    """Found by the soak bench: with the checkpoint disk full a join or a claim answered 500 (an
    unhandled OSError) and readiness stayed green. The unit is told of a lease only once a
    restart would remember it, so it hears 503 (which it retries), readiness names the lease
    journal, and once there is room the retry is given the lease the book already holds."""
    store = CheckpointStore(tmp_path)
    server = LiveSyncer(Syncer(tiny_cfg(data={"shards": 4}), TOKEN, store=store, eval_fn=None))
    real = store.record_leases

    def no_space(book: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    try:
        store.record_leases = no_space  # type: ignore[method-assign]
        body = json.dumps({"unit": "unit-0", "attempt": 0}).encode()
        status, reply = request(server, "/v1/join", body)
        assert status == 503 and reply["reason"] == "not_persisted", reply
        assert "No space left" in reply["error"]
        ready, health = server.raw("GET", "/readyz")
        assert ready == 503 and "No space left" in health["problems"]["lease_journal"]
        store.record_leases = real  # type: ignore[method-assign]
        assert server.client("unit-0").join().data_lease == DataLease(0, 0, 0)
        store.record_leases = no_space  # type: ignore[method-assign]
        claim = {"unit": "unit-0", "attempt": 0, "finished": DataLease(0, 0, 3).to_json()}
        status, reply = request(server, "/v1/data/claim", json.dumps(claim).encode())
        assert status == 503 and reply["reason"] == "not_persisted", reply
        store.record_leases = real  # type: ignore[method-assign]
        again = server.client("unit-0").claim_data(DataLease(0, 0, 3))
        assert again == DataLease(0, 1, 0)
        assert store.recorded_leases() is not None
        assert server.raw("GET", "/readyz")[0] == 200
    finally:
        server.close()

"""A sharded syncer in-process: two shards on loopback ports beside one unsharded syncer, driven
by the learner's real clients. The shards together must be the one syncer, bit for bit."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from diloco_trainer.auth import UNIT_HEADER, unit_token
from diloco_trainer.learner.client import SyncerRejected
from diloco_trainer.learner.shard_client import ShardedClient
from diloco_trainer.shards import Shard
from diloco_trainer.status import SyncerStatus, gathered
from diloco_trainer.syncer.checkpoint import CheckpointError, CheckpointStore
from diloco_trainer.syncer.core import Syncer
from diloco_trainer.syncer.main import shard_store_path
from diloco_trainer.wire import PushHeader, encode_push
from test_syncer import TOKEN, LiveSyncer, tiny_cfg, wait_until


class Pair:
    """One unsharded syncer and the same run as two shards."""

    def __init__(self, whole: LiveSyncer, shards: list[LiveSyncer]) -> None:
        self.whole, self.shards = whole, shards

    def sharded_client(self, unit: str = "unit-0") -> ShardedClient:
        return ShardedClient([s.client(unit) for s in self.shards])

    def close(self) -> None:
        for server in (self.whole, *self.shards):
            server.close()


def start_pair(tmp_path: Path | None = None, **overrides: object) -> Pair:
    cfg = tiny_cfg(fragments=5, **overrides)

    def store(name: str) -> CheckpointStore | None:
        return None if tmp_path is None else CheckpointStore(tmp_path / name)

    whole = LiveSyncer(Syncer(cfg, TOKEN, run="test-run", store=store("whole"), eval_fn=None))
    shards = [
        LiveSyncer(
            Syncer(
                cfg,
                TOKEN,
                run="test-run",
                store=store(f"shard-{i}"),
                eval_fn=None,
                shard=Shard(i, 2),
            )
        )
        for i in range(2)
    ]
    return Pair(whole, shards)


@pytest.fixture
def pair() -> Iterator[Pair]:
    both = start_pair()
    yield both
    both.close()


def _delta(shapes: dict[str, tuple[int, ...]], names: list[str], seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {n: (rng.normal(size=shapes[n]) * 0.01).astype(np.float32) for n in names}


def test_shards_split_the_model_and_merge_bit_for_bit_as_one_syncer(pair: Pair) -> None:
    whole, sharded = pair.whole.client(), pair.sharded_client()
    one, split = whole.join(), sharded.join()
    assert split.layout == one.layout and split.versions == one.versions == [0] * 5
    owners = sharded.owners
    assert sorted(set(owners)) == [0, 1]
    held = [{n for f in s.syncer.held for n in f.names} for s in pair.shards]
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == set(pair.whole.syncer.shapes)
    for i, server in enumerate(pair.shards):  # a shard holds no value of the other's fragments
        assert set(server.syncer.global_params()) == held[i]
        assert all(not f.params for f in server.syncer.frags if not f.held)

    shapes = pair.whole.syncer.shapes
    for round_ in range(3):
        for p, names in enumerate(one.layout):
            delta = _delta(shapes, names, seed=100 * round_ + p)
            assert whole.push(p, round_, delta, 4, 128, step=4 * (round_ + 1)).accepted
            assert sharded.push(p, round_, delta, 4, 128, step=4 * (round_ + 1)).accepted
        for p in range(len(one.layout)):
            assert whole.poll(p, round_, wait=5) is not None
            assert sharded.poll(p, round_, wait=5) is not None
    got_whole, versions_whole = whole.pull_all()
    got_split, versions_split = sharded.pull_all()
    assert versions_whole == versions_split == [3] * 5
    assert set(got_whole) == set(got_split)
    for name, value in got_whole.items():
        np.testing.assert_array_equal(got_split[name], value, err_msg=name)
    statuses = [s.client("x").status() for s in pair.shards]
    run = gathered(statuses)
    assert run.outer_step == pair.whole.client("x").status().outer_step == 15
    assert [f.index for f in run.fragments] == list(range(5))
    assert [s.shard for s in statuses] == [Shard(0, 2), Shard(1, 2)]


def _raw(server: LiveSyncer, method: str, path: str, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    headers = {"Authorization": f"Bearer {unit_token(TOKEN, 'unit-0')}", UNIT_HEADER: "unit-0"}
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def test_a_push_to_the_wrong_shard_is_refused_naming_the_right_one(pair: Pair) -> None:
    sharded = pair.sharded_client()
    joined = sharded.join()
    foreign = sharded.owners.index(1)  # a fragment of shard 1, sent to shard 0
    delta = _delta(pair.whole.syncer.shapes, joined.layout[foreign], seed=1)
    body, _, _ = encode_push(PushHeader(foreign, 0, 4, 128, "none", "unit-0", 0), delta, 0)
    status, reply = _raw(pair.shards[0], "POST", f"/v1/fragments/{foreign}/push", body)
    assert status == 421 and b"wrong_shard" in reply
    assert b"held by syncer shard 1 of 2" in reply
    status, reply = _raw(pair.shards[0], "GET", f"/v1/fragments/{foreign}?after=0", b"")
    assert status == 421
    assert pair.shards[0].syncer.versions() == pair.shards[1].syncer.versions() == [0] * 5
    # Data leases are shard 0's: shard 1 refuses a claim.
    status, reply = _raw(pair.shards[1], "POST", "/v1/data/claim", b"{}")
    assert status == 421 and b"shard 0" in reply


def test_a_learner_given_one_address_of_a_sharded_syncer_is_told_at_join(pair: Pair) -> None:
    with pytest.raises(SyncerRejected, match=r"shard 0 of 2.*every shard's address") as caught:
        pair.shards[0].client().join()
    assert caught.value.reason == "shard_mismatch"
    swapped = ShardedClient([pair.shards[1].client(), pair.shards[0].client()])
    with pytest.raises(SyncerRejected, match="shard 1 of 2, this learner expects shard 0"):
        swapped.join()
    assert isinstance(pair.whole.client().join().shard, object)  # unsharded: joins as before


def test_only_shard_0_hands_out_data_leases(pair: Pair) -> None:
    lead, other = pair.shards[0].client(), pair.shards[1].client()
    lead.slot, other.slot = (0, 2), (1, 2)
    assert lead.join().data_lease is not None
    assert other.join().data_lease is None


def test_shard_0_evaluates_the_model_from_every_shards_fragments() -> None:
    from diloco_trainer.workload.evaluate import eval_loss

    cfg = tiny_cfg(
        fragments=4,
        eval={"everySeconds": 0.2, "batches": 1},
        data={"maxBytes": 65536, "batchSize": 2},
    )
    other = LiveSyncer(Syncer(cfg, TOKEN, store=None, eval_fn=None, shard=Shard(1, 2)))
    lead = Syncer(cfg, TOKEN, store=None, shard=Shard(0, 2), peers=["-", other.url])
    assert lead.eval_fn is not None
    server = LiveSyncer(lead)
    lead.peers[0] = server.url
    try:
        observer = server.client("x")
        wait_until(lambda: observer.status().loss is not None, timeout=120)
        whole = Syncer(cfg, TOKEN, store=None, eval_fn=None)
        expected = eval_loss(whole.global_params(), cfg, 1)
        whole.close()
        assert observer.status().loss == pytest.approx(expected, rel=1e-6)
        assert len(lead.global_params()) < len(lead.shapes)  # it held only its share after
    finally:
        server.close()
        other.close()


def test_a_shard_restarts_from_its_own_checkpoint(tmp_path: Path) -> None:
    first = start_pair(tmp_path)
    try:
        sharded = first.sharded_client()
        joined = sharded.join()
        p = sharded.owners.index(1)
        delta = _delta(first.whole.syncer.shapes, joined.layout[p], seed=7)
        assert sharded.push(p, 0, delta, 4, 128, step=4).accepted
        assert sharded.poll(p, 0, wait=5) is not None
        kept = {n: v.copy() for n, v in first.shards[1].syncer.frags[p].params.items()}
    finally:
        first.close()  # a clean stop: each shard writes its final checkpoint
    again = Syncer(
        tiny_cfg(fragments=5),
        TOKEN,
        store=CheckpointStore(tmp_path / "shard-1"),
        eval_fn=None,
        shard=Shard(1, 2),
    )
    try:
        assert again.frags[p].version == 1
        for name, value in kept.items():
            np.testing.assert_array_equal(again.frags[p].params[name], value)
    finally:
        again.close()


def test_checkpoints_of_another_shard_count_are_refused(tmp_path: Path) -> None:
    base = str(tmp_path / "ckpt")
    assert shard_store_path(base, Shard(0, 1), "f") == base
    assert shard_store_path(base, Shard(1, 2), "f") == f"{base}/shard-1-of-2"
    (tmp_path / "ckpt" / "shard-0-of-3").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"another syncer shard count.*shard-0-of-3"):
        shard_store_path(base, Shard(0, 2), "f")
    with pytest.raises(CheckpointError, match="shard-0-of-3"):
        shard_store_path(base, Shard(0, 1), "f")
    assert shard_store_path(base, Shard(2, 3), "f").endswith("shard-2-of-3")
    (tmp_path / "ckpt" / "shard-0-of-3").rmdir()
    (tmp_path / "ckpt" / "ckpt-000001").mkdir()
    with pytest.raises(CheckpointError, match="unsharded"):
        shard_store_path(base, Shard(0, 2), "f")


def test_gathered_status_adds_up_shards_and_keeps_shard_0s_run_view() -> None:
    lead = SyncerStatus.from_json(
        {
            "outerStep": 4,
            "complete": True,
            "finalLoss": 2.5,
            "bytesSent": 10,
            "bytesReceived": 1,
            "fragments": [{"index": 2, "version": 2}, {"index": 0, "version": 2}],
            "shard": "0/2",
        }
    )
    other = SyncerStatus.from_json(
        {
            "outerStep": 3,
            "complete": False,
            "bytesSent": 5,
            "bytesReceived": 2,
            "fragments": [{"index": 1, "version": 3}],
            "shard": "1/2",
        }
    )
    run = gathered([lead, other])
    assert run.outer_step == 7 and run.complete and run.final_loss == 2.5
    assert [f.index for f in run.fragments] == [0, 1, 2]
    assert (run.bytes_sent, run.bytes_received) == (15, 3)
    assert gathered([lead]) is lead
    assert SyncerStatus.from_json({"shard": "9/2"}).shard is None  # garbage is no shard


def test_diloco_export_joins_every_shards_checkpoint_into_the_whole_model(tmp_path: Path) -> None:
    import safetensors
    from diloco_trainer.syncer.export import ExportError, export_checkpoint

    both = start_pair(tmp_path / "ckpt")
    # The shards' folders as a sharded syncer names them under its checkpoint path.
    try:
        whole, sharded = both.whole.client(), both.sharded_client()
        layout = whole.join().layout
        sharded.join()
        for p, names in enumerate(layout):
            delta = _delta(both.whole.syncer.shapes, names, seed=p)
            assert whole.push(p, 0, delta, 4, 128, step=4).accepted
            assert sharded.push(p, 0, delta, 4, 128, step=4).accepted
            assert whole.poll(p, 0, wait=5) is not None and sharded.poll(p, 0, wait=5) is not None
    finally:
        both.close()  # each writes its final checkpoint
    base = tmp_path / "ckpt"
    (base / "shard-0").rename(base / "shard-0-of-2")
    (base / "shard-1").rename(base / "shard-1-of-2")
    one = export_checkpoint(base / "whole", tmp_path / "whole.safetensors")
    split = export_checkpoint(base, tmp_path / "split.safetensors")
    assert split.leaves == one.leaves == len(both.whole.syncer.shapes)
    assert split.outer_step == one.outer_step == len(layout)
    assert split.metadata["versions"] == one.metadata["versions"] == json.dumps([1] * len(layout))
    assert len(split.metadata["checkpointSeq"].split(",")) == 2
    with (
        safetensors.safe_open(tmp_path / "whole.safetensors", framework="numpy") as a,
        safetensors.safe_open(tmp_path / "split.safetensors", framework="numpy") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():  # noqa: SIM118
            np.testing.assert_array_equal(a.get_tensor(name), b.get_tensor(name), err_msg=name)
    # A shard's folder missing, or one of another count beside: refused, naming it.
    (base / "shard-1-of-2").rename(base / "elsewhere")
    with pytest.raises(ExportError, match="shard-1-of-2 missing"):
        export_checkpoint(base, tmp_path / "x.safetensors")
    (base / "elsewhere").rename(base / "shard-1-of-2")
    (base / "shard-0-of-3").mkdir()
    with pytest.raises(ExportError, match=r"several shard counts \(2, 3\)"):
        export_checkpoint(base, tmp_path / "x.safetensors")

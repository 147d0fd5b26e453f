"""The hosts of a multi-host unit agree on a generation over real HTTP on loopback (one
UnitRestart per host, each on its own loopback address as on its own pod)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from diloco_trainer.learner.distributed import (
    COORDINATOR_PORT,
    GENERATION_ENV,
    distributed_args,
)
from diloco_trainer.learner.unit_restart import (
    PATH,
    SIGNATURE_HEADER,
    Peers,
    UnitRestart,
    from_env,
    signature,
)
from gcs_server import free_port

TOKEN = "unit-token"


class Unit:
    """Hosts 127.0.0.1, 127.0.0.2, ... each serving in a thread (the supervisor serves between
    polls of its learner; a thread stands in for that loop here)."""

    def __init__(self, tmp: Path, hosts: int) -> None:
        self.port = free_port()
        self.names = [f"127.0.0.{i + 1}" for i in range(hosts)]
        self.hosts = [self.start(tmp, i) for i in range(hosts)]
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.serve, args=(h,)) for h in self.hosts]
        for t in self.threads:
            t.start()

    def start(self, tmp: Path, i: int) -> UnitRestart:
        folder = tmp / f"host-{i}"
        folder.mkdir(exist_ok=True)
        peers = Peers.of(self.names, i, self.port)
        return UnitRestart(peers, TOKEN, folder, bind=self.names[i], port=self.port)

    def serve(self, host: UnitRestart) -> None:
        while not self.stop.is_set():
            host.serve_once(0.02)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        for h in self.hosts:
            h.close()


@pytest.fixture
def unit(tmp_path: Path) -> Iterator[Unit]:
    u = Unit(tmp_path, 3)
    yield u
    u.close()


def test_a_crash_on_one_host_moves_every_host_to_the_next_generation(unit: Unit) -> None:
    assert [h.generation for h in unit.hosts] == [0, 0, 0]
    assert unit.hosts[2].restart_all() == 1
    assert [h.generation for h in unit.hosts] == [1, 1, 1]
    # Two hosts crashing at once both announce 2: the unit moves once.
    assert unit.hosts[0].restart_all() == 2
    assert unit.hosts[1].heard(2) == 2
    assert [h.generation for h in unit.hosts] == [2, 2, 2]


def test_a_host_behind_joins_the_generation_its_peers_wait_in(unit: Unit) -> None:
    unit.hosts[0].heard(5)
    unit.hosts[1].heard(5)
    # Host 2 missed those restarts (it was importing): its crash announces 1, hears 5, joins.
    assert unit.hosts[2].restart_all() == 5
    assert unit.hosts[2].catch_up() == 5
    assert [h.generation for h in unit.hosts] == [5, 5, 5]


def test_the_generation_survives_a_container_restart(tmp_path: Path) -> None:
    u = Unit(tmp_path, 2)
    try:
        assert not u.hosts[1].restarted_container
        u.hosts[1].restart_all()
    finally:
        u.close()
    again = Unit(tmp_path, 2)  # the same restart directories: the pods' emptyDirs
    try:
        assert [h.restarted_container for h in again.hosts] == [True, True]
        assert [h.generation for h in again.hosts] == [1, 1]
        assert again.hosts[1].restart_all() == 2
        assert again.hosts[0].generation == 2
    finally:
        again.close()


def post(
    url: str, body: bytes, token: str = TOKEN, generation: int = 7
) -> tuple[int, dict[str, object]]:
    headers = {SIGNATURE_HEADER: signature(token, generation)}
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_bad_announcements_are_refused_and_change_nothing(unit: Unit) -> None:
    url = f"http://{unit.names[0]}:{unit.port}{PATH}"
    assert post(url, b'{"generation": 7}', token="another-units-token")[0] == 401
    # signed for another generation: a captured announcement replayed with a higher number
    assert post(url, b'{"generation": 8}', generation=7)[0] == 401
    assert post(url, b"not json")[0] == 400
    assert post(url, b'{"generation": -1}', generation=-1)[0] == 400
    assert post(url, b'{"gen": 3}')[0] == 400
    assert post(f"http://{unit.names[0]}:{unit.port}/v1/other", b"{}")[0] == 404
    assert unit.hosts[0].generation == 0
    assert post(url, b'{"generation": 3}', generation=3) == (200, {"generation": 3})


def test_two_hosts_announcing_at_once_hear_each_other(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each host's supervisor is one thread that announces while its peer announces to it (both
    learners died of the same fault): each serves the other's announcement while it waits for
    its own reply, so both get one (no `unreached`) and the unit moves to generation 1 once."""
    port = free_port()
    names = ["127.0.0.1", "127.0.0.2"]
    hosts = []
    for i, name in enumerate(names):
        (folder := tmp_path / f"host-{i}").mkdir()
        hosts.append(UnitRestart(Peers.of(names, i, port), TOKEN, folder, bind=name, port=port))
    results: list[int] = []
    supervisors = [
        threading.Thread(target=lambda h=h: results.append(h.restart_all())) for h in hosts
    ]
    try:
        with caplog.at_level("WARNING", logger="diloco_trainer.learner.unit_restart"):
            for t in supervisors:
                t.start()
            for t in supervisors:
                t.join()
    finally:
        for h in hosts:
            h.close()
    assert results == [1, 1]
    assert [h.generation for h in hosts] == [1, 1]
    assert "unit_restart_unreached" not in caplog.text


def test_an_unreachable_peer_is_left_to_the_operator(tmp_path: Path) -> None:
    port = free_port()
    peers = Peers.of(["127.0.0.1", "127.0.0.9"], 0, port)  # nobody serves on .9
    host = UnitRestart(peers, TOKEN, tmp_path, bind="127.0.0.1", port=port)
    try:
        assert host.restart_all() == 1
    finally:
        host.close()


def test_each_generation_has_its_own_coordinator_port() -> None:
    env = {"TPU_WORKER_HOSTNAMES": "h0.u,h1.u", "TPU_WORKER_ID": "1"}
    first = distributed_args(env)
    later = distributed_args({**env, GENERATION_ENV: "3"})
    assert first is not None and later is not None
    assert first.coordinator_address == f"h0.u:{COORDINATOR_PORT}"
    assert later.coordinator_address == f"h0.u:{COORDINATOR_PORT + 3}"
    with pytest.raises(ValueError, match=GENERATION_ENV):
        distributed_args({**env, GENERATION_ENV: "x"})


def test_only_a_multi_host_unit_gets_one(tmp_path: Path) -> None:
    assert from_env({"TPU_WORKER_HOSTNAMES": "localhost"}, TOKEN, str(tmp_path)) is None
    port = str(free_port())
    env = {
        "TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.2",
        "TPU_WORKER_ID": "1",
        "DILOCO_UNIT_RESTART_PORT": port,
        "DILOCO_UNIT_RESTART_BIND": "127.0.0.2",
    }
    host = from_env(env, TOKEN, str(tmp_path))
    assert host is not None
    try:
        assert host.peers.me == 1
        assert host.peers.others() == [f"http://127.0.0.1:{port}{PATH}"]
        with pytest.raises(OSError, match="DILOCO_UNIT_RESTART_PORT"):
            from_env(env, TOKEN, str(tmp_path))  # the port is taken
    finally:
        host.close()

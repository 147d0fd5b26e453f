"""HTTPS between learners and the syncer, over loopback with certificates made here: the
learner verifies the syncer (CA and name), certificates and CA bundles rotate under live
processes, and a bad new pair never takes the listener down."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import re
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from diloco_trainer.auth import unit_token
from diloco_trainer.config import ConfigError
from diloco_trainer.learner.client import SyncerClient, SyncerUnavailable, SyncerUntrusted
from diloco_trainer.learner.main import UsageError, build_parser, resolve
from diloco_trainer.learner.sync_link import Backoff, retry_until
from diloco_trainer.syncer.core import Syncer
from diloco_trainer.syncer.http_api import start_server
from diloco_trainer.syncer.main import resolve_tls
from diloco_trainer.tls import ClientTrust, Reloading, ServerTls
from test_syncer import TOKEN, LiveSyncer, fragment_delta, tiny_cfg
from tls_certs import Ca, served_serial, write_bundle


class TlsLiveSyncer(LiveSyncer):
    """LiveSyncer serving HTTPS with `tls`; its clients trust the bundle in `ca_file`."""

    def __init__(self, syncer: Syncer, tls: ServerTls, ca_file: Path) -> None:
        self.syncer, self.tls, self.ca_file = syncer, tls, ca_file
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, self.port = self.run(start_server(syncer, "127.0.0.1", 0, tls))
        self.url = f"https://127.0.0.1:{self.port}"

    def client(
        self, unit: str = "unit-0", attempt: int = 0, token: str | None = None
    ) -> SyncerClient:
        return SyncerClient(
            self.url,
            token or unit_token(TOKEN, unit),
            unit,
            attempt,
            compression=self.syncer.cfg.compression,
            trust=ClientTrust(str(self.ca_file)),
        )

    def get(self, path: str) -> tuple[int, bytes]:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, timeout=10, context=ctx)
        conn.request("GET", path, headers={"Authorization": f"Bearer {TOKEN}"})
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        return resp.status, body


@pytest.fixture
def ca() -> Ca:
    return Ca()


@pytest.fixture
def served(tmp_path: Path, ca: Ca) -> Iterator[TlsLiveSyncer]:
    """An HTTPS syncer with serial-1 certificate, checking its files at every handshake."""
    cert, key = ca.issue(1).write(tmp_path)
    tls = ServerTls(str(cert), str(key), check_seconds=0)
    live = TlsLiveSyncer(
        Syncer(tiny_cfg(), TOKEN, run="tls", eval_fn=None),
        tls,
        write_bundle(tmp_path / "ca.pem", ca),
    )
    yield live
    live.close()


def test_a_learner_verifies_the_syncer_and_trains_against_it_over_https(
    served: TlsLiveSyncer,
) -> None:
    learner = served.client()
    join = learner.join()
    learner.heartbeat(1, 8, 10.0, 3.0)
    reply = learner.push(0, 0, fragment_delta(served, 0), 2, 64)
    assert reply.accepted
    got = learner.poll(0, 0, wait=10)
    assert got is not None and got[0] == 1
    assert set(join.shapes) == set(served.syncer.shapes)
    # Probes and metrics are on the same listener, HTTPS too.
    assert served.get("/healthz") == (200, b"ok")
    assert served.get("/readyz")[0] == 200
    assert b"diloco_syncer_pushes_total" in served.get("/metrics")[1]
    assert json.loads(served.get("/v1/status")[1])["run"] == "tls"
    # HTTPS only: a plain HTTP request to the port gets no HTTP answer.
    plain = http.client.HTTPConnection("127.0.0.1", served.port, timeout=5)
    with pytest.raises((http.client.HTTPException, OSError)):
        plain.request("GET", "/healthz")
        plain.getresponse().read()
    plain.close()


def test_a_certificate_of_another_ca_is_refused_naming_the_address_and_why(
    served: TlsLiveSyncer, tmp_path: Path
) -> None:
    other = write_bundle(tmp_path / "other.pem", Ca("another CA"))
    learner = SyncerClient(
        served.url, unit_token(TOKEN, "unit-0"), "unit-0", 0, trust=ClientTrust(str(other))
    )
    with pytest.raises(SyncerUntrusted) as refused:
        learner.join()
    message = str(refused.value)
    assert f"https://127.0.0.1:{served.port}" in message
    assert f"the CA file {other}" in message
    assert "unable to get local issuer certificate" in message
    assert not served.syncer.learners.records  # nothing of it reached the syncer


def test_a_certificate_for_another_name_is_refused(tmp_path: Path, ca: Ca) -> None:
    cert, key = ca.issue(7, names=("syncer.elsewhere.example",)).write(tmp_path)
    live = TlsLiveSyncer(
        Syncer(tiny_cfg(), TOKEN, run="tls", eval_fn=None),
        ServerTls(str(cert), str(key)),
        write_bundle(tmp_path / "ca.pem", ca),
    )
    try:
        with pytest.raises(SyncerUntrusted, match=r"mismatch, certificate is not valid for"):
            live.client().join()
    finally:
        live.close()


def test_a_rotated_certificate_reaches_new_connections_while_learners_go_on(
    served: TlsLiveSyncer, tmp_path: Path, ca: Ca
) -> None:
    assert served_serial(served.port, served.ca_file) == 1
    learner = served.client()
    learner.join()
    learner.heartbeat(1, 8, 10.0, None)
    ca.issue(2).write(tmp_path)  # what cert-manager's renewal does to the Secret's files
    assert served_serial(served.port, served.ca_file) == 2
    learner.heartbeat(2, 16, 10.0, None)  # its kept-alive connection goes on
    learner.close()  # and a new one verifies the new certificate
    learner.heartbeat(3, 24, 10.0, None)
    assert learner.push(1, 0, fragment_delta(served, 1), 3, 24).accepted


def test_a_learner_takes_a_rotated_ca_bundle_without_restarting(
    served: TlsLiveSyncer, tmp_path: Path, ca: Ca
) -> None:
    learner = served.client()
    learner.join()
    successor = Ca("successor CA")
    successor.issue(3).write(tmp_path)  # the syncer moves to a certificate of the new CA
    learner.close()
    with pytest.raises(SyncerUntrusted):
        learner.heartbeat(1, 8, 10.0, None)  # its bundle holds the old CA only
    write_bundle(served.ca_file, ca, successor)  # the rotated bundle: old and new CA
    learner.heartbeat(2, 16, 10.0, None)
    assert served_serial(served.port, served.ca_file) == 3


def test_a_pair_that_does_not_load_is_warned_once_and_the_old_one_keeps_serving(
    served: TlsLiveSyncer, tmp_path: Path, ca: Ca, caplog: pytest.LogCaptureFixture
) -> None:
    learner = served.client()
    learner.join()
    good, other = ca.issue(4), ca.issue(5)
    (tmp_path / "server.crt").write_bytes(good.cert)
    (tmp_path / "server.key").write_bytes(other.key)  # the key of another certificate
    with caplog.at_level(logging.WARNING, logger="diloco.tls"):
        for _ in range(3):
            assert served_serial(served.port, served.ca_file) == 1
        (tmp_path / "server.crt").write_bytes(b"-----BEGIN CERTIFICATE-----\ngarbage\n")
        for _ in range(3):
            assert served_serial(served.port, served.ca_file) == 1
    failed = [r.getMessage() for r in caplog.records if "event=tls_reload_failed" in r.message]
    assert len(failed) == 2, failed  # once per bad state of the files, not per handshake
    assert "KEY_VALUES_MISMATCH" in failed[0] or "key values mismatch" in failed[0].lower()
    learner.heartbeat(1, 8, 10.0, None)
    good.write(tmp_path)
    assert served_serial(served.port, served.ca_file) == 4


def test_an_untrusted_syncer_is_retried_with_backoff_not_crashed_on(
    served: TlsLiveSyncer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert Backoff().after(SyncerUntrusted("x")) >= SyncerUntrusted.retry_after
    assert isinstance(SyncerUntrusted("x"), SyncerUnavailable)  # what retry_until retries
    other = write_bundle(tmp_path / "other.pem", Ca("another CA"))
    learner = SyncerClient(
        served.url, unit_token(TOKEN, "unit-0"), "unit-0", 0, trust=ClientTrust(str(other))
    )
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    with caplog.at_level(logging.WARNING):
        assert retry_until(learner.join, stop, "join") is None  # waited, then stopped
    retries = [r.getMessage() for r in caplog.records if "event=join_retry" in r.message]
    assert len(retries) == 1, retries  # one try in half a second: the next waits 10 s or more
    delay = re.search(r"delay=([\d.]+)", retries[0])
    assert delay is not None and float(delay.group(1)) >= SyncerUntrusted.retry_after
    assert f"https://127.0.0.1:{served.port}" in retries[0]


def test_the_syncer_takes_its_certificate_by_flag_or_environment(tmp_path: Path, ca: Ca) -> None:
    cert, key = ca.issue(6).write(tmp_path)
    assert resolve_tls(None, None, {}) is None
    assert resolve_tls(str(cert), str(key), {}) is not None
    assert resolve_tls(None, None, {"DILOCO_TLS_CERT": str(cert), "DILOCO_TLS_KEY": str(key)})
    with pytest.raises(ConfigError, match=r"--tls-cert needs --tls-key \(or DILOCO_TLS_KEY\)"):
        resolve_tls(str(cert), None, {})
    with pytest.raises(ConfigError, match=r"--tls-key needs --tls-cert"):
        resolve_tls(None, None, {"DILOCO_TLS_KEY": str(key)})
    other = ca.issue(8)
    key.write_bytes(other.key)
    with pytest.raises(ConfigError, match=r"--tls-cert/--tls-key .*with key"):
        resolve_tls(str(cert), str(key), {})


def test_the_learner_takes_a_ca_file_by_flag_or_environment(tmp_path: Path, ca: Ca) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("totalSteps: 10\n")
    bundle = write_bundle(tmp_path / "ca.pem", ca)
    base = ["--config", str(config), "--unit", "0", "--syncer", "https://s:1", "--token", "t"]
    by_flag = resolve(build_parser({}).parse_args([*base, "--ca-file", str(bundle)]), {})[1]
    assert by_flag["ca_file"] == str(bundle)
    env = {"DILOCO_CA_FILE": str(bundle)}
    assert resolve(build_parser(env).parse_args(base), env)[1]["ca_file"] == str(bundle)
    assert resolve(build_parser({}).parse_args(base), {})[1]["ca_file"] is None
    (tmp_path / "bad.pem").write_text("not a certificate\n")
    with pytest.raises(UsageError, match=r"--ca-file \(or DILOCO_CA_FILE\): CA file .*bad.pem"):
        resolve(build_parser({}).parse_args([*base, "--ca-file", str(tmp_path / "bad.pem")]), {})


def test_a_plain_http_syncer_still_serves_learners(tmp_path: Path) -> None:
    """In-cluster traffic may stay plain when the operator chooses so."""
    live = LiveSyncer(Syncer(tiny_cfg(), TOKEN, run="plain", eval_fn=None))
    try:
        assert live.url.startswith("http://")
        assert live.client().join().versions == [0, 0, 0]
        assert live.client().trust is None
    finally:
        live.close()


def test_files_that_change_while_read_are_looked_at_again(tmp_path: Path) -> None:
    path = tmp_path / "pem"

    def put(text: str) -> None:  # a new inode each time, as a Secret volume's swap makes
        (tmp_path / "tmp").write_text(text)
        os.replace(tmp_path / "tmp", path)

    def build() -> str:
        text = path.read_text()
        if text == "half":
            put("whole")  # its writer was still at work
        return text

    put("first")
    files = Reloading((str(path),), build, "test")
    assert not files.refresh() and files.value == "first"  # nothing changed
    put("half")
    assert not files.refresh() and files.value == "first"  # changed under the read: not taken
    assert files.refresh() and files.value == "whole"

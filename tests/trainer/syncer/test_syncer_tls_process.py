"""`diloco-syncer` with --tls-cert/--tls-key (here from DILOCO_TLS_CERT/DILOCO_TLS_KEY): the
serving syncer and its warm standby both serve HTTPS only, and the standby that takes over
serves the certificate the files hold by then."""

from __future__ import annotations

import http.client
import signal
from pathlib import Path

import pytest
from diloco_trainer.auth import unit_token
from diloco_trainer.learner.client import SyncerClient
from diloco_trainer.tls import ClientTrust
from tls_certs import Ca, served_serial, write_bundle

from tests.trainer.syncer.test_syncer_process import (
    TOKEN,
    SyncerProcess,
    procs,  # noqa: F401  (fixture)
)
from tests.trainer.syncer.test_syncer_standby import log_has, serving_and_standby


def test_a_standby_takes_over_serving_https_with_the_newest_certificate(
    tmp_path: Path,
    procs: list[SyncerProcess],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ca = Ca()
    certs = tmp_path / "certs"
    certs.mkdir()
    cert, key = ca.issue(1).write(certs)
    bundle = write_bundle(tmp_path / "ca.pem", ca)
    monkeypatch.setenv("DILOCO_TLS_CERT", str(cert))
    monkeypatch.setenv("DILOCO_TLS_KEY", str(key))
    with serving_and_standby(tmp_path, procs) as (first, _, standby_log, _lock):
        log_has(first.log, r"event=listening host=\S+ port=\d+ .*scheme=https")
        url = f"https://127.0.0.1:{first.port}"
        learner = SyncerClient(
            url, unit_token(TOKEN, "unit-0"), "unit-0", 0, trust=ClientTrust(str(bundle))
        )
        learner.join()
        assert served_serial(first.port, bundle) == 1
        plain = http.client.HTTPConnection("127.0.0.1", first.port, timeout=5)
        with pytest.raises((http.client.HTTPException, OSError)):  # HTTPS only
            plain.request("GET", "/healthz")
            plain.getresponse().read()
        log_has(standby_log, r"event=standby_ready")
        ca.issue(2).write(certs)  # renewed while the standby waits
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
        log_has(standby_log, r"event=listening .*scheme=https")
        assert served_serial(first.port, bundle) == 2
        learner.heartbeat(1, 8, 10.0, None)  # on a new connection, to the new certificate
        assert learner.status().learners["unit-0"].attempt == 0

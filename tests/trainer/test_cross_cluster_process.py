"""One run across a home and an away cluster, as real processes over real HTTPS on loopback.

A `diloco-syncer` serves HTTPS with a certificate of a CA made here, admitting a roster of one
home unit (group `home`) and one away unit (group `away`). The home learner holds its unit token
(of the run secret); the away learner holds only its token derived from a join credential and
the credential's public part (docs/multi-cluster.md, docs/protocol.md "Join credentials"). Both
verify the syncer against the CA file. Checked: both join (the away one under the credential),
merges hold both units' pushes and the run completes; revoking the credential with a new roster
revision shuts the away unit out on its next requests while the home unit trains on; an away
learner that trusts another CA never reaches the syncer.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from diloco_operator.local.processes import ManagedProcess, ProcessTable
from diloco_trainer.auth import unit_token
from diloco_trainer.join_credentials import (
    mint_join_credential,
    parse_join_credential,
    unit_token_from_credential,
)
from diloco_trainer.learner.client import SyncerClient
from diloco_trainer.status import SyncerStatus
from diloco_trainer.tls import ClientTrust, client_context
from gcs_server import free_port
from processes import syncer_argv

from tests.local.test_local_processes import wait_for
from tests.trainer.syncer.tls_certs import Ca, write_bundle

pytestmark = pytest.mark.slow

RUN = "r"  # the syncer's --run: what join credentials are minted for
SECRET = "cross-cluster-run-secret"  # the run secret: the syncer's, never an away learner's
HOME, AWAY = f"{RUN}-home-0", f"{RUN}-away-0"
GROUPS = {HOME: "home", AWAY: "away"}
# Global unit indices as the operator numbers them: later groups first, then the first group.
INDEX = {AWAY: 0, HOME: 1}
H = 5  # innerSteps; the syncer believes a unit's steps up to 2H past its last accepted push
# Neither learner may train more than MAX_STEPS, and the run needs TOTAL_STEPS counted: each
# unit must count at least TOTAL_STEPS - MAX_STEPS > 2H steps, which it can only with pushes
# the syncer accepted. So however their starts are skewed on a loaded machine, the run cannot
# complete on one unit's work alone.
MAX_STEPS = 300
TOTAL_STEPS = 320
assert TOTAL_STEPS - MAX_STEPS > 2 * H
DEADLINE = 240.0  # seconds: generous, the machine is shared and slow
TRAINING = {
    "model": {"preset": "tiny", "dModel": 16, "nLayers": 1, "nHeads": 2, "seqLen": 8},
    "data": {"batchSize": 4, "maxBytes": 65536, "shards": 8},
    "innerSteps": H,
    "fragments": 2,
    "grace": {"mode": "none"},
    "heartbeatSeconds": 0.1,
    "eval": {"everySeconds": None},
    "checkpoint": {"everySeconds": 60},
}
MERGED = re.compile(
    r"event=merged fragment=\d+ version=\d+ contributions=\d+ share=\S+ units=(\S+)"
)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _tails(procs: dict[str, ManagedProcess]) -> dict[str, str]:
    return {key: _read(proc.log_path)[-3000:] for key, proc in procs.items()}


class Clusters:
    """The home syncer and the learners of both clusters, as processes of one table (which
    stops them with SIGTERM, then SIGKILL, and tells whether any survived)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ca = Ca()
        self.cert, self.key = self.ca.issue(1).write(tmp)
        self.ca_file = write_bundle(tmp / "ca.pem", self.ca)
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.config = tmp / "run.yaml"
        self.syncer_log = tmp / "syncer.log"
        self.table = ProcessTable()
        self.learners: list[str] = []  # their keys in the table: their unit names
        # Minted at home; the away cluster's operator keeps it and hands its learners only
        # their token and the public part.
        self.credential = mint_join_credential(SECRET, RUN, "away", int(time.time()) + 3600)
        self.cred = parse_join_credential(self.credential)
        env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
        if os.environ.get("DILOCO_CACHE_DIR"):
            env["DILOCO_CACHE_DIR"] = os.environ["DILOCO_CACHE_DIR"]
        self.env = {**env, "JAX_PLATFORMS": "cpu"}

    # ---------------------------------------------------------------- processes
    def start_syncer(self, total_steps: int, quorum: int) -> None:
        self.config.write_text(
            yaml.safe_dump({**TRAINING, "totalSteps": total_steps, "quorum": quorum})
        )
        units = self.tmp / "units.json"
        units.write_text(json.dumps({"revision": 0, "units": GROUPS}))
        argv = syncer_argv(
            self.config,
            self.port,
            "--run",
            RUN,
            "--units-file",
            str(units),
            "--checkpoint-dir",
            str(self.tmp / "ckpt"),
            "--tls-cert",
            str(self.cert),
            "--tls-key",
            str(self.key),
        )
        self.table.spawn("syncer", argv, {**self.env, "DILOCO_TOKEN": SECRET}, self.syncer_log)

    def start_learner(
        self,
        unit: str,
        token: str,
        join: str = "",
        ca_file: Path | None = None,
        max_steps: int | None = None,
    ) -> ManagedProcess:
        """A learner started with the syncer (it retries its join until the syncer listens, as
        a pod does), so both start-ups overlap."""
        env = {
            **self.env,
            "DILOCO_SYNCER_ADDR": self.url,
            "DILOCO_CA_FILE": str(ca_file or self.ca_file),
            "DILOCO_UNIT": str(INDEX[unit]),
            "DILOCO_NUM_UNITS": str(len(GROUPS)),
            "DILOCO_UNIT_NAME": unit,
            "DILOCO_GROUP": GROUPS[unit],
            "DILOCO_TOKEN": token,
        }
        if join:
            env["DILOCO_JOIN"] = join
        argv = [sys.executable, "-m", "diloco_trainer.learner.main", "--config", str(self.config)]
        if max_steps is not None:
            argv += ["--max-steps", str(max_steps)]
        self.learners.append(unit)
        return self.table.spawn(unit, argv, env, self.tmp / f"{unit}.log")

    def start_home(self, max_steps: int | None = None) -> ManagedProcess:
        return self.start_learner(HOME, unit_token(SECRET, HOME), max_steps=max_steps)

    def start_away(
        self, ca_file: Path | None = None, max_steps: int | None = None
    ) -> ManagedProcess:
        token = unit_token_from_credential(self.credential, AWAY)
        return self.start_learner(AWAY, token, self.cred.public, ca_file, max_steps)

    def stop(self) -> None:
        """Learners first, then the syncer (which writes its final checkpoint and exits 0):
        SIGTERM, SIGKILL after the grace period; nothing of any process tree may survive."""
        self.table.stop_all(grace_seconds=30.0, batches=[self.learners, ["syncer"]])
        assert self.table.survivors() == []
        syncer = self.table.get("syncer")
        assert syncer is not None and syncer.returncode == 0, _read(self.syncer_log)[-3000:]

    # ---------------------------------------------------------------- observing
    def wait_log(
        self, proc: ManagedProcess, pattern: str, start: int = 0, timeout: float = DEADLINE
    ) -> re.Match[str]:
        """The first match of `pattern` in the log of `proc` from text offset `start`, waiting
        for it while the process runs."""
        found: list[re.Match[str]] = []

        def seen() -> bool:
            match = re.compile(pattern).search(_read(proc.log_path), start)
            if match:
                found.append(match)
            return bool(match) or proc.popen.poll() is not None

        wait_for(seen, timeout)
        others = {k: p for k in self.learners if (p := self.table.get(k)) and p is not proc}
        assert found, (
            f"no {pattern!r} in {proc.log_path}:\n{_read(proc.log_path)[-4000:]}\n"
            f"other learners (exit codes { ({k: p.popen.poll() for k, p in others.items()}) }): "
            f"{_tails(others)}"
        )
        return found[0]

    @property
    def syncer(self) -> ManagedProcess:
        proc = self.table.get("syncer")
        assert proc is not None
        return proc

    def wait_listening(self) -> None:
        self.wait_log(
            self.syncer, rf"event=listening host=127\.0\.0\.1 port={self.port} .*scheme=https"
        )

    def status(self) -> SyncerStatus:
        """GET /v1/status over HTTPS as the operator (the run secret), verifying the CA."""
        client = SyncerClient(self.url, SECRET, "", 0, trust=ClientTrust(str(self.ca_file)))
        try:
            return client.status()
        finally:
            client.close()

    def https(self, method: str, path: str, body: bytes | None = None) -> tuple[int, str]:
        """A request with the run secret (what the operator sends), verifying the CA."""
        conn = http.client.HTTPSConnection(
            "127.0.0.1", self.port, timeout=10, context=client_context(str(self.ca_file))
        )
        try:
            conn.request(method, path, body, {"Authorization": f"Bearer {SECRET}"})
            resp = conn.getresponse()
            return resp.status, resp.read().decode()
        finally:
            conn.close()

    def revoked_refusals(self) -> float:
        """diloco_syncer_credential_refusals_total{reason="credential_revoked"} (0: none yet)."""
        code, text = self.https("GET", "/metrics")
        assert code == 200, text
        found = re.search(
            r'^diloco_syncer_credential_refusals_total\{reason="credential_revoked"\} (\S+)$',
            text,
            re.M,
        )
        return float(found.group(1)) if found else 0.0

    def assert_away_holds_no_secret(self, away: ManagedProcess) -> None:
        """The away learner's environment and command line, as its process has them (Popen
        returns once the child exec'd, so /proc shows the learner's own), hold neither the run
        secret nor the credential's key, which the whole credential contains; they do hold its
        token and the credential's public part."""
        proc = Path(f"/proc/{away.pid}")
        environ = (proc / "environ").read_bytes().decode(errors="replace")
        argv = (proc / "cmdline").read_bytes().decode(errors="replace")
        for text in (environ, argv):
            assert SECRET not in text
            assert self.cred.key not in text
        assert f"DILOCO_JOIN={self.cred.public}\0" in environ
        assert f"DILOCO_TOKEN={unit_token_from_credential(self.credential, AWAY)}\0" in environ


@pytest.fixture
def clusters(tmp_path: Path) -> Iterator[Clusters]:
    started = Clusters(tmp_path)
    yield started
    started.table.stop_all(grace_seconds=10.0)  # after a failure: no process left behind


def test_home_and_away_units_train_one_run_over_https(clusters: Clusters) -> None:
    c = clusters
    # Quorum 2: every merge waits for a push of each unit, so each one holds both.
    c.start_syncer(TOTAL_STEPS, quorum=2)
    learners = {HOME: c.start_home(MAX_STEPS), AWAY: c.start_away(max_steps=MAX_STEPS)}
    c.assert_away_holds_no_secret(learners[AWAY])
    c.wait_listening()
    c.wait_log(c.syncer, rf"event=join unit={HOME} attempt=0 group=home .* credential=-\n")
    away_join = c.wait_log(
        c.syncer, rf"event=join unit={AWAY} attempt=0 group=away .* credential=(\S+)\n"
    )
    assert away_join.group(1) == c.cred.id

    done = wait_for(lambda: all(p.popen.poll() is not None for p in learners.values()), DEADLINE)
    assert done, _tails(learners)
    codes = {unit: p.popen.returncode for unit, p in learners.items()}
    assert codes == {HOME: 0, AWAY: 0}, _tails(learners)
    status = c.status()
    assert status.run == RUN and status.complete
    assert status.steps is not None and status.steps >= TOTAL_STEPS
    for unit, group in GROUPS.items():
        learner = status.learners[unit]
        assert learner.group == group
        # More than 2H steps counted: more than a unit without an accepted push can count.
        assert learner.step is not None and learner.step >= TOTAL_STEPS - MAX_STEPS
        assert learner.tokens is not None and learner.tokens > 0
    # Both pushed every fragment, so a merge follows (maybe after the learners left).
    c.wait_log(c.syncer, MERGED.pattern)
    merges = MERGED.findall(_read(c.syncer_log))
    assert merges and set(merges) == {f"{AWAY},{HOME}"}, merges
    c.stop()


def test_a_revoked_credential_shuts_the_away_unit_out_while_home_trains_on(
    clusters: Clusters,
) -> None:
    c = clusters
    c.start_syncer(10**6, quorum=1)  # no end in sight; quorum 1: home merges on its own
    learners = {HOME: c.start_home(), AWAY: c.start_away()}
    c.wait_listening()
    for unit in (AWAY, HOME):  # both train, and the syncer took work of each
        c.wait_log(c.syncer, rf"event=push_accepted fragment=\d+ unit={unit} ")
    assert c.revoked_refusals() == 0

    # What the operator does after `spec.syncer.revokedCredentials` changed (hand_roster).
    roster = {"revision": 1, "units": GROUPS, "revokedCredentials": [c.cred.id]}
    code, reply = c.https("PUT", "/v1/units", json.dumps(roster).encode())
    assert (code, json.loads(reply)) == (200, {"taken": True, "revision": 1})

    # The away unit's next heartbeat and next push are refused. Each comes from one thread
    # that waits for its previous request's answer, so once both refusals are logged, no
    # heartbeat or push of the away unit accepted before can still be in flight.
    revoked = (
        rf"status=403 reason=credential_revoked message='join credential {c.cred.id} is revoked'"
    )
    beat = c.wait_log(c.syncer, rf"event=rejected method=POST path=/v1/heartbeat {revoked}")
    push = c.wait_log(
        c.syncer, rf"event=rejected method=POST path=/v1/fragments/\d+/push {revoked}"
    )
    mark = max(beat.end(), push.end())
    away_step = c.status().learners[AWAY].step
    home_step = c.status().learners[HOME].step
    assert away_step is not None and home_step is not None
    assert c.revoked_refusals() >= 2  # scraped over HTTPS too
    c.wait_log(learners[AWAY], r"event=heartbeat_retry .*HTTP 403 credential_revoked")
    c.wait_log(
        learners[AWAY], r"event=push_rejected fragment=\d+ error=HTTP 403 credential_revoked"
    )

    # Home trains on: its pushes merge on their own, and its steps keep rising at the syncer,
    # beyond what it was believed for before (2H past an accepted push).
    c.wait_log(c.syncer, rf"event=merged .* units={HOME} ", start=mark)

    def home_beyond() -> bool:
        step = c.status().learners[HOME].step
        return step is not None and step > home_step + 2 * H

    assert wait_for(home_beyond, DEADLINE), c.status().learners[HOME]
    # Both learners still run: the shut-out one waits, unheard, for a new credential (its
    # units are recreated with one) rather than crash into a restart loop.
    assert [learners[u].popen.poll() for u in (HOME, AWAY)] == [None, None], _tails(learners)
    after = c.status()
    assert after.learners[AWAY].step == away_step  # nothing of the away unit counted since
    assert not after.complete
    since = _read(c.syncer_log)[mark:]
    assert not re.search(rf"event=(push_accepted fragment=\d+|join) unit={AWAY} ", since)
    c.stop()


def test_an_away_unit_that_trusts_another_ca_never_joins(clusters: Clusters) -> None:
    c = clusters
    c.start_syncer(10**6, quorum=1)
    other = write_bundle(c.tmp / "other-ca.pem", Ca("another CA"))
    away = c.start_away(ca_file=other)
    c.wait_listening()
    refused = c.wait_log(
        away,
        rf"event=join_retry delay=\S+ error=POST /v1/join: the certificate of "
        rf"https://127\.0\.0\.1:{c.port} does not verify against the CA file "
        rf"{re.escape(str(other))}: (.+)\n",
    )
    assert refused.group(1) == "unable to get local issuer certificate"
    assert away.popen.poll() is None  # it retries: a rotated bundle would fix it
    status = c.status()
    assert AWAY not in status.learners and status.learners == {}
    assert not re.search(r"event=join ", _read(c.syncer_log))
    c.stop()

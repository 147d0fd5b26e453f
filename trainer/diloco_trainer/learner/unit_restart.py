"""A multi-host unit restarts as one: a crashed learner on one host restarts every host's, in place.

The hosts of a unit run one SPMD program. When one host's learner dies, the others' next
collective fails or hangs, and a learner restarted on that host alone would find its peers still
in the old program, or their old coordinator. So the supervisors of a unit's hosts (one per pod,
supervisor.py) agree on a *generation*: every learner of generation g uses the coordinator port
of g (distributed.coordinator_port), and a supervisor whose learner crashes moves the unit to
g+1 by telling every peer (`POST /v1/unit/restart`, signed with the unit's token). A peer that
hears of a newer generation kills its learner and starts the next one; a learner of the new
generation can only ever meet learners of the same generation (another port), so no restart is
lost in a race. Two hosts crashing at once both announce g+1: the generation moves once. A supervisor restarted by the
kubelet (its pod's restart rule) finds the generation in the pod's restart directory and
announces the next one, so a whole-container restart also restarts the unit.

The supervisor is single-threaded on purpose: it forks its learner, and a fork taken while
another thread holds a lock leaves the child with that lock held. It serves peers between polls
of its child, and while its own announcement waits for replies, instead (`serve_once`); an
announcement's threads are joined before it returns.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from diloco_trainer.learner.distributed import GENERATION_ENV, worker_hostnames, worker_id

log = logging.getLogger("diloco_trainer.learner.unit_restart")

PORT_ENV = "DILOCO_UNIT_RESTART_PORT"
BIND_ENV = "DILOCO_UNIT_RESTART_BIND"  # several hosts of a unit on one machine (tests)
DEFAULT_PORT = 8475
GENERATION_FILE = "generation"
PATH = "/v1/unit/restart"
SIGNATURE_HEADER = "X-Diloco-Restart-Signature"
ANNOUNCE_TIMEOUT_S = 2.0
ANNOUNCE_TRIES = 3


def signature(token: str, generation: int) -> str:
    """An announcement's proof that it comes from a host of the unit: an HMAC of the generation
    keyed by the unit's token, which itself never crosses the pods' network. Replayed, a
    captured announcement can only ask for a generation the unit has already reached."""
    message = f"unit-restart:{generation}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Peers:
    """The unit's hosts' supervisors: `urls[i]` is host i's; `me` is this host's index."""

    urls: tuple[str, ...]
    me: int

    @classmethod
    def of(cls, hostnames: list[str], me: int, port: int) -> Peers:
        return cls(tuple(f"http://{h}:{port}{PATH}" for h in hostnames), me)

    def others(self) -> list[str]:
        return [url for i, url in enumerate(self.urls) if i != self.me]


class UnitRestart:
    """This host's side: the unit's generation (kept in the pod's restart directory), a small
    server that hears peers' announcements, and the announcement itself."""

    def __init__(
        self,
        peers: Peers,
        token: str,
        state_dir: str | Path | None,
        bind: str = "0.0.0.0",
        port: int = DEFAULT_PORT,
    ) -> None:
        self.peers = peers
        self.token = token
        self.path = Path(state_dir) / GENERATION_FILE if state_dir else None
        self.restarted_container = self.path is not None and self.path.exists()
        self.generation = self._read()
        self._write(self.generation)
        self.server = HTTPServer((bind, port), _handler(self))
        self._serving = threading.Lock()

    def _read(self) -> int:
        if self.path is None or not self.path.exists():
            return 0
        try:
            return int(self.path.read_text().strip() or 0)
        except ValueError:
            return 0

    def _write(self, generation: int) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(str(generation))
        os.replace(tmp, self.path)

    def heard(self, generation: int) -> int:
        """A peer's announcement: move to `generation` when it is newer; the generation now."""
        if generation > self.generation:
            log.warning(
                "event=unit_restart_heard generation=%d was=%d action=restart_learner",
                generation,
                self.generation,
            )
            self.generation = generation
            self._write(generation)
        return self.generation

    def restart_all(self) -> int:
        """Move the whole unit to the next generation; the generation to start. A peer found
        further on is joined instead: its learner waits in start-up for every host, ours too."""
        target = self.generation + 1
        self.heard(target)
        return self.heard(self.announce(target))

    def catch_up(self) -> int:
        """Join the newest generation any peer is at (after a start-up that served no one: a
        restart announced meanwhile went unheard); the generation to start."""
        return self.heard(self.announce(self.generation))

    def announce(self, generation: int) -> int:
        """Tell every peer; the highest generation any of them replied (unreachable peers are
        left to the operator: a pod that cannot be reached is a lost pod)."""
        others = self.peers.others()
        if not others:
            return generation
        with ThreadPoolExecutor(max_workers=min(64, len(others))) as pool:
            told = [pool.submit(self._tell, url, generation) for url in others]
            # Peers are served meanwhile: two hosts that crash together announce to each other
            # at once, and a supervisor that only waited for its replies would leave the other's
            # unanswered until both timed out (ANNOUNCE_TRIES x ANNOUNCE_TIMEOUT_S).
            while not all(f.done() for f in told):
                self.serve_once(0.02)
            replies = [f.result() for f in told]
        missed = sum(1 for r in replies if r is None)
        if missed:
            log.warning("event=unit_restart_unreached generation=%d peers=%d", generation, missed)
        return max([generation, *(r for r in replies if r is not None)])

    def _tell(self, url: str, generation: int) -> int | None:
        body = json.dumps({"generation": generation}).encode()
        last: Exception | None = None
        for _ in range(ANNOUNCE_TRIES):
            request = urllib.request.Request(
                url,
                data=body,
                method="POST",
                headers={
                    SIGNATURE_HEADER: signature(self.token, generation),
                    "Content-Type": "application/json",
                },
            )
            try:
                with urllib.request.urlopen(request, timeout=ANNOUNCE_TIMEOUT_S) as reply:
                    return int(json.loads(reply.read())["generation"])
            except (OSError, ValueError, KeyError) as exc:
                last = exc
        log.warning("event=unit_restart_unreached url=%s error=%r", url, str(last))
        return None

    def serve_once(self, timeout_s: float) -> None:
        """Answer at most one peer's request, waiting up to `timeout_s` for one. One caller at a
        time: two accepting at once could leave one blocked in accept (announce serves too)."""
        if not self._serving.acquire(timeout=timeout_s):
            return
        try:
            self.server.timeout = timeout_s
            self.server.handle_request()
        finally:
            self._serving.release()

    def close(self) -> None:
        self.server.server_close()

    def enter_learner(self, generation: int) -> None:
        """In a forked learner: drop the supervisor's socket, and say which generation it is
        (distributed.py takes its coordinator port from it)."""
        self.close()
        os.environ[GENERATION_ENV] = str(generation)


def _handler(unit: UnitRestart) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != PATH:
                return self._reply(404, {"error": "not_found"})
            try:
                length = min(int(self.headers.get("Content-Length", "0")), 1024)
                generation = int(json.loads(self.rfile.read(length))["generation"])
            except (ValueError, KeyError, TypeError):
                return self._reply(400, {"error": "bad_request", "detail": "want {generation}"})
            if generation < 0:
                return self._reply(400, {"error": "bad_request", "detail": "generation < 0"})
            given = self.headers.get(SIGNATURE_HEADER, "")
            if not hmac.compare_digest(given.encode(), signature(unit.token, generation).encode()):
                return self._reply(401, {"error": "unauthorized"})
            self._reply(200, {"generation": unit.heard(generation)})

        def _reply(self, code: int, body: dict[str, object]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            return  # every request that matters is logged by UnitRestart itself

    return Handler


def from_env(env: Mapping[str, str], token: str, state_dir: str | None) -> UnitRestart | None:
    """This host's UnitRestart for a multi-host unit (TPU_WORKER_HOSTNAMES lists several hosts),
    else None: a single host restarts alone."""
    hosts = worker_hostnames(env)
    if len(hosts) <= 1:
        return None
    port = int(env.get(PORT_ENV, str(DEFAULT_PORT)))
    peers = Peers.of(hosts, worker_id(env), port)
    try:
        return UnitRestart(peers, token, state_dir, env.get(BIND_ENV, "0.0.0.0"), port)
    except OSError as exc:  # the port is taken: say which, do not start half a unit
        raise OSError(f"unit restart port {port} ({PORT_ENV}): {exc}") from exc

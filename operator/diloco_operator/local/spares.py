"""Warm spare learners and the fork server they come from.

A spare is a learner started with `--standby`: it imports JAX, builds and compiles its step, then
waits on stdin for a unit identity (docs/contracts.md). A recreated unit takes the oldest live
spare and skips that warm-up. Spares, and units when no spare is ready, are forked from one
process that imported JAX once (forkserver.py) instead of exec'd, when the learner program is
the default one whose imports that process knows.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from diloco_operator.api import DilocoRunSpec
from diloco_operator.local.forkserver import ForkedChild, ForkServer
from diloco_operator.local.processes import ProcessTable
from diloco_operator.local.programs import LEARNER_ARGV, exit_description
from diloco_operator.local.recorder import Recorder
from diloco_operator.planner import CreateUnit

log = logging.getLogger(__name__)

# Keys of warm spare learners (a ':' never appears in a unit name, so no clash).
SPARE_PREFIX = "spare:"
# Spares that die before being used, after which the pool stops starting them.
MAX_SPARE_FAILURES = 3
# The fork server imports JAX once at the start (seconds; more while the syncer starts too).
FORK_SERVER_START_TIMEOUT = 60.0
# Once it is ready a fork takes milliseconds; this only bounds a broken server.
FORK_TIMEOUT = 10.0


def pool_size(flag: int | None, spec: DilocoRunSpec) -> int:
    """The run's warm spares here: the --spares flag, else what the manifest's groups ask for
    (one pool for the whole run: every local unit runs the same program), else one."""
    if flag is not None:
        return flag
    return sum(g.spares for g in spec.unit_groups) or 1


def is_spare(key: str) -> bool:
    return key.startswith(SPARE_PREFIX)


class SparePool:
    """Keeps `wanted` spares waiting and owns the fork server. `learner_env` gives the env every
    learner shares (the syncer address; no token: a spare gets its unit's with the identity);
    `config` is the manifest path the learners read."""

    def __init__(
        self,
        procs: ProcessTable,
        recorder: Recorder,
        *,
        logs_dir: Path,
        config: Path,
        num_units: int,
        learner_env: Callable[[], dict[str, str]],
        wanted: int,
        fork_server: bool,
        learner_argv: tuple[str, ...],
    ) -> None:
        self.procs = procs
        self.recorder = recorder
        self.log_path = logs_dir / "spares.log"
        self.config = config
        self.num_units = num_units
        self.learner_env = learner_env
        self.wanted = wanted
        self.use_fork_server = fork_server and tuple(learner_argv) == LEARNER_ARGV
        self.learner_argv = learner_argv
        self.spares: list[str] = []  # keys of live spares, oldest first
        self.server: ForkServer | None = None
        self.broken = False
        # Spares requested from the fork server and not started yet: key, learner args, future.
        self.forking: list[tuple[str, list[str], Future[ForkedChild]]] = []
        self.seq = 0
        self.failures = 0

    def fork_server(self) -> ForkServer | None:
        """The fork server, started on first use; None when not used or broken."""
        if self.broken or not self.use_fork_server:
            return None
        if self.server is None:
            self.server = ForkServer(self.learner_env())
        return self.server

    def take(
        self,
        action: CreateUnit,
        slowdown: float,
        token: str,
        compression: str,
        log_path: Path,
        now: float,
    ) -> bool:
        """Make the oldest live spare this unit (it has imported JAX and compiled the train step
        already), with `token`, the unit's own bearer token; False when there is none, and the
        caller starts a fresh process."""
        identity = {
            "unit": action.global_index,
            "unitName": action.name,
            "numUnits": action.num_units,
            "attempt": action.attempt,
            "group": action.group,
            "slowdown": slowdown,
            "token": token,
            "compression": compression,  # the group's own (JSON), "" for the run's
            "log": str(log_path.resolve()),
        }
        line = (json.dumps(identity) + "\n").encode()
        while self.spares:
            key = self.spares.pop(0)
            proc = self.procs.get(key)
            if proc is not None and self.procs.hand_over(key, action.name, line, log_path):
                self.recorder.event(
                    now,
                    "spare-taken",
                    action.name,
                    f"attempt {action.attempt} is warm spare pid {proc.pid}",
                    pid=proc.pid,
                )
                return True
        return False

    def top_up(self, now: float, run_over: bool) -> None:
        """Keep `wanted` spares waiting, from the first tick (a spare needs as long as a unit to
        warm up, and the first failure may come soon) until the run is over."""
        self.adopt_forked(now)
        if run_over or self.failures >= MAX_SPARE_FAILURES:
            return
        self.spares = [k for k in self.spares if (p := self.procs.get(k)) is not None and p.alive()]
        while len(self.spares) + len(self.forking) < self.wanted:
            key = f"{SPARE_PREFIX}{self.seq}"
            self.seq += 1
            env = self.learner_env()
            env["DILOCO_NUM_UNITS"] = str(self.num_units)
            args = ["--config", str(self.config), "--standby"]
            server = self.fork_server()
            if server is not None:
                self.forking.append((key, args, server.fork(args, env, self.log_path)))
                continue
            argv = [*self.learner_argv, *args]
            proc = self.procs.spawn(key, argv, env, self.log_path, stdin_pipe=True)
            self.spares.append(key)
            self.recorder.event(
                now, "spare-started", None, f"warm spare pid {proc.pid}", pid=proc.pid
            )

    def fork_unit(
        self, name: str, args: list[str], env: dict[str, str], log_path: Path, first_start: bool
    ) -> bool:
        """Start a unit as a fork of the fork server when it is usable: skips the imports. The
        very first units wait for the server (it imports once instead of each of them); later
        ones only use it when it is ready. False: exec it instead."""
        server = self.fork_server()
        if server is None:
            return False
        if not (server.ready or (first_start and server.wait_ready(FORK_SERVER_START_TIMEOUT))):
            return False
        try:
            child = server.fork(args, env, log_path).result(FORK_TIMEOUT)
        except Exception:  # a broken fork server must not stop the run: exec from now on
            log.exception("unit=fork-failed name=%s", name)
            self.broken = True
            return False
        if child.stdin is not None:
            child.stdin.close()  # a unit reads nothing from the supervisor
        self.procs.adopt(name, [*self.learner_argv, *args, "(forked)"], child, log_path)
        return True

    def adopt_forked(self, now: float) -> None:
        """Spares the fork server has started since the last tick join the process table."""
        waiting = []
        for key, args, future in self.forking:
            if not future.done():
                waiting.append((key, args, future))
                continue
            try:
                child = future.result()
            except Exception as exc:  # the fork server failed: spares come exec'd from now on
                log.exception("spare=fork-failed key=%s", key)
                self.recorder.event(now, "spare-exited", None, f"fork failed: {exc}")
                self.failures += 1
                self.broken = True
                continue
            argv = [*self.learner_argv, *args, "(forked)"]
            self.procs.adopt(key, argv, child, self.log_path)
            self.spares.append(key)
            self.recorder.event(
                now, "spare-started", None, f"warm spare pid {child.pid} (forked)", pid=child.pid
            )
        self.forking = waiting

    def exited(self, key: str, code: int, now: float) -> None:
        if key in self.spares:
            self.spares.remove(key)
        if code != 0:
            self.failures += 1
            self.recorder.event(now, "spare-exited", None, f"warm spare {exit_description(code)}")
            if self.failures >= MAX_SPARE_FAILURES:
                self.recorder.event(
                    now,
                    "spares-disabled",
                    None,
                    f"{self.failures} spares died unused (see logs/spares.log); "
                    "units are started fresh",
                )

    def settle(self, now: float) -> list[str]:
        """Before shutdown: let requested forks finish and register them; the keys of every
        live spare, for the caller to stop with the units."""
        if self.server is not None:
            self.server.finish_pending()
            self.adopt_forked(now)
        return list(self.spares)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

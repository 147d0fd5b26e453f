"""The syncer of a local run as a process: started (and restarted) on a loopback port, polled for
its /v1/status each tick, and given up on when it cannot start.

With `standby`, a second syncer process waits warm on the same port, checkpoint path and lock
file (diloco_trainer/syncer/standby.py). When the serving one dies, the standby has taken over
before the supervisor even notices; the supervisor only renames it `syncer` and starts the next
standby once it serves.

Its first start is watched through its log (startup.py): the start is given up when no new
start-up phase has been logged for `start_timeout` seconds (so a slow but progressing start, say
a long data index and then a long compile, is not cut short), or after `start_limit` seconds in
all, and the message names the phase it was in."""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

from diloco_operator.local.outcome import RunAborted
from diloco_operator.local.processes import ProcessTable
from diloco_operator.local.programs import child_env, exit_description, headline, log_tail
from diloco_operator.local.recorder import Recorder
from diloco_operator.local.startup import StartupWatch
from diloco_operator.local.syncer_client import SyncerClient, free_port
from diloco_operator.planner import SyncerStatus
from diloco_trainer.shards import Shard

SYNCER = "syncer"
STANDBY = "syncer-standby"


def process_keys(shard: Shard) -> tuple[str, str]:
    """The process keys of a shard's serving syncer and its standby: `syncer` and
    `syncer-standby` for shard 0 (the unsharded syncer's), `syncer-<i>` and
    `syncer-<i>-standby` for the others."""
    if shard.index == 0:
        return SYNCER, STANDBY
    return f"{SYNCER}-{shard.index}", f"{SYNCER}-{shard.index}-standby"


def default_start_limit(start_timeout: float) -> float:
    """How long a first start may take in all while it keeps logging new phases: 15 minutes, or
    five times the stall timeout when that is longer (a user who raised the timeout for one slow
    phase still has room for the others)."""
    return max(900.0, 5 * start_timeout)


class SyncerProcess:
    """`healthy`: it answered the last poll. `report`: its status as the planner sees it (None
    while the process is down). `last_status`: the last status it served, kept while it is down
    (the display's and the report's)."""

    def __init__(
        self,
        procs: ProcessTable,
        recorder: Recorder,
        *,
        argv: tuple[str, ...],
        config: Path,
        checkpoint_dir: Path | str,
        logs_dir: Path,
        roster: dict[str, str],
        max_restarts: int,
        start_timeout: float,
        start_limit: float | None = None,
        standby: bool = False,
        shard: Shard | None = None,
        token: str | None = None,
    ) -> None:
        """`start_timeout`: the longest a first start may go without a new phase line;
        `start_limit`: the longest it may take in all (None: `default_start_limit`).
        `shard`: the syncer shard this process serves (None: the whole model); `token`: the
        run secret the shards share (None: a new one)."""
        self.procs = procs
        self.recorder = recorder
        self.argv_prefix = argv
        self.config = config
        self.checkpoint_dir = checkpoint_dir
        self.shard = shard or Shard()
        self.key, self.standby_key = process_keys(self.shard)
        self.log_path = logs_dir / f"{self.key}.log"
        self.logs_dir = logs_dir
        self.standbys = 0  # standbys started: each logs to <standby key>-<n>.log
        self.lock_path = logs_dir / f"{self.key}.lock" if standby else None
        self.peers: list[str] = []  # every shard's address, shard 0's first (SyncerShards)
        self.takeovers = 0
        # The units the syncer admits (trainer's syncer/roster.py): no other name, whatever
        # the run secret would vouch for.
        self.units_file = logs_dir / "units.json"
        logs_dir.mkdir(parents=True, exist_ok=True)
        self.units_file.write_text(json.dumps({"revision": 1, "units": roster}))
        self.max_restarts = max_restarts
        self.start_timeout = start_timeout
        self.start_limit = (
            start_limit if start_limit is not None else default_start_limit(start_timeout)
        )
        self.startup: StartupWatch | None = None  # the serving syncer's latest start
        self.token = token or secrets.token_urlsafe(24)
        self.port = free_port()
        self.client = SyncerClient(f"http://127.0.0.1:{self.port}", self.token)
        self.ever_healthy = False
        self.restarts = 0
        self.healthy = False
        self.report: SyncerStatus | None = None
        self.last_status: SyncerStatus | None = None

    @property
    def what(self) -> str:
        """How events name it: `syncer`, or `syncer shard i/S`."""
        return f"syncer shard {self.shard}" if self.shard.sharded else "syncer"

    def alive(self) -> bool:
        proc = self.procs.get(self.key)
        return proc is not None and proc.alive()

    def start(self, now: float) -> None:
        """Start it, or restart it after it died; a no-op while it runs."""
        current = self.procs.get(self.key)
        if current is not None and current.alive():
            return
        restarting = current is not None
        if restarting:
            self.restarts += 1
            if self.restarts > self.max_restarts:
                raise RunAborted(f"the {self.what} died {self.restarts} times; giving up")
        self.startup = StartupWatch.from_end(self.log_path, time.monotonic())
        self._spawn(self.key, self.log_path)
        self.healthy = False
        kind = "syncer-restarted" if restarting else "syncer-started"
        self.recorder.event(now, kind, self.key, f"{self.what} on port {self.port}")
        self.recorder.state(now, self.key, "starting")

    def _spawn(self, key: str, log_path: Path) -> None:
        argv = [*self.argv_prefix, "--config", str(self.config), "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "--checkpoint-dir", str(self.checkpoint_dir)]
        if self.lock_path is not None:
            argv += ["--lock", str(self.lock_path)]
        env = child_env(dict(os.environ))
        env["DILOCO_TOKEN"] = self.token  # the run secret; each unit gets unit_token(secret, name)
        env["DILOCO_UNITS_FILE"] = str(self.units_file)
        if self.shard.sharded:
            env["DILOCO_SYNCER_SHARD"] = str(self.shard)
            env["DILOCO_SYNCER_PEERS"] = ",".join(self.peers)
        self.procs.spawn(key, argv, env, log_path)

    def top_up_standby(self, now: float, run_over: bool) -> None:
        """Start a standby once the serving syncer serves (not before: the two would compete
        for the CPU while the run starts), unless one waits already."""
        if self.lock_path is None or run_over or not self.healthy:
            return
        standby = self.procs.get(self.standby_key)
        if standby is None or not standby.alive():
            self.standbys += 1
            log_path = self.logs_dir / f"{self.standby_key}-{self.standbys}.log"
            self._spawn(self.standby_key, log_path)
            self.recorder.event(
                now, "syncer-standby-started", self.standby_key, f"logs to {log_path.name}"
            )

    def standby_exited(self, code: int, now: float) -> None:
        self.recorder.event(now, "syncer-standby-exited", self.standby_key, exit_description(code))

    def exited(self, code: int, now: float) -> None:
        """The process exited: a syncer that never served means the run cannot start. A
        standby, if one waits, is serving already (or is about to): it becomes `syncer`."""
        standby = self.procs.get(self.standby_key)
        if self.ever_healthy and standby is not None and standby.alive():
            self.recorder.event(now, "syncer-exited", self.key, exit_description(code))
            self.restarts += 1
            if self.restarts > self.max_restarts:
                raise RunAborted(f"the {self.what} died {self.restarts} times; giving up")
            self.procs.rename(self.standby_key, self.key)
            self.takeovers += 1
            self.healthy = False
            self.recorder.event(now, "syncer-standby-took-over", self.key, f"pid {standby.pid}")
            return
        self.recorder.state(now, self.key, "offline")
        if not self.ever_healthy:
            path = self.log_path
            raise RunAborted(
                f"the {self.what} failed to start ({exit_description(code)}){self._died_in()}: "
                f"{headline(path, 'diloco-syncer:')}\nlast lines of {path}:\n{log_tail(path)}"
            )
        self.recorder.event(now, "syncer-exited", self.key, exit_description(code))

    def poll(self, now: float) -> None:
        proc = self.procs.get(self.key)
        alive = proc is not None and proc.alive()
        status = self.client.status() if alive else None
        self.healthy = status is not None
        if status is not None:
            if not self.ever_healthy:
                self.recorder.event(
                    now, "syncer-ready", self.key, f"serving on {self.client.base_url}"
                )
            self.ever_healthy = True
            self.recorder.state(now, self.key, "online")
            self.report = self.last_status = status
            self.recorder.observe_status(now, status)
        elif alive and not self.ever_healthy and proc is not None:
            self._check_start(proc.started_at)
        if not alive:
            self.report = None  # the planner must not act on a dead syncer's last word

    def _check_start(self, started_at: float) -> None:
        """RunAborted naming the phase the start is in once it has stalled or run out of time."""
        if self.startup is None:
            return
        now = time.monotonic()
        self.startup.poll(now)
        waited = now - started_at
        quiet = now - max(started_at, self.startup.last_change)
        if quiet > self.start_timeout:
            why = f"no new start-up phase for {quiet:.0f}s"
        elif waited > self.start_limit:
            why = f"the start-up limit is {self.start_limit:.0f}s"
        else:
            return
        raise RunAborted(
            f"the {self.what} did not serve /v1/status within {waited:.0f}s: "
            f"{self.startup.describe(now)}; {why} (log: {self.log_path}); its last lines:\n"
            f"{log_tail(self.log_path)}"
        )

    def _died_in(self) -> str:
        if self.startup is None:
            return ""
        now = time.monotonic()
        self.startup.poll(now)
        current = self.startup.current
        return f" in phase {current.name!r} after {now - current.since:.0f}s" if current else ""

    def refresh(self) -> SyncerStatus | None:
        """Ask for its status outside a tick (after the budget); kept as `last_status`."""
        status = self.client.status()
        if status is not None:
            self.last_status = status
        return status

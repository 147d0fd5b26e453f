"""The local process backend: a DilocoRun on one machine, supervised by the operator's planner.

Each tick (~0.5 s) the runtime observes its processes and the syncer's /v1/status, maps them to
the planner's neutral types (ObservedUnit, ObservedSyncer, SyncerReport), asks the same pure
planner the Kubernetes backend uses what to do, and applies the actions with processes: a unit
is a learner process (group), the syncer is a process on a loopback port. Chaos faults are
delivered between ticks; the live display and the recorder see every tick.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from diloco_operator.api import DilocoRunStatus
from diloco_operator.local.chaos import ChaosScheduler, ChaosSettings, Fault
from diloco_operator.local.display import UnitRow, View, render
from diloco_operator.local.forkserver import ForkedChild, ForkServer
from diloco_operator.local.manifest import LocalRun
from diloco_operator.local.processes import ProcessTable
from diloco_operator.local.recorder import Event, Recorder
from diloco_operator.local.report import write_report
from diloco_operator.local.syncer_client import SyncerClient, free_port
from diloco_operator.planner import (
    Action,
    CreateSyncer,
    CreateUnit,
    DeleteUnit,
    EmitEvent,
    ObservedSyncer,
    ObservedUnit,
    SyncerReport,
    UnitSlot,
    desired_units,
    plan,
)
from diloco_operator.planner.model import PROCESS_EXITED
from diloco_trainer.auth import unit_token
from rich.console import Console
from rich.live import Live

log = logging.getLogger(__name__)

SYNCER = "syncer"
# Keys of warm spare learners (a ':' never appears in a unit name, so no clash).
SPARE_PREFIX = "spare:"
# Spares that die before being used, after which the runtime stops starting them.
MAX_SPARE_FAILURES = 3
# Exit code of both programs for a config error (docs/contracts.md): restarting cannot help.
CONFIG_ERROR_EXIT = 2
# The fork server imports JAX once at the start (seconds; more while the syncer starts too).
FORK_SERVER_START_TIMEOUT = 60.0
# Once it is ready a fork takes milliseconds; this only bounds a broken server.
FORK_TIMEOUT = 10.0
# A learner busy in an XLA compile can take seconds to act on SIGTERM; then it gets SIGKILL.
UNIT_STOP_GRACE = 5.0
# How long a complete run waits for the syncer's final evaluation (finalLoss) before stopping it;
# the syncer settles in-flight merges for at most 2 s, then runs one eval (seconds on a CPU).
FINAL_EVAL_WAIT = 60.0
# Planner event reasons under the names the report counts (others keep their reason).
EVENT_KINDS = {
    "UnitOffline": "unit-failed",
    "UnitRecreated": "unit-restarted",
    "UnitOnline": "unit-online",
    "RestartBudgetSpent": "unit-given-up",
}


class RunAborted(Exception):
    """The run cannot go on (bad config seen by a program, syncer cannot start); the message is
    for the user."""


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the supervisor."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


LEARNER_ARGV = (sys.executable, "-m", "diloco_trainer.learner_main")


@dataclass(frozen=True)
class RunOptions:
    report_dir: Path
    chaos: ChaosSettings = field(default_factory=ChaosSettings)
    max_seconds: float | None = None
    tick_seconds: float = 0.5
    live: bool = True
    checkpoint_dir: Path | None = None  # None: a fresh one under report_dir
    syncer_start_timeout: float = 120.0
    stop_grace_seconds: float = 5.0
    max_syncer_restarts: int = 50
    # Warm spare learners kept waiting (imported, compiled) to take over a recreated unit.
    spare_learners: int = 1
    # Fork learners (units and spares) from a process that imported JAX once (forkserver.py)
    # instead of exec'ing each; only for the default learner program, whose imports it knows.
    fork_server: bool = True
    # Argv prefix of the two programs; default: this interpreter's modules (same venv).
    syncer_argv: tuple[str, ...] = (sys.executable, "-m", "diloco_trainer.syncer_main")
    learner_argv: tuple[str, ...] = LEARNER_ARGV


@dataclass
class RunResult:
    complete: bool
    exit_reason: str
    report_dir: Path
    summary: dict[str, Any]


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:])


def headline(path: Path, prefix: str) -> str:
    """The last line of a log starting with `prefix` (a program's own error summary)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    found = [line for line in lines if line.startswith(prefix)]
    return found[-1] if found else "(no error line in its log)"


def child_env(base: dict[str, str]) -> dict[str, str]:
    """Environment of every child: JAX on CPU with one intra-op thread unless the user chose
    otherwise, so N learners on a small machine share cores instead of fighting over them."""
    env = dict(base)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    xla = env.get("XLA_FLAGS", "")
    if "intra_op_parallelism_threads" not in xla:
        env["XLA_FLAGS"] = (
            xla + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        ).strip()
    return env


class LocalRuntime:
    def __init__(self, run: LocalRun, options: RunOptions, console: Console | None = None) -> None:
        self.run = run
        self.opts = options
        self.console = console or Console(stderr=True)
        self.report_dir = options.report_dir
        self.logs_dir = self.report_dir / "logs"
        self.checkpoint_dir = options.checkpoint_dir or (self.report_dir / "checkpoints")
        self.procs = ProcessTable()
        self.token = secrets.token_urlsafe(24)
        self.port = free_port()
        self.client = SyncerClient(f"http://127.0.0.1:{self.port}", self.token)
        self.slots: list[UnitSlot] = desired_units(run.name, run.spec)
        self.slowdown = {g.name: g.slowdown for g in run.spec.unit_groups}
        self.chaos = ChaosScheduler(options.chaos)
        self.status = DilocoRunStatus()
        self.started_at = time.time()
        self.recorder = Recorder(self.started_at, self.report_dir / "events.jsonl")
        if not options.live:
            self.recorder.on_event = self._print_event
        self.unit_started: dict[str, float] = {}
        self.attempts: dict[str, int] = {}
        self.exit_codes: dict[str, int] = {}
        self.syncer_ever_healthy = False
        self.syncer_restarts = 0
        self.syncer_healthy = False
        self.report: SyncerReport | None = None
        self.last_status: dict[str, Any] | None = None
        self.resume_at: dict[str, float] = {}
        self.ready: set[str] = set()
        self.signals: list[int] = []
        self.killed: set[str] = set()
        self.spares: list[str] = []  # keys of live spares, oldest first
        self.fork_server: ForkServer | None = None
        self.fork_broken = False
        # Spares requested from the fork server and not started yet: key, learner args, future.
        self.spare_forks: list[tuple[str, list[str], Future[ForkedChild]]] = []
        self.spare_seq = 0
        self.spare_failures = 0
        self.requeue_after: float | None = None
        self.budget_reached_at: float | None = None
        self.final_eval_loss: float | None = None

    # --- process actions ------------------------------------------------------------------

    def _start_syncer(self, now: float) -> None:
        current = self.procs.get(SYNCER)
        if current is not None and current.alive():
            return
        restarting = current is not None
        if restarting:
            self.syncer_restarts += 1
            if self.syncer_restarts > self.opts.max_syncer_restarts:
                raise RunAborted(f"the syncer died {self.syncer_restarts} times; giving up")
        argv = [
            *self.opts.syncer_argv,
            "--config",
            str(self.run.path.resolve()),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--checkpoint-dir",
            str(self.checkpoint_dir),
        ]
        env = child_env(dict(os.environ))
        env["DILOCO_TOKEN"] = self.token
        env["DILOCO_MAX_UNITS"] = str(self.run.spec.total_units)
        self.procs.spawn(SYNCER, argv, env, self.logs_dir / "syncer.log")
        self.syncer_healthy = False
        kind = "syncer-restarted" if restarting else "syncer-started"
        self.recorder.event(now, kind, SYNCER, f"syncer on port {self.port}")
        self.recorder.state(now, SYNCER, "starting")

    def _learner_env(self) -> dict[str, str]:
        env = child_env(dict(os.environ))
        env.update({"DILOCO_SYNCER_ADDR": self.client.base_url})  # no token: spares get theirs
        return env

    def _start_unit(self, action: CreateUnit, now: float) -> None:
        proc = self.procs.get(action.name)
        if proc is not None and proc.alive():
            return  # idempotent: the planner may ask again before it observes the process
        slowdown = self.slowdown.get(action.group, 1.0)
        log_path = self.logs_dir / f"{action.name}.log"
        if not self._hand_to_spare(action, slowdown, log_path, now):
            env = self._learner_env()
            env.update(
                {
                    "DILOCO_UNIT": str(action.global_index),
                    "DILOCO_UNIT_NAME": action.name,
                    "DILOCO_NUM_UNITS": str(action.num_units),
                    "DILOCO_ATTEMPT": str(action.attempt),
                    "DILOCO_GROUP": action.group,
                    "DILOCO_SLOWDOWN": f"{slowdown:g}",
                    "DILOCO_TOKEN": unit_token(self.token, action.name),
                }
            )
            args = ["--config", str(self.run.path.resolve())]
            if not self._fork_unit(action.name, args, env, log_path):
                self.procs.spawn(action.name, [*self.opts.learner_argv, *args], env, log_path)
        self.attempts[action.name] = action.attempt
        self.ready.discard(action.name)
        self.exit_codes.pop(action.name, None)
        self.unit_started.setdefault(action.name, now)

    # --- warm spares --------------------------------------------------------------------------

    def _hand_to_spare(
        self, action: CreateUnit, slowdown: float, log_path: Path, now: float
    ) -> bool:
        """Make the oldest live spare this unit (it has imported JAX and compiled the train step
        already); False when there is none, and the caller starts a fresh process."""
        identity = {
            "unit": action.global_index,
            "unitName": action.name,
            "numUnits": action.num_units,
            "attempt": action.attempt,
            "group": action.group,
            "slowdown": slowdown,
            "token": unit_token(self.token, action.name),
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

    def _top_up_spares(self, now: float) -> None:
        """Keep `spare_learners` spares waiting, from the first tick (a spare needs as long as a
        unit to warm up, and the first failure may come soon) until the run is over."""
        self._adopt_forked_spares(now)
        if (
            self.status.phase in ("Succeeded", "Failed")
            or self.spare_failures >= MAX_SPARE_FAILURES
        ):
            return
        self.spares = [k for k in self.spares if (p := self.procs.get(k)) is not None and p.alive()]
        while len(self.spares) + len(self.spare_forks) < self.opts.spare_learners:
            key = f"{SPARE_PREFIX}{self.spare_seq}"
            self.spare_seq += 1
            env = self._learner_env()
            env["DILOCO_NUM_UNITS"] = str(self.run.spec.total_units)
            args = ["--config", str(self.run.path.resolve()), "--standby"]
            server = self._fork_server()
            if server is not None:
                future = server.fork(args, env, self.logs_dir / "spares.log")
                self.spare_forks.append((key, args, future))
                continue
            argv = [*self.opts.learner_argv, *args]
            proc = self.procs.spawn(key, argv, env, self.logs_dir / "spares.log", stdin_pipe=True)
            self.spares.append(key)
            self.recorder.event(
                now, "spare-started", None, f"warm spare pid {proc.pid}", pid=proc.pid
            )

    def _fork_unit(self, name: str, args: list[str], env: dict[str, str], log_path: Path) -> bool:
        """Start a unit as a fork of the fork server when it is usable: skips the imports. The
        very first units wait for the server (it imports once instead of each of them); later
        ones only use it when it is ready. False: exec it instead."""
        server = self._fork_server()
        if server is None:
            return False
        first_start = not self.unit_started
        if not (server.ready or (first_start and server.wait_ready(FORK_SERVER_START_TIMEOUT))):
            return False
        try:
            child = server.fork(args, env, log_path).result(FORK_TIMEOUT)
        except Exception:  # a broken fork server must not stop the run: exec from now on
            log.exception("unit=fork-failed name=%s", name)
            self.fork_broken = True
            return False
        if child.stdin is not None:
            child.stdin.close()  # a unit reads nothing from the supervisor
        self.procs.adopt(name, [*self.opts.learner_argv, *args, "(forked)"], child, log_path)
        return True

    def _fork_server(self) -> ForkServer | None:
        if self.fork_broken:
            return None
        default_learner = tuple(self.opts.learner_argv) == LEARNER_ARGV
        if self.fork_server is None and self.opts.fork_server and default_learner:
            self.fork_server = ForkServer(self._learner_env())
        return self.fork_server

    def _adopt_forked_spares(self, now: float) -> None:
        """Spares the fork server has started since the last tick join the process table."""
        waiting = []
        for key, args, future in self.spare_forks:
            if not future.done():
                waiting.append((key, args, future))
                continue
            try:
                child = future.result()
            except Exception as exc:  # the fork server failed: spares come exec'd from now on
                log.exception("spare=fork-failed key=%s", key)
                self.recorder.event(now, "spare-exited", None, f"fork failed: {exc}")
                self.spare_failures += 1
                self.fork_broken = True
                continue
            argv = [*self.opts.learner_argv, *args, "(forked)"]
            self.procs.adopt(key, argv, child, self.logs_dir / "spares.log")
            self.spares.append(key)
            self.recorder.event(
                now, "spare-started", None, f"warm spare pid {child.pid} (forked)", pid=child.pid
            )
        self.spare_forks = waiting

    def _spare_exited(self, key: str, code: int, now: float) -> None:
        if key in self.spares:
            self.spares.remove(key)
        if code != 0:
            self.spare_failures += 1
            self.recorder.event(now, "spare-exited", None, f"warm spare {_signal_name(code)}")
            if self.spare_failures >= MAX_SPARE_FAILURES:
                self.recorder.event(
                    now,
                    "spares-disabled",
                    None,
                    f"{self.spare_failures} spares died unused (see logs/spares.log); "
                    "units are started fresh",
                )

    def _delete_units(self, names: list[str]) -> None:
        """Stop the units' process groups together; afterwards they are Missing to the planner."""
        self.procs.stop(names, grace_seconds=UNIT_STOP_GRACE)
        for name in names:
            self.killed.discard(name)
            self.resume_at.pop(name, None)
            self.exit_codes.pop(name, None)
            self._forget(name)

    def _forget(self, name: str) -> None:
        """After a delete the unit is Missing to the planner until it is created again."""
        self.attempts.pop(name, None)
        self.ready.discard(name)

    def apply(self, actions: Sequence[Action], now: float) -> None:
        # Deletes first and together (one grace period for all), then creates and events; a
        # plan never creates and deletes the same unit in one pass.
        self._delete_units([a.name for a in actions if isinstance(a, DeleteUnit)])
        for action in actions:
            if isinstance(action, CreateSyncer):
                self._start_syncer(now)
            elif isinstance(action, CreateUnit):
                self._start_unit(action, now)
            elif isinstance(action, EmitEvent):
                kind = EVENT_KINDS.get(action.reason, action.reason)
                self.recorder.event(now, kind, action.unit, action.message, type=action.type)
                log.info("event=%s unit=%s message=%r", action.reason, action.unit, action.message)

    # --- observation ----------------------------------------------------------------------

    def observe_units(self, now: float) -> list[ObservedUnit]:
        observed: list[ObservedUnit] = []
        heard = self.report.learners if self.report else {}
        for slot in self.slots:
            proc = self.procs.get(slot.name)
            if proc is None or slot.name not in self.attempts:
                continue  # Missing
            attempt = self.attempts[slot.name]
            unit = partial(ObservedUnit, slot.name, slot.group, slot.index, attempt)
            code = self.exit_codes.get(slot.name)
            if code is None and slot.name in self.killed:
                # We sent SIGKILL: a failure signal even if the process is not reaped yet (a
                # process can take a while to die, e.g. threads stuck in the kernel).
                observed.append(
                    unit(
                        "Running",
                        failure=PROCESS_EXITED,
                        message="learner process killed by SIGKILL (chaos)",
                        since=proc.started_at,
                    )
                )
            elif code is None:
                learner = heard.get(slot.name)
                if learner is not None and learner.attempt == attempt:
                    # Ready once the syncer has heard from this attempt; it stays ready while
                    # the process lives (a restarting syncer forgets learners for a while).
                    self.ready.add(slot.name)
                observed.append(
                    unit("Running", ready=slot.name in self.ready, since=proc.started_at)
                )
            elif code == 0:
                observed.append(unit("Succeeded"))
            else:
                observed.append(
                    unit(
                        "Failed",
                        failure=PROCESS_EXITED,
                        message=f"learner process {_signal_name(code)}",
                    )
                )
        return observed

    def _poll_processes(self, now: float) -> None:
        for key, code in self.procs.poll().items():
            if key == SYNCER:
                self.recorder.state(now, SYNCER, "offline")
                if not self.syncer_ever_healthy:
                    path = self.logs_dir / "syncer.log"
                    raise RunAborted(
                        f"the syncer failed to start ({_signal_name(code)}): "
                        f"{headline(path, 'diloco-syncer:')}\nlast lines of {path}:\n{log_tail(path)}"
                    )
                self.recorder.event(now, "syncer-exited", SYNCER, _signal_name(code))
                continue
            if key.startswith(SPARE_PREFIX):
                self._spare_exited(key, code, now)
                continue
            self.exit_codes[key] = code
            if code == CONFIG_ERROR_EXIT:
                path = self.logs_dir / f"{key}.log"
                raise RunAborted(
                    f"learner {key} rejected the config (exit 2); last lines of {path}:\n{log_tail(path)}"
                )
            if code != 0:
                self.recorder.event(now, "unit-exited", key, _signal_name(code), code=code)

    def _poll_syncer(self, now: float) -> None:
        proc = self.procs.get(SYNCER)
        alive = proc is not None and proc.alive()
        status = self.client.status() if alive else None
        self.syncer_healthy = status is not None
        if status is not None:
            if not self.syncer_ever_healthy:
                self.recorder.event(
                    now, "syncer-ready", SYNCER, f"serving on {self.client.base_url}"
                )
            self.syncer_ever_healthy = True
            self.recorder.state(now, SYNCER, "online")
            self.last_status = status
            self.report = SyncerReport.from_json(status)
            self.recorder.observe_status(now, status)
        elif alive and not self.syncer_ever_healthy and proc is not None:
            waited = time.monotonic() - proc.started_at
            if waited > self.opts.syncer_start_timeout:
                path = self.logs_dir / "syncer.log"
                raise RunAborted(
                    f"the syncer did not serve /v1/status within {waited:.0f}s; last lines of "
                    f"{path}:\n{log_tail(path)}"
                )
        if not alive:
            self.report = None

    # --- chaos ------------------------------------------------------------------------------

    def _deliver(self, fault: Fault, now: float) -> None:
        if fault.kind == "kill-syncer":
            if self.procs.signal(SYNCER, signal.SIGKILL):
                self.recorder.event(now, "chaos-kill-syncer", SYNCER, "SIGKILL to the syncer")
            return
        slot = self.slots[fault.unit] if fault.unit is not None else None
        if slot is None:
            return
        if fault.kind == "kill":
            if self.procs.signal(slot.name, signal.SIGKILL):
                self.killed.add(slot.name)
                self.resume_at.pop(slot.name, None)
                self.recorder.event(now, "chaos-kill", slot.name, "SIGKILL")
        elif (
            fault.kind == "pause"
            and fault.resume_at is not None
            and self.procs.signal(slot.name, signal.SIGSTOP)
        ):
            wall_resume = now + (fault.resume_at - fault.at)
            self.resume_at[slot.name] = wall_resume
            self.recorder.pause(slot.name, now, wall_resume)
            self.recorder.event(
                now, "chaos-pause", slot.name, f"SIGSTOP for {fault.resume_at - fault.at:g}s"
            )

    def _chaos(self, now: float) -> None:
        for name, when in list(self.resume_at.items()):
            if now >= when:
                del self.resume_at[name]
                if self.procs.signal(name, signal.SIGCONT):
                    self.recorder.event(now, "chaos-resume", name, "SIGCONT")
        if not self.opts.chaos.enabled:
            return
        online = {u.name for u in self.status.units if u.state == "Online"}
        running = [
            s.global_index
            for s in self.slots
            if s.name in online
            and s.name not in self.resume_at
            and s.name not in self.killed
            and (p := self.procs.get(s.name)) is not None
            and p.alive()
        ]
        for fault in self.chaos.due(now - self.started_at, running):
            self._deliver(fault, now)

    # --- display ----------------------------------------------------------------------------

    def _unit_state(self, name: str, planned: str) -> str:
        proc = self.procs.get(name)
        if proc is not None and proc.paused and proc.alive():
            return "paused"
        return {"Recreating": "restarting", "Completed": "complete"}.get(planned, planned.lower())

    def view(self, now: float) -> View:
        rows: list[UnitRow] = []
        learners = (self.last_status or {}).get("learners") or {}
        by_name = {u.name: u for u in self.status.units}
        for slot in self.slots:
            unit = by_name.get(slot.name)
            entry = learners.get(slot.name)
            info: dict[str, Any] = entry if isinstance(entry, dict) else {}
            rows.append(
                UnitRow(
                    name=slot.name,
                    group=slot.group,
                    state=self._unit_state(slot.name, unit.state if unit else "Pending"),
                    attempt=unit.attempt if unit else 0,
                    restarts=unit.restarts if unit else 0,
                    step=info.get("step"),
                    tokens_per_sec=info.get("tokensPerSec"),
                    loss=info.get("loss"),
                    slowdown=self.slowdown.get(slot.group, 1.0),
                )
            )
        st = self.last_status or {}
        training = self.run.spec.training
        nxt = self.chaos.next_fault_at()
        chaos = "off"
        if self.opts.chaos.enabled:
            chaos = "on" + (
                f", next fault in {max(0.0, nxt - (now - self.started_at)):.0f}s" if nxt else ""
            )
        return View(
            run=self.run.name,
            elapsed=now - self.started_at,
            syncer_state="online" if self.syncer_healthy else "offline",
            outer_step=int(st.get("outerStep") or 0),
            steps=int(st.get("steps") or 0),
            tokens=int(st.get("tokens") or 0),
            token_budget=training.total_tokens,
            step_budget=training.total_steps,
            loss=st.get("loss"),
            train_loss=st.get("trainLoss"),
            units=rows,
            events=self.recorder.events[-8:],
            chaos=chaos,
            report_dir=str(self.report_dir),
        )

    def _note_signal(self, signum: int, frame: Any) -> None:
        self.signals.append(signum)

    def _print_event(self, ev: Event) -> None:
        """Plain output (no terminal): one key=value line per event."""
        self.console.print(
            f"elapsed={ev.time - self.started_at:.1f} event={ev.kind} unit={ev.unit or '-'} "
            f"message={ev.message!r}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )

    # --- main loop --------------------------------------------------------------------------

    def tick(self, now: float) -> bool:
        """One observe-plan-act pass; True once the run is complete."""
        self._poll_processes(now)
        self._poll_syncer(now)
        proc = self.procs.get(SYNCER)
        observed_syncer = ObservedSyncer(
            present=proc is not None and proc.alive(), ready=self.syncer_healthy
        )
        result = plan(
            self.run.name,
            self.run.spec,
            self.observe_units(now),
            self.status,
            now,
            syncer=observed_syncer,
            report=self.report,
        )
        self.status = result.status
        self.requeue_after = result.requeue_after
        self.apply(result.actions, now)
        self._top_up_spares(now)
        for unit in self.status.units:
            self.recorder.state(now, unit.name, self._unit_state(unit.name, unit.state))
        self._chaos(now)
        return self.status.phase == "Succeeded"

    def execute(self, on_tick: Callable[[View], None] | None = None) -> RunResult:
        self.report_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        # The handler only notes the signal; the loop acts on it between ticks, so a signal
        # can never land between starting a process and registering it (an orphan).
        previous = {
            sig: signal.signal(sig, self._note_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        complete = False
        reason = "unknown"
        aborted: RunAborted | None = None
        try:
            self._fork_server()  # starts importing now, alongside the syncer's start
            with (
                Live(
                    console=self.console, refresh_per_second=4, transient=False, auto_refresh=False
                )
                if self.opts.live
                else _NoLive() as live
            ):
                complete, reason = self._loop(live, on_tick)
        except Interrupted as exc:
            reason = f"interrupted by {exc}"
            self.recorder.event(time.time(), "interrupted", None, reason)
        except RunAborted as exc:
            reason = f"aborted: {exc}"
            self.recorder.event(time.time(), "aborted", None, str(exc))
            aborted = exc
        finally:
            # Ignore further Ctrl-C while stopping, so shutdown itself is never cut short.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                self.shutdown()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        ended = time.time()
        summary = write_report(
            self.recorder,
            self.report_dir,
            run_name=self.run.name,
            ended_at=ended,
            complete=complete,
            unit_started=self.unit_started,
            exit_reason=reason,
            budget_reached_at=self.budget_reached_at if complete else None,
            final_eval_loss=self.final_eval_loss if complete else None,
        )
        self.recorder.close()
        if aborted is not None:
            raise aborted
        return RunResult(
            complete=complete, exit_reason=reason, report_dir=self.report_dir, summary=summary
        )

    def _loop(self, live: Any, on_tick: Callable[[View], None] | None) -> tuple[bool, str]:
        self.recorder.event(
            self.started_at,
            "run-started",
            None,
            f"{len(self.slots)} units, chaos {'on' if self.opts.chaos.enabled else 'off'}",
        )
        self._start_syncer(time.time())
        while True:
            if self.signals:
                raise Interrupted(self.signals[0])
            now = time.time()
            if self.tick(now):
                self.budget_reached_at = now
                self.recorder.event(
                    now, "run-complete", None, "the syncer reports the budget reached"
                )
                self._finish_learners(now)
                self._await_final_eval(live, on_tick)
                return True, "complete"
            view = self.view(now)
            live.update(render(view), refresh=True)
            if on_tick is not None:
                on_tick(view)
            if self.opts.max_seconds is not None and now - self.started_at > self.opts.max_seconds:
                return False, f"stopped after --max-seconds {self.opts.max_seconds:g}"
            # The next pass comes sooner when the plan asks (e.g. a unit that ran healthily is
            # recreated as soon as it is gone) or a child exits (the Kubernetes backend is woken
            # by watch events the same way).
            wait = self.opts.tick_seconds
            if self.requeue_after is not None:
                wait = min(wait, max(0.0, self.requeue_after))
            while not self.signals and time.time() - now < wait and not self.procs.any_exited():
                time.sleep(0.05)

    def _finish_learners(self, now: float) -> None:
        """Learners exit 0 on their own once the syncer reports completion; give them a moment,
        then record the final state."""
        deadline = time.time() + 10.0
        while time.time() < deadline:
            self.procs.poll()
            if not any((p := self.procs.get(s.name)) is not None and p.alive() for s in self.slots):
                break
            time.sleep(0.2)
        final = self.client.status()
        if final is not None:
            self.recorder.observe_status(time.time(), final)
            self.last_status = final
        for slot in self.slots:
            self.recorder.state(time.time(), slot.name, "complete")

    def _await_final_eval(self, live: Any, on_tick: Callable[[View], None] | None) -> None:
        """The syncer evaluates the global model once more when the budget is reached; wait (at
        most FINAL_EVAL_WAIT) for that `finalLoss` before the syncer is stopped. A syncer without
        the field (older), without an eval function or whose evaluation failed is not waited for."""
        started = time.time()
        self.recorder.event(
            started, "final-eval-waiting", SYNCER, "waiting for the syncer's final evaluation"
        )
        outcome = f"no final evaluation within {FINAL_EVAL_WAIT:g}s"
        while not self.signals and time.time() - started < FINAL_EVAL_WAIT:
            proc = self.procs.get(SYNCER)
            if proc is None or not proc.alive():
                outcome = "the syncer is gone"
                break
            status = self.client.status()
            if status is not None:
                self.last_status = status
                state = status.get("finalEval")
                loss = status.get("finalLoss")
                if isinstance(loss, int | float) and not isinstance(loss, bool):
                    self.final_eval_loss = float(loss)
                    self.recorder.observe_status(time.time(), status)
                    self.recorder.event(
                        time.time(),
                        "final-eval",
                        SYNCER,
                        f"final eval loss {loss:.4f} after {time.time() - started:.1f}s",
                        loss=float(loss),
                    )
                    return
                if state not in ("waiting", "running"):
                    outcome = f"the syncer reports finalEval={state}"
                    break
            view = self.view(time.time())
            live.update(render(view), refresh=True)
            if on_tick is not None:
                on_tick(view)
            time.sleep(0.2)
        self.recorder.event(time.time(), "final-eval-missing", SYNCER, outcome)

    def shutdown(self) -> None:
        """Stop learners first, then the syncer (it checkpoints on SIGTERM); prove no child of
        ours is left."""
        for name in list(self.resume_at):
            self.procs.signal(name, signal.SIGCONT)
        self.resume_at.clear()
        if self.fork_server is not None:
            self.fork_server.finish_pending()
            self._adopt_forked_spares(time.time())
        units = [s.name for s in self.slots] + self.spares  # spares die with the units
        self.procs.stop_all(grace_seconds=self.opts.stop_grace_seconds, batches=[units, [SYNCER]])
        if self.fork_server is not None:
            self.fork_server.close()
        left = self.procs.survivors()
        if left:
            log.error("shutdown=incomplete survivors=%s", left)
            raise RuntimeError(f"processes still alive after shutdown: {left}")
        self.recorder.event(time.time(), "stopped", None, "all processes stopped")


class _NoLive:
    """Stand-in for rich.Live when output is not a terminal: no redraws, the events log and
    structured logs tell the story."""

    def __enter__(self) -> _NoLive:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, renderable: Any, refresh: bool = False) -> None:
        return None

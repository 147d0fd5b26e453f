"""The local process backend: a DilocoRun on one machine, supervised by the operator's planner.

Each tick (~0.5 s) the runtime observes its processes (observe.py) and the syncer's /v1/status,
asks the same pure planner the Kubernetes backend uses what to do, and applies the actions with
processes: a unit is a learner process (group), the syncer is a process on a loopback port.
Warm spares come from the spare pool (spares.py), chaos faults are delivered between ticks
(chaos.py), and the live display (display.py) and the recorder see every tick.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from diloco_operator.api import DilocoRunStatus
from diloco_operator.local.chaos import ChaosScheduler, ChaosSettings, FaultDelivery
from diloco_operator.local.display import (
    RunSnapshot,
    View,
    build_view,
    chaos_line,
    event_line,
    unit_state,
)
from diloco_operator.local.finish import Screen, await_final_eval, finish_learners
from diloco_operator.local.manifest import LocalRun
from diloco_operator.local.observe import UnitProcess, observe_units
from diloco_operator.local.outcome import Interrupted, RunAborted, RunOutcome, RunResult
from diloco_operator.local.processes import ProcessTable
from diloco_operator.local.programs import (
    CONFIG_ERROR_EXIT,
    LEARNER_ARGV,
    SYNCER_ARGV,
    child_env,
    exit_description,
    log_tail,
)
from diloco_operator.local.recorder import Event, Recorder
from diloco_operator.local.report import write_report
from diloco_operator.local.spares import SparePool, is_spare
from diloco_operator.local.syncer_process import SyncerProcess
from diloco_operator.local.syncer_shards import SyncerShards
from diloco_operator.planner import (
    Action,
    CreateSyncer,
    CreateUnit,
    DeleteUnit,
    EmitEvent,
    ObservedSyncer,
    UnitSlot,
    desired_units,
    fault_targets,
    plan,
)
from diloco_trainer.auth import unit_token
from diloco_trainer.shards import Shard
from rich.console import Console

__all__ = ["LocalRuntime", "RunAborted", "RunOptions", "RunResult"]

log = logging.getLogger(__name__)

# A learner busy in an XLA compile can take seconds to act on SIGTERM; then it gets SIGKILL.
UNIT_STOP_GRACE = 5.0
# Planner event reasons under the names the report counts (others keep their reason).
EVENT_KINDS = {
    "UnitOffline": "unit-failed",
    "UnitRecreated": "unit-restarted",
    "UnitOnline": "unit-online",
    "RestartBudgetSpent": "unit-given-up",
}


@dataclass(frozen=True)
class RunOptions:
    report_dir: Path
    chaos: ChaosSettings = field(default_factory=ChaosSettings)
    max_seconds: float | None = None
    tick_seconds: float = 0.5
    live: bool = True
    checkpoint_dir: Path | str | None = None  # a gs:// URL, or None: a fresh one under report_dir
    # The syncer's first start is given up when it logs no new start-up phase for this long
    # (syncer_process.py), or when it takes longer than the limit in all (None: 15 minutes, or
    # five times the timeout when that is longer).
    syncer_start_timeout: float = 120.0
    syncer_start_limit: float | None = None
    stop_grace_seconds: float = 5.0
    max_syncer_restarts: int = 50
    # Warm spare learners kept waiting (imported, compiled) to take over a recreated unit.
    spare_learners: int = 1
    # Fork learners (units and spares) from a process that imported JAX once (forkserver.py)
    # instead of exec'ing each; only for the default learner program, whose imports it knows.
    fork_server: bool = True
    # Argv prefix of the two programs; default: this interpreter's modules (same venv).
    syncer_argv: tuple[str, ...] = SYNCER_ARGV
    learner_argv: tuple[str, ...] = LEARNER_ARGV


class LocalRuntime:
    def __init__(self, run: LocalRun, options: RunOptions, console: Console | None = None) -> None:
        self.run = run
        self.opts = options
        self.console = console or Console(stderr=True)
        self.report_dir = options.report_dir
        self.logs_dir = self.report_dir / "logs"
        self.checkpoint_dir: Path | str = options.checkpoint_dir or (
            self.report_dir / "checkpoints"
        )
        self.config = run.path.resolve()
        self.procs = ProcessTable()
        self.slots: list[UnitSlot] = desired_units(run.name, run.spec)
        self.slowdown = dict(run.spec.chaos.slowdown) if run.spec.chaos else {}
        self.status = DilocoRunStatus()
        self.started_at = time.time()
        self.recorder = Recorder(self.started_at, self.report_dir / "events.jsonl")
        if not options.live:
            self.recorder.on_event = self._print_event
        self.syncer = SyncerShards(run.spec.syncer.shards, self._syncer_process)
        self.chaos = FaultDelivery(
            ChaosScheduler(options.chaos),
            self.procs,
            self.recorder,
            self.slots,
            list(self.syncer.keys),
        )
        self.spares = SparePool(
            self.procs,
            self.recorder,
            logs_dir=self.logs_dir,
            config=self.config,
            num_units=run.spec.total_units,
            learner_env=self._learner_env,
            wanted=options.spare_learners,
            fork_server=options.fork_server,
            learner_argv=options.learner_argv,
        )
        self.unit_started: dict[str, float] = {}
        self.attempts: dict[str, int] = {}
        self.exit_codes: dict[str, int] = {}
        self.ready: frozenset[str] = frozenset()
        self.signals: list[int] = []
        self.requeue_after: float | None = None
        self.budget_reached_at: float | None = None
        self.final_eval_loss: float | None = None

    def _syncer_process(self, shard: Shard, token: str | None) -> SyncerProcess:
        options = self.opts
        return SyncerProcess(
            self.procs,
            self.recorder,
            argv=options.syncer_argv,
            config=self.config,
            checkpoint_dir=self.checkpoint_dir,
            logs_dir=self.logs_dir,
            roster={slot.name: slot.group for slot in self.slots},
            max_restarts=options.max_syncer_restarts,
            start_timeout=options.syncer_start_timeout,
            start_limit=options.syncer_start_limit,
            standby=self.run.spec.syncer.standby,
            shard=shard,
            token=token,
        )

    # --- process actions ------------------------------------------------------------------

    def _learner_env(self) -> dict[str, str]:
        """The env every learner shares; no token: each unit gets its own (`unit_token`), a
        spare its unit's in the identity line."""
        env = child_env(dict(os.environ))
        env.update({"DILOCO_SYNCER_ADDR": self.syncer.addresses})
        return env

    def _start_unit(self, action: CreateUnit, now: float) -> None:
        proc = self.procs.get(action.name)
        if proc is not None and proc.alive():
            return  # idempotent: the planner may ask again before it observes the process
        slowdown = self.slowdown.get(action.group, 1.0)
        log_path = self.logs_dir / f"{action.name}.log"
        token = unit_token(self.syncer.token, action.name)
        group = self.run.spec.group(action.group)
        compression = group.compression_json() if group is not None else ""
        if not self.spares.take(action, slowdown, token, compression, log_path, now):
            env = self._learner_env()
            env.update(
                {
                    "DILOCO_UNIT": str(action.global_index),
                    "DILOCO_UNIT_NAME": action.name,
                    "DILOCO_NUM_UNITS": str(action.num_units),
                    "DILOCO_ATTEMPT": str(action.attempt),
                    "DILOCO_GROUP": action.group,
                    "DILOCO_SLOWDOWN": f"{slowdown:g}",
                    "DILOCO_TOKEN": token,
                    **(group.learner_env() if group is not None else {}),
                }
            )
            args = ["--config", str(self.config)]
            first_start = not self.unit_started
            if not self.spares.fork_unit(action.name, args, env, log_path, first_start):
                self.procs.spawn(action.name, [*self.opts.learner_argv, *args], env, log_path)
        self.attempts[action.name] = action.attempt
        self.ready -= {action.name}
        self.exit_codes.pop(action.name, None)
        self.unit_started.setdefault(action.name, now)

    def _delete_units(self, names: list[str]) -> None:
        """Stop the units' process groups together; afterwards they are Missing to the planner
        until they are created again."""
        self.procs.stop(names, grace_seconds=UNIT_STOP_GRACE)
        for name in names:
            self.chaos.forget(name)
            self.exit_codes.pop(name, None)
            self.attempts.pop(name, None)
        self.ready -= set(names)

    def apply(self, actions: Sequence[Action], now: float) -> None:
        # Deletes first and together (one grace period for all), then creates and events; a
        # plan never creates and deletes the same unit in one pass.
        self._delete_units([a.name for a in actions if isinstance(a, DeleteUnit)])
        for action in actions:
            if isinstance(action, CreateSyncer):
                self.syncer.start(now)
            elif isinstance(action, CreateUnit):
                self._start_unit(action, now)
            elif isinstance(action, EmitEvent):
                kind = EVENT_KINDS.get(action.reason, action.reason)
                self.recorder.event(now, kind, action.unit, action.message, type=action.type)
                log.info("event=%s unit=%s message=%r", action.reason, action.unit, action.message)

    # --- observation ----------------------------------------------------------------------

    def _unit_processes(self) -> dict[str, UnitProcess]:
        found = {}
        for name, attempt in self.attempts.items():
            proc = self.procs.get(name)
            if proc is not None:
                code = self.exit_codes.get(name)
                killed = name in self.chaos.killed
                found[name] = UnitProcess(attempt, proc.started_at, code, killed)
        return found

    def _poll_processes(self, now: float) -> None:
        for key, code in self.procs.poll().items():
            if self.syncer.process_exited(key, code, now):
                continue
            if is_spare(key):
                self.spares.exited(key, code, now)
                continue
            self.exit_codes[key] = code
            if code == CONFIG_ERROR_EXIT:
                path = self.logs_dir / f"{key}.log"
                raise RunAborted(
                    f"learner {key} rejected the config (exit 2); last lines of {path}:\n{log_tail(path)}"
                )
            if code != 0:
                self.recorder.event(now, "unit-exited", key, exit_description(code), code=code)

    def _paused(self, names: Sequence[str]) -> set[str]:
        return {n for n in names if (p := self.procs.get(n)) is not None and p.paused and p.alive()}

    def view(self, now: float) -> View:
        elapsed = now - self.started_at
        next_fault = self.chaos.scheduler.next_fault_at()
        snapshot = RunSnapshot(
            run=self.run.name,
            spec=self.run.spec,
            slots=self.slots,
            status=self.status,
            syncer=self.syncer.last_status,
            syncer_online=self.syncer.healthy,
            paused=self._paused([s.name for s in self.slots]),
            slowdown=self.slowdown,
            events=self.recorder.events,
            chaos=chaos_line(self.opts.chaos.enabled, next_fault, elapsed),
            report_dir=str(self.report_dir),
        )
        return build_view(snapshot, elapsed)

    def _print_event(self, ev: Event) -> None:
        line = event_line(ev, self.started_at)
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    # --- main loop --------------------------------------------------------------------------

    def tick(self, now: float) -> bool:
        """One observe-plan-act pass; True once the run is complete."""
        self._poll_processes(now)
        self.syncer.poll(now)
        report = self.syncer.report
        observed, self.ready = observe_units(self.slots, self._unit_processes(), report, self.ready)
        syncer = ObservedSyncer(present=self.syncer.alive(), ready=self.syncer.healthy)
        spec = self.run.spec
        result = plan(
            self.run.name,
            spec,
            observed,
            self.status,
            now,
            syncer=syncer,
            report=report,
            spares=False,
        )
        self.status = result.status
        self.requeue_after = result.requeue_after
        self.apply(result.actions, now)
        run_over = self.status.phase in ("Succeeded", "Failed")
        self.spares.top_up(now, run_over=run_over)
        self.syncer.top_up_standby(now, run_over=run_over)
        paused = self._paused([u.name for u in self.status.units])
        for unit in self.status.units:
            self.recorder.state(now, unit.name, unit_state(unit.state, unit.name in paused))
        targets = fault_targets(self.status.units, report, spec.failure_policy, now)
        settled = {u.name for u in targets}

        def candidate(name: str) -> bool:
            proc = self.procs.get(name)
            return name in settled and proc is not None and proc.alive()

        self.chaos.step(now, now - self.started_at, candidate, syncer_up=self.syncer.healthy)
        return self.status.phase == "Succeeded"

    def execute(self, on_tick: Callable[[View], None] | None = None) -> RunResult:
        self.report_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        # The handler only notes the signal; the loop acts on it between ticks, so a signal
        # can never land between starting a process and registering it (an orphan).
        previous = {
            sig: signal.signal(sig, lambda signum, _frame: self.signals.append(signum))
            for sig in (signal.SIGINT, signal.SIGTERM)
        }
        aborted: RunAborted | None = None
        try:
            self.spares.fork_server()  # starts importing now, alongside the syncer's start
            with Screen(self.console, self.opts.live, on_tick) as screen:
                outcome = self._loop(screen)
        except Interrupted as exc:
            outcome = RunOutcome.interrupted(exc.signum)
            self.recorder.event(time.time(), "interrupted", None, outcome.reason)
        except RunAborted as exc:
            outcome = RunOutcome.aborted(str(exc))
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
        complete = outcome.ending == "complete"
        summary = write_report(
            self.recorder,
            self.report_dir,
            run_name=self.run.name,
            ended_at=time.time(),
            complete=complete,
            unit_started=self.unit_started,
            exit_reason=outcome.reason,
            budget_reached_at=self.budget_reached_at if complete else None,
            final_eval_loss=self.final_eval_loss if complete else None,
        )
        self.recorder.close()
        if aborted is not None:
            raise aborted
        return RunResult(outcome=outcome, report_dir=self.report_dir, summary=summary)

    def _loop(self, screen: Screen) -> RunOutcome:
        chaos = "on" if self.opts.chaos.enabled else "off"
        message = f"{len(self.slots)} units, chaos {chaos}"
        self.recorder.event(self.started_at, "run-started", None, message)
        self.syncer.start(time.time())
        while True:
            if self.signals:
                raise Interrupted(self.signals[0])
            now = time.time()
            if self.tick(now):
                self.budget_reached_at = now
                self.recorder.event(
                    now, "run-complete", None, "the syncer reports the budget reached"
                )
                self._finish(screen)
                return RunOutcome.complete()
            screen.show(self.view(now))
            if self.opts.max_seconds is not None and now - self.started_at > self.opts.max_seconds:
                return RunOutcome.stopped(self.opts.max_seconds)
            # The next pass comes sooner when the plan asks (e.g. a unit that ran healthily is
            # recreated as soon as it is gone) or a child exits (the Kubernetes backend is woken
            # by watch events the same way).
            wait = self.opts.tick_seconds
            if self.requeue_after is not None:
                wait = min(wait, max(0.0, self.requeue_after))
            while not self.signals and time.time() - now < wait and not self.procs.any_exited():
                time.sleep(0.05)

    def _finish(self, screen: Screen) -> None:
        """After the budget: let the learners exit, then wait for the syncer's final eval."""
        final = finish_learners(self.procs, [s.name for s in self.slots], self.syncer.refresh)
        if final is not None:
            self.recorder.observe_status(time.time(), final)
        for slot in self.slots:
            self.recorder.state(time.time(), slot.name, "complete")
        self.final_eval_loss = await_final_eval(
            self.syncer.refresh,
            self.syncer.alive,
            self.recorder,
            lambda: bool(self.signals),
            lambda: screen.show(self.view(time.time())),
            self.syncer.lead.key,
        )

    def shutdown(self) -> None:
        """Stop learners first, then the syncer (it checkpoints on SIGTERM); prove no child of
        ours is left."""
        self.chaos.resume_all()
        spares = self.spares.settle(time.time())
        # Spares die with the units; so does the standby syncer, before the serving one's
        # SIGTERM would hand it the lock.
        units = [s.name for s in self.slots] + spares + list(self.syncer.standby_keys)
        self.procs.stop_all(
            grace_seconds=self.opts.stop_grace_seconds, batches=[units, list(self.syncer.keys)]
        )
        self.spares.close()
        left = self.procs.survivors()
        if left:
            log.error("shutdown=incomplete survivors=%s", left)
            raise RuntimeError(f"processes still alive after shutdown: {left}")
        self.recorder.event(time.time(), "stopped", None, "all processes stopped")

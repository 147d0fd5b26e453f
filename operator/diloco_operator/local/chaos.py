"""Fault delivery for local runs: the schedule's decisions (`diloco_operator.planner.faults`, pure) as
signals to the run's processes. `FaultDelivery` remembers what it did (killed units, paused ones
and when they resume).

- `kill`: SIGKILL a learner unit (the supervisor marks it offline and recreates it, from a warm
  spare when one is ready);
- `pause`: SIGSTOP a unit for `pause_seconds`, then SIGCONT (a straggler);
- `kill-syncer`: SIGKILL the syncer (it restarts from its last checkpoint; learners reconnect).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence

from diloco_operator.local.processes import ProcessTable
from diloco_operator.local.recorder import Recorder
from diloco_operator.planner import UnitSlot
from diloco_operator.planner.faults import (
    DEFAULT_CHAOS,
    FAULT_KINDS,
    ChaosScheduler,
    ChaosSettings,
    Fault,
    FaultKind,
    ScheduledFault,
)


class FaultDelivery:
    """Delivers the scheduler's faults to the run's processes: SIGKILL for kills, SIGSTOP and,
    `pause_seconds` later, SIGCONT for pauses. `syncers`: the process keys of the syncer's
    shards (one unsharded), killed in turn by `kill-syncer`."""

    def __init__(
        self,
        scheduler: ChaosScheduler,
        procs: ProcessTable,
        recorder: Recorder,
        slots: Sequence[UnitSlot],
        syncers: Sequence[str],
    ) -> None:
        self.scheduler = scheduler
        self.procs = procs
        self.recorder = recorder
        self.slots = slots
        self.syncers = list(syncers)
        self.syncer_kills = 0
        self.killed: set[str] = set()  # units sent SIGKILL and not stopped since
        self.resume_at: dict[str, float] = {}  # paused unit -> wall time of its SIGCONT
        self.killed_syncer: int | None = None  # pid of the syncer process last sent SIGKILL

    def step(
        self,
        now: float,
        elapsed: float,
        candidates: Callable[[str], bool],
        syncer_up: bool = True,
    ) -> None:
        """Resume the pauses that are over, then deliver the faults due at `elapsed` seconds
        into the run. `candidates(name)` says whether a unit may be hit (online, alive);
        `syncer_up` whether the syncer serves (a syncer kill waits for it)."""
        for name, when in list(self.resume_at.items()):
            if now >= when:
                del self.resume_at[name]
                if self.procs.signal(name, signal.SIGCONT):
                    self.recorder.event(now, "chaos-resume", name, "SIGCONT")
        if not self.scheduler.settings.enabled:
            return
        running = [
            s.global_index
            for s in self.slots
            if s.name not in self.resume_at and s.name not in self.killed and candidates(s.name)
        ]
        for fault in self.scheduler.due(elapsed, running, syncer_up):
            self.deliver(fault, now)

    def deliver(self, fault: Fault, now: float) -> None:
        if fault.kind == "kill-syncer":
            key = self.syncers[self.syncer_kills % len(self.syncers)]
            proc = self.procs.get(key)
            # Two kills due in one tick would both reach the one process (not yet dead, let
            # alone replaced) and count as two: the second finds it already killed and is
            # dropped, as a kill is while no syncer runs.
            if proc is None or proc.pid == self.killed_syncer:
                return
            if self.procs.signal(key, signal.SIGKILL):
                self.killed_syncer = proc.pid
                self.syncer_kills += 1
                self.recorder.event(now, "chaos-kill-syncer", key, f"SIGKILL to {key}")
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

    def forget(self, name: str) -> None:
        """The unit was stopped: its kill and pause are over."""
        self.killed.discard(name)
        self.resume_at.pop(name, None)

    def resume_all(self) -> None:
        """SIGCONT every paused unit (a stopped process cannot act on SIGTERM)."""
        for name in list(self.resume_at):
            self.procs.signal(name, signal.SIGCONT)
        self.resume_at.clear()


__all__ = [
    "DEFAULT_CHAOS",
    "FAULT_KINDS",
    "ChaosScheduler",
    "ChaosSettings",
    "Fault",
    "FaultDelivery",
    "FaultKind",
    "ScheduledFault",
]

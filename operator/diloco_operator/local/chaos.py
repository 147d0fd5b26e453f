"""Seeded fault injection for local runs: which fault hits which process, and when.

The scheduler (`ChaosScheduler`) is pure: it only decides. Given the same seed, settings and
sequence of `due()` calls (times and running units), it makes the same decisions, so a chaos run
can be replayed. `FaultDelivery` turns its decisions into signals to the run's processes and
remembers what it did (killed units, paused ones and when they resume).

Faults:
- `kill`: SIGKILL a learner unit (the supervisor marks it offline and recreates it, from a warm
  spare when one is ready);
- `pause`: SIGSTOP a unit for `pause_seconds`, then SIGCONT (a straggler);
- `kill-syncer`: SIGKILL the syncer (it restarts from its last checkpoint; learners reconnect).
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from diloco_operator.local.processes import ProcessTable
from diloco_operator.local.recorder import Recorder
from diloco_operator.planner import UnitSlot

FaultKind = Literal["kill", "pause", "kill-syncer"]
FAULT_KINDS: tuple[FaultKind, ...] = ("kill", "pause", "kill-syncer")


@dataclass(frozen=True)
class ScheduledFault:
    """One fault at a fixed time (seconds after chaos starts). `unit` None means a random
    running unit (ignored for kill-syncer)."""

    at: float
    kind: FaultKind
    unit: int | None = None
    pause_seconds: float | None = None


@dataclass(frozen=True)
class ChaosSettings:
    """What faults to inject. Intervals are mean seconds between faults across the whole run;
    gaps are exponentially distributed (faults arrive as a Poisson process), drawn from the
    seeded generator."""

    enabled: bool = False
    seed: int = 0
    start_after_seconds: float = 10.0
    kill_interval_seconds: float | None = None
    pause_interval_seconds: float | None = None
    pause_seconds: float = 5.0
    syncer_kill_interval_seconds: float | None = None
    schedule: tuple[ScheduledFault, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "kill_interval_seconds",
            "pause_interval_seconds",
            "syncer_kill_interval_seconds",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"chaos.{name}: must be > 0, got {value}")
        if self.pause_seconds <= 0:
            raise ValueError(f"chaos.pause_seconds: must be > 0, got {self.pause_seconds}")
        if self.start_after_seconds < 0:
            raise ValueError(
                f"chaos.start_after_seconds: must be >= 0, got {self.start_after_seconds}"
            )


# What `--chaos` turns on when the manifest has no chaos block of its own: enough faults that a
# few-minute demo sees several kills, a straggler and a syncer restart.
DEFAULT_CHAOS = ChaosSettings(
    enabled=True,
    seed=0,
    start_after_seconds=20.0,
    kill_interval_seconds=25.0,
    pause_interval_seconds=60.0,
    pause_seconds=8.0,
    syncer_kill_interval_seconds=90.0,
)


@dataclass(frozen=True)
class Fault:
    """A decision to deliver now. `unit` is the unit index (None for kill-syncer); `resume_at`
    is when a paused unit gets SIGCONT."""

    kind: FaultKind
    unit: int | None
    at: float
    resume_at: float | None = None


@dataclass
class _Stream:
    kind: FaultKind
    interval: float
    next_at: float


@dataclass
class ChaosScheduler:
    """Decides which faults are due. Times are seconds since the run started."""

    settings: ChaosSettings
    _rng: random.Random = field(init=False)
    _streams: list[_Stream] = field(init=False)
    _fixed: list[ScheduledFault] = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.settings.seed)
        s = self.settings
        self._streams = []
        for kind, interval in (
            ("kill", s.kill_interval_seconds),
            ("pause", s.pause_interval_seconds),
            ("kill-syncer", s.syncer_kill_interval_seconds),
        ):
            if s.enabled and interval is not None:
                first = s.start_after_seconds + self._gap(interval)
                self._streams.append(_Stream(kind, interval, first))  # type: ignore[arg-type]
        fixed = [f for f in s.schedule if s.enabled]
        self._fixed = sorted(fixed, key=lambda f: (f.at, FAULT_KINDS.index(f.kind)))

    def _gap(self, interval: float) -> float:
        return self._rng.expovariate(1.0 / interval)

    def due(self, now: float, running_units: Sequence[int]) -> list[Fault]:
        """Faults to deliver at `now`. A unit fault with no running unit to hit waits (it stays
        due) rather than being dropped, so a schedule's count of kills is kept."""
        faults: list[Fault] = []
        targets = sorted(running_units)
        hit: set[int] = set()

        def pick(preferred: int | None) -> int | None:
            free = [u for u in targets if u not in hit]
            if preferred is not None:
                return preferred if preferred in free else None
            return self._rng.choice(free) if free else None

        def make(kind: FaultKind, unit: int | None, pause: float | None = None) -> Fault:
            resume = now + (pause or self.settings.pause_seconds) if kind == "pause" else None
            return Fault(kind=kind, unit=unit, at=now, resume_at=resume)

        while self._fixed and self._fixed[0].at <= now:
            spec = self._fixed[0]
            if spec.kind == "kill-syncer":
                faults.append(make("kill-syncer", None))
            else:
                unit = pick(spec.unit)
                if unit is None:
                    break  # keep order: later fixed faults wait behind this one
                hit.add(unit)
                faults.append(make(spec.kind, unit, spec.pause_seconds))
            self._fixed.pop(0)

        for stream in self._streams:
            if stream.next_at > now:
                continue
            if stream.kind == "kill-syncer":
                faults.append(make("kill-syncer", None))
            else:
                unit = pick(None)
                if unit is None:
                    continue
                hit.add(unit)
                faults.append(make(stream.kind, unit))
            stream.next_at = now + self._gap(stream.interval)
        return faults

    def next_fault_at(self) -> float | None:
        """When the next fault is planned (for the display); None when nothing is planned."""
        times = [s.next_at for s in self._streams] + [f.at for f in self._fixed[:1]]
        return min(times) if times else None


class FaultDelivery:
    """Delivers the scheduler's faults to the run's processes: SIGKILL for kills, SIGSTOP and,
    `pause_seconds` later, SIGCONT for pauses. `syncer` is the syncer's process key."""

    def __init__(
        self,
        scheduler: ChaosScheduler,
        procs: ProcessTable,
        recorder: Recorder,
        slots: Sequence[UnitSlot],
        syncer: str,
    ) -> None:
        self.scheduler = scheduler
        self.procs = procs
        self.recorder = recorder
        self.slots = slots
        self.syncer = syncer
        self.killed: set[str] = set()  # units sent SIGKILL and not stopped since
        self.resume_at: dict[str, float] = {}  # paused unit -> wall time of its SIGCONT

    def step(self, now: float, elapsed: float, candidates: Callable[[str], bool]) -> None:
        """Resume the pauses that are over, then deliver the faults due at `elapsed` seconds
        into the run. `candidates(name)` says whether a unit may be hit (online, alive)."""
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
        for fault in self.scheduler.due(elapsed, running):
            self.deliver(fault, now)

    def deliver(self, fault: Fault, now: float) -> None:
        if fault.kind == "kill-syncer":
            if self.procs.signal(self.syncer, signal.SIGKILL):
                self.recorder.event(now, "chaos-kill-syncer", self.syncer, "SIGKILL to the syncer")
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

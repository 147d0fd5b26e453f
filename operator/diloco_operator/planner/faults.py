"""The fault schedule of a run's `spec.chaos`: which fault hits which unit, and when.

Pure, and shared by both backends: the local runtime delivers its decisions as signals to
processes (`local/chaos.py`), the operator as pod deletions and node conditions (`chaos.py`).
Given the same seed, settings and sequence of `due()` calls (times and running units), the
scheduler makes the same decisions, so a chaos run can be replayed.

Faults:
- `kill`: a learner unit dies (SIGKILL; on Kubernetes its pods are deleted with no grace);
- `pause`: a unit stops for `pause_seconds` (SIGSTOP/SIGCONT; local runtime only);
- `kill-syncer`: the syncer dies (it restarts from its last checkpoint; learners reconnect);
- `node-not-ready`: a unit's node is marked NotReady (Kubernetes only).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from diloco_operator.api import ChaosSpec

FaultKind = Literal["kill", "pause", "kill-syncer", "node-not-ready"]
FAULT_KINDS: tuple[FaultKind, ...] = ("kill", "pause", "kill-syncer", "node-not-ready")


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

    def due(self, now: float, running_units: Sequence[int], syncer_up: bool = True) -> list[Fault]:
        """Faults to deliver at `now`. A unit fault with no running unit to hit waits (it stays
        due) rather than being dropped, so a schedule's count of kills is kept; so does a
        syncer kill while the syncer is not serving (`syncer_up`): killing one that is still
        starting tests nothing a user would meet, and locally it ends a run whose syncer never
        served."""
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
                if not syncer_up:
                    break  # keep order, as for a unit fault with no target
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
                if not syncer_up:
                    continue
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


_ACTIONS = {
    "kill": "kill",
    "pause": "pause",
    "killSyncer": "kill-syncer",
    "nodeNotReady": "node-not-ready",
}


def chaos_settings(spec: ChaosSpec | None, enabled: bool, seed: int | None = None) -> ChaosSettings:
    """The faults to inject. `enabled` is the --chaos flag: without it nothing is injected; with
    it, the manifest's chaos block decides, or DEFAULT_CHAOS when there is none."""
    if not enabled:
        return ChaosSettings(enabled=False)
    if spec is None or not spec.has_fault_settings:
        base = DEFAULT_CHAOS
        return base if seed is None else ChaosSettings(**{**base.__dict__, "seed": seed})
    schedule = tuple(
        ScheduledFault(
            at=ev.at_seconds,
            kind=_ACTIONS[ev.action],  # type: ignore[arg-type]
            unit=ev.unit,
            pause_seconds=ev.pause_seconds if ev.action == "pause" else None,
        )
        for ev in spec.schedule
    )
    return ChaosSettings(
        enabled=True,
        seed=spec.seed if seed is None else seed,
        start_after_seconds=0.0,
        kill_interval_seconds=spec.kill_every_seconds,
        schedule=schedule,
    )

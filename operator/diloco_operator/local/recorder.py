"""What a local run remembers while it runs: samples for the plots, unit states for the timeline,
learner heartbeats for goodput, and the events log (also streamed to events.jsonl as it happens,
so a crash of the supervisor still leaves the story on disk).

All times are wall-clock seconds (time.time()), the clock the syncer's status uses too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from diloco_trainer.status import SyncerStatus


@dataclass(frozen=True)
class GlobalSample:
    """One poll of the syncer's /v1/status."""

    time: float
    outer_step: int
    steps: int
    tokens: int
    loss: float | None
    train_loss: float | None
    bytes_sent: int
    bytes_received: int


@dataclass(frozen=True)
class Heartbeat:
    """A learner's latest heartbeat as reported by the syncer (deduplicated by time)."""

    unit: str
    attempt: int
    time: float
    step: int
    tokens: int


@dataclass(frozen=True)
class StateChange:
    """A unit (or `syncer`) entered `state` at `time`."""

    time: float
    unit: str
    state: str


@dataclass(frozen=True)
class Event:
    time: float
    kind: str
    unit: str | None
    message: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Recorder:
    """Accumulates a run's observations; `events_path` (if given) gets one JSON line per event."""

    started_at: float
    events_path: Path | None = None
    samples: list[GlobalSample] = field(default_factory=list)
    heartbeats: list[Heartbeat] = field(default_factory=list)
    states: list[StateChange] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    pauses: list[tuple[str, float, float]] = field(default_factory=list)
    _current_state: dict[str, str] = field(default_factory=dict)
    _last_heartbeat: dict[str, float] = field(default_factory=dict)
    _events_file: IO[str] | None = None
    # Called with each event as it is recorded (the plain-output mode prints them).
    on_event: Callable[[Event], None] | None = None

    def __post_init__(self) -> None:
        if self.events_path is not None:
            self.events_path.parent.mkdir(parents=True, exist_ok=True)
            self._events_file = self.events_path.open("a", buffering=1)

    def close(self) -> None:
        if self._events_file is not None:
            self._events_file.close()
            self._events_file = None

    def event(self, now: float, kind: str, unit: str | None, message: str, **data: Any) -> Event:
        ev = Event(time=now, kind=kind, unit=unit, message=message, data=dict(data))
        self.events.append(ev)
        if self._events_file is not None:
            line = {"elapsed": round(now - self.started_at, 3), **asdict(ev)}
            self._events_file.write(json.dumps(line, default=str) + "\n")
        if self.on_event is not None:
            self.on_event(ev)
        return ev

    def state(self, now: float, unit: str, state: str) -> None:
        """Record `unit`'s state; only changes are stored."""
        if self._current_state.get(unit) != state:
            self._current_state[unit] = state
            self.states.append(StateChange(time=now, unit=unit, state=state))

    def pause(self, unit: str, start: float, end: float) -> None:
        self.pauses.append((unit, start, end))

    def observe_status(self, now: float, status: SyncerStatus) -> None:
        """Store a status sample and any new learner heartbeats in it."""
        self.samples.append(
            GlobalSample(
                time=now,
                outer_step=status.outer_step or 0,
                steps=status.steps or 0,
                tokens=status.tokens or 0,
                loss=status.loss,
                train_loss=status.train_loss,
                bytes_sent=status.bytes_sent or 0,
                bytes_received=status.bytes_received or 0,
            )
        )
        for name, learner in status.learners.items():
            beat = learner.last_heartbeat
            if beat is None or self._last_heartbeat.get(name) == beat:
                continue
            self._last_heartbeat[name] = beat
            self.heartbeats.append(
                Heartbeat(
                    unit=name,
                    attempt=learner.attempt,
                    time=beat,
                    step=learner.step or 0,
                    tokens=learner.tokens or 0,
                )
            )

"""Where a child's start-up is: the phases its log has opened and not yet closed.

The syncer and the learner log each start-up phase as `event=phase_started` / `event=phase_done`
lines (diloco_trainer/phases.py). `StartupWatch` follows one child's log from the byte where this
attempt's output begins (logs are appended across attempts) and keeps the open phases, each with
the moment this supervisor first read its start line: so a start that takes too long is reported
as "still in phase 'data_index' since 95s", and the start timeout can count the time since the
last phase line instead of since the process started.

The log, not a status file the child writes: it is already there for every child (the fork
server's learners included, and any stand-in program a test starts), needs no new contract, and
is what a user reads next. Timestamps come from this process's clock, not from the lines, so
neither log format's time field is parsed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from diloco_trainer.phases import read_phase_line

# Read at most this much per poll: a start-up log is small, and a child that floods its log must
# not stall the supervisor's tick.
_CHUNK = 1 << 20


@dataclass
class OpenPhase:
    name: str
    since: float  # supervisor clock when its start line was read


@dataclass
class StartupWatch:
    path: Path
    offset: int  # the next byte to read
    last_change: float  # supervisor clock of the last phase line read (or of the start)
    open: list[OpenPhase] = field(default_factory=list)  # outermost first
    last_done: str | None = None  # the phase that ended last
    _partial: bytes = b""

    @classmethod
    def from_end(cls, path: Path, now: float) -> StartupWatch:
        """A watch of what is appended to `path` from now on."""
        try:
            size = path.stat().st_size
        except OSError:
            size = 0
        return cls(path, size, now)

    @property
    def current(self) -> OpenPhase | None:
        """The innermost open phase."""
        return self.open[-1] if self.open else None

    def poll(self, now: float) -> None:
        """Read what the child has written since the last poll."""
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read(_CHUNK)
        except OSError:
            return
        self.offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # an unfinished line waits for the rest
        for raw in lines:
            self._note(raw.decode(errors="replace"), now)

    def _note(self, line: str, now: float) -> None:
        found = read_phase_line(line)
        if found is None:
            return
        self.last_change = now
        if found.event == "started":
            self.open.append(OpenPhase(found.name, now))
            return
        # The innermost open phase of that name: phases nest, and a line of another thread's
        # phase may come between.
        for i in range(len(self.open) - 1, -1, -1):
            if self.open[i].name == found.name:
                del self.open[i]
                break
        self.last_done = found.name

    def describe(self, now: float) -> str:
        """Where the start is, for a message: the innermost open phase and how long it has been
        open, with the phases around it; else the last one that ended."""
        current = self.current
        if current is not None:
            around = [p.name for p in self.open[:-1]]
            within = f" (within {' > '.join(around)})" if around else ""
            return f"still in phase {current.name!r} since {now - current.since:.0f}s{within}"
        if self.last_done is not None:
            return f"after phase {self.last_done!r}, no phase open"
        return "no start-up phase logged yet"

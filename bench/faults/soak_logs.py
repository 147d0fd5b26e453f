"""What the soak's syncer logs say: published versions lost per syncer kill, and pushes from a
unit's older attempt heard after a newer attempt of it (a zombie learner: the local runtime's
counterpart of a duplicate child). Pure functions of the parsed log lines
(`bench.lib.syncer_logs.syncer_log_events`), so they can be checked on hand-written lines."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from bench.lib.syncer_logs import LogEvent, fields

_VERSIONS = re.compile(r"versions=\[([\d, ]*)\]")
# Events that state every fragment's version (a syncer's starting state, or a standby's after
# it took over).
_STATE_EVENTS = ("restored", "journal_replayed", "took_over")


@dataclass(frozen=True)
class KillLoss:
    """One syncer SIGKILL: the versions the killed syncer had published, the versions its
    successor serves (with their content), and the difference."""

    at: float
    killed_log: str
    successor_log: str | None  # None: no syncer served again before the logs end
    serving_after: float | None  # seconds from the kill to the successor's `listening`
    successor_warm: bool  # a standby that was ready (warmed up) when the kill came
    published: tuple[int, ...]
    served: tuple[int, ...]

    @property
    def lost(self) -> int:
        return sum(max(0, p - s) for p, s in zip(self.published, self.served, strict=False))


def versions_of(rest: str) -> list[int] | None:
    m = _VERSIONS.search(rest)
    if m is None or not m.group(1).strip():
        return None
    return [int(v) for v in m.group(1).split(",")]


def _apply(state: dict[int, int], event: str, rest: str) -> None:
    """Update `state` (fragment -> version) with what one log line says a syncer holds."""
    if event in _STATE_EVENTS:
        state.update(enumerate(versions_of(rest) or []))
    elif event == "merged":
        f = fields(rest)
        state[int(f["fragment"])] = int(f["version"])


def serving_starts(events: Sequence[LogEvent]) -> list[tuple[float, str, float | None]]:
    """(began, log, listening) for each syncer that began serving, in time order: a standby at
    its `took_over` (its `listening` follows within milliseconds), any other at its `listening`.
    `listening` is None for a standby killed between the two."""
    starts: list[tuple[float, str, float | None]] = []
    taking_over: dict[str, int] = {}  # log -> index in `starts` of a took_over not yet listening
    for when, event, _, log in events:
        if event == "took_over":
            taking_over[log] = len(starts)
            starts.append((when, log, None))
        elif event == "listening":
            i = taking_over.pop(log, None)
            if i is None:
                starts.append((when, log, when))
            else:
                starts[i] = (starts[i][0], log, when)
    return starts


def kill_loss(kill: float, events: Sequence[LogEvent]) -> KillLoss | None:
    """The loss of the syncer kill at wall time `kill`; None when no syncer served before it.
    The killed syncer is the one that last began serving before the kill (`serving_starts`);
    its published versions are the last it stated or merged. Its successor is the next to begin
    serving; what it serves is what it stated by then (a standby states its restore and journal
    replay while it waits, before the kill), where a fragment it renumbered (`versions_lost`)
    counts with the version whose content it holds (`checkpointed`)."""
    starts = serving_starts(events)
    before = [s for s in starts if s[0] <= kill]
    if not before:
        return None
    killed_log = before[-1][1]
    published: dict[int, int] = {}
    for when, event, rest, log in events:
        if when <= kill and log == killed_log:
            _apply(published, event, rest)
    successor = next((s for s in starts if s[0] > kill), None)
    served: dict[int, int] = {}
    if successor is not None:
        began, successor_log, _ = successor
        for when, event, rest, log in events:
            if when > began:
                break
            # A syncer restarted into the killed one's log states its state after the kill.
            if log != successor_log or (log == killed_log and when <= kill):
                continue
            _apply(served, event, rest)
            if event == "versions_lost":
                f = fields(rest)
                served[int(f["fragment"])] = int(f["checkpointed"])
    frags = range(max([*published, *served], default=-1) + 1)
    return KillLoss(
        at=kill,
        killed_log=killed_log,
        successor_log=None if successor is None else successor[1],
        serving_after=None if successor is None else (successor[2] or successor[0]) - kill,
        successor_warm=successor is not None
        and any(e[1] == "standby_ready" and e[3] == successor[1] and e[0] <= kill for e in events),
        published=tuple(published.get(i, 0) for i in frags),
        served=tuple(served.get(i, 0) for i in frags) if successor is not None else (),
    )


def stale_pushes(events: Sequence[LogEvent]) -> list[str]:
    """Accepted pushes of unit u's attempt a heard after u's attempt a' > a joined or pushed:
    one line each (the local measure of a duplicate child: two attempts of one unit alive)."""
    newest: dict[str, int] = {}
    found = []
    for when, event, rest, _ in events:
        if event not in ("join", "push_accepted"):
            continue
        f = fields(rest)
        unit, attempt = f.get("unit", ""), int(f.get("attempt", "0"))
        if event == "push_accepted" and attempt < newest.get(unit, -1):
            found.append(f"{unit} attempt {attempt} after attempt {newest[unit]} at {when:.1f}")
        newest[unit] = max(attempt, newest.get(unit, -1))
    return found

"""Start-up phases as log lines: what a syncer or learner is busy with before it serves or trains.

    with phase(log, "data_index"):
        ...

logs `event=phase_started phase=data_index` as the block begins and `event=phase_done
phase=data_index seconds=12.31` when it ends, or `event=phase_failed phase=data_index
seconds=0.02 error=OSError` (WARNING) when it raises, in the program's log format (logfmt.py).
The start line comes first so that a phase that hangs is the last thing its log says. Phases
nest: the workload check's `workload_check` holds `model_build` and `data_index`.

`read_phase_line` parses one line of such a log, text or json: the local runtime follows a
child's log with it to say which phase a start that takes too long is stuck in. Stdlib only: the
operator imports it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

PhaseEvent = Literal["started", "done", "failed"]
_EVENTS: dict[str, PhaseEvent] = {"started": "started", "done": "done", "failed": "failed"}

_NAME = re.compile(r"[a-z][a-z0-9_]*")
# Adjacent `event=` and `phase=` keys, as `phase` writes them: a line that only quotes such a
# line inside another value (`message='... event=phase_started ...'`) does not match.
_LINE = re.compile(
    r"(?:^|\s)event=phase_(started|done|failed) phase=([a-z][a-z0-9_]*)(?=\s|$)(.*)$"
)
_SECONDS = re.compile(r"(?:^|\s)seconds=([0-9]+(?:\.[0-9]+)?)(?=\s|$)")


@dataclass(frozen=True)
class PhaseLine:
    event: PhaseEvent
    name: str
    seconds: float | None = None  # on `done` and `failed`: how long the phase took


@contextlib.contextmanager
def phase(logger: logging.Logger, name: str, **fields: object) -> Iterator[None]:
    """Log the start and the end of the block as phase `name` (lower case, digits and `_`);
    `fields` are appended to the start line as `key=value`."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"phase name {name!r}: lower case letters, digits and '_' only")
    extra = "".join(f" {key}={value}" for key, value in fields.items())
    logger.info("event=phase_started phase=%s%s", name, extra)
    started = time.perf_counter()
    try:
        yield
    except BaseException as exc:
        seconds = time.perf_counter() - started
        logger.warning(
            "event=phase_failed phase=%s seconds=%.2f error=%s", name, seconds, type(exc).__name__
        )
        raise
    logger.info("event=phase_done phase=%s seconds=%.2f", name, time.perf_counter() - started)


def read_phase_line(line: str) -> PhaseLine | None:
    """The phase event one log line records (a text line, or a json line's `message`), or None."""
    text = line.strip()
    if text.startswith("{"):
        with contextlib.suppress(ValueError):
            entry = json.loads(text)
            if isinstance(entry, dict) and isinstance(entry.get("message"), str):
                text = entry["message"]
    found = _LINE.search(text)
    if found is None:
        return None
    seconds = _SECONDS.search(found.group(3))
    return PhaseLine(
        _EVENTS[found.group(1)], found.group(2), float(seconds.group(1)) if seconds else None
    )

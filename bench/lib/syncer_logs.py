"""Reading the trainer's log lines: their timestamps, their `key=value` fields, and every
`event=NAME` line of a local run's syncer logs in time order."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

# (wall time, event, rest of the line, log file name), as syncer_log_events returns them.
LogEvent = tuple[float, str, str, str]

# The timestamp that starts every log line (logging's default asctime).
TIMESTAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
# One line of a syncer log: its timestamp, `event=NAME` and the rest of the line.
_SYNCER_LINE = re.compile("^" + TIMESTAMP + r" .*?event=(\w+)(.*)$")
_FIELD = re.compile(r"\b(\w+)=(\S+)")


def log_time(stamp: str) -> float:
    """Wall time (epoch seconds) of a log line's TIMESTAMP."""
    return dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def fields(rest: str) -> dict[str, str]:
    """The `key=value` fields of (the rest of) a log line."""
    return dict(_FIELD.findall(rest))


def syncer_log_events(logs: Path) -> list[LogEvent]:
    """(wall time, event, rest of the line, log file name) from every syncer log of a local
    run's logs folder (the serving syncer's and each standby's), in time order."""
    found = []
    for path in sorted(logs.glob("syncer*.log")):
        for line in path.read_text(errors="replace").splitlines():
            m = _SYNCER_LINE.match(line)
            if m:
                found.append((log_time(m.group(1)), m.group(2), m.group(3), path.name))
    return sorted(found)

"""Time helpers: the planner works in float seconds, status stores RFC 3339 datetimes."""

from __future__ import annotations

from datetime import UTC, datetime


def at(now: float) -> datetime:
    return datetime.fromtimestamp(now, UTC)


def seconds_since(moment: datetime | None, now: float) -> float:
    if moment is None:
        return float("inf")
    return now - moment.timestamp()

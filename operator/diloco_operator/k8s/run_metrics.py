"""Per-unit goodput of each run as Prometheus metrics of the operator (from status.units[]).

The seconds are counters: each pass adds what status.units[].goodput gained since the previous
pass, so `rate()` over them is the fleet's useful vs total learner time whatever the operator's
restarts (a restart starts the counters at 0, which Prometheus reads as a counter reset).
"""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge

from diloco_operator.api import DilocoRunStatus
from diloco_operator.api.unit_goodput import UnitGoodput

LABELS = ["namespace", "run", "unit"]
USEFUL_SECONDS = Counter(
    "diloco_operator_unit_useful_seconds_total",
    "Learner-seconds between heartbeats whose step advanced (status.units[].goodput)",
    LABELS,
)
TOTAL_SECONDS = Counter(
    "diloco_operator_unit_seconds_total",
    "Learner-seconds since the unit first trained, while it held or awaited its slot",
    LABELS,
)
GOODPUT = Gauge(
    "diloco_operator_unit_goodput_ratio", "usefulSeconds / totalSeconds of the unit", LABELS
)


def _by_unit(status: DilocoRunStatus | None) -> dict[str, UnitGoodput]:
    if status is None:
        return {}
    return {u.name: u.goodput for u in status.units if u.goodput is not None}


def export_goodput(
    namespace: str, run: str, previous: DilocoRunStatus | None, current: DilocoRunStatus
) -> None:
    """Add what each unit's goodput gained from the `previous` status (the one the pass
    started from; None for a new run) to `current`."""
    before = _by_unit(previous)
    for unit, now in _by_unit(current).items():
        was = before.get(unit)
        GOODPUT.labels(namespace, run, unit).set(now.ratio)
        USEFUL_SECONDS.labels(namespace, run, unit).inc(
            max(0.0, now.useful_seconds - (was.useful_seconds if was else 0.0))
        )
        TOTAL_SECONDS.labels(namespace, run, unit).inc(
            max(0.0, now.total_seconds - (was.total_seconds if was else 0.0))
        )


def forget_run(namespace: str, run: str, status: DilocoRunStatus | None) -> None:
    """Drop the run's series (its loop ended: deleted, or another replica took over)."""
    for unit in _by_unit(status):
        for metric in (USEFUL_SECONDS, TOTAL_SECONDS, GOODPUT):
            with contextlib.suppress(KeyError):
                metric.remove(namespace, run, unit)

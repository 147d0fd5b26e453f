"""Whether the syncer can do its job: merge pushes and persist its state (docs/protocol.md,
"Readiness"). A failure marks its component failing until the next success of it; /readyz, the
`health` field of status and `diloco_syncer_failing{what}` all read from here."""

from __future__ import annotations

import logging

from diloco_trainer.status import HealthStatus
from diloco_trainer.syncer.metrics import SyncerMetrics

log = logging.getLogger("diloco.syncer")
COMPONENTS = ("merge", "checkpoint")
# A failed merge is retried after this many seconds, doubled per consecutive failure up to the
# cap: a full disk must not turn into a busy loop, and a transient error costs one short wait.
RETRY_SECONDS = 0.5
RETRY_CAP_SECONDS = 30.0


def retry_delay(failures: int) -> float:
    """Seconds before the next attempt after `failures` consecutive failures (>= 1)."""
    return min(RETRY_CAP_SECONDS, RETRY_SECONDS * 2 ** min(failures - 1, 16))


class Health:
    def __init__(self, metrics: SyncerMetrics) -> None:
        self.metrics = metrics
        self.problems: dict[str, str] = {}

    @property
    def ready(self) -> bool:
        return not self.problems

    def failed(self, what: str, error: BaseException) -> None:
        self.problems[what] = f"{type(error).__name__}: {error}"[:500]
        self.metrics.failing.labels(what).set(1)
        self.metrics.failures.labels(what).inc()

    def failing(self, what: str) -> bool:
        """Whether the last attempt of `what` failed."""
        return what in self.problems

    def recovered(self, what: str) -> None:
        if self.problems.pop(what, None) is not None:
            log.info("event=recovered what=%s", what)
        self.metrics.failing.labels(what).set(0)

    def status(self) -> HealthStatus:
        return HealthStatus(self.ready, dict(self.problems))

    def to_json(self) -> dict[str, object]:
        return self.status().to_json()

"""Per-unit request rate limits: one unit's flood (a bug in a retry loop, or worse) cannot take
the syncer's loop from the others.

A token bucket per (unit, kind of request): `burst` requests at once, refilled at `rate` per
second. The rates sit well above what an honest learner sends (a heartbeat per
`heartbeatSeconds`, a push and a poll per fragment per round, a join and a pull per restart), so
only a flood meets them; the answer is 429 with Retry-After, which the learner's client treats
like an unavailable syncer (it backs off, and a push folds into the fragment's next one).
Requests with the run token (the operator's status reads) are not limited. Pure bookkeeping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco_trainer.config import TrainingConfig

KINDS = ("heartbeat", "join", "claim", "params", "push", "poll")


@dataclass(frozen=True)
class Rate:
    per_second: float
    burst: float


def rates_for(cfg: TrainingConfig) -> dict[str, Rate]:
    """What one unit may send of each kind, from the run's own periods."""
    # Pushes and polls: a small model pushes every fragment every few milliseconds' worth of
    # steps (P per H steps), so their bound is a flood's, not a period's.
    fragments = max(100.0, 8.0 * cfg.fragments)
    return {
        "heartbeat": Rate(4.0 / cfg.heartbeat_seconds, 8),
        "join": Rate(5.0, 20),
        "claim": Rate(5.0, 20),
        "params": Rate(2.0, 10),
        "push": Rate(fragments, fragments),
        "poll": Rate(fragments, fragments),
    }


def kind_of(method: str, path: str) -> str | None:
    """The limited kind of a request, None for what is not limited per unit."""
    if method == "POST":
        if path.endswith("/push"):
            return "push"
        return {"/v1/heartbeat": "heartbeat", "/v1/join": "join", "/v1/data/claim": "claim"}.get(
            path
        )
    if path == "/v1/params":
        return "params"
    if path.startswith("/v1/fragments/"):
        return "poll"
    return None


@dataclass
class _Bucket:
    tokens: float
    stamp: float


class RateLimits:
    def __init__(self, rates: dict[str, Rate]) -> None:
        self.rates = rates
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._warned: dict[str, float] = {}  # unit -> when its last refusal was logged

    def take(self, unit: str, kind: str, now: float) -> float:
        """0.0 when `unit` may send a request of `kind` now (one is counted), else the seconds
        until it may."""
        rate = self.rates[kind]
        bucket = self._buckets.setdefault((unit, kind), _Bucket(rate.burst, now))
        bucket.tokens = min(rate.burst, bucket.tokens + (now - bucket.stamp) * rate.per_second)
        bucket.stamp = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / rate.per_second

    def should_log(self, unit: str, now: float, every: float = 60.0) -> bool:
        """Whether a refusal of `unit` is logged now: once a minute, however many there are."""
        last = self._warned.get(unit)
        if last is not None and now - last < every:
            return False
        self._warned[unit] = now
        return True

    def forget(self, units: set[str]) -> None:
        """Drop the buckets of units no longer in the run."""
        self._buckets = {k: b for k, b in self._buckets.items() if k[0] in units}


def retry_after(seconds: float) -> str:
    """A Retry-After header value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))

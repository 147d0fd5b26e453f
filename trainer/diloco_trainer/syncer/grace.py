"""How long the syncer waits for stragglers once a fragment has its quorum (pure logic).

The slack: a learner that pushed fragment p keeps training; the merged fragment is useful without
extra staleness if it arrives within `overlap` (tau) of that learner's steps. By the time the
quorum is met, `quorum_elapsed` seconds of that budget are gone, and the merge plus broadcast costs
`sync_time`. So at most `overlap*step_time - quorum_elapsed - sync_time` remain for stragglers,
never more than `grace.maxSeconds`.

Within that slack we only wait as long as the missing learners are expected to need: a learner
pushes fragment p every H of its steps, so it is expected at (its last push of p) + H * (its EMA
step time). Learners with no history, or overdue ones, might arrive any moment, so they get the
whole slack; learners expected later than the slack are not waited for at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

GraceMode = Literal["adaptive", "fixed", "none"]


@dataclass
class Ema:
    """Exponential moving average; `value` is None until the first sample."""

    alpha: float
    value: float | None = None

    def update(self, sample: float) -> float:
        self.value = (
            sample if self.value is None else (1 - self.alpha) * self.value + self.alpha * sample
        )
        return self.value


def slack_seconds(
    overlap: int,
    step_time: float | None,
    quorum_elapsed: float,
    sync_time: float,
    max_seconds: float,
) -> float:
    """The adaptive bound: overlap*step_time - (quorum_elapsed + sync_time), in [0, max_seconds].

    With no step-time estimate yet the bound is max_seconds.
    """
    if step_time is None:
        return max_seconds
    return min(max_seconds, max(0.0, overlap * step_time - quorum_elapsed - sync_time))


def grace_window(
    mode: GraceMode,
    max_seconds: float,
    missing_lateness: Sequence[float | None],
    slack: float,
    margin: float = 1.25,
    whole_slack: bool = False,
) -> float:
    """Seconds to wait after the quorum for the learners that have not pushed yet.

    `missing_lateness`: per online learner that has not contributed, seconds until it is expected
    to push (None = unknown or overdue). No missing learners means nobody to wait for.
    `whole_slack`: wait the whole slack if any missing learner fits in it (phase-locked
    learners push H steps after an install, later than the estimate from their last push; the
    wait ends anyway as soon as everyone is in).
    """
    if mode == "none" or not missing_lateness:
        return 0.0
    if mode == "fixed":
        return max_seconds
    if slack <= 0:
        return 0.0
    fitting = [lat for lat in missing_lateness if lat is None or lat <= slack]
    if not fitting:
        return 0.0
    if whole_slack or any(lat is None for lat in fitting):
        return slack
    return min(slack, margin * max(lat for lat in fitting if lat is not None))

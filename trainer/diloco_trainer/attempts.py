"""How a learner's attempt is numbered at the syncer, when its pod may restart it in place.

A unit's pods are recreated by the operator (its attempt, from 0) and, on Kubernetes, a crashed
learner may also restart in its own pod (learner/in_place.py). Either way the syncer must see a
new attempt: counters are cumulative within an attempt and push keys name it, so a process that
reused its predecessor's attempt would have its progress hidden under the old maxima and its
pushes refused as duplicates. The attempt the syncer sees is `recreations * STRIDE + restarts
in place`: it grows with either kind of restart, and the operator reads its own number back
with `split`.
"""

from __future__ import annotations

STRIDE = 1000  # restarts in place per recreation the attempt number has room for
EXIT_GIVE_UP = 3  # the learner's exit once its restarts in place are spent: recreate the unit


def wire_attempt(recreations: int, restarts: int) -> int:
    """The attempt the syncer sees for a learner in the `recreations`-th pod of its unit after
    `restarts` restarts in place."""
    if not 0 <= restarts < STRIDE:
        raise ValueError(f"restarts in place: {restarts} is outside 0..{STRIDE - 1}")
    return recreations * STRIDE + restarts


def split(attempt: int) -> tuple[int, int]:
    """(recreations, restarts in place) of a syncer-side attempt made by `wire_attempt`."""
    return divmod(attempt, STRIDE)

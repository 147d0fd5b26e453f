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
# The learner's exit when the syncer says a newer attempt of its unit joined (409 superseded):
# its recreated pod took over, from a warm spare's cover or from a pod thought lost.
EXIT_SUPERSEDED = 4
# The restarts-in-place part of a warm spare's cover attempt: above any count a pod reaches
# (failurePolicy.inPlaceRestarts), below the unit's next recreation (learner/spare.py).
COVER_RESTARTS = STRIDE - 1


def cover_attempt(recreations: int) -> int:
    """The attempt a warm spare covers a unit under while the unit's `recreations`-th pod is
    replaced by the next: newer than every restart of that pod, older than the new pod."""
    return wire_attempt(recreations, COVER_RESTARTS)


def wire_attempt(recreations: int, restarts: int) -> int:
    """The attempt the syncer sees for a learner in the `recreations`-th pod of its unit after
    `restarts` restarts in place."""
    if not 0 <= restarts < STRIDE:
        raise ValueError(f"restarts in place: {restarts} is outside 0..{STRIDE - 1}")
    return recreations * STRIDE + restarts


def split(attempt: int) -> tuple[int, int]:
    """(recreations, restarts in place) of a syncer-side attempt made by `wire_attempt`."""
    return divmod(attempt, STRIDE)

"""Restarts of a learner in its own pod: the same node and devices, a new attempt at the syncer.

On Kubernetes a crashed learner container is restarted by the kubelet in its pod (a container
restart rule), which keeps the unit's pods, its node and its queue admission; only the process
is new, and it must be a new attempt at the syncer (attempts.py says why and how it is
numbered). The pod's own emptyDir (it survives container restarts, not a recreated pod) counts
the learner's starts. Past the allowed restarts in place the learner gives up with
attempts.EXIT_GIVE_UP, which no restart rule matches: the pod fails, and the operator recreates
the unit with its backoff, counted against maxUnitRestarts.
"""

from __future__ import annotations

import os
from pathlib import Path

STARTS_FILE = "starts"


class RestartsSpent(Exception):
    """More starts in this pod than the restarts in place allowed; the message says so."""


def count_start(directory: str | Path, allowed: int) -> int:
    """Record one more start of the learner in `directory` (the pod-local volume) and return
    how many starts came before it in this pod: 0 for the pod's first. Raises RestartsSpent
    when more than `allowed` came before."""
    path = Path(directory) / STARTS_FILE
    try:
        before = int(path.read_text().strip() or 0)
    except FileNotFoundError:
        before = 0
    except ValueError as exc:
        raise RestartsSpent(f"{path}: not a count of starts: {exc}") from None
    # Written before anything can fail, so a crash loop is counted whatever it crashes in.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(before + 1))
    os.replace(tmp, path)
    if before > allowed:
        raise RestartsSpent(
            f"the {allowed} restarts in place allowed in this pod are spent: the unit is "
            "recreated (failurePolicy.inPlaceRestarts)"
        )
    return before

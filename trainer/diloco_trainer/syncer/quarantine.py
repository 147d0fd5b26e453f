"""Quarantine: an attempt whose pushes are outliers again and again is refused until it restarts.

A screen (robust.py) limits what one outlying push does to one merge; a unit that sends outliers
round after round (a chip with a silent data corruption, a bug, an attacker) would still tax
every merge. So each attempt's last `window` merged pushes are remembered as outlier or not,
and once `after` of them were outliers the attempt is quarantined: its pushes are refused (403
`quarantined`), status says so, and the operator (or the local runtime) recreates the unit,
whose next attempt starts clean. A restart on broken hardware is quarantined again and counts
against the unit's restart budget like any crash loop. Pure bookkeeping, checkpointed.

A restarted attempt's first `grace` merged pushes are screened but not counted: it starts from
fresh AdamW moments in the middle of a run, and its first deltas are long and noisy (in the
chaos demo two of them were left out, cosine -0.02 and -0.09 with the others), which would
otherwise quarantine an honest unit and restart it into the same state again.

The same holds for a unit heard again after a silence (a cut link between clusters, a paused
host): its first pushes after it fold everything it learned while unheard onto an old base, and
are long and off the others' direction for that reason alone (measured: the `wan` bench's
cut-off units were quarantined in 2 of 5 short-cut runs). Each silence the registry counts
(longer than its offline_after) gives the attempt `grace` uncounted pushes again; they are still
screened, so a unit that goes quiet on purpose buys two screened pushes per silence, nothing more.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from diloco_trainer.syncer.robust import Verdict


class QuarantineBook:
    def __init__(self, after: int, window: int, grace: int = 2) -> None:
        self.after, self.window, self.grace = after, window, grace
        self._merged: dict[str, tuple[int, int]] = {}  # unit -> (attempt, merged pushes)
        self._recent: dict[str, tuple[int, deque[bool]]] = {}  # unit -> (attempt, outlier?)
        self.held: dict[str, tuple[int, str]] = {}  # unit -> (attempt, reason)
        self._silences: dict[str, int] = {}  # unit -> silences already given their grace

    def record(self, unit: str, attempt: int, verdict: Verdict, silences: int = 0) -> str | None:
        """Count one merged push's verdict; the reason when this quarantines the attempt.
        `silences`: how often the registry heard the unit again after a silence, so far."""
        if self.after <= 0 or self.reason(unit, attempt) is not None:
            return None
        attempt_seen, merged = self._merged.get(unit, (attempt, 0))
        merged = merged + 1 if attempt_seen == attempt else 1
        returned = silences > self._silences.get(unit, 0)
        if returned:
            self._silences[unit] = silences
            merged = 1  # back from a silence: its next pushes fold what it did while unheard
        self._merged[unit] = (attempt, merged)
        if (attempt > 0 or unit in self._silences) and merged <= self.grace:
            return None  # a restarted or returning attempt's first pushes
        known = self._recent.get(unit)
        if known is None or known[0] != attempt:
            if known is not None and known[0] > attempt:
                return None  # a late push of an attempt already replaced
            known = (attempt, deque(maxlen=self.window))
            self._recent[unit] = known
        known[1].append(verdict.outlier)
        outliers = sum(known[1])
        if outliers < self.after:
            return None
        reason = (
            f"{outliers} of attempt {attempt}'s last {len(known[1])} merged pushes were outliers; "
            f"the last one {verdict.describe()}"
        )
        self.held[unit] = (attempt, reason)
        return reason

    def reason(self, unit: str, attempt: int) -> str | None:
        """Why `unit`'s `attempt` is quarantined, None when it is not."""
        held = self.held.get(unit)
        return held[1] if held is not None and held[0] == attempt else None

    def to_json(self) -> dict[str, Any]:
        return {unit: [attempt, reason] for unit, (attempt, reason) in self.held.items()}

    def load_json(self, raw: Any) -> None:
        """Restore what a checkpoint holds; malformed entries are dropped (a dropped one only
        lets that attempt push until it is caught again)."""
        self.held = {
            str(unit): (entry[0], str(entry[1]))
            for unit, entry in (raw.items() if isinstance(raw, dict) else ())
            if isinstance(entry, list)
            and len(entry) == 2
            and isinstance(entry[0], int)
            and not isinstance(entry[0], bool)
        }

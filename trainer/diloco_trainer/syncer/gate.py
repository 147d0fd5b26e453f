"""The syncer's gate: who is admitted, how far their counters are believed, how often they may
ask, and whose pushes are screened out or quarantined (docs/design.md, "Trust no single unit").

One object owns that state (the roster or unit count, the plausibility rules, the rate limits,
the robust screens and the quarantine book), so the HTTP handlers, the push intake and the merge
rounds ask it rather than reaching into the syncer.
"""

from __future__ import annotations

import logging

from diloco_trainer.config import TrainingConfig
from diloco_trainer.syncer import robust
from diloco_trainer.syncer.fragment import Reject
from diloco_trainer.syncer.limits import RateLimits, rates_for
from diloco_trainer.syncer.metrics import SyncerMetrics
from diloco_trainer.syncer.quarantine import QuarantineBook
from diloco_trainer.syncer.registry import LearnerRegistry
from diloco_trainer.syncer.roster import Roster, newest
from diloco_trainer.syncer.trust import Implausible, Plausibility

log = logging.getLogger("diloco.syncer")


def lead_steps(cfg: TrainingConfig) -> int:
    """How far past its last accepted push a unit's progress is believed: 2H, the longest an
    honest learner goes without pushing each fragment (PushClock.max_period)."""
    return 2 * cfg.inner_steps


class Gate:
    def __init__(
        self,
        cfg: TrainingConfig,
        tokens_per_step: int,
        learners: LearnerRegistry,
        metrics: SyncerMetrics,
        roster: Roster | None = None,
        max_units: int | None = None,
    ) -> None:
        self.learners, self.metrics = learners, metrics
        self.roster = roster  # the exact units admitted (roster.py); None: by max_units
        self.max_units = max_units  # distinct units admitted without a roster; None: any
        self.trust = Plausibility(
            tokens_per_step,
            lead_steps(cfg),
            cfg.trust.max_steps_per_second,
            cfg.trust.max_speed_ratio,
        )
        self.limits = RateLimits(rates_for(cfg))
        self.screen = robust.screen(cfg.merge.robust)
        robust_cfg = cfg.merge.robust
        self.quarantine = QuarantineBook(robust_cfg.quarantine_after, robust_cfg.quarantine_window)

    @property
    def roster_revision(self) -> int | None:
        return None if self.roster is None else self.roster.revision

    def admit(self, unit: str, group: str | None = None) -> None:
        """Refuse a unit not on the roster (or of another group), or, with no roster, a unit
        new to the run once `max_units` distinct units are known."""
        if self.roster is not None:
            self.roster.admit(unit, group)
            return
        known = self.learners.records
        if self.max_units is not None and unit not in known and len(known) >= self.max_units:
            raise Reject(
                403,
                "too_many_units",
                f"unit {unit!r}: this run admits {self.max_units} units, all known already",
            )

    def take_roster(self, roster: Roster) -> bool:
        """Admit by `roster` from now on, when it is at least as new as the one held; False
        (nothing changes) for an older one."""
        if roster is not newest(self.roster, roster):
            return False
        self.roster = roster
        self.limits.forget(set(roster.units))
        log.info("event=roster revision=%d units=%d", roster.revision, len(roster.units))
        return True

    def refused(self, unit: str, kind: str, refusal: Implausible) -> Reject:
        """A heartbeat or push whose counters no honest unit could send: counted per rule and
        per unit (status shows it; the operator turns a new refusal into an Event), logged;
        the 422 to answer with."""
        self.metrics.claims_refused.labels(kind, refusal.reason).inc()
        self.learners.get(unit).refused(f"{kind}: {refusal.message}")
        log.warning(
            "event=claim_refused unit=%s kind=%s rule=%s message=%r",
            unit,
            kind,
            refusal.reason,
            refusal.message,
        )
        return Reject(422, "implausible", refusal.message)

    def check_heartbeat(self, unit: str, attempt: int, step: int, tokens: int, now: float) -> None:
        elapsed, peers = self.learners.reach(unit, attempt, now)
        try:
            self.trust.check_tokens(step, tokens, "heartbeat")
            self.trust.check_step(step, elapsed, peers, "heartbeat")
        except Implausible as exc:
            raise self.refused(unit, "heartbeat", exc) from exc

    def quarantined(self, unit: str, attempt: int) -> None:
        reason = self.quarantine.reason(unit, attempt)
        if reason is not None:
            raise Reject(403, "quarantined", f"unit {unit!r} is quarantined: {reason}")

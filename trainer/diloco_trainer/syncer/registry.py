"""What the syncer knows about learners: heartbeats, per-attempt counters, timings, status JSON.

Counting rule: a learner's step/tokens in a heartbeat are cumulative within its attempt. A restart
(attempt+1) starts again from zero, and what earlier attempts did still counts: per (unit, attempt)
we keep the maxima seen, and a unit's total is the sum over its attempts. A superseded attempt
counts only up to the step of its last accepted push: its successor resumes the unit's data where
that push said it was (the data position a push carries) and trains the steps after it again, so
counting them twice would end the run with less training in the model than its budget says. The
newest attempt counts what it reported, but at most `lead` steps past its last accepted push
(trust.py): a claim is only believed as far as the syncer has seen work arrive.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from diloco_trainer.status import LearnerStatus
from diloco_trainer.syncer.fragment import Reject
from diloco_trainer.syncer.grace import Ema
from diloco_trainer.syncer.trust import median
from diloco_trainer.wire import MAX_COUNTER

log = logging.getLogger("diloco.syncer")


@dataclass
class LearnerRecord:
    unit: str
    group: str = "default"
    attempt: int = 0
    attempts: dict[int, list[int]] = field(default_factory=dict)  # attempt -> [steps, tokens]
    pushed: dict[int, int] = field(default_factory=dict)  # attempt -> step of its last push
    # attempt -> fragment -> step of that fragment's last accepted push
    fragment_steps: dict[int, dict[int, int]] = field(default_factory=dict)
    lead: int | None = None  # steps counted past the last accepted push; None: no bound
    joined: set[int] = field(default_factory=set)  # attempts that joined (a push needs it)
    # Where the unit's LR schedule began: 0 for the run's first units, the run's progress for a
    # unit that joined a running run (LearnerRegistry.get).
    start_step: int = 0
    last_seen: float | None = None
    last_heartbeat: float | None = None
    attempt_since: float | None = None  # when the current attempt was first heard from
    tokens_per_sec: float = 0.0
    loss: float | None = None
    step_time: Ema = field(default_factory=lambda: Ema(0.2))
    last_beat: tuple[int, int, float] | None = None  # (attempt, step, time) of the previous beat
    refusals: int = 0  # heartbeats and pushes refused as impossible (trust.py)
    last_refusal: str | None = None
    # Times the unit was heard again after longer than offline_after without a sign of life (a
    # cut link, a paused host): its next pushes fold what it learned while unheard.
    silences: int = 0
    # Versions its last accepted push was behind: the fragment's version then minus the push's
    # base (0: it pushed against the newest). Across a thin link this is what the link costs.
    version_lag: int | None = None

    def refused(self, why: str) -> None:
        self.refusals += 1
        self.last_refusal = why[:300]

    def counted(self, attempt: int) -> tuple[int, int]:
        """What `attempt` counts (steps, tokens): what it reported, up to `lead` steps past its
        last accepted push while it is the unit's newest attempt, and up to that push once
        superseded (tokens pro rata)."""
        steps, tokens = self.attempts.get(attempt, (0, 0))
        if attempt >= self.attempt and self.lead is None:
            return steps, tokens
        lead = (self.lead or 0) if attempt >= self.attempt else 0
        kept = min(steps, self.pushed.get(attempt, 0) + lead)
        return kept, (tokens * kept // steps if steps else 0)

    @property
    def steps(self) -> int:
        return sum(self.counted(a)[0] for a in self.attempts)

    @property
    def tokens(self) -> int:
        return sum(self.counted(a)[1] for a in self.attempts)

    @property
    def schedule_position(self) -> int:
        return self.start_step + self.steps


class LearnerRegistry:
    def __init__(
        self, ema: float = 0.2, offline_after: float = 10.0, lead: int | None = None
    ) -> None:
        """`lead`: the steps an attempt is counted past its last accepted push (None: what it
        reports, as pure tests of the counting rules want)."""
        self.ema = ema
        self.offline_after = offline_after
        self.lead = lead
        self.records: dict[str, LearnerRecord] = {}

    def get(self, unit: str) -> LearnerRecord:
        """The unit's record; a unit new to the run starts its LR schedule where the run is,
        the mean schedule position of the units known so far, instead of at step 0: at step 0
        it would warm up and then train at peak LR while everyone else is deep into the decay,
        and its deltas would be the largest in every merge."""
        if unit not in self.records:
            known = [r.schedule_position for r in self.records.values()]
            start = int(sum(known) / len(known)) if known else 0
            self.records[unit] = LearnerRecord(
                unit, start_step=start, step_time=Ema(self.ema), lead=self.lead
            )
        return self.records[unit]

    def newest_joined(self, unit: str) -> int | None:
        rec = self.records.get(unit)
        return max(rec.joined) if rec is not None and rec.joined else None

    def check_current(self, unit: str, attempt: int) -> None:
        """Refuse (409 superseded) an attempt older than the newest of `unit` that joined:
        another process is that unit now (its recreated pod, or a warm spare's cover), and
        two processes under one unit would read the same data and merge it twice."""
        newest = self.newest_joined(unit)
        if newest is not None and attempt < newest:
            raise Reject(
                409,
                "superseded",
                f"unit {unit!r} attempt {attempt}: attempt {newest} of the unit joined since",
            )

    def seen(self, unit: str, attempt: int, group: str, now: float) -> LearnerRecord:
        rec = self.get(unit)
        if attempt > rec.attempt or rec.attempt_since is None:
            rec.attempt_since = now
        if attempt > rec.attempt:
            # A new attempt must not inherit the dead attempt's last heartbeat: a supervisor
            # would call it stale right after it joined (status falls back to last_seen).
            rec.last_heartbeat = None
            rec.last_beat = None
        if attempt >= rec.attempt:
            rec.attempt, rec.group = attempt, group
        rec.attempts.setdefault(attempt, [0, 0])
        if rec.last_seen is not None and now - rec.last_seen > self.offline_after:
            rec.silences += 1
        rec.last_seen = now
        return rec

    def heartbeat(
        self,
        unit: str,
        attempt: int,
        group: str,
        step: int,
        tokens: int,
        tokens_per_sec: float,
        loss: float | None,
        now: float,
    ) -> LearnerRecord:
        rec = self.seen(unit, attempt, group, now)
        counts = rec.attempts[attempt]
        counts[0], counts[1] = max(counts[0], step), max(counts[1], tokens)
        if attempt == rec.attempt:
            prev = rec.last_beat
            if prev is not None and prev[0] == attempt and step > prev[1] and now > prev[2]:
                rec.step_time.update((now - prev[2]) / (step - prev[1]))
            rec.last_beat = (attempt, step, now)
            rec.last_heartbeat = now
            rec.tokens_per_sec = tokens_per_sec
            rec.loss = loss
        return rec

    def pushed(
        self, unit: str, attempt: int, step: int, fragment: int = 0, lag: int | None = None
    ) -> None:
        """An accepted push of `fragment` by `unit`'s `attempt`, made at its step `step`,
        `lag` versions behind the fragment."""
        rec = self.get(unit)
        if lag is not None:
            rec.version_lag = lag
        rec.pushed[attempt] = max(rec.pushed.get(attempt, 0), step)
        steps = rec.fragment_steps.setdefault(attempt, {})
        steps[fragment] = max(steps.get(fragment, 0), step)

    def reach(self, unit: str, attempt: int, now: float) -> tuple[float | None, float | None]:
        """(seconds since `unit`'s `attempt` was first heard from, or None when unknown; the
        other units' median seconds per step, or None): what `trust.Plausibility` bounds a
        claim's step by. A restored record's attempt start is unknown (0.0: not bounded)."""
        rec = self.get(unit)
        since = rec.attempt_since if attempt == rec.attempt else None
        elapsed = None if not since else now - since
        others = [
            r.step_time.value
            for u, r in self.records.items()
            if u != unit and r.step_time.value is not None
        ]
        return elapsed, median(others)

    def previous_push(self, unit: str, attempt: int, fragment: int) -> int:
        """The step of the attempt's last accepted push of `fragment` (0: none)."""
        return self.get(unit).fragment_steps.get(attempt, {}).get(fragment, 0)

    def resume_step(self, unit: str, attempt: int) -> int:
        """Where attempt `attempt` of `unit` continues its LR schedule: where the unit started
        (`get`) plus the steps its other attempts count (`LearnerRecord.counted`)."""
        rec = self.get(unit)
        return rec.start_step + sum(rec.counted(a)[0] for a in rec.attempts if a != attempt)

    def online(self, now: float, within: float | None = None) -> list[str]:
        """Units seen within `within` seconds (default `offline_after`)."""
        window = self.offline_after if within is None else within
        return sorted(
            u
            for u, r in self.records.items()
            if r.last_seen is not None and now - r.last_seen <= window
        )

    def in_phase(self, now: float, fresh_within: float, last_merge: float | None) -> list[str]:
        """The units a phase-locked merge of a fragment waits for and shares with: heard from
        within `fresh_within` seconds (a killed learner drops out after that, not after
        `offline_after`), and on an attempt that began before the fragment's `last_merge`, so
        that it installed a version and pushes in step with the others. A learner that joined
        since then pushes the fragment first one round later (`PushClock.joined_running`).
        With `last_merge` None (a fragment not merged yet), or when no fresh unit is in phase
        (every unit restarted), every fresh unit: they all start the fragment's countdown at the
        same step."""
        fresh = self.online(now, fresh_within)
        phased = [
            u
            for u in fresh
            if last_merge is None or (self.records[u].attempt_since or 0.0) < last_merge
        ]
        return phased or fresh

    def totals(self) -> tuple[int, int]:
        return (
            sum(r.steps for r in self.records.values()),
            sum(r.tokens for r in self.records.values()),
        )

    def train_loss(self) -> float | None:
        """Token-weighted mean of the learners' latest reported losses."""
        pairs = [(r.tokens, r.loss) for r in self.records.values() if r.loss is not None]
        weight = sum(t for t, _ in pairs)
        if not pairs:
            return None
        if weight <= 0:
            return sum(loss for _, loss in pairs) / len(pairs)
        return sum(t * loss for t, loss in pairs) / weight

    def status(
        self, now: float, quarantined: Callable[[str, int], str | None] | None = None
    ) -> dict[str, LearnerStatus]:
        """Each unit's status; `quarantined(unit, attempt)`: why its attempt is quarantined."""
        out = {}
        for unit in sorted(self.records):
            r = self.records[unit]
            # Last sign of life: a heartbeat, else a join or push (never null once seen).
            alive = r.last_heartbeat if r.last_heartbeat is not None else r.last_seen
            out[unit] = LearnerStatus(
                attempt=r.attempt,
                group=r.group,
                last_heartbeat=alive,
                age_seconds=None if alive is None else round(now - alive, 3),
                step=r.steps,
                tokens=r.tokens,
                tokens_per_sec=r.tokens_per_sec,
                loss=r.loss,
                refused=r.refusals,
                last_refusal=r.last_refusal,
                quarantined=quarantined(unit, r.attempt) if quarantined else None,
                version_lag=r.version_lag,
            )
        return out

    # Checkpointed form: counters only (timings are re-learned after a restart).
    def to_json(self) -> dict[str, Any]:
        return {
            u: {
                "group": r.group,
                "attempt": r.attempt,
                "attempts": {str(a): c for a, c in r.attempts.items()},
                "pushed": {str(a): step for a, step in r.pushed.items()},
                "fragmentSteps": {
                    str(a): {str(p): step for p, step in steps.items()}
                    for a, steps in r.fragment_steps.items()
                },
                "startStep": r.start_step,
                "loss": r.loss,
                "joined": sorted(r.joined),
            }
            for u, r in self.records.items()
        }

    def load_json(self, data: dict[str, Any], now: float | None = None) -> None:
        """Restore counters. Restored learners count as last seen `now` (the restart), so the
        supervisor's staleness clock for them starts at the syncer's restart, not at null.

        A counter outside 0..MAX_COUNTER (written by a syncer that did not bound them, or a
        damaged file) would fail every status and metrics read, and every restart after it: it
        is dropped with an ERROR line naming unit and field, and the rest of the record kept."""
        for unit, raw in data.items():
            if not isinstance(raw, dict):
                log.error("event=checkpoint_counter_dropped unit=%s field=(record)", unit)
                continue
            rec = self.get(unit)
            rec.last_seen = now
            rec.attempt_since = 0.0  # it holds versions already: in phase (`in_phase`)
            rec.group = str(raw.get("group", "default"))
            rec.attempt = _counter(raw.get("attempt", 0), unit, "attempt") or 0
            rec.attempts = {}
            for a, c in (raw.get("attempts") or {}).items():
                attempt = _counter(a, unit, "attempts")
                pair = c if isinstance(c, list) and len(c) == 2 else [None, None]
                steps = _counter(pair[0], unit, f"attempts.{a}.steps")
                tokens = _counter(pair[1], unit, f"attempts.{a}.tokens")
                if attempt is not None and steps is not None and tokens is not None:
                    rec.attempts[attempt] = [steps, tokens]
            # Absent before the field existed: then every attempt counts what it reported.
            pushed = raw.get("pushed")
            if not isinstance(pushed, dict):
                pushed = {str(a): c[0] for a, c in rec.attempts.items()}
            rec.pushed = {}
            for a, step in pushed.items():
                attempt, at = _counter(a, unit, "pushed"), _counter(step, unit, f"pushed.{a}")
                if attempt is not None and at is not None:
                    rec.pushed[attempt] = at
            # Absent before the field existed: the previous push of each fragment is step 0.
            steps_of = raw.get("fragmentSteps")
            rec.fragment_steps = {}
            for a, frags in steps_of.items() if isinstance(steps_of, dict) else ():
                attempt = _counter(a, unit, "fragmentSteps")
                if attempt is None or not isinstance(frags, dict):
                    continue
                kept = {
                    fragment: step
                    for p, value in frags.items()
                    if (fragment := _counter(p, unit, f"fragmentSteps.{a}")) is not None
                    and (step := _counter(value, unit, f"fragmentSteps.{a}.{p}")) is not None
                }
                rec.fragment_steps[attempt] = kept
            # absent before the field existed
            rec.start_step = _counter(raw.get("startStep", 0), unit, "startStep") or 0
            loss = raw.get("loss")
            rec.loss = float(loss) if isinstance(loss, int | float) else None
            # Absent before the field existed: then every attempt the checkpoint knows joined.
            joined = raw.get("joined", list(rec.attempts))
            rec.joined = {j for a in joined if (j := _counter(a, unit, "joined")) is not None}


def _counter(value: Any, unit: str, name: str) -> int | None:
    """A checkpointed counter as an int in 0..MAX_COUNTER, else None with an ERROR line."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)  # attempt numbers are JSON object keys, hence strings
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNTER:
        return value
    log.error(
        "event=checkpoint_counter_dropped unit=%s field=%s value=%.40r reason=not an integer "
        "in 0..%d",
        unit,
        name,
        value,
        MAX_COUNTER,
    )
    return None

"""What the syncer believes of a unit's counters: no more than the unit could have done.

A unit with a valid credential (buggy, silently corrupted or hostile) can put any number in a
heartbeat or a push. Those numbers end the run (the budget), move every unit's learning-rate
schedule (the run's share of its budget) and weight the merges (cTokens^2 / cSteps), so the
syncer bounds them by what it can check (docs/design.md, "Trust no single unit"):

- a push's cTokens <= cSteps x tokens per step, and cSteps <= the steps between the push and
  the same attempt's previous accepted push of that fragment (both hold for every honest push,
  folded ones included): anything else is impossible, refused;
- a push's or heartbeat's step at most `lead` steps plus what the attempt could have trained
  since it was first heard from, at `max_steps_per_second` (an absolute bound no real step
  reaches) or, when set, `max_speed_ratio` times the other units' median step rate, whichever
  is lower: anything beyond is impossible. The attempt's start is the anchor, not its last
  accepted push: pushes held back (a throttled or slow link) arrive in a burst, their steps
  trained over seconds but accepted within milliseconds;
- progress is counted up to `lead` steps past the last accepted push (`counted`): an honest
  learner is never further ahead than that, whatever its heartbeat says;
- merge weights use counters capped at `lead` steps (`weight_counters`): a push folded from
  several (after an outage) weighs as one long one, and no push outweighs two honest ones.

`lead` is 2H: the longest an honest learner goes without pushing each fragment
(`fragments.PushClock.max_period`). Pure functions; the syncer calls them and answers 422.
"""

from __future__ import annotations

from dataclasses import dataclass


class Implausible(Exception):
    """A counter no honest unit could send; `reason` names the rule."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


@dataclass(frozen=True)
class Plausibility:
    tokens_per_step: int
    lead: int  # steps an attempt may be credited past its last accepted push (2H)
    max_steps_per_second: float = 100_000.0
    max_speed_ratio: float | None = None  # None: no bound by the other units' speed

    def speed(self, peer_step_time: float | None) -> float:
        """The fastest step rate believed: the absolute bound, or the other units' median
        rate times `max_speed_ratio` when that is set, known and lower."""
        if self.max_speed_ratio is None or peer_step_time is None or peer_step_time <= 0:
            return self.max_steps_per_second
        return min(self.max_steps_per_second, self.max_speed_ratio / peer_step_time)

    def reachable(self, elapsed: float | None, peer_step_time: float | None) -> int:
        """The largest step an attempt first heard from `elapsed` seconds ago can have made:
        `lead` plus that time at `speed`; no bound (-1) when the time is unknown (a record
        restored from a checkpoint)."""
        if elapsed is None:
            return -1
        return self.lead + int(max(0.0, elapsed) * self.speed(peer_step_time))

    def check_tokens(self, steps: int, tokens: int, what: str) -> None:
        if tokens > steps * self.tokens_per_step:
            raise Implausible(
                "tokens_exceed_steps",
                f"{what} tokens {tokens} exceed its steps {steps} x {self.tokens_per_step} tokens "
                "per step",
            )

    def check_step(
        self, step: int, elapsed: float | None, peer_step_time: float | None, what: str
    ) -> None:
        bound = self.reachable(elapsed, peer_step_time)
        if bound >= 0 and step > bound:
            assert elapsed is not None
            raise Implausible(
                "too_fast",
                f"{what} step {step} is beyond reach: {self.lead} + {elapsed:.1f}s since the "
                f"attempt was first heard from at {self.speed(peer_step_time):.4g} steps/s "
                f"= {bound}",
            )

    def check_push(
        self,
        step: int,
        c_steps: int,
        c_tokens: int,
        previous: int,
        elapsed: float | None,
        peer_step_time: float | None,
    ) -> None:
        """A push made at `step` whose attempt's previous accepted push of this fragment was
        at step `previous` (0: none)."""
        if c_steps > step - previous:
            raise Implausible(
                "steps_exceed_span",
                f"push cSteps {c_steps} exceed the {max(0, step - previous)} steps from this "
                f"fragment's previous accepted push (step {previous}) to this one (step {step})",
            )
        self.check_tokens(c_steps, c_tokens, "push c")
        self.check_step(step, elapsed, peer_step_time, "push")

    def weight_counters(self, c_steps: int, c_tokens: int) -> tuple[int, int]:
        """The (cSteps, cTokens) a push weighs with in a merge: at most `lead` steps of full
        batches."""
        steps = min(c_steps, self.lead)
        return steps, min(c_tokens, steps * self.tokens_per_step)


def median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

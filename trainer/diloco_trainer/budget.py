"""A run's budget: when it is complete, and how much of it is done.

The one part of the training block a running run may change: the syncer alone decides when the
run is complete, and takes a changed budget with the roster (syncer/roster.py); the operator
puts the spec's budget there (planner/placement.py in the operator).
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco_trainer.config import TrainingConfig


@dataclass(frozen=True)
class Budget:
    """When the run is complete: after this many inner steps and/or tokens summed over its
    learners (whichever comes first)."""

    total_steps: int | None = None
    total_tokens: int | None = None

    @classmethod
    def of(cls, cfg: TrainingConfig) -> Budget:
        """The budget a training block sets (`totalSteps`, `totalTokens`)."""
        return cls(cfg.total_steps, cfg.total_tokens)

    def to_json(self) -> dict[str, int]:
        pairs = (("totalSteps", self.total_steps), ("totalTokens", self.total_tokens))
        return {key: value for key, value in pairs if value is not None}

    def reached(self, steps: int, tokens: int) -> bool:
        return (self.total_steps is not None and steps >= self.total_steps) or (
            self.total_tokens is not None and tokens >= self.total_tokens
        )

    def share_done(self, steps: int, tokens: int) -> float:
        """The share of the budget counted, in [0, 1]: the larger of the two."""
        shares = [0.0]
        if self.total_steps:
            shares.append(steps / self.total_steps)
        if self.total_tokens:
            shares.append(tokens / self.total_tokens)
        return min(1.0, max(shares))

"""The spec.chaos block: scheduled and random faults (the local runtime with --chaos, the
operator with --enable-chaos) and slowed groups (local runtime only)."""

from __future__ import annotations

from typing import Annotated, Literal

from diloco_trainer.config import Strict
from pydantic import Field

from diloco_operator.api.kubesyntax import INT64_MAX, MAX_UNITS, MIN_PERIOD_SECONDS


class ChaosEvent(Strict):
    """One scheduled fault."""

    at_seconds: float = Field(ge=0, le=1e6, description="Seconds after the run starts.")
    action: Literal["kill", "pause", "killSyncer", "nodeNotReady"] = Field(
        description="kill: SIGKILL a unit (on Kubernetes: delete its pods with no grace); "
        "pause: SIGSTOP it for pauseSeconds (local runtime only); killSyncer: the same for the "
        "syncer; nodeNotReady: mark a node of the unit NotReady (Kubernetes only)."
    )
    unit: int | None = Field(
        None, ge=0, lt=MAX_UNITS, description="Global unit index; omitted: a seeded random unit."
    )
    pause_seconds: float = Field(
        5.0, ge=MIN_PERIOD_SECONDS, le=3600, description="For pause: how long."
    )


class ChaosSpec(Strict):
    """Fault injection (the local runtime with --chaos, the operator with --enable-chaos) and
    slowed groups (local runtime only)."""

    seed: int = Field(
        0, ge=0, le=INT64_MAX, description="Seeds the random choices (units, kill intervals)."
    )
    schedule: list[ChaosEvent] = Field(
        default_factory=list, max_length=1000, description="Faults at fixed times."
    )
    kill_every_seconds: float | None = Field(
        None,
        ge=1.0,
        le=1e6,
        description="Also kill a random unit at exponential intervals of this mean.",
    )
    slowdown: dict[
        Annotated[str, Field(max_length=12)], Annotated[float, Field(ge=1.0, le=100.0)]
    ] = Field(
        default_factory=dict,
        max_length=16,
        description="Group name -> factor >= 1 stretching each step of its learners (a stand-in "
        "for slower hardware); applied with or without --chaos.",
    )

    @property
    def has_fault_settings(self) -> bool:
        """Whether the block says anything about faults (a block with only `slowdown` leaves
        --chaos to its default faults, as no block does)."""
        return bool(self.model_fields_set - {"slowdown"})

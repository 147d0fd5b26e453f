"""`status.units[].goodput`: the per-unit goodput the planner accounts (planner/goodput.py)."""

from __future__ import annotations

from datetime import datetime

from diloco_trainer.config import Strict
from pydantic import Field


class UnitGoodput(Strict):
    """Useful vs total learner-seconds of one unit, as the local report defines them
    (docs/gke.md, "Monitoring and logs"); the last four fields are the operator's bookkeeping."""

    useful_seconds: float = Field(
        0.0,
        ge=0,
        description="Seconds between two consecutive heartbeats of the same attempt whose step "
        "advanced.",
    )
    total_seconds: float = Field(
        0.0,
        ge=0,
        description="Seconds since the unit first trained, while it was Pending, Online, "
        "Offline or Recreating.",
    )
    ratio: float = Field(0.0, ge=0, le=1, description="usefulSeconds / totalSeconds.")
    last_attempt: int | None = Field(
        None,
        description="The learner process of the last heartbeat counted: its attempt as the "
        "syncer numbers it (recreations x 1000 + restarts in place).",
    )
    last_step: int | None = Field(None, description="Step of the last heartbeat counted.")
    last_heartbeat: float | None = Field(
        None, description="Time of the last heartbeat counted (the syncer's clock, Unix seconds)."
    )
    counted_until: datetime | None = Field(
        None, description="totalSeconds counts up to this moment; null until the unit trained."
    )

"""The DilocoRun status: what the operator (or the local runtime) writes back."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from diloco_trainer.config import Strict
from pydantic import Field

from diloco_operator.kubesyntax import MAX_UNITS

RunPhase = Literal["Pending", "Running", "Degraded", "Succeeded", "Failed"]
UnitState = Literal["Pending", "Online", "Offline", "Recreating", "Removing", "Completed", "Failed"]


class UnitFailure(Strict):
    reason: str = Field(max_length=128)
    message: str = Field("", max_length=1024)
    time: datetime


class UnitStatus(Strict):
    """Bookkeeping of one learner unit; the operator rebuilds it from children when lost."""

    name: str
    group: str
    index: int = Field(description="Index within the group.")
    global_index: int = Field(description="Index across the run (the unit's data shard).")
    state: UnitState
    attempt: int = 0
    restarts: int = 0
    preemptions: int = Field(
        0,
        description="Recreations after a preemption or node maintenance (DisruptionTarget by "
        "preemption, eviction or the kubelet, or its node deleted); not counted in restarts.",
    )
    quick_failures: int = Field(
        0,
        description="Failures in a row of attempts that had not run healthily (crash loop); "
        "the restart backoff doubles with each. 0: recreated at once.",
    )
    since: datetime | None = Field(None, description="When the unit entered its state.")
    last_failure: UnitFailure | None = None


class Condition(Strict):
    """A Kubernetes-style condition (type, status True/False/Unknown, reason, message)."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: datetime
    observed_generation: int | None = None


class DilocoRunStatus(Strict):
    phase: RunPhase = "Pending"
    conditions: list[Condition] = Field(default_factory=list)
    units: list[UnitStatus] = Field(default_factory=list, max_length=MAX_UNITS)
    units_online: int = 0
    replicas: int = Field(0, description="Units of the first group that exist (scale status).")
    selector: str = Field("", description="Label selector of the first group's pods (scale).")
    outer_step: int | None = None
    steps: int | None = None
    tokens: int | None = None
    loss: float | None = None
    train_loss: float | None = None
    final_loss: float | None = Field(
        None,
        description="Held-out loss of the global model evaluated once the budget was reached "
        "(the syncer's finalLoss); null until then.",
    )
    observed_generation: int | None = None
    message: str | None = None

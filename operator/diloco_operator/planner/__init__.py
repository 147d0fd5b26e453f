"""Backend-agnostic planning: (spec, observed units, status, syncer report, now) -> Plan.

Pure functions only; Kubernetes (handlers) and the local process runtime map their world to
`ObservedUnit`s and apply the returned actions. One module per policy:
placement (which units should exist), failure (signals -> Offline -> recreate),
scaling (add/remove units), completion (Succeeded/Failed), conditions (status conditions).
"""

# The `report` input: the syncer's /v1/status, one typed model for every reader.
from diloco_trainer.status import LearnerStatus, SyncerStatus

from diloco_operator.planner.failure import fault_targets
from diloco_operator.planner.model import (
    Action,
    CoverUnit,
    CreateSpare,
    CreateSyncer,
    CreateUnit,
    DeleteUnit,
    EmitEvent,
    ObservedSyncer,
    ObservedUnit,
    Plan,
    ScaleSyncer,
    SuspendUnit,
)
from diloco_operator.planner.placement import UnitSlot, desired_units, unit_name
from diloco_operator.planner.reconcile import plan

__all__ = [
    "Action",
    "CoverUnit",
    "CreateSpare",
    "CreateSyncer",
    "CreateUnit",
    "DeleteUnit",
    "EmitEvent",
    "LearnerStatus",
    "ObservedSyncer",
    "ObservedUnit",
    "Plan",
    "ScaleSyncer",
    "SuspendUnit",
    "SyncerStatus",
    "UnitSlot",
    "desired_units",
    "fault_targets",
    "plan",
    "unit_name",
]

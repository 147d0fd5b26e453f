"""Neutral input and output types of the planner (no Kubernetes, no processes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from diloco_operator.api import DilocoRunStatus

UnitPhase = Literal[
    "Pending", "Running", "Suspended", "Failed", "Succeeded", "Missing", "Terminating"
]

# Failure reasons a backend may report on an ObservedUnit (free text is allowed too).
POD_FAILED = "PodFailed"
DISRUPTION_TARGET = "DisruptionTarget"
NODE_NOT_READY = "NodeNotReady"
NODE_DELETED = "NodeDeleted"
JOB_FAILED = "JobFailed"
POD_DELETED = "PodDeleted"
PROCESS_EXITED = "ProcessExited"
# Reasons the planner itself derives.
UNIT_DELETED = "UnitDeleted"
HEARTBEAT_STALE = "HeartbeatStale"
QUARANTINED = "Quarantined"  # the syncer refuses the attempt's pushes (planner/trust.py)


@dataclass(frozen=True)
class ObservedUnit:
    """What a backend sees of one unit (a Job + its pods, or a process group).

    phase: Pending until every host is Running; Failed/Succeeded when the unit ended;
    Terminating while it is being deleted; Missing (or simply absent from the list) when gone;
    Suspended while its Job is suspended (by the operator for spec.suspend, or by a queue).
    failure: a reason (e.g. DisruptionTarget, NodeNotReady) when the backend saw a failure signal
    even though the phase may still look alive.
    disruption_reason: for DisruptionTarget, the condition's reason (e.g. TerminationByKubelet),
    which tells a preemption from a failure (planner/preemption.py).
    queue: the Kueue LocalQueue its Job is labelled with ("" when none): such a Job's suspension
    belongs to Kueue (admission, eviction, preemption), never to the operator.
    spare: a warm spare of the group (planner/spares.py), not a unit.
    """

    name: str
    group: str
    index: int
    attempt: int
    phase: UnitPhase
    ready: bool = False
    failure: str | None = None
    message: str = ""
    since: float = 0.0
    disruption_reason: str = ""
    queue: str = ""
    spare: bool = False


def gone(obs: ObservedUnit | None) -> bool:
    """Whether a unit has nothing left to observe: absent from the list, or seen Missing."""
    return obs is None or obs.phase == "Missing"


@dataclass(frozen=True)
class ObservedSyncer:
    """present: its Deployment exists; replicas: the Deployment's desired count (None: unknown)."""

    present: bool
    ready: bool
    replicas: int | None = None


@dataclass(frozen=True)
class CreateUnit:
    """Create every child of a unit (Kubernetes: headless Service + Indexed Job)."""

    name: str
    group: str
    index: int
    global_index: int
    attempt: int
    num_units: int
    hosts: int


@dataclass(frozen=True)
class CreateSpare:
    """Create a warm spare of a group (Kubernetes: an Indexed Job of one pod): a learner that
    compiles, then waits at the syncer for a unit to cover (planner/spares.py)."""

    name: str
    group: str
    index: int
    attempt: int
    num_units: int


@dataclass(frozen=True)
class CoverUnit:
    """Ask the syncer to hand unit `name` to a waiting spare of its group, under wire attempt
    `attempt` (the trainer's attempts.cover_attempt), while its pods are recreated."""

    name: str
    group: str
    global_index: int
    num_units: int
    attempt: int


@dataclass(frozen=True)
class DeleteUnit:
    """Delete the whole unit (all its hosts); it counts as gone once no longer observed."""

    name: str
    reason: str


@dataclass(frozen=True)
class SuspendUnit:
    """Suspend (or resume) the unit in place (Kubernetes: the Job's spec.suspend): its pods go,
    the unit stays, nothing counts as a failure."""

    name: str
    suspend: bool


@dataclass(frozen=True)
class CreateSyncer:
    """Ensure the syncer exists (Kubernetes: Deployment, Service, Secret, storage)."""


@dataclass(frozen=True)
class ScaleSyncer:
    """Scale the syncer (0 while the run is suspended, 1 otherwise)."""

    replicas: int


@dataclass(frozen=True)
class EmitEvent:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str
    unit: str | None = None


Action = (
    CreateUnit
    | CreateSpare
    | CoverUnit
    | DeleteUnit
    | SuspendUnit
    | CreateSyncer
    | ScaleSyncer
    | EmitEvent
)


@dataclass(frozen=True)
class Plan:
    """Actions to apply (in order), the status to write once, and when to look again."""

    actions: tuple[Action, ...]
    status: DilocoRunStatus
    requeue_after: float | None = None

    def of_type(self, kind: type) -> list[Any]:
        return [a for a in self.actions if isinstance(a, kind)]

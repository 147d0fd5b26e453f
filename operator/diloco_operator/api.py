"""The DilocoRun custom resource: spec and status models (the CRD is generated from these).

Replica counts: the scale subresource needs ONE replicas path, so `spec.replicas` is the number of
units of the FIRST unit group (the elastic group that `kubectl scale dlr/NAME --replicas=N`
resizes); every further group states its own fixed `replicas`, and the first group must not.
A single-group run therefore reads naturally: `replicas: 4` plus one group describing the hardware.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from diloco_trainer.config import Strict, TrainingConfig, format_validation_error
from pydantic import Field, ValidationError, model_validator

from diloco_operator.accelerators import (
    ACCELERATOR_LABEL,
    ACCELERATORS,
    SPOT_LABEL,
    TOPOLOGY_LABEL,
    check_tpu,
    hosts,
)
from diloco_operator.pod_template import PodTemplate

GROUP = "diloco.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DilocoRun"
PLURAL = "dilocoruns"
SINGULAR = "dilocorun"
SHORT_NAMES = ["dlr"]

# Labels on every child; the planner's unit names and these labels are the whole identity of a
# child, so a restarted operator rebuilds its view from the cluster alone.
LABEL_RUN = "diloco.dev/run"
LABEL_GROUP = "diloco.dev/group"
LABEL_UNIT = "diloco.dev/unit"
LABEL_INDEX = "diloco.dev/index"
LABEL_ATTEMPT = "diloco.dev/attempt"
LABEL_COMPONENT = "app.kubernetes.io/component"

# Run names become prefixes of Job/Service/Pod names (63-char DNS labels): run (40) + "-" +
# group (12) + "-" + index (<= 4 digits) stays below the limit with room for pod suffixes.
MAX_RUN_NAME = 40
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"

Accelerator = Literal["tpu-v6e-slice", "tpu-v5p-slice", "tpu-v5-lite-podslice", "tpu-v4-podslice"]
assert set(Accelerator.__args__) == set(ACCELERATORS)  # type: ignore[attr-defined]

# Kubernetes quantity: "500m", "2Gi" or a plain number (x-kubernetes-int-or-string in the CRD).
Quantity = Annotated[int | str, Field(description="A Kubernetes quantity, e.g. 500m or 2Gi.")]
ShortStr = Annotated[str, Field(max_length=253)]


class ResourceRequirements(Strict):
    """Container resources, as in a Pod spec."""

    requests: dict[ShortStr, Quantity] | None = Field(None, max_length=16)
    limits: dict[ShortStr, Quantity] | None = Field(None, max_length=16)


class Toleration(Strict):
    """A Pod toleration, as in a Pod spec."""

    key: str | None = Field(None, max_length=253)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(None, max_length=253)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class TpuSpec(Strict):
    """One TPU slice per learner unit (GKE node pool labels select it)."""

    accelerator: Accelerator = Field(
        description="GKE TPU accelerator (cloud.google.com/gke-tpu-accelerator)."
    )
    topology: str = Field(
        pattern=r"^[0-9]+x[0-9]+(x[0-9]+)?$",
        max_length=16,
        description="Slice topology (cloud.google.com/gke-tpu-topology), e.g. 2x4 or 2x2x1.",
    )
    chips_per_host: int | None = Field(
        None,
        ge=1,
        le=8,
        description="Chips on one host; default 4 for multi-host slices (1 for 1x1).",
    )

    @model_validator(mode="after")
    def _known_combination(self) -> TpuSpec:
        problem = check_tpu(self.accelerator, self.topology, self.chips_per_host)
        if problem:
            raise ValueError(problem)
        return self

    @property
    def hosts(self) -> int:
        return hosts(self.accelerator, self.topology, self.chips_per_host)

    @property
    def chips_on_each_host(self) -> int:
        from diloco_operator.accelerators import topology_chips

        return topology_chips(self.topology) // self.hosts


class UnitGroup(Strict):
    """A set of identical learner units (one kind of hardware). Several groups = mixed hardware."""

    name: str = Field(
        pattern=DNS_LABEL, min_length=1, max_length=12, description="Group name (DNS label)."
    )
    replicas: int | None = Field(
        None,
        ge=1,
        le=1000,
        description="Units in this group. Not allowed on the first group: spec.replicas sizes it.",
    )
    tpu: TpuSpec | None = Field(None, description="TPU slice per unit; omit for CPU/GPU units.")
    resources: ResourceRequirements | None = Field(
        None, description="Learner container resources (GPU via limits, e.g. nvidia.com/gpu)."
    )
    node_selector: dict[ShortStr, Annotated[str, Field(max_length=63)]] | None = Field(
        None, max_length=16, description="Extra node selector for this group's pods."
    )
    tolerations: list[Toleration] | None = Field(None, max_length=16)
    exclusive_topology: bool = Field(
        False, description="One unit per node pool: pods of other units are kept off it."
    )
    spot: bool = Field(
        False,
        description="Run on Spot VMs: adds the cloud.google.com/gke-spot=true node selector and "
        "toleration. Preemptions are counted in status.units[].preemptions, not as restarts.",
    )
    template: PodTemplate | None = Field(
        None,
        description="Pod customisation merged into this group's pods (labels, annotations, "
        "volumes, env, sidecars, ...); operator-owned fields are refused.",
    )

    @model_validator(mode="after")
    def _selector_not_owned(self) -> UnitGroup:
        owned = [
            *((ACCELERATOR_LABEL, TOPOLOGY_LABEL) if self.tpu else ()),
            *((SPOT_LABEL,) if self.spot else ()),
        ]
        taken = [key for key in owned if key in (self.node_selector or {})]
        if taken:
            raise ValueError(
                f"nodeSelector: {', '.join(taken)} is set by the operator from tpu and spot"
            )
        return self

    @property
    def hosts(self) -> int:
        return self.tpu.hosts if self.tpu else 1


class CheckpointStorage(Strict):
    """Where the syncer keeps checkpoints."""

    path: str | None = Field(
        None,
        max_length=512,
        description="gs://bucket/prefix, or the name of an existing PVC; default: a PVC "
        "<run>-checkpoints created by the operator.",
    )
    size: Quantity = Field("10Gi", description="Size of the created PVC.")
    storage_class: str | None = Field(None, max_length=253, description="StorageClass of the PVC.")
    ephemeral: bool = Field(False, description="emptyDir instead of a PVC (tests, kind).")

    @property
    def is_bucket(self) -> bool:
        return bool(self.path and self.path.startswith("gs://"))


class SyncerSpec(Strict):
    """The outer-sync service (CPU only): one Deployment with a Service."""

    resources: ResourceRequirements | None = None
    port: int = Field(8470, ge=1024, le=65535, description="Syncer HTTP port.")
    checkpoint: CheckpointStorage = Field(default_factory=lambda: CheckpointStorage())
    node_selector: dict[ShortStr, Annotated[str, Field(max_length=63)]] | None = Field(
        None, max_length=16, description="Node labels the syncer pod must run on (a CPU pool)."
    )
    tolerations: list[Toleration] | None = Field(
        None, max_length=16, description="Taints the syncer pod tolerates."
    )
    template: PodTemplate | None = Field(
        None,
        description="Pod customisation merged into the syncer pod; operator-owned fields are "
        "refused.",
    )


class FailurePolicy(Strict):
    """How failed units are handled."""

    max_unit_restarts: int = Field(
        10, ge=0, le=10000, description="Recreations per unit before it is given up (Failed)."
    )
    restart_backoff_seconds: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="Crash-loop backoff: the wait between a unit being gone and its recreation "
        "after a quick failure (one before the attempt ran healthily); it doubles with each "
        "further quick failure in a row. A unit that had run healthily is recreated at once.",
    )
    max_restart_backoff_seconds: float = Field(
        300.0, ge=0, le=86400, description="Cap of the doubling crash-loop backoff."
    )
    healthy_after_seconds: float = Field(
        10.0,
        ge=0,
        le=86400,
        description="An attempt that was Online this long (and, when the syncer reports it, "
        "made training progress) ran healthily: its failure is restarted at once and clears "
        "the crash-loop count.",
    )
    offline_after_seconds: float = Field(
        30.0, gt=0, le=86400, description="Heartbeat age at the syncer that marks a unit Offline."
    )


class ChaosEvent(Strict):
    """One scheduled fault."""

    at_seconds: float = Field(ge=0, le=1e6, description="Seconds after the run starts.")
    action: Literal["kill", "pause", "killSyncer", "nodeNotReady"] = Field(
        description="kill: SIGKILL a unit (on Kubernetes: delete its pods with no grace); "
        "pause: SIGSTOP it for pauseSeconds (local runtime only); killSyncer: the same for the "
        "syncer; nodeNotReady: mark a node of the unit NotReady (Kubernetes only)."
    )
    unit: int | None = Field(
        None, ge=0, description="Global unit index; omitted: a seeded random unit."
    )
    pause_seconds: float = Field(5.0, gt=0, le=3600, description="For pause: how long.")


class ChaosSpec(Strict):
    """Fault injection (the local runtime with --chaos, the operator with --enable-chaos) and
    slowed groups (local runtime only)."""

    seed: int = Field(0, ge=0)
    schedule: list[ChaosEvent] = Field(default_factory=list, max_length=1000)
    kill_every_seconds: float | None = Field(
        None, gt=0, description="Also kill a random unit at exponential intervals of this mean."
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


class DilocoRunSpec(Strict):
    """Desired state of a decoupled-DiLoCo training run."""

    image: str = Field(min_length=1, max_length=512, description="Trainer image (learner+syncer).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    replicas: int = Field(
        1, ge=1, le=1000, description="Units of the first unit group (the scale subresource)."
    )
    unit_groups: list[UnitGroup] = Field(
        default_factory=lambda: [UnitGroup(name="default")],
        min_length=1,
        max_length=16,
        description="Kinds of hardware; each unit is one slice (or one pod) of its group.",
    )
    training: TrainingConfig = Field(description="The trainer's configuration (spec.training).")
    syncer: SyncerSpec = Field(default_factory=lambda: SyncerSpec())
    failure_policy: FailurePolicy = Field(default_factory=lambda: FailurePolicy())
    chaos: ChaosSpec | None = Field(
        None,
        description="Fault injection: acted on by the local runtime with --chaos and by an "
        "operator started with --enable-chaos (the chart's chaos.enabled); ignored otherwise. "
        "Slowed groups: local runtime only.",
    )
    service_account_name: str | None = Field(None, max_length=253)

    @model_validator(mode="after")
    def _consistent(self) -> DilocoRunSpec:
        first, *rest = self.unit_groups
        if first.replicas is not None:
            raise ValueError(
                "unitGroups[0].replicas: the first group is sized by spec.replicas; remove it"
            )
        for i, group in enumerate(rest, start=1):
            if group.replicas is None:
                raise ValueError(
                    f"unitGroups[{i}].replicas: required for every group but the first"
                )
        names = [g.name for g in self.unit_groups]
        if len(set(names)) != len(names):
            raise ValueError(f"unitGroups[].name: group names must be unique, got {names}")
        for slowed in self.chaos.slowdown if self.chaos else {}:
            if slowed not in names:
                raise ValueError(
                    f"chaos.slowdown.{slowed}: no unit group of that name (groups: {names})"
                )
        if self.training.quorum > self.total_units:
            raise ValueError(
                f"training.quorum: {self.training.quorum} exceeds the {self.total_units} units "
                "of the run"
            )
        return self

    def group_replicas(self, index: int) -> int:
        group = self.unit_groups[index]
        return self.replicas if index == 0 else group.replicas or 0

    @property
    def total_units(self) -> int:
        return sum(self.group_replicas(i) for i in range(len(self.unit_groups)))

    def group(self, name: str) -> UnitGroup | None:
        return next((g for g in self.unit_groups if g.name == name), None)


# --- status -------------------------------------------------------------------------------

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
    units: list[UnitStatus] = Field(default_factory=list)
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


def parse_spec(spec: dict[str, Any], prefix: str = "spec") -> DilocoRunSpec:
    """Validate a manifest's spec; raises ValueError whose lines name each bad field."""
    try:
        return DilocoRunSpec.model_validate(spec)
    except ValidationError as exc:
        raise ValueError(format_validation_error(exc, prefix).replace("Value error, ", "")) from exc


def parse_manifest(doc: dict[str, Any]) -> DilocoRunSpec:
    """Validate a whole DilocoRun manifest (apiVersion, kind, metadata.name, spec)."""
    if doc.get("apiVersion") != API_VERSION:
        raise ValueError(f"apiVersion: expected {API_VERSION}, got {doc.get('apiVersion')!r}")
    if doc.get("kind") != KIND:
        raise ValueError(f"kind: expected {KIND}, got {doc.get('kind')!r}")
    name = (doc.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("metadata.name: required")
    if len(name) > MAX_RUN_NAME:
        raise ValueError(f"metadata.name: at most {MAX_RUN_NAME} characters, got {len(name)}")
    if not isinstance(doc.get("spec"), dict):
        raise ValueError("spec: required (a mapping)")
    return parse_spec(doc["spec"])

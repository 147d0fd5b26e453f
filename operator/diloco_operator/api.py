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

from diloco_operator.accelerators import ACCELERATORS, check_tpu, hosts
from diloco_operator.unit_goodput import UnitGoodput

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

    requests: dict[ShortStr, Quantity] | None = Field(
        None, max_length=16, description="Resource name -> amount the scheduler reserves."
    )
    limits: dict[ShortStr, Quantity] | None = Field(
        None, max_length=16, description="Resource name -> most the container may use."
    )


class Toleration(Strict):
    """A Pod toleration, as in a Pod spec."""

    key: str | None = Field(
        None, max_length=253, description="Taint key; empty with operator Exists: every taint."
    )
    operator: Literal["Exists", "Equal"] | None = Field(
        None, description="Exists: any value; Equal (the default): the value must match."
    )
    value: str | None = Field(None, max_length=253, description="Taint value (for Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; empty: every effect."
    )
    toleration_seconds: int | None = Field(
        None, description="For NoExecute: seconds the pod stays after the taint; empty: forever."
    )


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
    tolerations: list[Toleration] | None = Field(
        None, max_length=16, description="Extra taints this group's pods tolerate."
    )
    exclusive_topology: bool = Field(
        False, description="One unit per node pool: pods of other units are kept off it."
    )

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

    resources: ResourceRequirements | None = Field(
        None, description="Syncer container resources (CPU and memory)."
    )
    port: int = Field(8470, ge=1024, le=65535, description="Syncer HTTP port.")
    checkpoint: CheckpointStorage = Field(default_factory=lambda: CheckpointStorage())
    node_selector: dict[ShortStr, Annotated[str, Field(max_length=63)]] | None = Field(
        None, max_length=16, description="Node labels the syncer pod must run on (a CPU pool)."
    )
    tolerations: list[Toleration] | None = Field(
        None, max_length=16, description="Taints the syncer pod tolerates."
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

    seed: int = Field(0, ge=0, description="Seeds the random choices (units, kill intervals).")
    schedule: list[ChaosEvent] = Field(
        default_factory=list, max_length=1000, description="Faults at fixed times."
    )
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
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Pull policy of the learner and syncer containers."
    )
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
    service_account_name: str | None = Field(
        None,
        max_length=253,
        description="ServiceAccount of the learner and syncer pods (e.g. one bound to a Google "
        "service account through Workload Identity); default: the namespace's default.",
    )

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
    """The last failure seen on a unit."""

    reason: str = Field(max_length=128, description="Failure signal, e.g. PodFailed.")
    message: str = Field("", max_length=1024, description="What was seen, in words.")
    time: datetime = Field(description="When it was seen.")


class UnitStatus(Strict):
    """Bookkeeping of one learner unit; the operator rebuilds it from children when lost."""

    name: str = Field(description="Unit name: its Job and headless Service.")
    group: str = Field(description="Unit group (spec.unitGroups[].name).")
    index: int = Field(description="Index within the group.")
    global_index: int = Field(description="Index across the run (the unit's data shard).")
    state: UnitState = Field(
        description="Pending (created, not all hosts ready), Online, Offline (failed, waiting "
        "to be recreated), Recreating, Removing (scaled down), Completed or Failed (restart "
        "budget spent)."
    )
    attempt: int = Field(0, description="Attempt number of the unit's current Job (from 0).")
    restarts: int = Field(0, description="Recreations after failures (maxUnitRestarts bounds it).")
    quick_failures: int = Field(
        0,
        description="Failures in a row of attempts that had not run healthily (crash loop); "
        "the restart backoff doubles with each. 0: recreated at once.",
    )
    since: datetime | None = Field(None, description="When the unit entered its state.")
    last_failure: UnitFailure | None = Field(None, description="The last failure seen.")
    goodput: UnitGoodput | None = Field(
        None, description="Useful vs total seconds; null until the syncer reported the unit."
    )


class Condition(Strict):
    """A Kubernetes-style condition (type, status True/False/Unknown, reason, message)."""

    type: str = Field(description="Ready, Degraded, Progressing or Complete.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="Why, as one CamelCase word.")
    message: str = Field("", description="Why, in words.")
    last_transition_time: datetime = Field(description="When the status last changed.")
    observed_generation: int | None = Field(
        None, description="The spec generation the condition was computed from."
    )


class DilocoRunStatus(Strict):
    """Observed state of the run, written by the operator."""

    phase: RunPhase = Field(
        "Pending",
        description="Pending (no unit online yet), Running, Degraded (a unit Offline, Recreating "
        "or Failed), Succeeded (budget reached) or Failed (fewer units left than the quorum).",
    )
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready, Degraded, Progressing and Complete."
    )
    units: list[UnitStatus] = Field(default_factory=list, description="One entry per unit.")
    units_online: int = Field(0, description="Units in state Online.")
    replicas: int = Field(0, description="Units of the first group that exist (scale status).")
    selector: str = Field("", description="Label selector of the first group's pods (scale).")
    outer_step: int | None = Field(
        None, description="Sum of the fragment versions at the syncer (merges so far)."
    )
    steps: int | None = Field(None, description="Inner steps summed over all learners.")
    tokens: int | None = Field(None, description="Tokens summed over all learners.")
    loss: float | None = Field(None, description="Latest held-out loss of the global model.")
    train_loss: float | None = Field(
        None, description="Token-weighted mean of the learners' latest losses."
    )
    final_loss: float | None = Field(
        None,
        description="Held-out loss of the global model evaluated once the budget was reached "
        "(the syncer's finalLoss); null until then.",
    )
    observed_generation: int | None = Field(
        None, description="The spec generation this status was computed from."
    )
    message: str | None = Field(None, description="Why the run is in its phase, in words.")


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

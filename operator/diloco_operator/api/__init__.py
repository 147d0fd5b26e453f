"""The DilocoRun custom resource: spec and status models (the CRD is generated from these).

Replica counts: the scale subresource needs ONE replicas path, so `spec.replicas` is the number of
units of the FIRST unit group (the elastic group that `kubectl scale dlr/NAME --replicas=N`
resizes); every further group states its own fixed `replicas`, and the first group must not.
A single-group run therefore reads naturally: `replicas: 4` plus one group describing the hardware.

A unit group's model is in unit_group.py, the status models in status.py; the parsers of a
manifest (`parse_spec`, `parse_manifest`) are here.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from diloco_trainer import attempts
from diloco_trainer.config import Strict, TrainingConfig, format_validation_error
from diloco_trainer.shards import MAX_SHARDS
from pydantic import Field, ValidationError, ValidationInfo, model_validator

from diloco_operator.api import pod_paths
from diloco_operator.api.chaos_spec import ChaosEvent, ChaosSpec
from diloco_operator.api.clusters import (
    CredentialId,
    ExternalSyncer,
    SyncerExposure,
    SyncerTls,
    check_cluster_fields,
    check_shards,
)
from diloco_operator.api.kubesyntax import (
    CHECKPOINT_PATH,
    DNS_SUBDOMAIN,
    HEARTBEATS_PER_OFFLINE,
    IMAGE,
    MAX_UNITS,
    MIN_PERIOD_SECONDS,
    RUN_NAME,
)
from diloco_operator.api.kubetypes import (
    NodeSelector,
    Quantity,
    ResourceRequirements,
    Toleration,
)
from diloco_operator.api.pod_security import RUN_TOKEN_WHY, run_token_pattern, secret_references
from diloco_operator.api.pod_template import PodTemplate
from diloco_operator.api.unit_group import UnitGroup

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
LABEL_SPARE = "diloco.dev/spare"  # "true" on a warm spare's Job and pods (no unit of its own)
LABEL_COMPONENT = "app.kubernetes.io/component"

# Run names become prefixes of Job/Service/Pod names (63-char DNS labels): run (40) + "-" +
# group (12) + "-" + index (<= 4 digits) stays below the limit with room for pod suffixes.
MAX_RUN_NAME = 40


class CheckpointStorage(Strict):
    """Where the syncer keeps checkpoints."""

    path: str | None = Field(
        None,
        max_length=512,
        pattern=CHECKPOINT_PATH,
        description="gs://bucket/prefix, or the name of an existing PVC; default: a PVC "
        "<run>-checkpoints created by the operator.",
    )
    size: Quantity = Field("10Gi", description="Size of the created PVC.")
    storage_class: str | None = Field(
        None, max_length=253, pattern=DNS_SUBDOMAIN, description="StorageClass of the PVC."
    )
    ephemeral: bool = Field(False, description="emptyDir instead of a PVC (tests, kind).")
    retention_policy: Literal["Retain", "Delete"] = Field(
        "Retain",
        description="What happens to the PVC the operator creates when the run is deleted: "
        "Retain keeps it (a run re-created under the same name resumes from its checkpoints; "
        "`kubectl delete pvc <run>-checkpoints` frees it), Delete removes it with the run.",
    )

    @property
    def is_bucket(self) -> bool:
        return bool(self.path and self.path.startswith("gs://"))

    @property
    def on_claim(self) -> bool:
        """Kept on a PersistentVolumeClaim (the operator's or an existing one)."""
        return not self.is_bucket and not self.ephemeral


class SyncerSpec(Strict):
    """The outer-sync service (CPU only): one Deployment with a Service."""

    resources: ResourceRequirements | None = Field(
        None, description="Syncer container resources (CPU and memory)."
    )
    port: int = Field(8470, ge=1024, le=65535, description="Syncer HTTP port.")
    shards: int = Field(
        1,
        ge=1,
        le=MAX_SHARDS,
        description="Syncer processes dividing the fragments (each its own Deployment, "
        "checkpoint folder and standby; shard 0 also keeps the data leases and evaluates). At "
        "most training.fragments; fixed for the life of the run.",
    )
    standby: bool = Field(
        True,
        description="Keep a warm standby syncer beside the serving one (a second process "
        "locally, a second container in the syncer pod): it follows the fragment journal and "
        "serves within a second when the serving syncer's process dies, with every published "
        "version. Costs a second copy of the syncer's memory.",
    )
    checkpoint: CheckpointStorage = Field(default_factory=lambda: CheckpointStorage())
    node_selector: NodeSelector | None = Field(
        None, description="Node labels the syncer pod must run on (a CPU pool)."
    )
    tolerations: list[Toleration] | None = Field(
        None, max_length=16, description="Taints the syncer pod tolerates."
    )
    template: PodTemplate | None = Field(
        None,
        description="Pod customisation merged into the syncer pod; operator-owned fields are "
        "refused.",
    )
    tls: SyncerTls | None = Field(
        None,
        description="Serve HTTPS with this certificate; required when the syncer is reached "
        "from other clusters. Unset: plain HTTP, inside the cluster only.",
    )
    expose: SyncerExposure | None = Field(
        None, description="How other clusters reach the syncer (default: in-cluster only)."
    )
    external: ExternalSyncer | None = Field(
        None,
        description="Join the syncer of a run whose home is another cluster instead of running "
        "one here (an away run).",
    )
    revoked_credentials: list[CredentialId] | None = Field(
        None,
        max_length=256,
        description="Ids of join credentials the syncer refuses from now on (credential_revoked), "
        "whatever their expiry: `diloco join-credential` prints each one's id.",
    )


class FailurePolicy(Strict):
    """How failed units are handled."""

    max_unit_restarts: int = Field(
        10, ge=0, le=10000, description="Recreations per unit before it is given up (Failed)."
    )
    in_place_restarts: int = Field(
        3,
        ge=0,
        le=attempts.STRIDE - 1,
        description="Restarts of a crashed learner in its own pod (same node and devices, "
        "queue admission kept: a supervisor in the container forks it again) before the unit "
        "is recreated instead, per pod. 0: every crash recreates the unit. Not counted in "
        "maxUnitRestarts; a lost pod or node is always a recreation.",
    )
    kubelet_restart_rule: bool = Field(
        False,
        description="Also give the learner container the kubelet's RestartAllContainers "
        "restart rule, for a crash that takes its supervisor down too (the container's main "
        "process killed): the pod's containers restart in place instead of the unit being "
        "recreated. Needs Kubernetes 1.36+ and nodes that declare the feature (kubelets of "
        "1.36+): the scheduler places such pods only there, so node pools older than the "
        "control plane would leave them Pending. Counted in inPlaceRestarts.",
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
        30.0,
        ge=3 * MIN_PERIOD_SECONDS,
        le=86400,
        description="Heartbeat age at the syncer that marks a unit Offline; at least "
        f"{HEARTBEATS_PER_OFFLINE} heartbeat periods (training.heartbeatSeconds).",
    )

    @model_validator(mode="after")
    def _backoff_within_cap(self) -> FailurePolicy:
        if self.restart_backoff_seconds > self.max_restart_backoff_seconds:
            raise ValueError(
                f"restartBackoffSeconds: {self.restart_backoff_seconds} is above its cap "
                f"maxRestartBackoffSeconds ({self.max_restart_backoff_seconds})"
            )
        return self


class DilocoRunSpec(Strict):
    """Desired state of a decoupled-DiLoCo training run."""

    image: str = Field(
        min_length=1,
        max_length=512,
        pattern=IMAGE,
        description="Trainer image (learner+syncer).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Pull policy of the learner and syncer containers."
    )
    replicas: int = Field(
        1, ge=1, le=MAX_UNITS, description="Units of the first unit group (the scale subresource)."
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
    suspend: bool = Field(
        False,
        description="Suspend the run: its units stop (their Jobs are suspended; a unit queued "
        "through Kueue has its Job deleted instead, which gives its quota back) and the syncer "
        "is scaled to zero, without spending restarts. Setting it back to false resumes from "
        "the global parameters of the syncer's last checkpoint.",
    )
    service_account_name: str | None = Field(
        None,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="ServiceAccount of the learner and syncer pods (e.g. one bound to a Google "
        "service account through Workload Identity); default: the namespace's default.",
    )

    @model_validator(mode="after")
    def _no_run_token_in_templates(self, info: ValidationInfo) -> DilocoRunSpec:
        # Only the manifest knows the run's name, hence the validation context (parse_spec).
        run = (info.context or {}).get("run")
        if not run:
            return self
        token = re.compile(run_token_pattern(run))
        templates = [("syncer.template", self.syncer.template)] + [
            (f"unitGroups[{i}].template", g.template) for i, g in enumerate(self.unit_groups)
        ]
        for where, template in templates:
            for field, name in secret_references(template.to_wire() if template else {}):
                if token.match(name):
                    raise ValueError(f"{where}.{field}: {name} is {RUN_TOKEN_WHY}")
        return self

    @model_validator(mode="after")
    def _pods_have_what_they_read(self, info: ValidationInfo) -> DilocoRunSpec:
        # Only runs on Kubernetes (the context's `pods`): the local runtime reads the machine's
        # own files, relative paths included.
        if (info.context or {}).get("pods"):
            learners = [
                (f"the unitGroups[{i}] learners", g.template)
                for i, g in enumerate(self.unit_groups)
                if not g.remote
            ]
            syncer = [] if self.away else [("the syncer", self.syncer.template)]
            problems = pod_paths.unprovided(self.training, learners, syncer)
            if problems:
                raise ValueError("; ".join(problems))
        return self

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
        total = self.total_units
        if total > MAX_UNITS:
            raise ValueError(
                f"replicas: the run has {total} units (spec.replicas plus unitGroups[].replicas); "
                f"at most {MAX_UNITS}"
            )
        if self.training.quorum > total:
            raise ValueError(
                f"training.quorum: {self.training.quorum} exceeds the {total} units of the run"
            )
        for i, event in enumerate(self.chaos.schedule if self.chaos else []):
            if event.unit is not None and event.unit >= total:
                raise ValueError(
                    f"chaos.schedule.{i}.unit: unit {event.unit} does not exist "
                    f"(the run has units 0..{total - 1})"
                )
        for i, group in enumerate(self.unit_groups):
            if group.compression is not None:
                try:
                    group.compression.over(self.training.compression)
                except ValidationError as exc:
                    why = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
                    raise ValueError(f"unitGroups[{i}].compression: {why}") from None
        syncer = self.syncer
        remote = [g.remote for g in self.unit_groups]
        check_cluster_fields(syncer.external, syncer.expose, syncer.tls, remote)
        check_shards(syncer.shards, self.training.fragments, self.away, bool(syncer.expose), remote)
        heartbeat = self.training.heartbeat_seconds
        offline = self.failure_policy.offline_after_seconds
        if heartbeat * HEARTBEATS_PER_OFFLINE > offline:
            raise ValueError(
                f"training.heartbeatSeconds: {heartbeat} is not well below "
                f"failurePolicy.offlineAfterSeconds ({offline}); at most 1/"
                f"{HEARTBEATS_PER_OFFLINE} of it, or healthy units are taken offline"
            )
        return self

    def group_replicas(self, index: int) -> int:
        group = self.unit_groups[index]
        return self.replicas if index == 0 else group.replicas or 0

    @property
    def total_units(self) -> int:
        return sum(self.group_replicas(i) for i in range(len(self.unit_groups)))

    @property
    def away(self) -> bool:
        """This run joins a syncer in another cluster (it runs none)."""
        return self.syncer.external is not None

    def group(self, name: str) -> UnitGroup | None:
        return next((g for g in self.unit_groups if g.name == name), None)


# The status models live in diloco_operator.api.status; re-exported here, with the spec.
from diloco_operator.api.status import (  # noqa: E402
    Condition,
    DilocoRunStatus,
    RunPhase,
    UnitFailure,
    UnitState,
    UnitStatus,
)

__all__ = [
    "ChaosEvent",
    "ChaosSpec",
    "Condition",
    "DilocoRunStatus",
    "Quantity",
    "ResourceRequirements",
    "RunPhase",
    "Toleration",
    "UnitFailure",
    "UnitState",
    "UnitStatus",
]


def _integral_floats_as_ints(value: Any) -> Any:
    """5.0 is an integer to the API server's schema validation; say the same here (strict
    validation would refuse it, lax validation would also take "5")."""
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def parse_spec(
    spec: dict[str, Any], prefix: str = "spec", run: str | None = None, pods: bool = False
) -> DilocoRunSpec:
    """Validate a manifest's spec; raises ValueError whose lines name each bad field. With the
    run's name, pod templates that name its token Secrets are refused too; with `pods` (a run
    on Kubernetes), paths the training reads that its pods would not have (api/pod_paths.py).

    Strict types, as the API server's schema: "5" is not a number, 1 is not a boolean."""
    try:
        return DilocoRunSpec.model_validate(
            _integral_floats_as_ints(spec), strict=True, context={"run": run, "pods": pods}
        )
    except ValidationError as exc:
        text = format_validation_error(exc, prefix).replace("Value error, ", "")
        # A model-level rule names its field first ("spec: chaos.schedule.0.unit: ..."): one path.
        text = re.sub(
            rf"^{re.escape(prefix)}: ([A-Za-z][\w.\[\]]*): ", rf"{prefix}.\1: ", text, flags=re.M
        )
        raise ValueError(text) from exc


def parse_manifest(doc: dict[str, Any], pods: bool = False) -> DilocoRunSpec:
    """Validate a whole DilocoRun manifest (apiVersion, kind, metadata.name, spec); `pods`: as
    a run on Kubernetes (parse_spec)."""
    if doc.get("apiVersion") != API_VERSION:
        raise ValueError(f"apiVersion: expected {API_VERSION}, got {doc.get('apiVersion')!r}")
    if doc.get("kind") != KIND:
        raise ValueError(f"kind: expected {KIND}, got {doc.get('kind')!r}")
    name = (doc.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("metadata.name: required")
    if len(name) > MAX_RUN_NAME:
        raise ValueError(f"metadata.name: at most {MAX_RUN_NAME} characters, got {len(name)}")
    if not re.match(RUN_NAME, name):
        raise ValueError(
            f"metadata.name: {name!r} is not a valid name for the run's Services (lower-case "
            "letters, digits and '-', starting with a letter)"
        )
    if not isinstance(doc.get("spec"), dict):
        raise ValueError("spec: required (a mapping)")
    return parse_spec(doc["spec"], run=name, pods=pods)

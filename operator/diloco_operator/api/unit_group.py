"""A unit group of a DilocoRun (`spec.unitGroups[]`): a set of identical learner units on one
kind of hardware (a TPU slice per unit, or a CPU/GPU pod), where its pods are scheduled (node
selector, tolerations, Spot VMs) and the pod template merged into them.
"""

from __future__ import annotations

from typing import Literal

from diloco_trainer.config import LinkCompression, Strict
from pydantic import Field, model_validator

from diloco_operator.api.accelerators import (
    ACCELERATOR_LABEL,
    ACCELERATORS,
    SPOT_LABEL,
    TOPOLOGY_LABEL,
    check_tpu,
    hosts,
    topology_chips,
)
from diloco_operator.api.capacity import SELECTOR_KEYS, Capacity, KueueTopology
from diloco_operator.api.kubesyntax import DNS_LABEL, MAX_UNITS, NORMAL_PATH
from diloco_operator.api.kubetypes import NodeSelector, ResourceRequirements, Toleration
from diloco_operator.api.pod_template import PodTemplate

# jax.distributed's processes in one CPU/GPU unit (GKE's largest GPU node pools are hundreds).
MAX_HOSTS_PER_UNIT = 1024
# Warm spares per group: each holds a unit's hardware, so a handful is already a lot.
MAX_SPARES = 16

Accelerator = Literal[
    "tpu-v6e-slice", "tpu-v5p-slice", "tpu-v5-lite-podslice", "tpu-v4-podslice", "tpu7x"
]
assert set(Accelerator.__args__) == set(ACCELERATORS)  # type: ignore[attr-defined]


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
        return topology_chips(self.topology) // self.hosts


class UnitGroup(Strict):
    """A set of identical learner units (one kind of hardware). Several groups = mixed hardware."""

    name: str = Field(
        pattern=DNS_LABEL, min_length=1, max_length=12, description="Group name (DNS label)."
    )
    replicas: int | None = Field(
        None,
        ge=1,
        le=MAX_UNITS,
        description="Units in this group. Not allowed on the first group: spec.replicas sizes it.",
    )
    tpu: TpuSpec | None = Field(None, description="TPU slice per unit; omit for CPU/GPU units.")
    hosts_per_unit: int | None = Field(
        None,
        ge=1,
        le=MAX_HOSTS_PER_UNIT,
        description="Pods (one per host) in each CPU/GPU unit: several form one JAX program "
        "(jax.distributed, host 0 coordinates) and restart together. Default 1. A TPU unit's "
        "hosts come from its topology.",
    )
    resources: ResourceRequirements | None = Field(
        None, description="Learner container resources (GPU via limits, e.g. nvidia.com/gpu)."
    )
    node_selector: NodeSelector | None = Field(
        None, description="Extra node selector for this group's pods."
    )
    tolerations: list[Toleration] | None = Field(
        None, max_length=16, description="Extra taints this group's pods tolerate."
    )
    exclusive_topology: bool | None = Field(
        None,
        description="One unit per node pool: all hosts of a unit share one node pool (one "
        "slice) and pods of other units are kept off it. Default: true for a multi-host TPU "
        "slice, false otherwise.",
    )
    spot: bool = Field(
        False,
        description="Run on Spot VMs: adds the cloud.google.com/gke-spot=true node selector and "
        "toleration. Preemptions are counted in status.units[].preemptions, not as restarts.",
    )
    capacity: Capacity | None = Field(
        None,
        description="Where the group's nodes come from beyond on-demand and spot: a "
        "reservation, flex-start VMs, a queued-provisioning run duration.",
    )
    kueue_topology: KueueTopology | None = Field(
        None,
        description="Kueue topology-aware scheduling of each unit's pods (runs admitted by "
        "Kueue through a ResourceFlavor with a topology).",
    )
    remote: bool = Field(
        False,
        description="This group's units run in another cluster (a DilocoRun there with "
        "syncer.external): here they are admitted by the syncer and reported, never created.",
    )
    template: PodTemplate | None = Field(
        None,
        description="Pod customisation merged into this group's pods (labels, annotations, "
        "volumes, env, sidecars, ...); operator-owned fields are refused.",
    )
    compile_cache: str | None = Field(
        None,
        max_length=1024,
        pattern=NORMAL_PATH,
        description="Where this group's learners keep JAX's persistent compilation cache (an "
        "absolute path on a volume the group's template mounts: a PVC or a GCS FUSE bucket), "
        "shared by every attempt and unit of the group: a recreated pod skips compiling. "
        "Default: a pod-local emptyDir, kept across restarts in place only.",
    )
    spares: int = Field(
        0,
        ge=0,
        le=MAX_SPARES,
        description="Warm spare pods kept started for this group (JAX imported, step compiled, "
        "waiting at the syncer): when a unit's pods are lost, a spare trains as that unit at "
        "once while its pods are recreated, then waits again. Each spare holds a unit's "
        "hardware. Units of one host only.",
    )
    compression: LinkCompression | None = Field(
        None,
        description="This group's own compression of its pushes over training.compression "
        "(a group across a thin link: int2 with errorFeedback). The downlink stays the run's.",
    )

    def compression_json(self) -> str:
        """What the group's learners get as DILOCO_COMPRESSION ("" for the run's own)."""
        if self.compression is None:
            return ""
        return self.compression.model_dump_json(by_alias=True, exclude_none=True)

    def learner_env(self) -> dict[str, str]:
        """The environment this group's learners get on top of every learner's (its own push
        compression, its compile cache), on Kubernetes and in the local runtime alike."""
        env = {"DILOCO_COMPRESSION": self.compression_json()}
        env["JAX_COMPILATION_CACHE_DIR"] = self.compile_cache or ""
        return {k: v for k, v in env.items() if v}

    @model_validator(mode="after")
    def _exclusive_by_default_across_hosts(self) -> UnitGroup:
        # A unit's hosts must be the hosts of one slice: the scheduler alone may place them on
        # two node pools of the same shape, and the slice never forms. Unset means "keep the
        # unit to one slice" wherever it spans several hosts; an explicit false stays false.
        if self.exclusive_topology is None:
            self.exclusive_topology = self.tpu is not None and self.hosts > 1
        return self

    @model_validator(mode="after")
    def _hosts_of_a_slice_from_its_topology(self) -> UnitGroup:
        if self.tpu and self.hosts_per_unit is not None:
            raise ValueError(
                "hostsPerUnit: a TPU unit's hosts come from tpu.topology; remove hostsPerUnit"
            )
        return self

    @model_validator(mode="after")
    def _spares_of_one_host(self) -> UnitGroup:
        if self.spares and self.hosts > 1:
            raise ValueError(
                f"spares: warm spares cover units of one host; this group's units have "
                f"{self.hosts} hosts"
            )
        if self.spares and self.remote:
            raise ValueError("spares: a remote group's spares belong to its own cluster's run")
        return self

    @model_validator(mode="after")
    def _selector_not_owned(self) -> UnitGroup:
        owned = [
            *((ACCELERATOR_LABEL, TOPOLOGY_LABEL) if self.tpu else ()),
            *((SPOT_LABEL,) if self.spot else ()),
            *(SELECTOR_KEYS if self.capacity else ()),
        ]
        taken = [key for key in owned if key in (self.node_selector or {})]
        if taken:
            raise ValueError(
                f"nodeSelector: {', '.join(taken)} is set by the operator from tpu, spot and "
                "capacity"
            )
        return self

    @model_validator(mode="after")
    def _spot_or_capacity(self) -> UnitGroup:
        # A node is Spot, reserved or flex-start: asking for two selects no node at all.
        if self.spot and self.capacity and (self.capacity.reservation or self.capacity.flex_start):
            raise ValueError("spot: Spot VMs or capacity.reservation/flexStart, not both")
        return self

    @property
    def hosts(self) -> int:
        return self.tpu.hosts if self.tpu else self.hosts_per_unit or 1

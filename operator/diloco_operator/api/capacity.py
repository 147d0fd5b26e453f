"""Where a group's TPU capacity comes from, and how Kueue places its pods.

GKE offers TPU slices on demand, as Spot VMs (`spot`), from a Compute Engine reservation, or as
flex-start VMs from the Dynamic Workload Scheduler; a pod picks them by node selector labels GKE
puts on the nodes. With Kueue, a ClusterQueue whose admission check is a ProvisioningRequest
(queued provisioning) obtains a unit's whole slice at once before it admits the Job, bounded by
the Job's `provreq.kueue.x-k8s.io/maxRunDurationSeconds`, and Kueue's topology-aware scheduling
places a unit's pods within one domain of a topology level (a pod template annotation). These are
passthroughs: the operator writes the labels and annotations the other components read.
docs/gke.md, "Capacity and topology: reservations, flex-start, queued provisioning, Kueue TAS".
"""

from __future__ import annotations

from diloco_trainer.config import Strict
from pydantic import Field, model_validator

from diloco_operator.api.kubesyntax import QUALIFIED_NAME

RESERVATION_NAME_LABEL = "cloud.google.com/reservation-name"
RESERVATION_AFFINITY_LABEL = "cloud.google.com/reservation-affinity"
RESERVATION_PROJECT_LABEL = "cloud.google.com/reservation-project"
FLEX_START_LABEL = "cloud.google.com/gke-flex-start"
# Kueue copies a Job's annotations of this prefix into its ProvisioningRequest's parameters.
MAX_RUN_DURATION_ANNOTATION = "provreq.kueue.x-k8s.io/maxRunDurationSeconds"
REQUIRED_TOPOLOGY_ANNOTATION = "kueue.x-k8s.io/podset-required-topology"
PREFERRED_TOPOLOGY_ANNOTATION = "kueue.x-k8s.io/podset-preferred-topology"
SELECTOR_KEYS = (
    RESERVATION_NAME_LABEL,
    RESERVATION_AFFINITY_LABEL,
    RESERVATION_PROJECT_LABEL,
    FLEX_START_LABEL,
)
# A ProvisioningRequest's VMs live at most seven days (GKE's flex-start limit).
MAX_RUN_SECONDS = 7 * 24 * 3600
RESERVATION = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
PROJECT_ID = r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$"


class Reservation(Strict):
    """A specific Compute Engine reservation the group's nodes consume."""

    name: str = Field(pattern=RESERVATION, max_length=63, description="The reservation's name.")
    project: str | None = Field(
        None,
        pattern=PROJECT_ID,
        max_length=30,
        description="The project that owns a shared reservation. Default: the cluster's.",
    )


class Capacity(Strict):
    """Where the group's nodes come from beyond on-demand (Spot VMs: the group's `spot`)."""

    reservation: Reservation | None = Field(
        None,
        description="Consume this reservation: the node selectors cloud.google.com/"
        "reservation-name, reservation-affinity=specific (and reservation-project).",
    )
    flex_start: bool = Field(
        False,
        description="Flex-start VMs (Dynamic Workload Scheduler): the cloud.google.com/"
        "gke-flex-start=true node selector.",
    )
    max_run_duration_seconds: int | None = Field(
        None,
        ge=60,
        le=MAX_RUN_SECONDS,
        description="With Kueue queued provisioning (a ClusterQueue admission check of "
        "ProvisioningRequests): how long a unit's provisioned slice may run, passed to the "
        f"ProvisioningRequest as the Job annotation {MAX_RUN_DURATION_ANNOTATION}. Default: "
        "GKE's (seven days).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> Capacity:
        if self.reservation is not None and self.flex_start:
            raise ValueError("capacity: a reservation or flexStart, not both")
        return self

    def node_selector(self) -> dict[str, str]:
        selector: dict[str, str] = {}
        if self.reservation is not None:
            selector[RESERVATION_NAME_LABEL] = self.reservation.name
            selector[RESERVATION_AFFINITY_LABEL] = "specific"
            if self.reservation.project:
                selector[RESERVATION_PROJECT_LABEL] = self.reservation.project
        if self.flex_start:
            selector[FLEX_START_LABEL] = "true"
        return selector

    def job_annotations(self) -> dict[str, str]:
        if self.max_run_duration_seconds is None:
            return {}
        return {MAX_RUN_DURATION_ANNOTATION: str(self.max_run_duration_seconds)}


class KueueTopology(Strict):
    """Kueue topology-aware scheduling of a unit's pods: all in one domain of a topology level
    (a node label of the level, e.g. cloud.google.com/gce-topology-block), required or
    preferred. Takes effect where Kueue admits the run (its queue-name label) through a
    ResourceFlavor with a topology."""

    required: str | None = Field(
        None,
        pattern=QUALIFIED_NAME,
        max_length=317,
        description="Every pod of a unit in one domain of this level, or the unit waits.",
    )
    preferred: str | None = Field(
        None,
        pattern=QUALIFIED_NAME,
        max_length=317,
        description="As few domains of this level as Kueue finds room in.",
    )

    @model_validator(mode="after")
    def _one_level(self) -> KueueTopology:
        if (self.required is None) == (self.preferred is None):
            raise ValueError("kueueTopology: set required or preferred (one of them)")
        return self

    def pod_annotations(self) -> dict[str, str]:
        if self.required is not None:
            return {REQUIRED_TOPOLOGY_ANNOTATION: self.required}
        assert self.preferred is not None
        return {PREFERRED_TOPOLOGY_ANNOTATION: self.preferred}

"""The DilocoRun status: what the operator (or the local runtime) writes back."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from diloco_trainer.config import Strict
from diloco_trainer.shards import MAX_SHARDS
from pydantic import Field

from diloco_operator.api.kubesyntax import MAX_UNITS
from diloco_operator.api.unit_goodput import UnitGoodput

SpareState = Literal["Starting", "Ready", "Covering", "Failed"]
RunPhase = Literal["Pending", "Queued", "Running", "Degraded", "Suspended", "Succeeded", "Failed"]
UnitState = Literal[
    "Pending",
    "Queued",
    "Online",
    "Offline",
    "Recreating",
    "Suspended",
    "Removing",
    "Completed",
    "Failed",
]


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
    global_index: int = Field(
        description="Index across the run (DILOCO_UNIT; data shards are leased by the syncer)."
    )
    state: UnitState = Field(
        description="Pending (created, not all hosts ready), Queued (its Job is suspended by "
        "a queue such as Kueue: waiting for admission, or evicted/preempted), Online, Offline "
        "(failed, waiting to be recreated), Recreating, Suspended (the run is suspended), "
        "Removing (scaled down), Completed or Failed (restart budget spent)."
    )
    attempt: int = Field(0, description="Attempt number of the unit's current Job (from 0).")
    restarts: int = Field(0, description="Recreations after failures (maxUnitRestarts bounds it).")
    restarts_in_place: int = Field(
        0,
        description="Restarts of the current attempt's learner in its own pod (as the syncer "
        "last heard it; failurePolicy.inPlaceRestarts bounds them per pod).",
    )
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
    last_failure: UnitFailure | None = Field(None, description="The last failure seen.")
    goodput: UnitGoodput | None = Field(
        None, description="Useful vs total seconds; null until the syncer reported the unit."
    )
    claims_refused: int = Field(
        0,
        ge=0,
        description="Heartbeats and pushes of this unit the syncer refused as impossible "
        "(counters no honest unit could send); each increase is a UnitClaimRefused Event.",
    )
    remote: bool = Field(
        False,
        description="The unit runs in another cluster (a remote unit group): its state is "
        "what the syncer hears of it, and its own cluster's operator recreates it.",
    )
    covered_by: str | None = Field(
        None,
        description="The warm spare training as this unit while its pods are recreated.",
    )


class GroupStatus(Strict):
    """One unit group at a glance: a group is what one cluster runs, so at home these are the
    run's clusters side by side (remote groups as the syncer hears them)."""

    name: str = Field(description="The unit group (spec.unitGroups[].name).")
    remote: bool = Field(False, description="It runs in another cluster.")
    units: int = Field(0, ge=0, description="Its units (Removing ones excluded).")
    units_online: int = Field(0, ge=0, description="Its units in state Online.")
    tokens: int | None = Field(
        None, ge=0, description="Tokens its units trained, as the syncer last reported them."
    )
    tokens_per_sec: float | None = Field(
        None, ge=0, description="Its units' latest throughput, summed."
    )
    goodput: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Useful over total learner-seconds of its units (status.units[].goodput "
        "summed); null until one was accounted.",
    )


class SpareStatus(Strict):
    """A warm spare pod of a unit group (spec.unitGroups[].spares)."""

    name: str = Field(max_length=63, description="The spare's Job.")
    group: str = Field(description="Unit group (spec.unitGroups[].name).")
    state: SpareState = Field(
        description="Starting (created, not waiting at the syncer yet), Ready (compiled and "
        "waiting to cover a unit), Covering (training as a unit whose pods are recreated) or "
        "Failed (it crashed too often: recreated after its backoff)."
    )
    attempt: int = Field(0, description="Attempt number of the spare's current Job (from 0).")
    covering: str | None = Field(None, description="The unit it trains as, while Covering.")
    covers: int = Field(0, description="Units it was asked to cover so far.")
    since: datetime | None = Field(None, description="When it entered its state.")


class SyncerReach(Strict):
    """An away run's view of the home syncer it joins."""

    address: str = Field(max_length=300, description="The home syncer's address.")
    reachable: bool = Field(description="The last status read from this cluster succeeded.")
    last_contact: datetime | None = Field(None, description="When it last answered.")
    last_error: str | None = Field(
        None, max_length=1024, description="Why the last read failed, naming the address."
    )
    last_merge: datetime | None = Field(
        None, description="The syncer's latest merge of any fragment, as it last reported."
    )
    version_lag: int | None = Field(
        None,
        ge=0,
        description="Versions this cluster's units were behind: the most any of their last "
        "accepted pushes was behind its fragment at the syncer (what the link costs them).",
    )


# training.fragments' bound (diloco_trainer.config): the most fragments one shard can hold.
MAX_FRAGMENTS = 4096


class FragmentVersion(Strict):
    """A fragment and the version of it its syncer shard holds."""

    index: int = Field(ge=0, description="The fragment's index (0 .. training.fragments - 1).")
    version: int = Field(ge=0, description="Merges of this fragment so far.")


class SyncerShardStatus(Strict):
    """One shard of a sharded syncer (spec.syncer.shards > 1), as the operator last saw it."""

    index: int = Field(ge=0, description="The shard's index; shard 0 leads (leases, eval).")
    name: str = Field(max_length=63, description="Its Deployment, Service and budget.")
    ready: bool = Field(False, description="Its Deployment has a ready pod.")
    answering: bool = Field(False, description="Its /v1/status answered the operator's last read.")
    since: datetime | None = Field(None, description="When it last began (or stopped) answering.")
    outer_step: int | None = Field(
        None,
        description="Sum of its fragments' versions (its merges), as last reported; kept "
        "while it does not answer.",
    )
    fragments: list[FragmentVersion] = Field(
        default_factory=list,
        max_length=MAX_FRAGMENTS,
        description="The fragments it holds and their versions, as last reported.",
    )
    message: str | None = Field(
        None, max_length=1024, description="Why it does not answer, naming its address."
    )


class Condition(Strict):
    """A Kubernetes-style condition (type, status True/False/Unknown, reason, message)."""

    type: str = Field(
        description="Ready, Degraded, Progressing, Complete, ChildrenCreated, and with Kueue or "
        "spec.suspend: Queued, QueueFound, Suspended; with syncer.shards > 1: SyncerShards."
    )
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
        description="Pending (no unit online yet), Queued (no unit online, some waiting for "
        "admission by their queue), Running, Degraded (a unit Offline, Recreating or Failed), "
        "Suspended (spec.suspend), Succeeded (budget reached) or Failed (fewer units left than "
        "the quorum).",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Degraded, Progressing, Complete and ChildrenCreated; Queued, "
        "QueueFound and Suspended once they apply.",
    )
    units: list[UnitStatus] = Field(
        default_factory=list, max_length=MAX_UNITS, description="One entry per unit."
    )
    units_online: int = Field(0, description="Units in state Online.")
    groups: list[GroupStatus] = Field(
        default_factory=list,
        max_length=16,  # spec.unitGroups' bound
        description="Per unit group (per cluster, for a run across clusters): units, units "
        "online, tokens, throughput and goodput.",
    )
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
    syncer: SyncerReach | None = Field(
        None, description="An away run only: the home syncer as this cluster sees it."
    )
    syncer_shards: list[SyncerShardStatus] | None = Field(
        None,
        max_length=MAX_SHARDS,
        description="A sharded syncer only (syncer.shards > 1): each shard, shard 0 first. "
        "The run's outerStep is their sum while every shard answers.",
    )
    spares: list[SpareStatus] | None = Field(
        None,
        max_length=256,
        description="The warm spares of the run's unit groups (unitGroups[].spares); null "
        "when there are none.",
    )

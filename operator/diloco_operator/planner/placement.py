"""Placement/startup policy: which units a spec asks for, with deterministic names and indices."""

from __future__ import annotations

from dataclasses import dataclass

from diloco_trainer.budget import Budget

from diloco_operator.api import DilocoRunSpec


@dataclass(frozen=True)
class UnitSlot:
    name: str
    group: str
    index: int
    global_index: int
    hosts: int
    remote: bool = False


def unit_name(run: str, group: str, index: int) -> str:
    """`{run}-{group}-{index}`: stable across attempts, so a crashed operator finds its children
    again and Kubernetes' AlreadyExists prevents duplicates. The attempt lives in labels."""
    return f"{run}-{group}-{index}"


def desired_units(run: str, spec: DilocoRunSpec) -> list[UnitSlot]:
    """Every unit the spec asks for.

    Global indices (`DILOCO_UNIT`) are laid out so that scaling never renumbers a
    running unit: the fixed groups (unitGroups[1:]) take 0..F-1 in order, and the scalable first
    group takes F.., so `kubectl scale` only appends or drops the highest indices.
    """
    slots: list[UnitSlot] = []
    offset = 0
    order = [*range(1, len(spec.unit_groups)), 0]
    for gi in order:
        group = spec.unit_groups[gi]
        for i in range(spec.group_replicas(gi)):
            name = unit_name(run, group.name, i)
            slots.append(UnitSlot(name, group.name, i, offset + i, group.hosts, group.remote))
        offset += spec.group_replicas(gi)
    slots.sort(key=lambda s: s.global_index)
    return slots


def roster_document(run: str, spec: DilocoRunSpec, revision: int) -> dict[str, object]:
    """The units the spec asks for, each with its group: the only identities the run's syncer
    admits (the trainer's syncer/roster.py). `revision` orders rosters: the operator uses the
    run's metadata.generation, the file written at creation 0."""
    doc: dict[str, object] = {
        "revision": revision,
        "units": {s.name: s.group for s in desired_units(run, spec)},
    }
    if spec.syncer.revoked_credentials:
        doc["revokedCredentials"] = sorted(set(spec.syncer.revoked_credentials))
    # The one part of spec.training a running run may change: the syncer alone decides when
    # the run is complete, so a new budget reaches it here, with the next revision.
    doc["budget"] = Budget.of(spec.training).to_json()
    return doc

"""Where a learner unit's pods run: the node selector, tolerations and TPU chips of its group
(TPU slice, spot, the user's selector) and, with exclusiveTopology, the affinity keeping one
unit per node pool."""

from __future__ import annotations

from typing import Any

from diloco_operator.api import LABEL_UNIT
from diloco_operator.api.accelerators import (
    ACCELERATOR_LABEL,
    SPOT_LABEL,
    TOPOLOGY_LABEL,
    TPU_TAINT_KEY,
)
from diloco_operator.api.unit_group import UnitGroup

NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"


def exclusive_affinity(unit: str) -> dict[str, Any]:
    """Exclusive topology: all hosts of this unit share one node pool, and no other unit's pods
    land on it (a slice is never split or shared)."""
    mine = {"matchLabels": {LABEL_UNIT: unit}}
    others = {
        "matchExpressions": [
            {"key": LABEL_UNIT, "operator": "Exists"},
            {"key": LABEL_UNIT, "operator": "NotIn", "values": [unit]},
        ]
    }
    return {
        "podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": mine, "topologyKey": NODEPOOL_LABEL}
            ]
        },
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": others, "topologyKey": NODEPOOL_LABEL}
            ]
        },
    }


def group_placement(group: UnitGroup) -> tuple[dict[str, str], list[dict[str, Any]], int]:
    """Node selector, tolerations and TPU chips per host of a group's pods."""
    node_selector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    chips = 0
    if group.tpu:
        node_selector[ACCELERATOR_LABEL] = group.tpu.accelerator
        node_selector[TOPOLOGY_LABEL] = group.tpu.topology
        tolerations.append({"key": TPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"})
        chips = group.tpu.chips_on_each_host
    if group.spot:
        node_selector[SPOT_LABEL] = "true"
        tolerations.append(
            {"key": SPOT_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"}
        )
    if group.capacity:
        node_selector.update(group.capacity.node_selector())
    node_selector.update(group.node_selector or {})
    tolerations.extend(t.to_wire() for t in group.tolerations or [])
    return node_selector, tolerations, chips


def place_learner_pod(
    pod_spec: dict[str, Any],
    group: UnitGroup,
    unit: str,
    node_selector: dict[str, str],
    tolerations: list[dict[str, Any]],
) -> None:
    """Set the placement fields of a learner pod spec (only those that say something)."""
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if group.exclusive_topology:
        pod_spec["affinity"] = exclusive_affinity(unit)

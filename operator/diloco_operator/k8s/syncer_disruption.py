"""The syncer stays where it is unless a person moves it.

Moving the syncer pod costs a cold start (checkpoint, journal, compile) during which no learner
merges. So the cluster autoscaler may not move it to consolidate nodes (the pod annotation), and
no eviction may take it (a PodDisruptionBudget): drains, node upgrades and the autoscaler's
scale-down all evict. A drain of its node therefore waits until someone deletes the pod
(`kubectl delete pod` is not an eviction); the Deployment then starts it on another node, where
it resumes from its checkpoint. Chaos kills and `spec.suspend` delete or scale, which the budget
does not stop.
"""

from __future__ import annotations

from typing import Any

SAFE_TO_EVICT_ANNOTATION = "cluster-autoscaler.kubernetes.io/safe-to-evict"


def keep_on_its_node(template: dict[str, Any]) -> None:
    """Tell the cluster autoscaler (GKE's node consolidation included) to leave the pod's node.
    The operator's default, which a syncer template may override (`"true"`), unlike the keys
    the operator owns."""
    annotations = template.setdefault("metadata", {}).setdefault("annotations", {})
    annotations.setdefault(SAFE_TO_EVICT_ANNOTATION, "false")


def disruption_budget(metadata: dict[str, Any], selector: dict[str, str]) -> dict[str, Any]:
    """No voluntary eviction of the pods `selector` picks (the syncer's one pod).

    maxUnavailable 0, not minAvailable 1: the budget then follows the Deployment's replicas, so a
    suspended run (scaled to 0) asks nothing of anyone instead of a budget it can never meet. The
    warm standby does not make 1 safe: it is a container of the same pod and goes with it. An
    unready syncer (starting, crash-looping, unable to persist) may still be evicted, so a broken
    one never blocks a drain for good."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata,
        "spec": {
            "maxUnavailable": 0,
            "selector": {"matchLabels": dict(selector)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }

"""The optional per-run NetworkPolicy (`--syncer-network-policy`): only the run's learner pods,
the operator, a sharded syncer's shard 0 and, for a syncer exposed to other clusters, the away
clusters' ranges reach the run's syncer; everything else in the cluster is refused at the
network. One policy covers every shard (its pods share the run's syncer labels). Pure
functions, like builders."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diloco_operator.api import LABEL_COMPONENT, LABEL_RUN
from diloco_operator.k8s.builders import LEARNER, SYNCER, Run, run_objects
from diloco_operator.k8s.object_meta import child_meta
from diloco_operator.k8s.syncer_shards import shard_labels

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class OperatorIdentity:
    """Where the operator's pods run and how they are labelled (the chart passes both)."""

    namespace: str
    pod_labels: dict[str, str] = field(default_factory=dict)


def syncer_network_policy(run: Run, operator: OperatorIdentity) -> dict[str, Any]:
    own = {LABEL_RUN: run.name}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_meta(run, run.syncer_name, SYNCER),
        "spec": {
            "podSelector": {"matchLabels": {**own, LABEL_COMPONENT: SYNCER}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        # The run's learners (same namespace: a bare podSelector).
                        {"podSelector": {"matchLabels": {**own, LABEL_COMPONENT: LEARNER}}},
                        # The operator, polling /v1/status.
                        {
                            "namespaceSelector": {
                                "matchLabels": {NAMESPACE_NAME_LABEL: operator.namespace}
                            },
                            "podSelector": {"matchLabels": dict(operator.pod_labels)},
                        },
                        *_from_shard_zero(run),
                    ],
                    "ports": [{"protocol": "TCP", "port": run.spec.syncer.port}],
                },
                *_from_other_clusters(run),
            ],
        },
    }


def _from_shard_zero(run: Run) -> list[dict[str, Any]]:
    """A sharded syncer's shard 0 reads the other shards' fragments (`GET /v1/params`, with the
    run token) to evaluate the whole model; no other shard calls another."""
    if run.shards == 1:
        return []
    lead = {LABEL_RUN: run.name, LABEL_COMPONENT: SYNCER, **shard_labels(run, 0)}
    return [{"podSelector": {"matchLabels": lead}}]


def _from_other_clusters(run: Run) -> list[dict[str, Any]]:
    """An exposed syncer also takes the away clusters' traffic, which arrives through the load
    balancer from their ranges, or from a Gateway's proxies: the ranges given for either
    (loadBalancerSourceRanges, the same CIDRs the load balancer admits; gateway.sourceRanges),
    else any source (the load balancer, internal by default, or the Gateway is the gate)."""
    exposure = run.spec.syncer.expose
    if exposure is None or not exposure.external:
        return []
    ranges = exposure.source_ranges or ["0.0.0.0/0", "::/0"]
    return [
        {
            "from": [{"ipBlock": {"cidr": cidr}} for cidr in ranges],
            "ports": [{"protocol": "TCP", "port": run.spec.syncer.port}],
        }
    ]


def run_objects_with_policy(run: Run, operator: OperatorIdentity | None) -> list[dict[str, Any]]:
    """builders.run_objects, plus the policy (when asked) before the syncer Deployment, so the
    syncer pod is never reachable without it."""
    objs = run_objects(run)
    if operator is None:
        return objs
    at = next(i for i, o in enumerate(objs) if o["kind"] == "Deployment")
    return [*objs[:at], syncer_network_policy(run, operator), *objs[at:]]

"""Children the API server refuses, on a real control plane with the chart's RBAC: a name taken
by an object the run does not own (409) and a namespace quota (403) are reported on the run as
the ChildrenCreated condition and a Warning Event, the rest of the run is still created, and the
run recovers by itself once the obstacle is gone."""

from __future__ import annotations

import json
from typing import Any

from conftest import Operator, kubectl, wait_for
from runs import apply, condition, events, example, live_jobs, status

RUN = "v6e-100m"


def children_condition(cluster: Any, namespace: str) -> dict[str, Any] | None:
    return condition(status(cluster, namespace, RUN), "ChildrenCreated")


def test_name_conflict_and_quota_are_reported_then_cleared(
    cluster: Any, operator: Operator, tpu_nodes: Any, namespace: str
) -> None:
    # Somebody else's Secret under the run's token name, and room for one Job only.
    kubectl(
        cluster,
        "create",
        "secret",
        "generic",
        f"{RUN}-token",
        "-n",
        namespace,
        "--from-literal=token=not-yours",
    )
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "one-job", "namespace": namespace},
        "spec": {"hard": {"count/jobs.batch": "1"}},
    }
    kubectl(cluster, "apply", "-f", "-", input=json.dumps(quota))
    apply(cluster, namespace, example("gke-tpu-v6e", replicas=2))

    conflict = wait_for(
        "ChildrenCreated=False (NameConflict)",
        lambda: (
            (c := children_condition(cluster, namespace))
            and c["status"] == "False"
            and c["reason"] == "NameConflict"
            and c
        ),
        timeout=60,
    )
    assert f"Secret {RUN}-token" in conflict["message"]
    assert events(cluster, namespace, RUN, "NameConflict")
    # The token is not the run's: it was neither used nor overwritten.
    secret = cluster.kubectl_json("get", "secret", f"{RUN}-token", "-n", namespace)
    assert "ownerReferences" not in secret["metadata"]
    # The units were still created, up to the quota: one Job, the other refused (403).
    wait_for("one unit Job", lambda: len(live_jobs(cluster, namespace, RUN)) == 1, timeout=60)
    wait_for(
        "the quota refusal reported",
        lambda: (
            any(
                "exceeded quota" in e["message"]
                for e in events(cluster, namespace, RUN, "ChildRejected")
            )
            or any(
                "exceeded quota" in e["message"]
                for e in events(cluster, namespace, RUN, "NameConflict")
            )
        ),
        timeout=60,
    )

    kubectl(cluster, "delete", "secret", f"{RUN}-token", "-n", namespace)
    kubectl(cluster, "delete", "resourcequota", "one-job", "-n", namespace)
    wait_for(
        "ChildrenCreated=True",
        lambda: (c := children_condition(cluster, namespace)) and c["status"] == "True",
        timeout=60,
    )
    wait_for("both unit Jobs", lambda: len(live_jobs(cluster, namespace, RUN)) == 2, timeout=60)
    secret = cluster.kubectl_json("get", "secret", f"{RUN}-token", "-n", namespace)
    assert secret["metadata"]["ownerReferences"][0]["name"] == RUN
    kubectl(cluster, "delete", "dlr", RUN, "-n", namespace, "--timeout=60s")

"""The checkpoint PVC outlives its run (retentionPolicy Retain, the default): `spec.training` is
immutable, so a user changes it by deleting and re-creating the run, and the re-created run
(same name) must find and reuse the same claim instead of losing its checkpoints."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from conftest import Operator, kubectl, wait_for
from runs import apply, condition, example, status

RUN = "v6e-100m"
CLAIM = f"{RUN}-checkpoints"


def manifest(inner_steps: int) -> dict[str, Any]:
    doc = example("gke-tpu-v6e", replicas=1, syncer={"checkpoint": {"size": "1Gi"}})
    doc["spec"]["training"]["innerSteps"] = inner_steps
    return doc


def claim(cluster: Any, namespace: str) -> dict[str, Any] | None:
    r = cluster.kubectl("get", "pvc", CLAIM, "-n", namespace, "-o", "json", check=False)
    if r.returncode != 0:
        return None
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def gone(cluster: Any, namespace: str, kind: str, name: str) -> bool:
    return cluster.kubectl("get", kind, name, "-n", namespace, check=False).returncode != 0


def syncer(cluster: Any, namespace: str) -> dict[str, Any] | None:
    r = cluster.kubectl(
        "get", "deploy", f"{RUN}-syncer", "-n", namespace, "-o", "json", check=False
    )
    if r.returncode != 0:
        return None
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def test_recreating_a_run_to_change_its_training_keeps_its_checkpoints(
    cluster: Any, operator: Operator, tpu_nodes: Any, namespace: str
) -> None:
    apply(cluster, namespace, manifest(24))
    first = wait_for("the checkpoint claim", lambda: claim(cluster, namespace), timeout=60)
    assert "ownerReferences" not in first["metadata"]
    old_syncer = wait_for("the syncer", lambda: syncer(cluster, namespace), timeout=60)

    kubectl(cluster, "delete", "dlr", RUN, "-n", namespace, "--wait=true", "--timeout=90s")
    wait_for(
        "the old syncer garbage-collected",
        lambda: (
            (s := syncer(cluster, namespace)) is None
            or s["metadata"]["uid"] != old_syncer["metadata"]["uid"]
        ),
        timeout=90,
    )
    # Every owned child goes in the same garbage-collection sweep: once the Secret and the
    # ConfigMap are gone too, an owned claim would be gone or Terminating by now.
    for kind, name in (("secret", f"{RUN}-token"), ("configmap", f"{RUN}-config")):
        wait_for(f"{kind} {name} garbage-collected", partial(gone, cluster, namespace, kind, name))
    kept = claim(cluster, namespace)
    assert kept is not None and kept["metadata"]["uid"] == first["metadata"]["uid"]
    assert not kept["metadata"].get("deletionTimestamp")

    apply(cluster, namespace, manifest(48))  # a different training: a new run, same name
    new_syncer = wait_for(
        "the new run's syncer",
        lambda: (
            (s := syncer(cluster, namespace))
            and s["metadata"]["uid"] != old_syncer["metadata"]["uid"]
            and s
        ),
        timeout=60,
    )
    volumes = {v["name"]: v for v in new_syncer["spec"]["template"]["spec"]["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == CLAIM
    reused = claim(cluster, namespace)
    assert reused is not None and reused["metadata"]["uid"] == first["metadata"]["uid"]
    created = wait_for(
        "ChildrenCreated=True",
        lambda: (
            (c := condition(status(cluster, namespace, RUN), "ChildrenCreated"))
            and c["status"] == "True"
            and c
        ),
        timeout=60,
    )
    assert created["reason"] == "Created"  # the retained claim is no NameConflict
    kubectl(cluster, "delete", "dlr", RUN, "-n", namespace, "--timeout=60s")
    kubectl(cluster, "delete", "pvc", CLAIM, "-n", namespace, "--wait=false")

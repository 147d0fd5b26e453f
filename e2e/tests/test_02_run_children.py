"""examples/mixed-v6e-v5p.yaml on a real control plane: the operator builds exactly the children
the design says (Indexed Jobs, headless Services, syncer Deployment/Service/Secret/ConfigMap/PVC),
the scheduler places each unit's pods on its fake TPU node pool, KWOK runs them, the run reports
every unit Online, and deleting the run garbage-collects every child."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import yaml
from conftest import wait_for
from runs import (
    ACCELERATOR_LABEL,
    TOPOLOGY_LABEL,
    TPU,
    all_units_online,
    apply,
    env_of,
    example,
    items,
    learner_pods,
    live_jobs,
    run_obj,
    run_selector,
    running,
    status,
)

RUN = "mixed-100m"
# Two v6e 2x4 slices (2 hosts of 4 chips) + two v5p 2x2x1 slices (1 host of 4 chips).
UNITS = {
    f"{RUN}-v5p-0": ("tpu-v5p-slice", "2x2x1", 1, 0),
    f"{RUN}-v5p-1": ("tpu-v5p-slice", "2x2x1", 1, 1),
    f"{RUN}-v6e-0": ("tpu-v6e-slice", "2x4", 2, 2),
    f"{RUN}-v6e-1": ("tpu-v6e-slice", "2x4", 2, 3),
}


@pytest.fixture(scope="module")
def mixed(cluster: Any, operator: Any, tpu_nodes: Any, namespace: str) -> dict[str, Any]:
    apply(cluster, namespace, example("mixed-v6e-v5p"))
    wait_for("4 learner Jobs", lambda: len(live_jobs(cluster, namespace, RUN)) == 4, timeout=60)
    return run_obj(cluster, namespace, RUN)


def test_learner_jobs(cluster: Any, namespace: str, mixed: dict[str, Any]) -> None:
    jobs = live_jobs(cluster, namespace, RUN)
    assert set(jobs) == set(UNITS)
    for name, job in jobs.items():
        accelerator, topology, hosts, global_index = UNITS[name]
        spec = job["spec"]
        assert spec["completionMode"] == "Indexed"
        assert spec["completions"] == spec["parallelism"] == hosts
        assert spec["backoffLimit"] == 0
        rules = spec["podFailurePolicy"]["rules"]
        assert {"type": "DisruptionTarget", "status": "True"} in rules[0]["onPodConditions"]
        assert rules[1]["onExitCodes"]["values"] == [2]
        assert all(r["action"] == "FailJob" for r in rules)
        owner = job["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "DilocoRun" and owner["uid"] == mixed["metadata"]["uid"]
        assert owner["controller"] is True

        pod = spec["template"]["spec"]
        assert pod["restartPolicy"] == "Never" and pod["subdomain"] == name
        assert pod["nodeSelector"] == {ACCELERATOR_LABEL: accelerator, TOPOLOGY_LABEL: topology}
        assert {"key": TPU, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        (container,) = pod["containers"]
        assert container["resources"]["limits"][TPU] == "4"
        assert container["resources"]["requests"][TPU] == "4"
        env = env_of(container)
        assert env["DILOCO_UNIT"] == str(global_index)
        assert env["DILOCO_UNIT_NAME"] == name
        assert env["DILOCO_NUM_UNITS"] == "4"
        assert env["DILOCO_ATTEMPT"] == "0"
        assert env["DILOCO_SYNCER_ADDR"] == f"http://{RUN}-syncer.{namespace}.svc:8470"
        assert "DILOCO_TOKEN" not in env  # a mounted file, never an env var
        assert env["DILOCO_TOKEN_FILE"] == "/var/run/diloco/token/token"
        assert env["TPU_WORKER_HOSTNAMES"] == ",".join(f"{name}-{i}.{name}" for i in range(hosts))
        assert "batch.kubernetes.io/job-completion-index" in str(env["TPU_WORKER_ID"])
        # The unit's own token (derived from the run secret), never the run secret itself.
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["token"]["secret"]["secretName"] == f"{name}-token"
        unit_secret = cluster.kubectl_json("get", "secret", f"{name}-token", "-n", namespace)
        assert unit_secret["metadata"]["ownerReferences"][0]["uid"] == mixed["metadata"]["uid"]


def test_headless_unit_services(cluster: Any, namespace: str, mixed: dict[str, Any]) -> None:
    svcs = {
        s["metadata"]["name"]: s
        for s in items(cluster, "svc", namespace, run_selector(RUN, "learner"))
    }
    assert set(svcs) == set(UNITS)
    for name, svc in svcs.items():
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["publishNotReadyAddresses"] is True
        attempt = svc["metadata"]["labels"].get("diloco.dev/attempt", "0")
        assert svc["spec"]["selector"] == {"diloco.dev/unit": name, "diloco.dev/attempt": attempt}


def test_syncer_and_run_objects(cluster: Any, namespace: str, mixed: dict[str, Any]) -> None:
    deploy = cluster.kubectl_json("get", "deploy", f"{RUN}-syncer", "-n", namespace)
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"]["type"] == "Recreate"
    # The syncer and its warm standby (spec.syncer.standby, on by default): one lock, one port.
    container, standby = deploy["spec"]["template"]["spec"]["containers"]
    assert (container["name"], standby["name"]) == ("syncer", "syncer-standby")
    assert container["image"] == standby["image"] == mixed["spec"]["image"]
    assert env_of(standby)["DILOCO_SYNCER_LOCK"] == env_of(container)["DILOCO_SYNCER_LOCK"]
    env = env_of(container)
    assert "DILOCO_TOKEN" not in env
    assert env["DILOCO_SYNCER_PORT"] == "8470"
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    assert volumes["token"]["secret"]["secretName"] == f"{RUN}-token"
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == f"{RUN}-checkpoints"

    svc = cluster.kubectl_json("get", "svc", f"{RUN}-syncer", "-n", namespace)
    assert svc["spec"]["ports"][0]["port"] == 8470

    secret = cluster.kubectl_json("get", "secret", f"{RUN}-token", "-n", namespace)
    assert len(base64.b64decode(secret["data"]["token"])) >= 32

    cm = cluster.kubectl_json("get", "configmap", f"{RUN}-config", "-n", namespace)
    config = yaml.safe_load(cm["data"]["run.yaml"])
    assert config["spec"]["training"]["innerSteps"] == 24
    assert config["spec"]["training"]["totalSteps"] == 400000

    pvc = cluster.kubectl_json("get", "pvc", f"{RUN}-checkpoints", "-n", namespace)
    assert pvc["spec"]["storageClassName"] == "premium-rwo"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "50Gi"
    for obj in (deploy, svc, secret, cm):
        assert obj["metadata"]["ownerReferences"][0]["uid"] == mixed["metadata"]["uid"]
    # The checkpoints outlive the run (retentionPolicy Retain): labelled, not owned.
    assert "ownerReferences" not in pvc["metadata"]
    assert pvc["metadata"]["labels"]["diloco.dev/run"] == RUN


def test_pods_land_on_their_node_pools_and_run(
    cluster: Any, namespace: str, mixed: dict[str, Any]
) -> None:
    def all_running() -> list[dict[str, Any]] | None:
        pods = learner_pods(cluster, namespace, RUN)
        return pods if len(pods) == 6 and all(running(p) for p in pods) else None

    pods = wait_for("6 learner pods Running", all_running, timeout=90)
    nodes = {
        n["metadata"]["name"]: n["metadata"]["labels"]
        for n in cluster.kubectl_json("get", "nodes")["items"]
    }
    for pod in pods:
        unit = pod["metadata"]["labels"]["diloco.dev/unit"]
        accelerator, topology, _, _ = UNITS[unit]
        labels = nodes[pod["spec"]["nodeName"]]
        assert labels[ACCELERATOR_LABEL] == accelerator, pod["metadata"]["name"]
        assert labels[TOPOLOGY_LABEL] == topology, pod["metadata"]["name"]
    # One 4-chip host per pod: no node carries two learner pods.
    assert len({p["spec"]["nodeName"] for p in pods}) == 6


def test_run_reports_every_unit_online(cluster: Any, namespace: str, mixed: dict[str, Any]) -> None:
    wait_for("4 units Online", lambda: all_units_online(cluster, namespace, RUN, 4), timeout=60)
    st = status(cluster, namespace, RUN)
    assert st["unitsOnline"] == 4
    assert st["replicas"] == 2  # the scalable (first) group
    by_name = {u["name"]: u for u in st["units"]}
    for name, (_, _, _, global_index) in UNITS.items():
        assert by_name[name]["globalIndex"] == global_index
        assert by_name[name]["attempt"] == 0


def test_deleting_the_run_garbage_collects_every_child(
    cluster: Any, namespace: str, mixed: dict[str, Any]
) -> None:
    cluster.kubectl("delete", "dlr", RUN, "-n", namespace, "--wait=false")
    # Not the checkpoint PVC: it is retained for the next run of this name (checked below).
    kinds = "jobs,pods,svc,deploy,replicasets,secrets,configmaps"

    def leftovers() -> list[str]:
        out = cluster.kubectl(
            "get", kinds, "-n", namespace, "-l", run_selector(RUN), "-o", "name"
        ).stdout.split()
        gone = cluster.kubectl("get", "dlr", RUN, "-n", namespace, check=False).returncode != 0
        return out + ([] if gone else [f"dilocorun/{RUN}"])

    wait_for("every child of the run gone", lambda: not leftovers() or None, timeout=120)
    pvc = cluster.kubectl_json("get", "pvc", f"{RUN}-checkpoints", "-n", namespace)
    assert not pvc["metadata"].get("deletionTimestamp")
    cluster.kubectl("delete", "pvc", f"{RUN}-checkpoints", "-n", namespace, "--wait=false")

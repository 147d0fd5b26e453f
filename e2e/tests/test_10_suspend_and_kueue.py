"""spec.suspend and Kueue on a real control plane, with the real Kueue controller (built from the
Go module proxy by e2e/cluster/build.sh, run by the harness as a host process; its webhooks
serve the API server at 127.0.0.1).

- spec.suspend without a queue: the Jobs are suspended in place (pods gone), the syncer scaled to
  zero, the run Suspended; resumed, the same Jobs run again and every unit comes back Online.
- A run labelled with a LocalQueue whose ClusterQueue has too little `google.com/tpu` quota: its
  unit Jobs stay suspended, the units Queued; quota raised: Kueue admits them and they come
  Online; a plain Job of a higher WorkloadPriorityClass on the same queue preempts one unit
  (Queued again, its pods gone); that Job deleted: the unit is admitted again and rejoins.
  Suspended with spec.suspend, the queued run's Jobs (and so their Workloads and quota) go;
  resumed, new Jobs are queued and admitted. Throughout: no restart, no preemption counted, no
  unit Failed, no UnitOffline Event.
- A run labelled with a LocalQueue that does not exist: QueueFound=False and a Warning Event.
- Topology-aware scheduling: a group's `kueueTopology.required` reaches Kueue on the unit Jobs'
  pod templates; through a ResourceFlavor with a topology (blocks of two slices each, labelled on
  the fake nodes) Kueue admits each unit into one block and its pods run on the hosts Kueue
  assigned; a level no topology has is never admitted (the unit stays Queued).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import Operator, kubectl, say, wait_for
from runs import (
    TPU,
    all_units_online,
    apply,
    condition,
    events,
    example,
    items,
    jobs,
    learner_pods,
    running,
    status,
    unit_status,
)

from e2e.cluster import harness

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
UNIT_CHIPS = 8  # a v6e 2x4 slice: 2 hosts x 4 chips


@pytest.fixture(scope="module")
def kueue(cluster: harness._ClusterBase) -> Iterator[None]:
    if cluster.kueue_host() is None:
        pytest.skip("starts Kueue as a process of this machine, which this cluster cannot reach")
    cluster.start_kueue()
    try:
        yield
    finally:
        cluster.stop_kueue()


def tpu_run(name: str, replicas: int, labels: dict[str, str] | None = None) -> dict[str, Any]:
    doc = example("gke-tpu-v6e", replicas=replicas, failurePolicy={"restartBackoffSeconds": 2})
    doc["metadata"] = {"name": name, "labels": labels or {}}
    return doc


def unit_states(cluster: Any, namespace: str, run: str) -> list[str]:
    return [u["state"] for u in unit_status(cluster, namespace, run).values()]


def nothing_counted(cluster: Any, namespace: str, run: str) -> None:
    units = unit_status(cluster, namespace, run).values()
    assert units
    for u in units:
        assert (u.get("restarts", 0), u.get("preemptions", 0)) == (0, 0), u
        assert u["state"] != "Failed" and not u.get("lastFailure"), u
    assert not events(cluster, namespace, run, "UnitOffline")
    assert not events(cluster, namespace, run, "UnitPreempted")


def job_facts(cluster: Any, namespace: str, run: str) -> dict[str, tuple[str, str]]:
    """Job name -> (uid, attempt label): what must survive suspension and preemption."""
    return {
        n: (j["metadata"]["uid"], j["metadata"]["labels"]["diloco.dev/attempt"])
        for n, j in jobs(cluster, namespace, run).items()
    }


def suspended(cluster: Any, namespace: str, run: str) -> dict[str, bool]:
    return {n: bool(j["spec"].get("suspend")) for n, j in jobs(cluster, namespace, run).items()}


def workloads(cluster: Any, namespace: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = cluster.kubectl_json(
        "get", "workloads.kueue.x-k8s.io", "-n", namespace
    )["items"]
    return out


def patch_suspend(cluster: Any, namespace: str, run: str, value: bool) -> None:
    patch = json.dumps({"spec": {"suspend": value}})
    kubectl(cluster, "patch", "dlr", run, "-n", namespace, "--type=merge", "-p", patch)


def delete_run(cluster: Any, namespace: str, run: str) -> None:
    kubectl(cluster, "delete", "dlr", run, "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for(f"{run}'s Jobs gone", lambda: not jobs(cluster, namespace, run), timeout=60)


def test_suspend_and_resume_without_a_queue(
    cluster: Any, operator: Operator, tpu_nodes: Any, namespace: str
) -> None:
    run = "plain"
    apply(cluster, namespace, tpu_run(run, 2))
    wait_for("2 units Online", lambda: all_units_online(cluster, namespace, run, 2), timeout=90)
    before = job_facts(cluster, namespace, run)

    patch_suspend(cluster, namespace, run, True)
    wait_for(
        "Jobs suspended, pods gone, syncer at 0, run Suspended",
        lambda: (
            all(suspended(cluster, namespace, run).values())
            and not learner_pods(cluster, namespace, run)
            and cluster.kubectl_json("get", "deploy", f"{run}-syncer", "-n", namespace)["spec"][
                "replicas"
            ]
            == 0
            and status(cluster, namespace, run).get("phase") == "Suspended"
            and unit_states(cluster, namespace, run) == ["Suspended", "Suspended"]
        ),
        timeout=60,
    )
    cond = condition(status(cluster, namespace, run), "Suspended")
    assert cond is not None and cond["status"] == "True"
    assert job_facts(cluster, namespace, run) == before  # suspended in place, not recreated

    patch_suspend(cluster, namespace, run, False)
    wait_for(
        "2 units Online again", lambda: all_units_online(cluster, namespace, run, 2), timeout=90
    )
    assert (
        cluster.kubectl_json("get", "deploy", f"{run}-syncer", "-n", namespace)["spec"]["replicas"]
        == 1
    )
    assert job_facts(cluster, namespace, run) == before
    assert status(cluster, namespace, run)["phase"] == "Running"
    nothing_counted(cluster, namespace, run)
    delete_run(cluster, namespace, run)


def kueue_objects(namespace: str, tpu_quota: int) -> list[dict[str, Any]]:
    big = {"cpu": "1000", "memory": "10Ti"}
    resources = [{"name": k, "nominalQuota": v} for k, v in big.items()]
    return [
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ResourceFlavor",
            "metadata": {"name": "tpu-v6e"},
            "spec": {"nodeLabels": {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice"}},
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ClusterQueue",
            "metadata": {"name": f"tpu-{namespace}"},
            "spec": {
                "namespaceSelector": {},
                "preemption": {"withinClusterQueue": "LowerPriority"},
                "resourceGroups": [
                    {
                        "coveredResources": ["cpu", "memory", TPU],
                        "flavors": [
                            {
                                "name": "tpu-v6e",
                                "resources": [
                                    *resources,
                                    {"name": TPU, "nominalQuota": tpu_quota},
                                ],
                            }
                        ],
                    }
                ],
            },
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "LocalQueue",
            "metadata": {"name": "tpu", "namespace": namespace},
            "spec": {"clusterQueue": f"tpu-{namespace}"},
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "WorkloadPriorityClass",
            "metadata": {"name": "urgent"},
            "value": 1000,
        },
    ]


def kubectl_apply(cluster: Any, objs: list[dict[str, Any]]) -> None:
    doc = {"apiVersion": "v1", "kind": "List", "items": objs}
    kubectl(cluster, "apply", "-f", "-", input=json.dumps(doc))


def urgent_job(namespace: str) -> dict[str, Any]:
    """A plain Job of a higher priority on the same queue, needing one slice's chips."""
    pod = {
        "restartPolicy": "Never",
        "tolerations": [{"key": TPU, "operator": "Exists"}],
        "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice"},
        "containers": [
            {
                "name": "urgent",
                "image": "example/urgent:1",
                "resources": {"requests": {TPU: "4"}, "limits": {TPU: "4"}},
            }
        ],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": "urgent",
            "namespace": namespace,
            "labels": {QUEUE_LABEL: "tpu", PRIORITY_LABEL: "urgent"},
        },
        "spec": {"suspend": True, "completions": 2, "parallelism": 2, "template": {"spec": pod}},
    }


def preemption(cluster: Any, namespace: str, run: str) -> list[str]:
    """The suspended Jobs of the run, once one unit is Queued and the urgent Job runs."""
    urgent = items(cluster, "pods", namespace, "job-name=urgent")
    if sorted(unit_states(cluster, namespace, run)) != ["Online", "Queued"]:
        return []
    if sum(running(p) for p in urgent) != 2:
        return []
    return [n for n, s in suspended(cluster, namespace, run).items() if s]


def test_queued_admitted_preempted_and_admitted_again(
    cluster: Any, operator: Operator, tpu_nodes: Any, namespace: str, kueue: None
) -> None:
    run = "queued"
    kubectl_apply(cluster, kueue_objects(namespace, tpu_quota=UNIT_CHIPS // 2))
    apply(cluster, namespace, tpu_run(run, 2, {QUEUE_LABEL: "tpu"}))

    # Quota for half a slice: nothing is admitted.
    wait_for(
        "2 units Queued, run Queued",
        lambda: (
            unit_states(cluster, namespace, run) == ["Queued", "Queued"]
            and status(cluster, namespace, run).get("phase") == "Queued"
        ),
        timeout=60,
    )
    for job in jobs(cluster, namespace, run).values():
        assert job["spec"]["suspend"] is True
        assert job["metadata"]["labels"][QUEUE_LABEL] == "tpu"
    assert not learner_pods(cluster, namespace, run)
    queued = condition(status(cluster, namespace, run), "Queued")
    assert queued is not None and queued["status"] == "True"
    found = condition(status(cluster, namespace, run), "QueueFound")
    assert found is not None and found["status"] == "True"
    # Kueue makes a Workload per Job on its own schedule: the units are Queued (their Jobs are
    # created suspended, with the queue label) possibly before Kueue has caught up.
    wait_for("Kueue's 2 Workloads", lambda: len(workloads(cluster, namespace)) == 2, timeout=30)
    before = job_facts(cluster, namespace, run)
    nothing_counted(cluster, namespace, run)

    # Quota for both slices: Kueue admits (unsuspends) both Jobs.
    kubectl_apply(cluster, kueue_objects(namespace, tpu_quota=2 * UNIT_CHIPS)[1:2])
    wait_for("2 units Online", lambda: all_units_online(cluster, namespace, run, 2), timeout=90)
    assert status(cluster, namespace, run)["phase"] == "Running"
    assert job_facts(cluster, namespace, run) == before
    assert events(cluster, namespace, run, "UnitAdmitted")

    # A higher-priority Job on the same queue: Kueue preempts one unit (suspends its Job).
    kubectl_apply(cluster, [urgent_job(namespace)])
    preempted = wait_for(
        "one unit Queued by the preemption, the urgent Job running",
        lambda: preemption(cluster, namespace, run),
        timeout=90,
    )
    say(f"preempted: {preempted}")
    victim = preempted[0]
    assert not [p for p in learner_pods(cluster, namespace, run) if victim in p["metadata"]["name"]]
    assert status(cluster, namespace, run)["phase"] == "Running"  # the other unit trains on
    nothing_counted(cluster, namespace, run)

    # The urgent Job gone: the unit is admitted again, the same Job, the same attempt.
    kubectl(cluster, "delete", "job", "urgent", "-n", namespace, "--wait=true")
    wait_for(
        "2 units Online again", lambda: all_units_online(cluster, namespace, run, 2), timeout=90
    )
    assert job_facts(cluster, namespace, run) == before
    assert len(events(cluster, namespace, run, "UnitQueued")) >= 3
    nothing_counted(cluster, namespace, run)

    # Suspending a queued run deletes its Jobs (Kueue would unsuspend an admitted one): their
    # Workloads go and the quota is free; resumed, new Jobs queue and are admitted again.
    patch_suspend(cluster, namespace, run, True)
    wait_for(
        "Jobs and Workloads gone, units Suspended",
        lambda: (
            not jobs(cluster, namespace, run)
            and not workloads(cluster, namespace)
            and unit_states(cluster, namespace, run) == ["Suspended", "Suspended"]
        ),
        timeout=60,
    )
    patch_suspend(cluster, namespace, run, False)
    wait_for(
        "2 units Online after the resume",
        lambda: all_units_online(cluster, namespace, run, 2),
        timeout=90,
    )
    assert {attempt for _, attempt in job_facts(cluster, namespace, run).values()} == {"1"}
    nothing_counted(cluster, namespace, run)
    delete_run(cluster, namespace, run)


def test_a_queue_that_does_not_exist_is_reported(
    cluster: Any, operator: Operator, tpu_nodes: Any, namespace: str, kueue: None
) -> None:
    run = "lost"
    apply(cluster, namespace, tpu_run(run, 1, {QUEUE_LABEL: "no-such-queue"}))
    found = wait_for(
        "QueueFound=False",
        lambda: (
            (c := condition(status(cluster, namespace, run), "QueueFound"))
            and c["status"] == "False"
            and c
        ),
        timeout=60,
    )
    assert found["reason"] == "LocalQueueNotFound"
    assert "no-such-queue" in found["message"]
    warned = events(cluster, namespace, run, "LocalQueueNotFound")
    assert warned and warned[0]["type"] == "Warning"
    wait_for(
        "the unit Queued", lambda: unit_states(cluster, namespace, run) == ["Queued"], timeout=60
    )
    nothing_counted(cluster, namespace, run)
    delete_run(cluster, namespace, run)


BLOCK = "cloud.google.com/gce-topology-block"
HOSTNAME = "kubernetes.io/hostname"


def tas_objects(namespace: str) -> list[dict[str, Any]]:
    """A topology of blocks and hosts, a TAS flavor of the v6e nodes and a queue using it."""
    big = [{"name": k, "nominalQuota": v} for k, v in {"cpu": "1000", "memory": "10Ti"}.items()]
    return [
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "Topology",
            "metadata": {"name": "blocks"},
            "spec": {"levels": [{"nodeLabel": BLOCK}, {"nodeLabel": HOSTNAME}]},
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ResourceFlavor",
            "metadata": {"name": "tas-v6e"},
            "spec": {
                "nodeLabels": {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice"},
                "topologyName": "blocks",
            },
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ClusterQueue",
            "metadata": {"name": f"tas-{namespace}"},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [
                    {
                        "coveredResources": ["cpu", "memory", TPU],
                        "flavors": [
                            {
                                "name": "tas-v6e",
                                "resources": [*big, {"name": TPU, "nominalQuota": 4 * UNIT_CHIPS}],
                            }
                        ],
                    }
                ],
            },
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "LocalQueue",
            "metadata": {"name": "tas", "namespace": namespace},
            "spec": {"clusterQueue": f"tas-{namespace}"},
        },
    ]


def label_blocks(cluster: Any, v6e_nodes: list[dict[str, Any]]) -> dict[str, str]:
    """Two slices (node pools) per block, as a data centre block holds several slices."""
    pools = sorted({n["metadata"]["labels"]["cloud.google.com/gke-nodepool"] for n in v6e_nodes})
    block_of_pool = {pool: f"block-{i // 2}" for i, pool in enumerate(pools)}
    blocks = {}
    for n in v6e_nodes:
        name = n["metadata"]["name"]
        blocks[name] = block_of_pool[n["metadata"]["labels"]["cloud.google.com/gke-nodepool"]]
        kubectl(cluster, "label", "node", name, f"{BLOCK}={blocks[name]}", "--overwrite")
    return blocks


def assigned_hosts(workload: dict[str, Any]) -> list[str]:
    """The hostname of each pod in Kueue's topology assignment of the workload (v1beta2:
    slices of domains, values stored as prefix + root + suffix or one universal value)."""
    (podset,) = workload["status"]["admission"]["podSetAssignments"]
    assignment = podset["topologyAssignment"]
    assert assignment["levels"] == [HOSTNAME], assignment  # the lowest level names the node
    hosts: list[str] = []
    for piece in assignment["slices"]:
        n = piece["domainCount"]
        level = piece["valuesPerLevel"][0]
        if "universal" in level:
            values = [level["universal"]] * n
        else:
            ind = level["individual"]
            values = [ind.get("prefix", "") + r + ind.get("suffix", "") for r in ind["roots"]]
        counts = piece["podCounts"].get("individual") or [piece["podCounts"]["universal"]] * n
        for value, count in zip(values, counts, strict=True):
            hosts += [value] * count
    return hosts


def test_kueue_topology_places_each_unit_in_one_block(
    cluster: Any, operator: Operator, tpu_nodes: Any, namespace: str, kueue: None
) -> None:
    blocks = label_blocks(cluster, tpu_nodes["tpu-v6e-slice"])
    kubectl_apply(cluster, tas_objects(namespace))
    run = "tas"
    doc = tpu_run(run, 2, {QUEUE_LABEL: "tas"})
    doc["spec"]["unitGroups"][0]["kueueTopology"] = {"required": BLOCK}
    apply(cluster, namespace, doc)
    wait_for("2 units Online", lambda: all_units_online(cluster, namespace, run, 2), timeout=120)
    admitted = [
        w for w in workloads(cluster, namespace) if (w.get("status") or {}).get("admission")
    ]
    assert len(admitted) == 2
    for workload in admitted:
        hosts = assigned_hosts(workload)
        assert len(hosts) == 2 and len({blocks[h] for h in hosts}) == 1, (hosts, blocks)
    pods = [p for p in learner_pods(cluster, namespace, run) if running(p)]
    assert len(pods) == 4
    placed = {p["spec"]["nodeName"] for p in pods}
    assert placed == {h for w in admitted for h in assigned_hosts(w)}
    for job in jobs(cluster, namespace, run).values():
        annotations = job["spec"]["template"]["metadata"]["annotations"]
        assert annotations["kueue.x-k8s.io/podset-required-topology"] == BLOCK
    nothing_counted(cluster, namespace, run)
    delete_run(cluster, namespace, run)

    # A level no topology has: Kueue never admits the unit, the operator reports it Queued.
    lost = "no-level"
    doc = tpu_run(lost, 1, {QUEUE_LABEL: "tas"})
    doc["spec"]["unitGroups"][0]["kueueTopology"] = {"required": "example.com/no-such-level"}
    apply(cluster, namespace, doc)
    refusal = wait_for(
        "Kueue refusing the unit's Workload a flavor",
        lambda: next(
            (
                c["message"]
                for w in workloads(cluster, namespace)
                if w["metadata"]["name"].startswith(f"job-{lost}-")
                for c in (w.get("status") or {}).get("conditions") or []
                if c["type"] == "QuotaReserved" and c["status"] == "False"
            ),
            None,
        ),
        timeout=60,
    )
    say(f"Kueue: {refusal}")
    assert "does not contain the requested level" in refusal
    # The operator's next pass reports it (passes of a run are at least half a second apart).
    wait_for(
        "the unit Queued", lambda: unit_states(cluster, namespace, lost) == ["Queued"], timeout=30
    )
    delete_run(cluster, namespace, lost)

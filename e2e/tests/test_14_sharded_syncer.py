"""A sharded syncer on real pods (`spec.syncer.shards: 2`, docs/operator.md "Sharded syncer").

On the real node, with the chart's operator in-cluster from its image, one CPU unit trains
against two syncer shards, each its own Deployment, Service, budget and checkpoint claim, with a
standby container in its pod. In order:

1. both shards merge: the run's status shows each shard answering with outer steps for the
   fragment it holds (shard 0 fragment 0, shard 1 fragment 1), the run's outer step their sum;
   the learner is given both shards' addresses, each shard its index and both peers;
2. shard 1's serving syncer process is SIGKILLed inside its container (from the node, as the OOM
   killer would): its standby container takes over in the same pod with every version the dead
   one published, no fragment's version ever goes backwards in the status sampled throughout,
   the run stays Running and the learner is not restarted;
3. shard 1's pod is deleted and its new pod held Pending (a taint on the node): the run stays
   Running, shard 0 merges on, the SyncerShards condition and a Warning Event SyncerShardDown
   name shard 1; let start, the new pod resumes cold from its own claim and answers again
   (SyncerShardBack) with no fragment's version gone back;
4. the budget, lowered on the running run, is reached: Succeeded with a finalLoss (shard 0
   evaluates the whole model with shard 1's fragment, read over its Service); deleting the run
   removes every shard's Deployment, Service and budget, and the retained claims stay.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import runs
from conftest import get_json, kubectl, say, wait_for
from real_pods import container_pid, real_node_run

from e2e.cluster import harness

pytestmark = pytest.mark.timeout(900)

RUN = "sharded"
SHARDS = 2
TOTAL_STEPS = 20_000  # lowered by the last test, once the faults are over
BUDGET_LEFT = 150
LABEL_SHARD = "diloco.dev/syncer-shard"


def manifest(image: str) -> dict[str, Any]:
    return real_node_run(
        RUN,
        image,
        training={
            "fragments": SHARDS,  # one fragment per shard
            "totalSteps": TOTAL_STEPS,
            "checkpoint": {"everySeconds": 5},
            # shard 0 reads shard 1's fragment for each evaluation: few of them on 2 cores
            "eval": {"everySeconds": 60, "batches": 2},
        },
        syncer={"shards": SHARDS, "checkpoint": {"size": "1Gi"}},
        failurePolicy={"healthyAfterSeconds": 5, "offlineAfterSeconds": 20},
    )


@pytest.fixture(scope="module")
def run(
    cluster: harness._ClusterBase, real: dict[str, Any], incluster: str, namespace: str
) -> Iterator[dict[str, Any]]:
    with runs.restricted_run(
        cluster, namespace, manifest(real["images"]["trainer"]), "sharded syncer module"
    ) as r:
        yield r


# ----------------------------------------------------------------------------------------------
# helpers


def st(c: harness._ClusterBase, ns: str) -> dict[str, Any]:
    return runs.status(c, ns, RUN)


def shards_of(status: dict[str, Any]) -> list[dict[str, Any]]:
    shards: list[dict[str, Any]] = status.get("syncerShards") or []
    return shards


def versions(status: dict[str, Any]) -> dict[int, int]:
    """Fragment -> version as the status shows them, over every shard."""
    return {f["index"]: f["version"] for s in shards_of(status) for f in s.get("fragments") or []}


def shard_name(i: int) -> str:
    return f"{RUN}-syncer" if i == 0 else f"{RUN}-syncer-{i}"


def shard_pod(c: harness._ClusterBase, ns: str, i: int) -> dict[str, Any]:
    sel = f"{runs.run_selector(RUN, 'syncer')},{LABEL_SHARD}={i}"
    (pod,) = runs.items(c, "pods", ns, sel)
    return pod


def pod_log(c: harness._ClusterBase, ns: str, pod: str, container: str, *more: str) -> str:
    r = kubectl(c, "logs", "-n", ns, pod, "-c", container, *more, check=False)
    return r.stdout + r.stderr


def merged_versions(log: str) -> dict[int, int]:
    """The last version each fragment was merged to, from a syncer's log."""
    out: dict[int, int] = {}
    for frag, version in re.findall(r"event=merged fragment=(\d+) version=(\d+)", log):
        out[int(frag)] = max(out.get(int(frag), 0), int(version))
    return out


def restarts(pod: dict[str, Any], container: str) -> int:
    statuses = pod["status"].get("containerStatuses") or []
    return int(next(s["restartCount"] for s in statuses if s["name"] == container))


@contextlib.contextmanager
def node_held(c: harness._ClusterBase, node: str) -> Iterator[None]:
    """No new pod starts on `node` inside the block (a NoSchedule taint; running pods stay)."""
    key = "e2e.diloco.dev/hold"
    kubectl(c, "taint", "node", node, f"{key}=true:NoSchedule")
    try:
        yield
    finally:
        kubectl(c, "taint", "node", node, f"{key}:NoSchedule-")


def unit_attempts(c: harness._ClusterBase, ns: str) -> dict[str, tuple[int, int]]:
    return {
        n: (u["attempt"], u.get("restartsInPlace", 0))
        for n, u in runs.unit_status(c, ns, RUN).items()
    }


# ----------------------------------------------------------------------------------------------
# the tests, in order: one run goes through all of them


def test_both_shards_merge_their_own_fragments(
    cluster: harness._ClusterBase, run: dict[str, Any]
) -> None:
    ns = run["ns"]

    def both_merged() -> dict[str, Any] | None:
        status = st(cluster, ns)
        shards = shards_of(status)
        ok = len(shards) == SHARDS and all(
            s["answering"] and (s.get("outerStep") or 0) > 0 for s in shards
        )
        return status if ok else None

    status = wait_for("both shards answering with merges", both_merged, 300)
    say(f"apply -> both shards merged: {time.monotonic() - run['t0']:.1f}s")
    shards = shards_of(status)
    assert [s["name"] for s in shards] == [shard_name(0), shard_name(1)]
    held = [[f["index"] for f in s["fragments"]] for s in shards]
    assert sorted(p for h in held for p in h) == list(range(SHARDS)) and all(held), held
    assert status["phase"] == "Running"
    assert next(c for c in status["conditions"] if c["type"] == "SyncerShards")["status"] == "True"
    # each shard's objects, its claim bound on the node
    for i in range(SHARDS):
        for kind in ("deploy", "svc", "pdb"):
            get_json(cluster, "get", kind, shard_name(i), "-n", ns)
        claim = f"{RUN}-checkpoints" + ("" if i == 0 else f"-{i}")
        bound = get_json(cluster, "get", "pvc", claim, "-n", ns)
        assert bound["status"]["phase"] == "Bound", bound["status"]
        pod = shard_pod(cluster, ns, i)
        env = runs.env_of(pod["spec"]["containers"][0])
        assert env["DILOCO_SYNCER_SHARD"] == f"{i}/{SHARDS}"
        assert env["DILOCO_SYNCER_PEERS"].split(",")[1].startswith(f"http://{shard_name(1)}.")
        assert [c["name"] for c in pod["spec"]["containers"]] == ["syncer", "syncer-standby"]
    (learner,) = runs.learner_pods(cluster, ns, RUN)
    addresses = runs.env_of(learner["spec"]["containers"][0])["DILOCO_SYNCER_ADDR"].split(",")
    assert addresses == [f"http://{shard_name(i)}.{ns}.svc:8470" for i in range(SHARDS)]


def test_a_killed_shard_is_taken_over_by_its_standby_and_no_version_goes_back(
    cluster: harness._ClusterBase, run: dict[str, Any]
) -> None:
    ns = run["ns"]
    pod = shard_pod(cluster, ns, 1)
    name = pod["metadata"]["name"]

    def roles() -> tuple[str, str] | None:
        logs = {c: pod_log(cluster, ns, name, c) for c in ("syncer", "syncer-standby")}
        serving = [c for c, text in logs.items() if "event=listening" in text]
        waiting = [c for c, text in logs.items() if "event=standby_ready" in text]
        return (serving[0], waiting[0]) if len(serving) == 1 and len(waiting) == 1 else None

    serving, standby = wait_for("shard 1: one syncer serving, one a warm standby", roles, 240)
    attempts = unit_attempts(cluster, ns)
    samples: list[dict[str, Any]] = [st(cluster, ns)]
    before = shards_of(samples[0])[1]["outerStep"]
    pod = get_json(cluster, "get", "pod", name, "-n", ns)
    pid = container_pid(cluster, pod, serving)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()

    def took_over() -> re.Match[str] | None:
        samples.append(st(cluster, ns))
        log = pod_log(cluster, ns, name, standby)
        return re.search(r"event=took_over .*?versions=\[([0-9, ]+)\]", log)

    took = wait_for("shard 1's standby took over", took_over, 120)
    served = [int(v) for v in re.split(r",\s*", took.group(1))]
    say(f"SIGKILL of shard 1's {serving} (host pid {pid}) -> {standby}: {took.group(0)}")

    def merging_again() -> bool:
        samples.append(status := st(cluster, ns))
        shard = shards_of(status)[1]
        return bool(shard["answering"] and shard["outerStep"] > before)

    wait_for("shard 1 merging past its old outer step", merging_again, 120)
    say(f"shard 1 killed -> merging again in {time.monotonic() - t0:.1f}s")
    # The dead process's last merges are all in what the standby serves: from its own log
    # (the kubelet restarted the container in place, so its previous log) against the
    # versions the standby took over with.
    wait_for(
        f"shard 1's {serving} container restarted in place",
        lambda: restarts(get_json(cluster, "get", "pod", name, "-n", ns), serving) > 0,
        60,
    )
    dead = merged_versions(pod_log(cluster, ns, name, serving, "--previous"))
    assert dead, "the killed syncer had merged nothing"
    assert all(served[p] >= v for p, v in dead.items()), (dead, served)
    assert "versions_lost" not in pod_log(cluster, ns, name, standby)
    # No fragment's version ever went back in the operator's view, and the run went on.
    last: dict[int, int] = {}
    for sample in samples:
        for p, v in versions(sample).items():
            assert v >= last.get(p, 0), (p, last.get(p), v)
            last[p] = v
    assert {s.get("phase") for s in samples} == {"Running"}
    assert runs.items(cluster, "pods", ns, f"{LABEL_SHARD}=1")[0]["metadata"]["name"] == name
    assert unit_attempts(cluster, ns) == attempts, "the learner restarted for a syncer shard"


def test_a_shard_down_is_a_fault_domain_named_in_status_and_events(
    cluster: harness._ClusterBase, run: dict[str, Any], real: dict[str, Any]
) -> None:
    """Shard 1's pod deleted: its new pod starts cold from its own claim. Meanwhile the run keeps
    its phase, shard 0 merges on, the condition and a Warning Event name shard 1, and when it
    answers again no fragment has gone back."""
    ns = run["ns"]
    attempts = unit_attempts(cluster, ns)
    old = shard_pod(cluster, ns, 1)["metadata"]["name"]
    samples: list[dict[str, Any]] = [st(cluster, ns)]
    # The replacement pod waits (Pending) until the test lets it start: how long the shard is
    # down is the test's choice, not the node's speed. A fresh pod answered 8 s after the
    # deletion on an idle machine, a window too short to see shard 0 merge in for certain.
    with node_held(cluster, real["real_node"]):
        kubectl(cluster, "delete", "pod", "-n", ns, old, "--wait=false")
        t0 = time.monotonic()

        def down() -> dict[str, Any] | None:
            samples.append(status := st(cluster, ns))
            return None if shards_of(status)[1]["answering"] else status

        first_down = wait_for("the operator seeing shard 1 silent", down, 60, every=0.1)
        cond = next(c for c in first_down["conditions"] if c["type"] == "SyncerShards")
        assert cond["status"] == "False" and f"shard 1 ({shard_name(1)})" in cond["message"], cond
        lead_then = shards_of(first_down)[0]["outerStep"]

        def lead_merging_alone() -> bool:
            samples.append(status := st(cluster, ns))
            lead, silent = shards_of(status)
            assert not silent["answering"], "shard 1 answered while its pod could not start"
            return bool(lead["outerStep"] > lead_then)

        wait_for("shard 0 merging while shard 1 is down", lead_merging_alone, 120)
        events = wait_for(
            "a SyncerShardDown Event", lambda: runs.events(cluster, ns, RUN, "SyncerShardDown"), 30
        )
        assert f"shard 1 ({shard_name(1)})" in events[0]["message"], events[0]["message"]
        pods = runs.items(cluster, "pods", ns, f"{LABEL_SHARD}=1")
        (held,) = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        assert held["status"].get("phase") == "Pending", held["status"]
    released = time.monotonic()

    def back() -> bool:
        samples.append(status := st(cluster, ns))
        return all(s["answering"] for s in shards_of(status))

    wait_for("shard 1 answering again from its claim", back, 180)
    now = time.monotonic()
    say(
        f"shard 1 down {now - t0:.1f}s; its new pod let start -> answering in {now - released:.1f}s"
    )
    wait_for(
        "a SyncerShardBack Event", lambda: runs.events(cluster, ns, RUN, "SyncerShardBack"), 30
    )
    last: dict[int, int] = {}
    for sample in samples:
        for p, v in versions(sample).items():
            assert v >= last.get(p, 0), (p, last.get(p), v)
            last[p] = v
    assert {s.get("phase") for s in samples} == {"Running"}
    assert unit_attempts(cluster, ns) == attempts, "the learner restarted for a syncer shard"


def test_run_succeeds_with_a_final_loss_and_every_shard_goes_with_it(
    cluster: harness._ClusterBase, run: dict[str, Any]
) -> None:
    ns = run["ns"]
    budget = st(cluster, ns)["steps"] + BUDGET_LEFT
    assert budget < TOTAL_STEPS
    patch = {"spec": {"training": {"totalSteps": budget}}}
    kubectl(cluster, "patch", "dlr", RUN, "-n", ns, "--type=merge", "-p", json.dumps(patch))
    done = wait_for(
        "Succeeded with a finalLoss",
        lambda: (s := st(cluster, ns)).get("phase") == "Succeeded" and s.get("finalLoss") and s,
        300,
    )
    say(f"run Succeeded: outerStep {done['outerStep']}, finalLoss {done['finalLoss']}")
    assert done["outerStep"] == sum(s["outerStep"] for s in shards_of(done))
    kubectl(cluster, "delete", "dlr", RUN, "-n", ns, "--wait=true", "--timeout=120s")
    wait_for(
        "every shard's children gone",
        lambda: not runs.items(cluster, "deploy,svc,pdb,pods,jobs", ns, runs.run_selector(RUN)),
        120,
    )
    claims = runs.items(cluster, "pvc", ns, runs.run_selector(RUN))
    # retained (retentionPolicy Retain): the next run of this name resumes from them
    assert sorted(c["metadata"]["name"] for c in claims) == [
        f"{RUN}-checkpoints",
        f"{RUN}-checkpoints-1",
    ]

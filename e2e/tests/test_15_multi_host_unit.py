"""A unit of two hosts on real pods (`unitGroups[].hostsPerUnit: 2`, docs/operator.md).

On the real node, with the chart's operator in-cluster from its image, one CPU unit is two pods
of one Indexed Job that form one JAX program (jax.distributed over the pods' network: host 0
coordinates at `{unit}-0.{unit}`, the Job's headless Service). In order:

1. both pods train as one unit: each learner joined the distributed program (2 processes), only
   host 0 talks to the syncer, and the run's steps and tokens rise;
2. host 1's learner process is SIGKILLed inside its container (from the node, as the OOM killer
   would): its supervisor moves the unit to generation 1, host 0's supervisor hears it and
   restarts its own learner, and both form the program again on the next coordinator port: the
   same two pods (no recreation), one restart in place in status, training again;
3. the budget, lowered on the running run, is reached: Succeeded, both pods Completed.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import runs
from conftest import kubectl, say, wait_for
from real_pods import children, container_pid, real_node_run

from e2e.cluster import harness

pytestmark = pytest.mark.timeout(900)

RUN = "twohost"
UNIT = f"{RUN}-cpu-0"
TOTAL_STEPS = 20_000  # lowered by the last test, once the fault is over
BUDGET_LEFT = 100


def manifest(image: str) -> dict[str, Any]:
    return real_node_run(
        RUN,
        image,
        group={"hostsPerUnit": 2},
        training={"totalSteps": TOTAL_STEPS, "eval": {"everySeconds": 60, "batches": 2}},
        # the real node's few local volumes belong to the modules that test claims
        syncer={"checkpoint": {"ephemeral": True}, "standby": False},
        failurePolicy={
            "inPlaceRestarts": 3,
            "healthyAfterSeconds": 5,
            # The restart in place must beat this, or the unit is recreated instead: 6 s here
            # under load, but a CI machine once took longer (two hosts announcing at once then
            # waited 6 s on each other, since fixed; the coordinator's client backs off too).
            "offlineAfterSeconds": 60,
        },
    )


@pytest.fixture(scope="module")
def run(
    cluster: harness._ClusterBase, real: dict[str, Any], incluster: str, namespace: str
) -> Iterator[dict[str, Any]]:
    with runs.restricted_run(
        cluster, namespace, manifest(real["images"]["trainer"]), "two-host unit module"
    ) as r:
        yield r


def st(c: harness._ClusterBase, ns: str) -> dict[str, Any]:
    return runs.status(c, ns, RUN)


def host_pods(c: harness._ClusterBase, ns: str) -> dict[int, dict[str, Any]]:
    """The unit's live pods by completion index."""
    pods = [p for p in runs.pods_of(c, ns, UNIT) if not p["metadata"].get("deletionTimestamp")]
    index = "batch.kubernetes.io/job-completion-index"
    return {int(p["metadata"]["annotations"][index]): p for p in pods}


def learner_log(c: harness._ClusterBase, ns: str, pod: dict[str, Any]) -> str:
    r = kubectl(c, "logs", "-n", ns, pod["metadata"]["name"], "-c", "learner", check=False)
    return r.stdout + r.stderr


def learner_pid(c: harness._ClusterBase, pod: dict[str, Any]) -> int:
    """The host PID of the learner process: the one child of the container's supervisor."""
    (child,) = children(container_pid(c, pod, "learner"))
    return child


def test_two_pods_train_as_one_unit(cluster: harness._ClusterBase, run: dict[str, Any]) -> None:
    ns = run["ns"]
    wait_for("the unit Online", lambda: runs.all_units_online(cluster, ns, RUN, 1), 300)
    first = wait_for("training in status", lambda: (s := st(cluster, ns)).get("tokens") and s, 240)
    say(f"apply -> the two-host unit training: {time.monotonic() - run['t0']:.1f}s")
    wait_for(
        "steps and tokens rising",
        lambda: st(cluster, ns).get("tokens", 0) > first["tokens"],
        120,
    )
    pods = host_pods(cluster, ns)
    assert sorted(pods) == [0, 1]
    for i, pod in pods.items():
        log = learner_log(cluster, ns, pod)
        assert "event=distributed_init" in log and "processes=2" in log, log[-2000:]
        assert f"process={i}" in log
        assert f"coordinator={UNIT}-0.{UNIT}:8476" in log
    assert "event=joined" in learner_log(cluster, ns, pods[0])
    assert "event=joined" not in learner_log(cluster, ns, pods[1]), "only host 0 talks"


def test_one_hosts_crash_restarts_both_in_their_pods(
    cluster: harness._ClusterBase, run: dict[str, Any]
) -> None:
    ns = run["ns"]
    before = host_pods(cluster, ns)
    uids = {i: p["metadata"]["uid"] for i, p in before.items()}
    unit = runs.unit_status(cluster, ns, RUN)[UNIT]
    victim = learner_pid(cluster, before[1])
    leader = learner_pid(cluster, before[0])
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()

    def restarted() -> bool:
        u = runs.unit_status(cluster, ns, RUN)[UNIT]
        return u.get("restartsInPlace", 0) > unit.get("restartsInPlace", 0) and (
            u["state"] == "Online"
        )

    wait_for("the unit restarted in place", restarted, 180)
    tokens = st(cluster, ns)["tokens"]
    wait_for("training again", lambda: st(cluster, ns)["tokens"] > tokens, 120)
    took = time.monotonic() - t0
    say(f"SIGKILL of host 1's learner -> both hosts restarted, training again: {took:.1f}s")
    run["restart_s"] = took
    after = host_pods(cluster, ns)
    assert {i: p["metadata"]["uid"] for i, p in after.items()} == uids, "pods were recreated"
    assert runs.unit_status(cluster, ns, RUN)[UNIT]["attempt"] == unit["attempt"]
    assert learner_pid(cluster, after[0]) != leader, "host 0's learner must restart too"
    host0, host1 = learner_log(cluster, ns, after[0]), learner_log(cluster, ns, after[1])
    assert "event=learner_crashed exit=137" in host1
    assert "event=unit_restart generation=1" in host1
    assert "event=unit_restart_heard generation=1" in host0
    for log in (host0, host1):
        assert f"coordinator={UNIT}-0.{UNIT}:8477" in log, log[-2000:]


def test_the_unit_completes(cluster: harness._ClusterBase, run: dict[str, Any]) -> None:
    ns = run["ns"]
    budget = st(cluster, ns)["steps"] + BUDGET_LEFT
    assert budget < TOTAL_STEPS
    patch = {"spec": {"training": {"totalSteps": budget}}}
    kubectl(cluster, "patch", "dlr", RUN, "-n", ns, "--type=merge", "-p", json.dumps(patch))
    wait_for("Succeeded", lambda: st(cluster, ns).get("phase") == "Succeeded", 300)

    def completed() -> bool:
        pods = runs.pods_of(cluster, ns, UNIT)
        return len(pods) == 2 and all(p["status"].get("phase") == "Succeeded" for p in pods)

    wait_for("both pods Completed", completed, 120)
    kubectl(cluster, "delete", "dlr", RUN, "-n", ns, "--wait=true", "--timeout=120s")
    runs.record_timings("multi_host", {"restart_s": run.get("restart_s")})

"""Real pods: the trainer image trains inside Kubernetes, end to end (docs/e2e.md).

On the local cluster's real node (e2e/cluster/real_node.py: containerd, kubelet, kube-proxy,
CoreDNS) the chart runs the operator in-cluster from its image, and a CPU DilocoRun's learner and
syncer pods are real containers of the trainer image. The namespace enforces the "restricted" Pod
Security profile. In order, one run:

1. the learners reach the syncer through its Service by DNS and train: `kubectl get dlr` shows
   steps, tokens and loss rising from the syncer's report; the operator and CRD are the previous
   release's chart's, and `helm upgrade` to this chart mid-run upgrades the CRD (the new
   operator does) while the run trains on in the same pods;
2. the run's own `spec.chaos` kills unit 0 (the operator, started with chaos on, deletes its pod
   with no grace): Offline, recreated, the new pod joins and pulls the global parameters;
3. a learner's process is SIGKILLed inside its container (from the node, as the OOM killer
   would): its supervisor forks a new one, and killed with its supervisor the kubelet restarts
   the container in the same pod, each a new attempt at the syncer that rejoins with the global
   parameters; one kill more than its restarts in place, and the unit is recreated; and a
   learner pod is deleted: the unit is recreated and rejoins;
4. the serving syncer's process is SIGKILLed: the standby container of the same pod serves every
   version and the run trains on, no learner restarts;
5. the syncer pod is deleted: the new one resumes from its checkpoint volume (a fresh ext4
   disk), the outer step falls back at most one checkpoint period, and no learner restarts;
6. its budget, lowered on the running run (`kubectl patch`), is reached: Succeeded, finalLoss
   set, learner pods Completed;
7. deleting the run removes every child, and no container of the namespace is left on the node.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import runs
from conftest import SYSTEM_NS, get_json, kubectl, say, wait_for
from diloco_operator.api import crdgen
from real_pods import (
    children,
    container_pid,
    ctr,
    operator_pod,
    operator_pods,
    real_node_run,
    upgrade_chart,
)

from e2e.cluster import harness, real_node

# The first test also waits for the cluster, the node and (after a source change) the images.
pytestmark = pytest.mark.timeout(1500)

RUN = "real"
UNITS = 2
CHECKPOINT_SECONDS = 5
CHAOS_KILL_AT = 40.0
BACKOFF_S = 1.0
TOTAL_STEPS = 10_000  # the budget the run is created with
BUDGET_LEFT = 500  # steps to go once the last test lowers it: ~10 s for both units
# Restarts in place one learner gets (SIGKILLed each time) before one more kill is a recreation:
# all but the last by its supervisor in the container, the last by the kubelet. The bench's
# real-pods section asks for more, to take a median.
IN_PLACE_RESTARTS = int(os.environ.get("DILOCO_E2E_IN_PLACE_RESTARTS", "2"))


def manifest(image: str) -> dict[str, Any]:
    return real_node_run(
        RUN,
        image,
        replicas=UNITS,
        training={
            "fragments": 2,
            # Every fault below hits a training run, however slow the machine: this
            # budget would take ~6 min on 2 loaded cores (~15k tokens/s for both units).
            # Once the faults are over, the last test lowers it to what is nearly done.
            "totalSteps": TOTAL_STEPS,
            "checkpoint": {"everySeconds": CHECKPOINT_SECONDS},
            "eval": {"everySeconds": 10, "batches": 2},
        },
        syncer={"checkpoint": {"size": "1Gi"}},
        failurePolicy={
            "restartBackoffSeconds": BACKOFF_S,
            "inPlaceRestarts": IN_PLACE_RESTARTS,
            "kubeletRestartRule": True,  # the real node's kubelet declares the feature
            "healthyAfterSeconds": 5,
            "offlineAfterSeconds": 20,
        },
        chaos={"schedule": [{"atSeconds": CHAOS_KILL_AT, "action": "kill", "unit": 0}]},
    )


@pytest.fixture(scope="module")
def restricted(cluster: harness._ClusterBase, namespace: str) -> str:
    enforce = "pod-security.kubernetes.io/enforce"
    labels = [f"{enforce}=restricted", f"{enforce}-version=latest"]
    kubectl(cluster, "label", "namespace", namespace, *labels)
    return namespace


@pytest.fixture(scope="module")
def run(
    cluster: harness._ClusterBase,
    real: dict[str, Any],
    incluster_previous_release: str,
    restricted: str,
) -> Iterator[dict[str, Any]]:
    ns = restricted
    t0 = time.time()
    runs.apply(cluster, ns, manifest(real["images"]["trainer"]))
    timings: dict[str, Any] = {
        "applied": t0,
        "backoff_s": BACKOFF_S,
        "replacement_s": [],
        "replacement_what": [],
    }
    yield {"ns": ns, "timings": timings}


# ----------------------------------------------------------------------------------------------
# helpers


def record(run: dict[str, Any], what: str, seconds: float) -> None:
    run["timings"]["replacement_what"].append(what)
    run["timings"]["replacement_s"].append(round(seconds, 2))


def st(c: harness._ClusterBase, ns: str) -> dict[str, Any]:
    return runs.status(c, ns, RUN)


def units(c: harness._ClusterBase, ns: str) -> dict[str, dict[str, Any]]:
    return runs.unit_status(c, ns, RUN)


def unit_name(i: int) -> str:
    return f"{RUN}-cpu-{i}"


def training_pod(
    c: harness._ClusterBase, ns: str, unit: str, attempt: int
) -> dict[str, Any] | None:
    """The unit's pod of `attempt` once its container runs."""
    for p in runs.pods_of(c, ns, unit, attempt):
        if runs.running(p) and all(
            cs.get("state", {}).get("running") for cs in p["status"].get("containerStatuses", [])
        ):
            return p
    return None


def training_pods_of(c: harness._ClusterBase, ns: str, unit: str) -> dict[str, Any] | None:
    """The pod of the unit's current attempt (by the run's status), whatever its phase."""
    attempt = units(c, ns)[unit]["attempt"]
    pods = runs.pods_of(c, ns, unit, attempt)
    return pods[0] if pods else None


def pod_log(c: harness._ClusterBase, ns: str, pod: str, container: str | None = None) -> str:
    which = ["-c", container] if container else []
    r = kubectl(c, "logs", "-n", ns, pod, *which, check=False)
    return r.stdout + r.stderr


def joined_with_global_params(log: str) -> bool:
    """The latest learner's join line names the versions it pulled: all zero only at the run's
    start. (Text or JSON log lines: the message is the same key=value text. A supervised
    learner's restarts log into the same container log: the last join is the newest.)"""
    joins = re.findall(r"event=joined .*?versions=\[([0-9, ]*)\]", log)
    return bool(joins) and any(int(v) > 0 for v in joins[-1].split(",") if v.strip())


def wait_replaced(
    c: harness._ClusterBase, ns: str, unit: str, attempt: int, what: str
) -> tuple[float, dict[str, Any]]:
    """Wait for the unit's next attempt to be Online with a running pod that joined with the
    global parameters; returns (seconds taken, the pod)."""
    t0 = time.monotonic()
    wait_for(
        f"{what}: {unit} attempt > {attempt} Online",
        lambda: (u := units(c, ns).get(unit)) and u["attempt"] > attempt and u["state"] == "Online",
        timeout=180,
    )
    new_attempt = units(c, ns)[unit]["attempt"]
    pod = wait_for(
        f"{what}: a running pod of {unit}", lambda: training_pod(c, ns, unit, new_attempt), 120
    )
    wait_for(
        f"{what}: {pod['metadata']['name']} joined with the global parameters",
        lambda: joined_with_global_params(pod_log(c, ns, pod["metadata"]["name"])),
        timeout=120,
    )
    return time.monotonic() - t0, pod


def wait_restarted_in_place(
    c: harness._ClusterBase, ns: str, unit: str, before: dict[str, Any], what: str
) -> tuple[float, dict[str, Any]]:
    """Wait for the syncer to hear the unit's learner restarted in its pod (restartsInPlace up,
    the same attempt) and for the new process to join with the global parameters; returns
    (seconds taken, the pod)."""
    t0 = time.monotonic()
    restarted = before.get("restartsInPlace", 0)
    wait_for(
        f"{what}: {unit} restarted in place",
        lambda: (
            (u := units(c, ns).get(unit))
            and u.get("restartsInPlace", 0) > restarted
            and u["state"] == "Online"
        ),
        timeout=180,
    )
    pod = wait_for(
        f"{what}: {unit}'s pod running", lambda: training_pod(c, ns, unit, before["attempt"]), 60
    )
    wait_for(
        f"{what}: the restarted learner joined with the global parameters",
        lambda: joined_with_global_params(pod_log(c, ns, pod["metadata"]["name"], "learner")),
        timeout=120,
    )
    return time.monotonic() - t0, pod


def node_containers(cluster: harness._ClusterBase, ns: str) -> list[str]:
    pod_namespace = 'labels."io.kubernetes.pod.namespace"'
    return ctr(cluster, "containers", "ls", "-q", f"{pod_namespace}=={ns}").split()


# ----------------------------------------------------------------------------------------------
# the tests, in order: one run goes through all of them


def test_learners_train_in_pods_and_status_rises(
    cluster: harness._ClusterBase, run: dict[str, Any]
) -> None:
    ns = run["ns"]
    wait_for("all units Online", lambda: runs.all_units_online(cluster, ns, RUN, UNITS), 300)
    first = wait_for(
        "a training step in status", lambda: (s := st(cluster, ns)).get("tokens") and s, 240
    )
    run["timings"]["first_step_s"] = time.time() - run["timings"]["applied"]
    say(f"apply -> first training step in status: {run['timings']['first_step_s']:.1f}s")
    later = wait_for(
        "steps, tokens and loss rising",
        lambda: (
            (s := st(cluster, ns)).get("outerStep", 0) > first.get("outerStep", 0)
            and s["tokens"] > first["tokens"]
            and s.get("loss") is not None
            and s
        ),
        120,
    )
    printed = kubectl(cluster, "get", "dlr", RUN, "-n", ns).stdout
    say(f"kubectl get dlr:\n{printed}")
    nodes = kubectl(cluster, "get", "nodes", "-o", "wide").stdout
    run["timings"]["nodes"] = nodes
    say(f"kubectl get nodes -o wide:\n{nodes}")
    assert (RUN in printed and str(later["outerStep"]) in printed) or later["outerStep"] > 0
    # Every pod is a real container on the real node, admitted under "restricted".
    for p in runs.items(cluster, "pods", ns, runs.run_selector(RUN)):
        assert p["spec"]["nodeName"] == cluster.info()["real_node"], p["metadata"]["name"]
    syncer_dns = f"http://{RUN}-syncer.{ns}.svc:8470"
    pod = training_pod(cluster, ns, unit_name(1), units(cluster, ns)[unit_name(1)]["attempt"])
    assert pod is not None
    assert runs.env_of(pod["spec"]["containers"][0])["DILOCO_SYNCER_ADDR"] == syncer_dns


def test_helm_upgrade_mid_run_upgrades_the_crd_and_training_goes_on(
    cluster: harness._ClusterBase, run: dict[str, Any]
) -> None:
    """The run so far was made by the previous release's chart and CRD. `helm upgrade` to this
    tree's chart (docs/operator.md, "Upgrades") replaces the operator pod; the new operator
    brings the CRD to this release's schema, takes the run over and it trains on: unit 1's pod is
    the same pod, its container never restarted. (Unit 0 is left out: the chaos schedule kills it
    at 40 s, whenever that falls.)"""
    ns = run["ns"]
    crd_name = "dilocoruns.diloco.dev"
    before_crd = get_json(cluster, "get", "crd", crd_name)["metadata"].get("annotations") or {}
    assert crdgen.VERSION_ANNOTATION not in before_crd  # the previous release's CRD
    old_operator = operator_pod(cluster)
    unit = unit_name(1)
    pod = training_pod(cluster, ns, unit, units(cluster, ns)[unit]["attempt"])
    assert pod is not None
    restarts = sum(c["restartCount"] for c in pod["status"]["containerStatuses"])
    t0 = time.monotonic()
    upgrade_chart(cluster)
    new_operator = wait_for(
        "the upgraded operator pod Ready",
        lambda: (p := operator_pod(cluster)) and p != old_operator and p,
        180,
    )
    say(f"helm upgrade -> {new_operator} ready in {time.monotonic() - t0:.1f}s")
    wanted = crdgen.crd()
    crd = wait_for(
        "the CRD upgraded by the new operator",
        lambda: (
            (c := get_json(cluster, "get", "crd", crd_name))["metadata"].get("annotations", {})
            == c["metadata"].get("annotations", {}) | wanted["metadata"]["annotations"]
            and c
        ),
        60,
    )
    served = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert as_floats(served) == as_floats(
        wanted["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    )
    outer = st(cluster, ns).get("outerStep", 0)
    wait_for(
        "the outer step rising under the new operator",
        lambda: st(cluster, ns).get("outerStep", 0) > outer,
        120,
    )
    took = time.monotonic() - t0
    after = get_json(cluster, "get", "pod", "-n", ns, pod["metadata"]["name"])
    assert after["metadata"]["uid"] == pod["metadata"]["uid"]
    assert sum(c["restartCount"] for c in after["status"]["containerStatuses"]) == restarts
    version = crd["metadata"]["annotations"][crdgen.VERSION_ANNOTATION]
    say(f"helm upgrade mid-run: CRD at {version}, training on after {took:.1f}s")


def as_floats(schema: Any) -> Any:
    """The API server stores a schema's numbers as JSON numbers: 1 comes back as 1.0, and
    int64 bounds rounded; compare them as floats."""
    return json.loads(json.dumps(schema), parse_int=float)


def test_chaos_kill_from_the_manifest_replaces_the_unit(
    cluster: harness._ClusterBase, run: dict[str, Any]
) -> None:
    ns = run["ns"]
    before = units(cluster, ns)[unit_name(0)]["attempt"]
    event = wait_for("the ChaosKill Event", lambda: runs.events(cluster, ns, RUN, "ChaosKill"), 180)
    t_event = time.monotonic()
    _, _ = wait_replaced(cluster, ns, unit_name(0), before, "chaos kill")
    took = time.monotonic() - t_event
    record(run, "chaos kill (pod deleted by the operator)", took)
    say(f"chaos kill ({event[0]['message']}) -> unit 0 training again in {took:.1f}s")


def test_sigkilled_learner_restarts_in_its_pod_until_its_restarts_are_spent(
    cluster: harness._ClusterBase, run: dict[str, Any]
) -> None:
    """SIGKILL from the node, as the OOM killer would: of the learner process, which its
    supervisor forks again in the container; of the container's main process (the supervisor),
    which the kubelet restarts in the same pod. Each is a new attempt at the syncer; once the
    pod's restarts in place are spent, the next crash exits 3 and the unit is recreated."""
    ns = run["ns"]
    unit = unit_name(1)
    before = units(cluster, ns)[unit]
    pod = training_pod(cluster, ns, unit, before["attempt"])
    assert pod is not None
    main = container_pid(cluster, pod)
    for i in range(IN_PLACE_RESTARTS):
        by_kubelet = i == IN_PLACE_RESTARTS - 1
        (learner_pid,) = children(container_pid(cluster, pod))
        seen = units(cluster, ns)[unit]
        os.kill(container_pid(cluster, pod) if by_kubelet else learner_pid, signal.SIGKILL)
        took, again = wait_restarted_in_place(cluster, ns, unit, seen, "SIGKILL")
        layer = "the kubelet" if by_kubelet else "its supervisor"
        record(run, f"SIGKILL of the learner: restarted in its pod by {layer}", took)
        say(f"SIGKILL of {unit}'s learner -> restarted by {layer}, training in {took:.1f}s")
        assert again["metadata"]["uid"] == pod["metadata"]["uid"], "the pod was recreated"
        assert again["spec"]["nodeName"] == pod["spec"]["nodeName"]
        assert children(container_pid(cluster, again)) != [learner_pid]
        (container,) = [c for c in again["status"]["containerStatuses"] if c["name"] == "learner"]
        assert container["restartCount"] == (1 if by_kubelet else 0)
        assert (container_pid(cluster, again) == main) != by_kubelet
        pod = again
    after = units(cluster, ns)[unit]
    assert after["restartsInPlace"] == IN_PLACE_RESTARTS, after
    assert (after["attempt"], after.get("restarts", 0)) == (
        before["attempt"],
        before.get("restarts", 0),
    ), "a restart in place is not a recreation"

    (learner_pid,) = children(container_pid(cluster, pod))
    os.kill(learner_pid, signal.SIGKILL)  # one more: they are spent
    took, new_pod = wait_replaced(cluster, ns, unit, before["attempt"], "restarts spent")
    record(run, "SIGKILL after the restarts in place are spent: recreated", took)
    say(f"{unit}'s restarts in place spent -> recreated, training again in {took:.1f}s")
    assert new_pod["metadata"]["uid"] != pod["metadata"]["uid"]
    recreated = units(cluster, ns)[unit]
    assert recreated.get("restarts", 0) == before.get("restarts", 0) + 1, recreated


def test_deleted_learner_pod_is_replaced(
    cluster: harness._ClusterBase, run: dict[str, Any]
) -> None:
    ns = run["ns"]
    unit = unit_name(0)
    attempt = units(cluster, ns)[unit]["attempt"]
    pod = wait_for("unit 0 running", lambda: training_pod(cluster, ns, unit, attempt), 120)
    kubectl(cluster, "delete", "pod", "-n", ns, pod["metadata"]["name"], "--wait=false")
    took, _ = wait_replaced(cluster, ns, unit, attempt, "pod deleted")
    record(run, "learner pod deleted", took)
    say(f"pod of {unit} deleted -> training again in {took:.1f}s")
    restarts = {u["name"]: u.get("restarts", 0) for u in units(cluster, ns).values()}
    assert restarts[unit_name(0)] >= 2, restarts  # the chaos kill and this one


def test_sigkilled_syncer_is_replaced_by_the_standby_in_its_pod(
    cluster: harness._ClusterBase, run: dict[str, Any]
) -> None:
    """The syncer pod's two containers share one lock: SIGKILL the serving syncer's process
    (from the node, as the OOM killer would) and the other container serves the same port with
    every version; the pod stays, the kubelet restarts the dead container as the next standby."""
    ns = run["ns"]
    attempts = {n: u["attempt"] for n, u in units(cluster, ns).items()}
    (pod,) = runs.items(cluster, "pods", ns, runs.run_selector(RUN, "syncer"))
    name = pod["metadata"]["name"]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["syncer", "syncer-standby"]

    def roles() -> tuple[str, str] | None:
        logs = {c: pod_log(cluster, ns, name, c) for c in ("syncer", "syncer-standby")}
        serving = [c for c, text in logs.items() if "event=listening" in text]
        waiting = [c for c, text in logs.items() if "event=standby_ready" in text]
        return (serving[0], waiting[0]) if len(serving) == 1 and len(waiting) == 1 else None

    serving, standby = wait_for("one syncer serving, the other a warm standby", roles, 240)
    before = st(cluster, ns)["outerStep"]
    pod = get_json(cluster, "get", "pod", name, "-n", ns)
    pid = container_pid(cluster, pod, serving)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    took = wait_for(
        "the standby took over",
        lambda: re.search(r"event=took_over .*", pod_log(cluster, ns, name, standby)),
        120,
    )
    wait_for("outer step past the old one", lambda: st(cluster, ns)["outerStep"] > before, 180)
    record(
        run, "SIGKILL of the serving syncer -> standby container training on", time.monotonic() - t0
    )
    say(
        f"SIGKILL of the {serving} container's syncer (host pid {pid}) -> {standby}: {took.group(0)}"
    )
    assert "versions_lost" not in pod_log(cluster, ns, name, standby)
    after = runs.items(cluster, "pods", ns, runs.run_selector(RUN, "syncer"))
    assert [p["metadata"]["name"] for p in after] == [name]  # the same pod
    assert {n: u["attempt"] for n, u in units(cluster, ns).items()} == attempts
    wait_for(
        "the killed container back as the standby",
        lambda: "event=standby_ready" in pod_log(cluster, ns, name, serving),
        240,
    )


def test_syncer_pod_deleted_resumes_from_its_checkpoint_volume(
    cluster: harness._ClusterBase, run: dict[str, Any]
) -> None:
    ns = run["ns"]
    claim = get_json(cluster, "get", "pvc", f"{RUN}-checkpoints", "-n", ns)
    assert claim["spec"]["volumeName"] == real_node.EXT4_VOLUME  # a fresh ext4 disk
    attempts = {n: u["attempt"] for n, u in units(cluster, ns).items()}
    time.sleep(CHECKPOINT_SECONDS + 2)  # at least one checkpoint since the last faults
    before = st(cluster, ns)["outerStep"]
    syncers = runs.items(cluster, "pods", ns, runs.run_selector(RUN, "syncer"))
    assert len(syncers) == 1
    old = syncers[0]["metadata"]["name"]
    kubectl(cluster, "delete", "pod", "-n", ns, old, "--wait=false")
    t0 = time.monotonic()

    def new_syncer_serving() -> dict[str, Any] | None:
        pods = runs.items(cluster, "pods", ns, runs.run_selector(RUN, "syncer"))
        fresh = [p for p in pods if p["metadata"]["name"] != old and runs.running(p)]
        return fresh[0] if fresh else None

    new = wait_for("a new syncer pod running", new_syncer_serving, 180)

    def restored_log() -> str | None:
        text = pod_log(cluster, ns, new["metadata"]["name"])
        return text if "event=checkpoint_loaded" in text else None

    log = wait_for("the new syncer restored its checkpoint", restored_log, 120)
    run["timings"]["syncer_restore_s"] = time.monotonic() - t0
    m = re.search(r"event=checkpoint_loaded .*?outer_step=(\d+)", log)
    assert m, log[-2000:]
    restored = int(m.group(1))
    say(
        f"syncer deleted at outer step {before}; the new one restored {restored} "
        f"({time.monotonic() - t0:.1f}s)"
    )
    # at most one checkpoint period lost: learners push every innerSteps, a period holds a few
    assert restored > 0
    assert restored >= before - 4 * UNITS * 2, (before, restored)
    wait_for(
        "outer step past the old one", lambda: st(cluster, ns).get("outerStep", 0) > before, 180
    )
    now = {n: u["attempt"] for n, u in units(cluster, ns).items()}
    assert now == attempts, "learners restarted when only the syncer went away"


def test_run_completes_and_children_go_with_it(
    cluster: harness._ClusterBase, run: dict[str, Any]
) -> None:
    ns = run["ns"]
    # The budget is the one part of a running run's training that may change: the operator hands
    # it to the syncer with the next roster, and the syncer ends the run there (a few seconds of
    # training on), not at the TOTAL_STEPS it was created with.
    budget = st(cluster, ns)["steps"] + BUDGET_LEFT
    assert budget < TOTAL_STEPS, "the faults took the run to its budget: nothing left to lower"
    patch = {"spec": {"training": {"totalSteps": budget}}}
    kubectl(cluster, "patch", "dlr", RUN, "-n", ns, "--type=merge", "-p", json.dumps(patch))
    wait_for("phase Succeeded", lambda: st(cluster, ns).get("phase") == "Succeeded", 720)
    ended = st(cluster, ns)["steps"]
    if ended >= TOTAL_STEPS:  # what the in-cluster operator did with the new generation
        obj = get_json(cluster, "get", "dlr", RUN, "-n", ns)
        say(
            f"generation {obj['metadata'].get('generation')} observed "
            f"{obj['status'].get('observedGeneration')} totalSteps "
            f"{obj['spec']['training'].get('totalSteps')}"
        )
        for pod in operator_pods(cluster):
            logs = pod_log(cluster, SYSTEM_NS, pod["metadata"]["name"])
            lines = [line for line in logs.splitlines() if re.search("roster|peer|pause", line)]
            say(f"{pod['metadata']['name']}:\n" + "\n".join(lines[-40:]))
    # the syncer's final evaluation of the global model follows the budget by a moment
    done = wait_for(
        "finalLoss in status", lambda: (s := st(cluster, ns)).get("finalLoss") and s, 180
    )
    say(
        f"run Succeeded: outerStep {done.get('outerStep')}, tokens {done.get('tokens')}, "
        f"finalLoss {done['finalLoss']}"
    )
    say(f"status at the end:\n{json.dumps(done, indent=1)[:3000]}")
    run["timings"]["final_status"] = done
    run["timings"]["get_dlr"] = kubectl(cluster, "get", "dlr", RUN, "-n", ns).stdout
    assert {u["state"] for u in done["units"]} == {"Completed"}
    assert budget <= done["steps"] < TOTAL_STEPS, (budget, done["steps"])

    def learners_exited_0() -> list[dict[str, Any]] | None:
        """The current attempt's pod of each unit, once all of them Succeeded (exit 0)."""
        current = [training_pods_of(cluster, ns, u) for u in (unit_name(i) for i in range(UNITS))]
        if all(p and p["status"]["phase"] == "Succeeded" for p in current):
            return [p for p in current if p]
        return None

    finished = wait_for("the learner pods Completed", learners_exited_0, 60)
    say(f"learner pods: {[(p['metadata']['name'], p['status']['phase']) for p in finished]}")
    kubectl(cluster, "delete", "dlr", RUN, "-n", ns, "--wait=true", "--timeout=120s")
    wait_for(
        "every child gone",
        lambda: (
            not runs.items(cluster, "jobs,pods,deploy,svc,cm,secret", ns, runs.run_selector(RUN))
        ),
        180,
    )
    wait_for(
        "no container of the namespace left on the node",
        lambda: not node_containers(cluster, ns),
        120,
    )
    timings = {k: v for k, v in run["timings"].items() if k != "applied"}
    say(f"timings: {json.dumps(timings)}")
    out = os.environ.get("DILOCO_E2E_TIMINGS")
    if out:  # bench/cluster/real_pods.py reads them
        Path(out).write_text(json.dumps(timings))

"""A warm spare on real pods (`unitGroups[].spares`, docs/operator.md "Warm spares").

On the real node, with the chart's operator in-cluster from its image, a run of one CPU unit
keeps one spare pod. In order:

1. the spare pod compiles and waits at the syncer: status.spares says Ready, while the unit
   trains;
2. the unit's pod is deleted: the operator asks the syncer for a cover, the spare trains as the
   unit (joined under the cover attempt, first step) while the unit's Job is recreated; the
   unit's status names the spare in coveredBy;
3. the recreated pod joins: the syncer refuses the cover's attempt from then on, the spare's
   learner exits and the same spare pod waits again (Ready, no new pod);
4. the budget, lowered on the running run, is reached: Succeeded, and the spare's Job is gone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import runs
from conftest import kubectl, say, wait_for
from real_pods import real_node_run

from e2e.cluster import harness

pytestmark = pytest.mark.timeout(900)

RUN = "spare"
UNIT = f"{RUN}-cpu-0"
SPARE = f"{RUN}-cpu-s0"
TOTAL_STEPS = 50_000  # lowered by the last test, once the fault is over
BUDGET_LEFT = 100
COVER_ATTEMPT = 999  # attempts.cover_attempt(0): the restarts part of a wire attempt


def manifest(image: str) -> dict[str, Any]:
    return real_node_run(
        RUN,
        image,
        group={"spares": 1},
        training={"totalSteps": TOTAL_STEPS, "eval": {"everySeconds": 60, "batches": 2}},
        # the real node's few local volumes belong to the modules that test claims
        syncer={"checkpoint": {"ephemeral": True}, "standby": False},
        failurePolicy={"healthyAfterSeconds": 5, "offlineAfterSeconds": 30},
    )


@pytest.fixture(scope="module")
def run(
    cluster: harness._ClusterBase, real: dict[str, Any], incluster: str, namespace: str
) -> Iterator[dict[str, Any]]:
    with runs.restricted_run(
        cluster, namespace, manifest(real["images"]["trainer"]), "warm spare module"
    ) as r:
        yield r


def st(c: harness._ClusterBase, ns: str) -> dict[str, Any]:
    return runs.status(c, ns, RUN)


def spare_status(c: harness._ClusterBase, ns: str) -> dict[str, Any]:
    return next(s for s in st(c, ns).get("spares") or [{}] if s.get("name") == SPARE)


def live_pods(c: harness._ClusterBase, ns: str, job: str) -> list[dict[str, Any]]:
    return [p for p in runs.pods_of(c, ns, job) if not p["metadata"].get("deletionTimestamp")]


def log_lines(c: harness._ClusterBase, ns: str, pod: str) -> list[dict[str, Any]]:
    """The learner container's JSON log records (DILOCO_LOG_FORMAT=json on pods)."""
    out = kubectl(c, "logs", "-n", ns, pod, "-c", "learner", check=False).stdout
    records = []
    for line in out.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def first_at(records: list[dict[str, Any]], *words: str, after: float = 0.0) -> float | None:
    """When the first record carrying every word was written (epoch seconds), after `after`."""
    for r in records:
        at = datetime.fromisoformat(r.get("time", "1970-01-01T00:00:00+00:00")).timestamp()
        if at > after and all(w in r.get("message", "") for w in words):
            return at
    return None


def test_the_spare_waits_while_the_unit_trains(
    cluster: harness._ClusterBase, run: dict[str, Any]
) -> None:
    ns = run["ns"]
    wait_for("the unit Online", lambda: runs.all_units_online(cluster, ns, RUN, 1), 300)
    wait_for("the spare Ready", lambda: spare_status(cluster, ns).get("state") == "Ready", 300)
    first = wait_for("training in status", lambda: (s := st(cluster, ns)).get("tokens") and s, 240)
    wait_for("tokens rising", lambda: st(cluster, ns).get("tokens", 0) > first["tokens"], 120)
    (pod,) = live_pods(cluster, ns, SPARE)
    env = runs.env_of(pod["spec"]["containers"][0])
    assert env["DILOCO_SPARE"] == SPARE and "DILOCO_UNIT" not in env
    assert "event=spare_waiting" in json.dumps(log_lines(cluster, ns, pod["metadata"]["name"]))
    say(f"apply -> unit training and spare Ready: {time.monotonic() - run['t0']:.1f}s")


def test_a_lost_unit_is_covered_by_the_spare_then_handed_back(
    cluster: harness._ClusterBase, run: dict[str, Any]
) -> None:
    ns = run["ns"]
    (spare_pod,) = live_pods(cluster, ns, SPARE)
    spare_name, spare_uid = spare_pod["metadata"]["name"], spare_pod["metadata"]["uid"]
    (unit_pod,) = live_pods(cluster, ns, UNIT)
    attempt = runs.unit_status(cluster, ns, RUN)[UNIT]["attempt"]
    fault = time.time()
    kubectl(cluster, "delete", "pod", "-n", ns, unit_pod["metadata"]["name"], "--wait=false")

    def covered() -> float | None:
        records = log_lines(cluster, ns, spare_name)
        return first_at(records, "event=first_step", f"unit={UNIT}", after=fault)

    trained = wait_for("the spare training as the unit", covered, 120)
    joined = first_at(
        log_lines(cluster, ns, spare_name), "event=joined", f"unit={UNIT}", after=fault
    )
    assert joined is not None and f"attempt={COVER_ATTEMPT}" in json.dumps(
        log_lines(cluster, ns, spare_name)
    )
    run["takeover_joined_s"] = joined - fault
    run["takeover_step_s"] = trained - fault
    say(
        f"unit pod deleted -> spare joined as the unit {joined - fault:.2f}s, "
        f"first step {trained - fault:.2f}s"
    )
    wait_for(
        "coveredBy in the unit's status",
        lambda: (
            runs.unit_status(cluster, ns, RUN)[UNIT].get("coveredBy") == SPARE
            or runs.unit_status(cluster, ns, RUN)[UNIT]["attempt"] > attempt
        ),
        60,
    )

    def handed_back() -> bool:
        unit = runs.unit_status(cluster, ns, RUN)[UNIT]
        spare = spare_status(cluster, ns)
        return (
            unit["attempt"] == attempt + 1
            and unit["state"] == "Online"
            and unit.get("coveredBy") is None
            and spare.get("state") == "Ready"
        )

    wait_for("the recreated unit online and the spare waiting again", handed_back, 240)
    run["handback_s"] = time.time() - fault
    say(f"unit pod deleted -> recreated unit online, spare Ready again: {run['handback_s']:.1f}s")
    (again,) = live_pods(cluster, ns, SPARE)
    assert again["metadata"]["uid"] == spare_uid, "the spare pod must stay, not be recreated"
    text = json.dumps(log_lines(cluster, ns, spare_name))
    assert "event=superseded" in text and "event=spare_again exit=4" in text
    assert spare_status(cluster, ns)["covers"] == 1
    events = runs.events(cluster, ns, RUN, "UnitCovered")
    assert events and SPARE in events[-1]["message"]


def test_the_run_completes_and_its_spare_goes(
    cluster: harness._ClusterBase, run: dict[str, Any]
) -> None:
    ns = run["ns"]
    budget = st(cluster, ns)["steps"] + BUDGET_LEFT
    assert budget < TOTAL_STEPS
    patch = {"spec": {"training": {"totalSteps": budget}}}
    kubectl(cluster, "patch", "dlr", RUN, "-n", ns, "--type=merge", "-p", json.dumps(patch))
    wait_for("Succeeded", lambda: st(cluster, ns).get("phase") == "Succeeded", 300)
    wait_for("the spare's Job gone", lambda: SPARE not in runs.jobs(cluster, ns, RUN), 120)
    assert st(cluster, ns).get("spares") is None
    kubectl(cluster, "delete", "dlr", RUN, "-n", ns, "--wait=true", "--timeout=120s")
    keys = ("takeover_joined_s", "takeover_step_s", "handback_s")
    runs.record_timings("spare", {k: run.get(k) for k in keys})

"""Goodput on real pods with one learner crash per unit per minute (a benchmark scenario: the
real-pods bench runs it, `make e2e` does not: marker `bench`).

On the real node, with the chaos-free chart operator in-cluster, a run of two CPU units trains;
for WINDOW_S seconds each unit's learner process is SIGKILLed once a minute (the units half a
minute apart), from the node, as the OOM killer would. Each crash is restarted in its pod by the
container's supervisor. The goodput of each unit over the window is what the operator accounts
(`status.units[].goodput`: seconds between consecutive heartbeats of one process whose step
advanced, over the seconds the unit was expected to train), taken as the difference of the two
readings at the window's ends.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import runs
from conftest import kubectl, say, wait_for
from real_pods import real_node_run
from test_15_multi_host_unit import learner_pid

from e2e.cluster import harness

pytestmark = [pytest.mark.timeout(1200), pytest.mark.bench]

RUN = "crashes"
UNITS = 2
WINDOW_S = float(os.environ.get("DILOCO_E2E_GOODPUT_WINDOW", "300"))
CRASH_EVERY_S = 60.0
TARGET = 0.95


def manifest(image: str) -> dict[str, Any]:
    return real_node_run(
        RUN,
        image,
        replicas=UNITS,
        training={"totalSteps": 10_000_000, "eval": {"everySeconds": 120, "batches": 2}},
        syncer={"checkpoint": {"ephemeral": True}, "standby": False},
        failurePolicy={"inPlaceRestarts": 50, "healthyAfterSeconds": 5},
    )


@pytest.fixture(scope="module")
def run(
    cluster: harness._ClusterBase, real: dict[str, Any], incluster: str, namespace: str
) -> Iterator[dict[str, Any]]:
    runs.apply(cluster, namespace, manifest(real["images"]["trainer"]))
    yield {"ns": namespace}
    kubectl(cluster, "delete", "dlr", RUN, "-n", namespace, "--wait=true", "--timeout=120s")


def goodput(c: harness._ClusterBase, ns: str) -> dict[str, tuple[float, float]]:
    """(useful, total) seconds of each unit, as the operator last wrote them."""
    out = {}
    for name, unit in runs.unit_status(c, ns, RUN).items():
        g = unit.get("goodput") or {}
        out[name] = (float(g.get("usefulSeconds", 0.0)), float(g.get("totalSeconds", 0.0)))
    return out


def live_pod(c: harness._ClusterBase, ns: str, unit: str) -> dict[str, Any]:
    (pod,) = [p for p in runs.pods_of(c, ns, unit) if not p["metadata"].get("deletionTimestamp")]
    return pod


def test_one_crash_per_unit_per_minute_keeps_goodput(
    cluster: harness._ClusterBase, run: dict[str, Any]
) -> None:
    ns = run["ns"]
    wait_for("every unit Online", lambda: runs.all_units_online(cluster, ns, RUN, UNITS), 300)
    names = sorted(runs.unit_status(cluster, ns, RUN))
    wait_for(
        "every unit accounted",
        lambda: all(total > 30 for _, total in goodput(cluster, ns).values()),
        300,
    )
    start = goodput(cluster, ns)
    began = time.monotonic()
    # Each unit's crashes, a minute apart; the second unit's half a minute after the first's.
    due = sorted(
        (k * CRASH_EVERY_S + i * CRASH_EVERY_S / UNITS, name)
        for i, name in enumerate(names)
        for k in range(int(WINDOW_S // CRASH_EVERY_S))
    )
    crashes = 0
    for at, name in due:
        time.sleep(max(0.0, began + at + CRASH_EVERY_S / 2 - time.monotonic()))
        os.kill(learner_pid(cluster, live_pod(cluster, ns, name)), signal.SIGKILL)
        crashes += 1
    time.sleep(max(0.0, began + WINDOW_S - time.monotonic()))
    time.sleep(5)  # the last heartbeats of the window reach the status
    end = goodput(cluster, ns)
    ratios = {n: (end[n][0] - start[n][0]) / max(1e-9, end[n][1] - start[n][1]) for n in names}
    restarts = {
        n: u.get("restartsInPlace", 0) for n, u in runs.unit_status(cluster, ns, RUN).items()
    }
    say(f"goodput over {WINDOW_S:.0f}s with {crashes} crashes: {ratios}, in place: {restarts}")
    runs.record_timings(
        "goodput",
        {"window_s": WINDOW_S, "crashes": crashes, "ratios": ratios, "restarts": restarts},
    )
    assert all(r >= crashes // UNITS for r in restarts.values()), restarts
    assert {u["attempt"] for u in runs.unit_status(cluster, ns, RUN).values()} == {0}
    assert min(ratios.values()) > 0.5  # a sanity floor; the target is the bench's verdict

"""Spot unit groups and preemptions: the Spot selector and toleration, the refusal of selectors the
operator owns, how pods and nodes are read (observe.py), and the planner's policy: a preemption
or node maintenance is recreated at once and counted in `preemptions`, never as a restart."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_operator.api import UnitFailure, UnitStatus, parse_spec
from diloco_operator.k8s import builders
from diloco_operator.k8s.observe import JobView, observe_unit, pod_view
from diloco_operator.planner import (
    CreateUnit,
    DeleteUnit,
    EmitEvent,
    ObservedSyncer,
    ObservedUnit,
    Plan,
    plan,
)
from diloco_operator.planner.model import DISRUPTION_TARGET, NODE_DELETED, NODE_NOT_READY
from diloco_operator.planner.preemption import PREEMPTED, PREEMPTION_REASONS
from diloco_operator.planner.timefmt import at

T0 = 1_700_000_000.0
UP = ObservedSyncer(present=True, ready=True)
POLICY = {"maxUnitRestarts": 1, "restartBackoffSeconds": 10, "healthyAfterSeconds": 10}
TPU = {"accelerator": "tpu-v6e-slice", "topology": "2x4"}


def make_spec(**group: Any) -> Any:
    return parse_spec(
        {
            "image": "trainer:1",
            "replicas": 2,
            "unitGroups": [{"name": "v6e", "tpu": TPU, **group}],
            "training": {"totalSteps": 1000},
            "failurePolicy": POLICY,
        }
    )


# --- placement ------------------------------------------------------------------------------


def pod_spec(spec: Any) -> dict[str, Any]:
    run = builders.Run("r", "ml", "uid", spec)
    job = builders.unit_job(run, CreateUnit("r-v6e-0", "v6e", 0, 0, 0, 2, 2))
    pod: dict[str, Any] = job["spec"]["template"]["spec"]
    return pod


def test_spot_group_selects_and_tolerates_spot_nodes() -> None:
    pod = pod_spec(make_spec(spot=True))
    assert pod["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"
    assert {
        "key": "cloud.google.com/gke-spot",
        "operator": "Equal",
        "value": "true",
        "effect": "NoSchedule",
    } in pod["tolerations"]
    plain = pod_spec(make_spec())
    assert "cloud.google.com/gke-spot" not in plain["nodeSelector"]
    assert all(t["key"] != "cloud.google.com/gke-spot" for t in plain["tolerations"])


@pytest.mark.parametrize(
    ("group", "key"),
    [
        ({"spot": True, "nodeSelector": {"cloud.google.com/gke-spot": "false"}}, "gke-spot"),
        ({"nodeSelector": {"cloud.google.com/gke-tpu-topology": "4x4"}}, "gke-tpu-topology"),
        ({"nodeSelector": {"cloud.google.com/gke-tpu-accelerator": "x"}}, "gke-tpu-accelerator"),
    ],
)
def test_selectors_the_operator_sets_cannot_be_overridden(group: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=r"spec\.unitGroups\.0: nodeSelector: ") as info:
        make_spec(**group)
    assert key in str(info.value)


def test_a_spot_selector_without_spot_and_other_selectors_stay_allowed() -> None:
    make_spec(nodeSelector={"cloud.google.com/gke-spot": "true", "pool": "a"})
    cpu = parse_spec(
        {
            "image": "i",
            "unitGroups": [
                {"name": "cpu", "nodeSelector": {"cloud.google.com/gke-tpu-topology": "x"}}
            ],
            "training": {"totalSteps": 1},
        }
    )
    assert cpu.unit_groups[0].node_selector


# --- observation ----------------------------------------------------------------------------

JOB = JobView("r-v6e-0", "v6e", 0, 0, 2, False, False, False, "", T0)


def pod_body(reason: str, node: str = "n1") -> dict[str, Any]:
    return {
        "metadata": {
            "name": "r-v6e-0-0",
            "labels": {"diloco.dev/unit": "r-v6e-0", "diloco.dev/attempt": "0"},
        },
        "spec": {"nodeName": node},
        "status": {
            "phase": "Failed",
            "conditions": [
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": reason,
                    "message": "Pod was terminated in response to imminent node shutdown.",
                }
            ],
        },
    }


def test_observation_carries_the_disruption_reason() -> None:
    pod = pod_view(pod_body("TerminationByKubelet"))
    assert pod.disruption_reason == "TerminationByKubelet"
    obs = observe_unit(JOB, [pod], {"n1": True})
    assert (obs.failure, obs.disruption_reason) == (DISRUPTION_TARGET, "TerminationByKubelet")
    assert "imminent node shutdown" in obs.message


# --- the planner ----------------------------------------------------------------------------


def running(name: str, attempt: int = 0, **kw: Any) -> ObservedUnit:
    fields: dict[str, Any] = {"phase": "Running", "ready": True, "since": T0}
    fields.update(kw)
    return ObservedUnit(name=name, group="v6e", index=int(name[-1]), attempt=attempt, **fields)


def unit(p: Plan, name: str) -> UnitStatus:
    return next(u for u in p.status.units if u.name == name)


def events(p: Plan, reason: str) -> list[EmitEvent]:
    return [e for e in p.of_type(EmitEvent) if e.reason == reason]


def online(spec: Any) -> Plan:
    first = plan("r", spec, [], None, T0, syncer=UP)
    p = plan("r", spec, [running("r-v6e-0"), running("r-v6e-1")], first.status, T0 + 1, syncer=UP)
    assert p.status.phase == "Running"
    return p


PREEMPTIONS = [
    *({"failure": DISRUPTION_TARGET, "disruption_reason": r} for r in sorted(PREEMPTION_REASONS)),
    {"failure": NODE_DELETED, "message": "node n1 of pod r-v6e-1-0 is gone"},
]


@pytest.mark.parametrize("signal", PREEMPTIONS, ids=lambda s: s.get("disruption_reason", "node"))
def test_a_preempted_quick_failure_is_recreated_at_once_and_not_counted_as_a_restart(
    signal: dict[str, Any],
) -> None:
    spec = make_spec()
    p = online(spec)
    # Seconds after coming Online: were it a failure, it would be a quick one (10 s backoff).
    world = [running("r-v6e-0"), running("r-v6e-1", phase="Failed", **signal)]
    p = plan("r", spec, world, p.status, T0 + 3, syncer=UP)
    victim = unit(p, "r-v6e-1")
    assert victim.state == "Offline"
    assert victim.last_failure is not None and victim.last_failure.reason == PREEMPTED
    assert victim.quick_failures == 0
    assert [d.name for d in p.of_type(DeleteUnit)] == ["r-v6e-1"]
    assert events(p, "UnitPreempted") and not events(p, "UnitOffline")
    assert p.requeue_after == 0.0
    # Gone: recreated in the same second, no backoff.
    p = plan("r", spec, [running("r-v6e-0")], p.status, T0 + 3, syncer=UP)
    (create,) = p.of_type(CreateUnit)
    assert (create.name, create.attempt) == ("r-v6e-1", 1)
    recreated = unit(p, "r-v6e-1")
    assert (recreated.restarts, recreated.preemptions) == (0, 1)
    assert "after a preemption" in events(p, "UnitRecreated")[0].message


def test_preemptions_never_spend_the_restart_budget() -> None:
    spec = make_spec()  # maxUnitRestarts 1
    p = online(spec)
    now = T0 + 2
    for attempt in range(4):
        preempted = running(
            "r-v6e-1", attempt, failure=DISRUPTION_TARGET, disruption_reason="PreemptionByScheduler"
        )
        p = plan("r", spec, [running("r-v6e-0"), preempted], p.status, now, syncer=UP)
        assert unit(p, "r-v6e-1").state == "Offline"
        p = plan("r", spec, [running("r-v6e-0")], p.status, now + 1, syncer=UP)
        assert unit(p, "r-v6e-1").attempt == attempt + 1
        now += 2
    assert (unit(p, "r-v6e-1").preemptions, unit(p, "r-v6e-1").restarts) == (4, 0)
    assert not events(p, "RestartBudgetSpent")
    # A real failure still counts, and the budget (1) still ends the unit after that.
    failed = running("r-v6e-1", 4, phase="Failed")
    p = plan("r", spec, [running("r-v6e-0"), failed], p.status, now, syncer=UP)
    assert unit(p, "r-v6e-1").state == "Offline"
    p = plan("r", spec, [running("r-v6e-0")], p.status, now + 60, syncer=UP)
    assert (unit(p, "r-v6e-1").restarts, unit(p, "r-v6e-1").preemptions) == (1, 4)
    failed = running("r-v6e-1", 5, phase="Failed")
    p = plan("r", spec, [running("r-v6e-0"), failed], p.status, now + 61, syncer=UP)
    assert unit(p, "r-v6e-1").state == "Failed"


def test_a_preemption_keeps_the_crash_loop_count_without_waiting_on_it() -> None:
    spec = make_spec()
    p = online(spec)
    looping = unit(p, "r-v6e-1").model_copy(update={"quick_failures": 3})
    status = p.status.model_copy(update={"units": [unit(p, "r-v6e-0"), looping]})
    evicted = running(
        "r-v6e-1", failure=DISRUPTION_TARGET, disruption_reason="EvictionByEvictionAPI"
    )
    p = plan("r", spec, [running("r-v6e-0"), evicted], status, T0 + 2, syncer=UP)
    assert unit(p, "r-v6e-1").quick_failures == 3
    p = plan("r", spec, [running("r-v6e-0")], p.status, T0 + 2, syncer=UP)
    assert p.of_type(CreateUnit)


@pytest.mark.parametrize(
    "signal",
    [
        {"failure": DISRUPTION_TARGET, "disruption_reason": "DeletionByTaintManager"},
        {"failure": DISRUPTION_TARGET},  # no reason the backend could read
        {"failure": NODE_NOT_READY},
        {"phase": "Failed"},
    ],
)
def test_other_signals_stay_failures(signal: dict[str, Any]) -> None:
    spec = make_spec()
    p = online(spec)
    world = [running("r-v6e-0"), running("r-v6e-1", **signal)]
    p = plan("r", spec, world, p.status, T0 + 3, syncer=UP)
    assert unit(p, "r-v6e-1").last_failure.reason != PREEMPTED  # type: ignore[union-attr]
    assert events(p, "UnitOffline")
    p = plan("r", spec, [running("r-v6e-0")], p.status, T0 + 3, syncer=UP)
    assert not p.of_type(CreateUnit)  # a quick failure waits out its backoff
    p = plan("r", spec, [running("r-v6e-0")], p.status, T0 + 14, syncer=UP)
    assert (unit(p, "r-v6e-1").restarts, unit(p, "r-v6e-1").preemptions) == (1, 0)


def test_a_replacement_adopted_after_a_lost_status_write_counts_a_preemption() -> None:
    spec = make_spec()
    p = online(spec)
    offline = unit(p, "r-v6e-1").model_copy(
        update={
            "state": "Offline",
            "last_failure": UnitFailure(reason=PREEMPTED, message="m", time=at(T0 + 2)),
        }
    )
    status = p.status.model_copy(update={"units": [unit(p, "r-v6e-0"), offline]})
    world = [running("r-v6e-0"), running("r-v6e-1", attempt=1, ready=False)]
    p = plan("r", spec, world, status, T0 + 3, syncer=UP)
    adopted = unit(p, "r-v6e-1")
    assert (adopted.state, adopted.attempt, adopted.preemptions, adopted.restarts) == (
        "Recreating",
        1,
        1,
        0,
    )

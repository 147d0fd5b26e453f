"""Restarts in place on Kubernetes, the operator's half: the learner container's restart rule,
the attempts the syncer reports read back as recreation + restarts in place, the count in
status, and the restart gap left out of goodput."""

from __future__ import annotations

from typing import Any

from diloco_operator.api import FailurePolicy, UnitStatus, parse_spec
from diloco_operator.k8s import builders
from diloco_operator.k8s.syncer_calls import pod_attempts
from diloco_operator.planner import LearnerStatus, SyncerStatus
from diloco_operator.planner.goodput import account
from diloco_operator.planner.placement import desired_units
from diloco_operator.planner.reconcile import in_place_count
from diloco_trainer.attempts import EXIT_GIVE_UP, EXIT_SUPERSEDED, wire_attempt
from test_builders import create

T0 = 1_700_000_000.0


def learner_container(**failure_policy: Any) -> dict[str, Any]:
    spec = parse_spec(
        {"image": "t", "training": {"totalSteps": 5}, "failurePolicy": failure_policy}
    )
    run = builders.Run("r", "ns", "uid", spec)
    slot = desired_units(run.name, run.spec)[0]
    job = builders.unit_job(run, create(run, slot.name))
    pod = job["spec"]["template"]["spec"]
    container: dict[str, Any] = pod["containers"][0]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DILOCO_RESTART_DIR"] in mounts  # the pod's own volume, writable
    return container


def test_the_learner_restarts_in_its_pod_unless_that_is_turned_off() -> None:
    supervised = learner_container()  # the default: the supervisor, no kubelet rule
    assert "restartPolicyRules" not in supervised and "restartPolicy" not in supervised
    env = {e["name"]: e.get("value") for e in supervised["env"]}
    assert (env["DILOCO_IN_PLACE_RESTARTS"], env["DILOCO_SUPERVISE"]) == ("3", "1")

    container = learner_container(kubeletRestartRule=True)
    assert container["restartPolicy"] == "Never"
    (rule,) = container["restartPolicyRules"]
    assert rule["action"] == "RestartAllContainers"
    assert rule["exitCodes"] == {
        "operator": "NotIn",
        "values": [0, 2, EXIT_GIVE_UP, EXIT_SUPERSEDED, 143],
    }
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (env["DILOCO_IN_PLACE_RESTARTS"], env["DILOCO_SUPERVISE"]) == ("3", "1")

    off = learner_container(inPlaceRestarts=0, kubeletRestartRule=True)
    assert "restartPolicyRules" not in off and "restartPolicy" not in off
    env = {e["name"]: e.get("value") for e in off["env"]}
    assert (env["DILOCO_IN_PLACE_RESTARTS"], env["DILOCO_SUPERVISE"]) == ("0", "0")


def test_reported_attempts_read_as_recreations_and_restarts_in_status() -> None:
    report = pod_attempts(
        SyncerStatus(learners={"u": LearnerStatus(attempt=wire_attempt(2, 1), step=5)})
    )
    learner = report.learners["u"]
    assert (learner.attempt, learner.restarts_in_place) == (2, 1)
    unit = UnitStatus(name="u", group="g", index=0, global_index=0, state="Online", attempt=2)
    assert in_place_count(unit, learner).restarts_in_place == 1
    older = unit.model_copy(update={"attempt": 3})  # the syncer still reports the last pod
    assert in_place_count(older, learner).restarts_in_place == 0


def test_the_gap_of_a_restart_in_place_is_not_useful_time() -> None:
    unit = UnitStatus(name="u", group="g", index=0, global_index=0, state="Online")
    # Trains 0..4 s, crashes, restarts in place, compiles, and heartbeats again at 12 s with
    # more steps: the 8 s between are not training.
    for now, restarts, step in ((0, 0, 0), (2, 0, 10), (4, 0, 20), (12, 1, 25), (14, 1, 35)):
        learner = LearnerStatus(
            attempt=0, restarts_in_place=restarts, step=step, last_heartbeat=T0 + now
        )
        unit = account(unit, learner, T0 + now)
    assert unit.goodput is not None
    assert (unit.goodput.useful_seconds, unit.goodput.total_seconds) == (6.0, 14.0)


def test_an_api_server_without_the_rule_gets_the_supervisor_only_and_a_condition_saying_so() -> (
    None
):
    from diloco_operator.api import DilocoRunStatus
    from diloco_operator.k8s import in_place

    assert in_place.supported((1, 37)) and in_place.supported((1, 36))
    assert not in_place.supported((1, 35)) and not in_place.supported(None)
    policy = {"kubeletRestartRule": True}
    spec = parse_spec({"image": "t", "training": {"totalSteps": 5}, "failurePolicy": policy})
    run = builders.Run("r", "ns", "uid", spec)
    slot = desired_units(run.name, run.spec)[0]
    old_server = builders.unit_job(run, create(run, slot.name), kubelet_rule_ok=False)
    container = old_server["spec"]["template"]["spec"]["containers"][0]
    assert "restartPolicyRules" not in container and "restartPolicy" not in container
    assert {e["name"]: e.get("value") for e in container["env"]}["DILOCO_SUPERVISE"] == "1"

    def condition(allowed: int, rule: bool, server: tuple[int, int] | None) -> tuple[str, str, str]:
        policy = FailurePolicy(in_place_restarts=allowed, kubelet_restart_rule=rule)
        status = in_place.with_condition(DilocoRunStatus(), policy, server, T0)
        (c,) = [c for c in status.conditions if c.type == "RestartInPlace"]
        return c.status, c.reason, c.message

    assert condition(3, True, (1, 37))[:2] == ("True", "SupervisorAndKubelet")
    assert condition(3, False, (1, 37))[:2] == ("True", "SupervisorOnly")
    assert condition(0, True, (1, 37))[:2] == ("False", "Disabled")
    status, reason, message = condition(3, True, (1, 34))
    assert (status, reason) == ("True", "SupervisorOnly") and "v1.34" in message
    assert "restarts as one" not in message
    several = in_place.with_condition(
        DilocoRunStatus(), FailurePolicy(in_place_restarts=3), (1, 37), T0, multi_host=True
    )
    (c,) = [c for c in several.conditions if c.type == "RestartInPlace"]
    assert "every host of its unit" in c.message

"""Restarts of a crashed learner in its own pod (the trainer's attempts.py, learner/in_place.py
and learner/supervisor.py hold the other half: the attempt numbering, the count of starts and
the supervisor in the container).

Two layers, the faster first: the learner container's process supervises the learner and forks
a new one when it crashes (JAX imported already: well under a second to the next join); when
the container itself dies (the supervisor OOM-killed, the container's main process killed), the
kubelet's RestartAllContainers rule, where the run asks for it, restarts the pod's containers on
the same node. It is opt-in (failurePolicy.kubeletRestartRule): the scheduler places pods that
use it only on nodes that declare the feature, so node pools older than the control plane, a
common skew, would leave them Pending. Both count against failurePolicy.inPlaceRestarts per
pod; past it the learner exits 3 and the unit is recreated."""

from __future__ import annotations

from typing import Any

from diloco_trainer.attempts import EXIT_GIVE_UP, EXIT_SUPERSEDED

from diloco_operator.api import DilocoRunStatus, FailurePolicy
from diloco_operator.api.pod_security import CACHE_DIR
from diloco_operator.planner.conditions import set_condition

CONDITION = "RestartInPlace"

# Container restart rules (beta, on by default, from 1.35) with their RestartAllContainers
# action (from 1.36). An older API server refuses a Job that has them (a container-level
# restartPolicy), so there only the supervisor restarts in place.
SINCE = (1, 36)

# Exits a restart in place cannot help: complete (0), a config error (2), restarts in place
# spent (EXIT_GIVE_UP), superseded by a newer attempt of the unit (EXIT_SUPERSEDED), stopped by
# SIGTERM (143: the pod is going away).
NOT_RESTARTED_IN_PLACE = [0, 2, EXIT_GIVE_UP, EXIT_SUPERSEDED, 143]


def restart_in_place(pod_spec: dict[str, Any], policy: FailurePolicy, server_ok: bool) -> None:
    """The learner's supervisor, and the kubelet's rule where the run asks for it and the API
    server takes it (with no growing back-off, it restarts every container of the pod
    together). The pod's cache volume (an emptyDir: kept across restarts in place, not
    recreations) counts the starts and holds the XLA compilation cache, so a new process skips
    compiling. With none allowed the count is kept all the same: the attempts learners report
    read the same way on every unit (`attempts.split`)."""
    allowed = policy.in_place_restarts
    learner = pod_spec["containers"][0]
    if allowed > 0 and policy.kubelet_restart_rule and server_ok:
        learner["restartPolicy"] = "Never"
        learner["restartPolicyRules"] = [
            {
                "action": "RestartAllContainers",
                "exitCodes": {"operator": "NotIn", "values": NOT_RESTARTED_IN_PLACE},
            }
        ]
    learner["env"] += [
        {"name": "DILOCO_RESTART_DIR", "value": CACHE_DIR},
        {"name": "DILOCO_IN_PLACE_RESTARTS", "value": str(allowed)},
        {"name": "DILOCO_SUPERVISE", "value": "1" if allowed > 0 else "0"},
    ]


def supported(server: tuple[int, int] | None) -> bool:
    """Whether an API server of version `server` takes the restart rule (unknown: no)."""
    return server is not None and server >= SINCE


def with_condition(
    status: DilocoRunStatus,
    policy: FailurePolicy,
    server: tuple[int, int] | None,
    now: float,
    multi_host: bool = False,
) -> DilocoRunStatus:
    """`status` with the RestartInPlace condition: whether a crashed learner restarts in its
    pod, by which layers, and why not by the kubelet. `multi_host`: the run has units of
    several hosts, whose learners restart together (the trainer's learner/unit_restart.py)."""
    allowed = policy.in_place_restarts
    supervisor = (
        f"a crashed learner process restarts in its container, up to {allowed} times per pod"
    )
    if multi_host:
        supervisor += " (on every host of its unit: a multi-host unit restarts as one)"
    if allowed == 0:
        state, reason, message = False, "Disabled", "failurePolicy.inPlaceRestarts is 0"
    elif policy.kubelet_restart_rule and supported(server):
        state, reason = True, "SupervisorAndKubelet"
        message = f"{supervisor}, a crashed container with its pod's containers on the same node"
    elif policy.kubelet_restart_rule:
        shown = "unknown" if server is None else f"v{server[0]}.{server[1]}"
        state, reason = True, "SupervisorOnly"
        message = (
            f"{supervisor}; the API server ({shown}) lacks the kubelet's RestartAllContainers "
            f"rule (v{SINCE[0]}.{SINCE[1]}+), so a crashed container recreates the unit"
        )
    else:
        state, reason = True, "SupervisorOnly"
        message = f"{supervisor}; a crashed container recreates the unit (kubeletRestartRule)"
    conditions = set_condition(
        list(status.conditions), CONDITION, state, reason, message, now, status.observed_generation
    )
    return status.model_copy(update={"conditions": sorted(conditions, key=lambda c: c.type)})

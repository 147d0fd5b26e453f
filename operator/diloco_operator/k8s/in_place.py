"""Restarts of a crashed learner in its own pod, by the kubelet (the trainer's attempts.py and
learner/in_place.py hold the other half: the count of starts and the attempt numbering)."""

from __future__ import annotations

from typing import Any

from diloco_trainer.attempts import EXIT_GIVE_UP

from diloco_operator.api import DilocoRunStatus
from diloco_operator.api.pod_security import CACHE_DIR
from diloco_operator.planner.conditions import set_condition

CONDITION = "RestartInPlace"

# Container restart rules (beta, on by default, from 1.35) with their RestartAllContainers
# action (from 1.36). An older API server refuses a Job that has them (a container-level
# restartPolicy), so there the operator recreates units instead.
SINCE = (1, 36)

# Exits a restart in place cannot help: complete (0), a config error (2), restarts in place
# spent (EXIT_GIVE_UP), stopped by SIGTERM (143: the pod is going away).
NOT_RESTARTED_IN_PLACE = [0, 2, EXIT_GIVE_UP, 143]


def restart_in_place(pod_spec: dict[str, Any], allowed: int, server_supports: bool) -> None:
    """The kubelet's RestartAllContainers rule on the learner: with no growing back-off, it
    restarts every container of the pod together. The pod's cache volume (an emptyDir: kept
    across restarts in place, not recreations) counts the starts and holds the XLA compilation
    cache, so the new process skips compiling. With none allowed the count is kept all the
    same: the attempts learners report read the same way on every unit (`attempts.split`)."""
    allowed = allowed if server_supports else 0
    learner = pod_spec["containers"][0]
    if allowed > 0:
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
    ]


def supported(server: tuple[int, int] | None) -> bool:
    """Whether an API server of version `server` takes the restart rule (unknown: no)."""
    return server is not None and server >= SINCE


def with_condition(
    status: DilocoRunStatus, allowed: int, server: tuple[int, int] | None, now: float
) -> DilocoRunStatus:
    """`status` with the RestartInPlace condition: whether a crashed learner restarts in its
    pod, and if not, why (the run's failurePolicy, or an API server without the rule)."""
    if allowed == 0:
        state, reason, message = False, "Disabled", "failurePolicy.inPlaceRestarts is 0"
    elif not supported(server):
        shown = "unknown" if server is None else f"v{server[0]}.{server[1]}"
        state, reason = False, "UnsupportedByServer"
        message = (
            f"the API server ({shown}) lacks container restart rules with RestartAllContainers "
            f"(v{SINCE[0]}.{SINCE[1]}+): a crashed learner's unit is recreated"
        )
    else:
        state, reason = True, "RestartAllContainers"
        message = f"a crashed learner restarts in its pod, up to {allowed} times per pod"
    conditions = set_condition(
        list(status.conditions), CONDITION, state, reason, message, now, status.observed_generation
    )
    return status.model_copy(update={"conditions": sorted(conditions, key=lambda c: c.type)})

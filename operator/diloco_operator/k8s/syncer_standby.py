"""The warm standby syncer on Kubernetes: a second container in the syncer pod.

Both containers run the same `diloco-syncer` with the same lock file, so whichever holds the lock
serves the pod's port (the two share its network namespace) and the other waits warm
(diloco_trainer/syncer/standby.py). A container that dies is restarted by the kubelet and waits
as the next standby.

The lock is on the checkpoint volume when that is a claim, standby or not: a Deployment replaces
a deleted or evicted pod at once (its Recreate strategy only orders rollouts), and the syncer of
the new pod then waits, warm, until the one of the pod on its way out has exited, instead of
serving beside it on one checkpoint directory. A claim is mounted by one node at a time (or is a
local directory of one node), so the lock is one kernel's. Otherwise (a bucket, an emptyDir) it is
in the pod's `/tmp`, an emptyDir both containers mount (secure_pod).
"""

from __future__ import annotations

import copy
from typing import Any

from diloco_trainer.config import SERVING_LOCK_FILE

STANDBY = "syncer-standby"
POD_LOCK_FILE = "/tmp/diloco-syncer.lock"
DEFAULT_CONTAINER = "kubectl.kubernetes.io/default-container"
STARTUP_CHECKS = 120  # 10 minutes at 5 s: a large checkpoint to load on a busy node


def lock_env(claim_dir: str | None, standby: bool) -> list[dict[str, str]]:
    """The syncer's DILOCO_SYNCER_LOCK: in `claim_dir` on its claim (the mount, or a shard's
    folder in it; None: no claim), else in the pod's /tmp for a standby, else none."""
    if claim_dir is not None:
        path = f"{claim_dir}/{SERVING_LOCK_FILE}"
    elif standby:
        path = POD_LOCK_FILE
    else:
        return []
    return [{"name": "DILOCO_SYNCER_LOCK", "value": path}]


def add_standby(template: dict[str, Any], port: int) -> None:
    """Add the standby to the syncer's pod template: a copy of the syncer container (template
    overrides included), second in the list."""
    syncer = template["spec"]["containers"][0]
    standby = copy.deepcopy(syncer)
    standby["name"] = STANDBY
    # Probes reach the port by number (the name belongs to the first container) and answer for
    # whichever of the two serves.
    standby.pop("ports", None)
    # Waiting, it idles: it asks the scheduler for nothing (the pod fits where one syncer did)
    # and keeps the syncer's limits for when it serves. Its memory, a second copy of the
    # parameters, is above its request: under node memory pressure the spare goes first.
    standby["resources"] = {k: v for k, v in standby.get("resources", {}).items() if k == "limits"}
    for container in (syncer, standby):
        # Both start, restore and compile at once: liveness only counts once one serves.
        container["startupProbe"] = {
            "httpGet": {"path": "/healthz", "port": port},
            "periodSeconds": 5,
            "failureThreshold": STARTUP_CHECKS,
        }
    for probe in ("readinessProbe", "livenessProbe"):
        standby[probe]["httpGet"]["port"] = port
    template["spec"]["containers"].insert(1, standby)
    annotations = template.setdefault("metadata", {}).setdefault("annotations", {})
    annotations[DEFAULT_CONTAINER] = syncer["name"]  # `kubectl logs` without -c

"""The warm standby syncer on Kubernetes: a second container in the syncer pod.

Both containers run the same `diloco-syncer` with the same lock file in the pod's `/tmp` (an
emptyDir both mount, secure_pod), so whichever holds the lock serves the pod's port (the two
share its network namespace) and the other waits warm (diloco_trainer/syncer/standby.py). A
container that dies is restarted by the kubelet and waits as the next standby.
"""

from __future__ import annotations

import copy
from typing import Any

STANDBY = "syncer-standby"
LOCK_FILE = "/tmp/diloco-syncer.lock"
LOCK_ENV = {"name": "DILOCO_SYNCER_LOCK", "value": LOCK_FILE}
DEFAULT_CONTAINER = "kubectl.kubernetes.io/default-container"
STARTUP_CHECKS = 120  # 10 minutes at 5 s: a large checkpoint to load on a busy node


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

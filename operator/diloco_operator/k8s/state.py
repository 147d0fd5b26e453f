"""What the operator process holds between reconcile passes: its options, one waker per run,
the runs' tokens, recently deleted pods, chaos progress and the HTTP session to the syncers."""

from __future__ import annotations

import asyncio
import ssl
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from diloco_operator.k8s import chaos, in_place
from diloco_operator.k8s.netpolicy import OperatorIdentity


@dataclass
class Options:
    poll_interval: float = 5.0
    syncer_timeout: float = 2.0
    # How the operator reaches a syncer: {name} {namespace} {port}. Out-of-cluster operators
    # (development, e2e) can point it at a port-forward or proxy.
    syncer_url: str = "http://{name}.{namespace}.svc:{port}"
    # Deliver spec.chaos faults (--enable-chaos): off unless the operator's owner opts in.
    chaos: bool = False
    # kopf peering: how long a silent peer counts as alive (the failover bound for HA).
    peering_lifetime: int = 15
    # Set: each run gets a NetworkPolicy letting only its learners and this operator in.
    network_policy: OperatorIdentity | None = None
    # The API server's (major, minor), read at start: whether it takes the kubelet's restart
    # rule (k8s/in_place.py); None: unknown, taken as no.
    server_version: tuple[int, int] | None = None
    # Upgrade the cluster's DilocoRun CRD to this operator's at start (k8s/crd_upgrade.py).
    manage_crd: bool = False

    @property
    def kubelet_rule_ok(self) -> bool:
        return in_place.supported(self.server_version)


@dataclass(frozen=True)
class Reach:
    """The last status read of a run's syncer from here: for an away run's status."""

    address: str
    reachable: bool
    last_contact: float | None
    error: str | None
    reason: str = "Reachable"  # the SyncerReachable condition's reason (k8s/away.py)
    # When the current unbroken stretch of answers began (None while it does not answer).
    since: float | None = None


@dataclass
class State:
    options: Options = field(default_factory=Options)
    wakers: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    # Pods seen deleted while their Job lived: Job uid -> pod name -> when deletion was asked.
    deleted_pods: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    tokens: dict[tuple[str, str], str] = field(default_factory=dict)
    chaos: dict[tuple[str, str], chaos.RunChaos] = field(default_factory=dict)
    http: aiohttp.ClientSession | None = None
    reach: dict[tuple[str, str], Reach] = field(default_factory=dict)
    # What of each run the user decides (metadata.generation, labels, annotations, deletion):
    # only a change of it wakes the run's loop, never the operator's own status writes.
    intents: dict[tuple[str, str], tuple[object, ...]] = field(default_factory=dict)
    # TLS contexts by the sha256 of the CA bundle that verifies with them.
    trust: dict[str, ssl.SSLContext] = field(default_factory=dict)


STATE = State()


def intent_of(body: Any) -> tuple[object, ...]:
    meta = body.get("metadata") or {}
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    return (
        meta.get("generation"),
        tuple(sorted(labels.items())),
        tuple(sorted(annotations.items())),
        meta.get("deletionTimestamp"),
    )


def intent_changed(key: tuple[str, str], body: Any) -> bool:
    """Whether `body` (a DilocoRun as a watch delivered it) carries a change the user made
    since the last one seen; the first sighting counts as one."""
    intent = intent_of(body)
    changed = STATE.intents.get(key) != intent
    STATE.intents[key] = intent
    return changed


def wake(namespace: str | None, run: str | None) -> None:
    event = STATE.wakers.get((namespace or "", run or ""))
    if event is not None:
        event.set()

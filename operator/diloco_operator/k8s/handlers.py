"""kopf handlers: thin adapters between the cluster and the planner (what each planner action does
to the cluster is the table in actions.py).

Watches (as kopf indexes, so no extra API reads per pass): learner Jobs and Pods and syncer
Deployments of every run (label-selected), and Nodes. One asyncio daemon per DilocoRun runs
the loop: observe -> poll the syncer -> plan -> apply actions -> write status once. Child events
wake the run's daemon at once; otherwise it wakes every `poll_interval` seconds (and sooner when
the plan asks, e.g. when a restart backoff ends).

Deliberate kopf choices: kopf's own log messages are not posted as Events (we post our own, one
per decision); server-side watch timeouts bound silent stale watches; per-run daemons stop by
themselves when a peer with higher priority takes over (peering, for HA replicas). kopf puts its
finalizer on runs so it can stop the daemon cleanly; children are cleaned up by owner references.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import aiohttp
import kopf
from prometheus_client import Counter, Gauge, Histogram

from diloco_operator.api import (
    GROUP,
    LABEL_COMPONENT,
    LABEL_RUN,
    PLURAL,
    VERSION,
    DilocoRunStatus,
    parse_spec,
)
from diloco_operator.k8s import (
    builders,
    chaos,
    crd_upgrade,
    in_place,
    kube,
    queue_status,
    run_metrics,
)
from diloco_operator.k8s.actions import ACTIONS, apply
from diloco_operator.k8s.away import away_status, heard_since_the_link_returned
from diloco_operator.k8s.observe import (
    CONTROLLER_UID,
    PodView,
    job_view,
    node_ready,
    observe_unit,
    pod_view,
)
from diloco_operator.k8s.refusals import report_refusals
from diloco_operator.k8s.shard_status import gathered_report, report_shards
from diloco_operator.k8s.state import STATE, intent_changed, wake
from diloco_operator.k8s.syncer_calls import hand_rosters, read_shards
from diloco_operator.k8s.syncer_shards import SyncerDeployment, observed_syncer, shard_of
from diloco_operator.planner import ObservedSyncer, Plan, fault_targets, plan

log = logging.getLogger("diloco_operator")

PASSES = Counter("diloco_operator_reconcile_passes_total", "Reconcile passes", ["outcome"])
PASS_SECONDS = Histogram("diloco_operator_reconcile_seconds", "Duration of one reconcile pass")
RUNS = Gauge("diloco_operator_runs", "DilocoRuns with a running reconcile loop")
UNITS_ONLINE = Gauge("diloco_operator_units_online", "Units online", ["namespace", "run"])


# kopf needs a finalizer on runs to stop their daemons cleanly (see docs/operator.md);
# `diloco-operator --release-runs` removes it when the operator is gone for good.
FINALIZER = f"{GROUP}/kopf-finalizer"


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Our own Events carry the decisions; kopf's log lines as Events would be noise.
    settings.posting.level = logging.WARNING
    # Watches end server-side every minute and are re-established: a stream that stops
    # delivering (a silently dead TCP connection, or one the API server keeps open without
    # events) hides changes for at most that long. Runs read their pods, Jobs and spec from the
    # watch-fed indexes and body: at 270 s the e2e suite twice saw a run act on minutes-old
    # state (a spec patch, and a pod going Running, not seen for minutes).
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 90
    settings.watching.connect_timeout = 30
    settings.persistence.finalizer = FINALIZER
    # A SIGKILLed leader's keep-alive stays in the peering object: a paused replica takes over
    # once it is this old (kopf's default, 60 s, would stall every run for a minute).
    settings.peering.lifetime = STATE.options.peering_lifetime
    # After kopf patches a run (its finalizer) it waits for that version to come back; our passes
    # are level-based and idempotent, so a short wait is safe and starts new runs seconds sooner
    # (measured: the default 5 s was the whole create-to-first-Job latency on a real apiserver).
    settings.persistence.consistency_timeout = 1.0
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    kube.load_config()
    # The first kubernetes ApiClient takes seconds to build (measured 4.5 s on a loaded box):
    # build it now, off the event loop, instead of inside the first run's first pass.
    await asyncio.to_thread(kube.warm_up)
    STATE.options.server_version = await asyncio.to_thread(kube.server_version)
    if STATE.options.manage_crd:
        await asyncio.to_thread(crd_upgrade.ensure_current)
    STATE.http = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=STATE.options.syncer_timeout)
    )


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    if STATE.http is not None:
        await STATE.http.close()


@kopf.on.probe(id="runs")
def probe_runs(**_: Any) -> int:
    return len(STATE.wakers)


LEARNER_LABELS: dict[str, Any] = {
    LABEL_RUN: kopf.PRESENT,
    LABEL_COMPONENT: builders.LEARNER,
}
SYNCER_LABELS: dict[str, Any] = {
    LABEL_RUN: kopf.PRESENT,
    LABEL_COMPONENT: builders.SYNCER,
}


@kopf.index("batch", "v1", "jobs", labels=LEARNER_LABELS)
def learner_jobs(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> Any:
    wake(namespace, labels.get(LABEL_RUN))
    return {(namespace or "", labels[LABEL_RUN]): job_view(body)}


@kopf.index("", "v1", "pods", labels=LEARNER_LABELS)
def learner_pods(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> Any:
    wake(namespace, labels.get(LABEL_RUN))
    return {(namespace or "", labels[LABEL_RUN]): pod_view(body)}


@kopf.index("apps", "v1", "deployments", labels=SYNCER_LABELS)
def syncer_deployments(
    namespace: str | None,
    labels: Mapping[str, str],
    spec: kopf.Spec,
    status: kopf.Status,
    **_: Any,
) -> Any:
    wake(namespace, labels.get(LABEL_RUN))
    ready = int(status.get("readyReplicas") or 0) > 0
    replicas = spec.get("replicas")
    seen = SyncerDeployment(ready, 1 if replicas is None else replicas, shard_of(labels))
    return {(namespace or "", labels[LABEL_RUN]): seen}


@kopf.index("", "v1", "nodes")
def cluster_nodes(name: str, body: Any, **_: Any) -> Any:
    ready = node_ready(body)
    return {name: ready}


@kopf.on.event(GROUP, VERSION, PLURAL)
def run_changed(namespace: str | None, name: str, body: Any, **_: Any) -> None:
    # Spec edits (kubectl scale, apply) are acted on at once, not at the next poll. The pass's
    # own status write is not a reason for another pass: where the status changes every pass
    # (an away run's lastContact), that would be a busy loop of syncer reads over the link.
    if intent_changed((namespace or "", name), body):
        wake(namespace, name)


@kopf.on.event("", "v1", "nodes")
def node_changed(type: str, body: Any, **_: Any) -> None:
    # A node going NotReady or away concerns whichever runs have pods on it: wake them all
    # (cheap: a pass is pure computation plus the writes it really needs).
    if type == "DELETED" or not node_ready(body):
        for event in STATE.wakers.values():
            event.set()


def _is_deletion(type: str, **_: Any) -> bool:
    return type == "DELETED"


# Filtered by kopf, not inside the handler: a unit of thousands of pods makes thousands of pod
# events a minute while it starts or goes, and kopf logs every handler it calls.
@kopf.on.event("", "v1", "pods", labels=LEARNER_LABELS, when=_is_deletion)
def learner_pod_deleted(
    namespace: str | None,
    labels: Mapping[str, str],
    name: str,
    meta: kopf.Meta,
    **_: Any,
) -> None:
    # Keyed by the owning Job's uid: a same-named unit of a re-created run is another Job.
    if len(STATE.deleted_pods) > 10_000:  # bound the memory; only recent Jobs matter
        STATE.deleted_pods.clear()
    deleted_at = pod_view({"metadata": dict(meta)}).deleted_at
    STATE.deleted_pods[labels.get(CONTROLLER_UID, "")][name] = deleted_at
    wake(namespace, labels.get(LABEL_RUN))


def observed_units(namespace: str, name: str, indexes: dict[str, Any]) -> list[Any]:
    key = (namespace, name)
    jobs = [j for j in indexes["learner_jobs"].get(key, [])]
    # Bucketed by unit first: a run of 16 units of 2,304 hosts would otherwise scan every pod
    # of the run once per unit, every pass.
    pods: dict[str, list[PodView]] = defaultdict(list)
    for pod in indexes["learner_pods"].get(key, []):
        pods[pod.unit].append(pod)
    nodes_index = indexes["cluster_nodes"]
    nodes = {node: all(store) for node, store in nodes_index.items()}
    units = []
    for job in jobs:
        deleted = STATE.deleted_pods.get(job.uid, {}) if job.uid else {}
        units.append(observe_unit(job, pods.get(job.name, []), nodes, deleted))
    return units


async def reconcile_once(
    name: str,
    namespace: str,
    uid: str,
    body: Any,
    last: DilocoRunStatus | None,
    indexes: dict[str, Any],
) -> tuple[Plan | None, DilocoRunStatus | None]:
    try:
        spec = parse_spec(dict(body.get("spec") or {}), run=name, pods=True)
    except ValueError as exc:
        # The CRD should have rejected it; an older CRD may not have. Say so, change nothing.
        kopf.warn(body, reason="InvalidSpec", message=str(exc)[:1024])
        PASSES.labels("invalid").inc()
        return None, last
    meta = body.get("metadata") or {}
    run = builders.Run(name, namespace, uid, spec, meta.get("labels"))
    key = (namespace, name)
    deployments: list[SyncerDeployment] = list(indexes["syncer_deployments"].get(key, []))
    syncer = observed_syncer(run, deployments)
    # Every shard's status (one read for an unsharded syncer), gathered into the run's one
    # report for the planner (k8s/shard_status.py).
    reads = await read_shards(run) if deployments or spec.away else []
    report = gathered_report(run, reads)
    if spec.away:  # the home syncer: there when it answers
        syncer = ObservedSyncer(present=True, ready=report is not None)
        report = heard_since_the_link_returned(report, STATE.reach.get(key), time.time())
    generation = body.get("metadata", {}).get("generation")
    if isinstance(generation, int):
        await hand_rosters(run, reads, generation)
    status = last
    if status is None and body.get("status"):
        try:
            status = DilocoRunStatus.model_validate(dict(body["status"]))
        except ValueError:
            status = None  # unreadable status: rebuilt from the children
    the_plan = plan(
        name,
        spec,
        observed_units(namespace, name, indexes),
        status,
        time.time(),
        syncer=syncer,
        report=report,
        generation=generation,
    )
    refused = await apply(run, the_plan, body)
    new = report_refusals(the_plan.status, status, refused, body, generation)
    new = await queue_status.report_queue(run, new, status, body, generation)
    new = report_shards(run, new, status, deployments, reads, body, generation, time.time())
    if spec.away:
        new = away_status(new, STATE.reach.get(key), report, now=time.time())
    new = in_place.with_condition(
        new,
        spec.failure_policy,
        STATE.options.server_version,
        now=time.time(),
        multi_host=any(g.hosts > 1 for g in spec.unit_groups),
    )
    if STATE.options.chaos and spec.chaos is not None:
        await inject_chaos(run, body, new)
    if last is None or new != last:
        await kube.patch_status(namespace, name, new.model_dump(mode="json", by_alias=True))
    UNITS_ONLINE.labels(namespace, name).set(new.units_online)
    run_metrics.export_goodput(namespace, name, status, new)
    PASSES.labels("ok").inc()
    return the_plan, new


async def inject_chaos(run: builders.Run, body: Any, status: DilocoRunStatus) -> None:
    """Deliver the run's due faults (chaos.py) to its online units; one Event per fault."""
    key = (run.namespace, run.name)
    state = STATE.chaos.get(key)
    if state is None:
        meta = body.get("metadata", {})
        created = datetime.fromisoformat(meta["creationTimestamp"].replace("Z", "+00:00"))
        delivered = float((meta.get("annotations") or {}).get(chaos.PROGRESS_ANNOTATION, 0))
        state = chaos.new_run_chaos(run, created.timestamp(), delivered)
        if state is None:
            return
        STATE.chaos[key] = state
    now = time.time()
    targets = fault_targets(status.units, None, run.spec.failure_policy, now)
    online = {u.global_index: u.name for u in targets}
    faults = chaos.due(state, now, sorted(online))
    for fault in faults:
        delivery = chaos.plan_delivery(run, fault, online)
        message = await chaos.deliver(run, delivery)
        kind = "Normal" if delivery.action == "skip" else "Warning"
        kopf.event(body, type=kind, reason=delivery.reason, message=message[:1024])
        log.warning("chaos run=%s reason=%s %s", run.name, delivery.reason, message)
        ACTIONS.labels("chaos", delivery.reason).inc()
    if faults:
        await kube.annotate_run(
            run.namespace, run.name, {chaos.PROGRESS_ANNOTATION: f"{state.delivered_at:.3f}"}
        )


# Seconds between the starts of two passes of one run, however often its children change.
MIN_PASS_GAP = 0.5


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def run_loop(
    stopped: kopf.DaemonStopped,
    name: str,
    namespace: str | None,
    uid: str,
    body: kopf.Body,
    **kwargs: Any,
) -> None:
    """The reconcile loop of one run; kopf starts it per DilocoRun and stops it on deletion or
    when this operator replica is paused by a higher-priority peer."""
    # kopf passes every index by its function's name.
    indexes = {
        key: kwargs[key]
        for key in ("learner_jobs", "learner_pods", "syncer_deployments", "cluster_nodes")
    }
    namespace = namespace or ""
    key = (namespace, name)
    waker = STATE.wakers.setdefault(key, asyncio.Event())
    RUNS.inc()
    last: DilocoRunStatus | None = None
    try:
        while not stopped:
            waker.clear()
            delay = STATE.options.poll_interval
            started = time.monotonic()
            try:
                the_plan, last = await reconcile_once(name, namespace, uid, body, last, indexes)
                if the_plan is not None and the_plan.requeue_after is not None:
                    delay = max(0.2, min(delay, the_plan.requeue_after))
            except Exception as exc:  # one bad pass must not end the loop
                PASSES.labels("error").inc()
                log.warning("reconcile failed run=%s/%s error=%r", namespace, name, exc)
                last = None  # re-read status from the cluster next time
            PASS_SECONDS.observe(time.monotonic() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waker.wait(), timeout=delay)
            # A burst of child events (a unit of thousands of pods starting or going) is one
            # pass, not one per event: each pass also reads the syncer's status.
            await asyncio.sleep(max(0.0, started + MIN_PASS_GAP - time.monotonic()))
    finally:
        RUNS.dec()
        STATE.wakers.pop(key, None)
        STATE.tokens.pop(key, None)
        STATE.chaos.pop(key, None)
        STATE.reach.pop(key, None)
        STATE.intents.pop(key, None)
        queue_status.forget(namespace, name)
        with contextlib.suppress(KeyError):
            UNITS_ONLINE.remove(namespace, name)
        run_metrics.forget_run(namespace, name, last)

"""Thin Kubernetes I/O used by the handlers: create (409 = success when the existing object is
this run's), delete (404 = success), status patch, secret read. Blocking client calls run in a
thread so the kopf loop stays free."""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from prometheus_client import Counter

from diloco_operator.api import GROUP, LABEL_RUN, PLURAL, VERSION

__all__ = ["ApiException"]

log = logging.getLogger("diloco_operator.k8s.kube")


def load_config() -> None:
    """In-cluster credentials when running as a pod, else the local kubeconfig."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    _apis.cache_clear()
    _networking.cache_clear()
    _policy.cache_clear()


@functools.cache
def _apis() -> tuple[
    client.CoreV1Api, client.AppsV1Api, client.BatchV1Api, client.CustomObjectsApi
]:
    """One shared ApiClient (one connection pool, reused TLS connections) for every call:
    a client per call cost a TLS handshake each time (seconds on a loaded machine)."""
    shared = client.ApiClient()
    return (
        client.CoreV1Api(shared),
        client.AppsV1Api(shared),
        client.BatchV1Api(shared),
        client.CustomObjectsApi(shared),
    )


@functools.cache
def _networking() -> client.NetworkingV1Api:
    return client.NetworkingV1Api(_apis()[0].api_client)


@functools.cache
def _policy() -> client.PolicyV1Api:
    return client.PolicyV1Api(_apis()[0].api_client)


# Every API call's (connect, read) timeout: the client has none by default, and one call hung on
# a dead connection would stall its run's reconcile loop until the kernel gave up on the socket.
REQUEST_TIMEOUT = (5.0, 30.0)


# Requests beyond kopf's watches, by client method: what a reconcile pass costs the API server
# (bench huge_units: it must not grow with a unit's pods).
API_REQUESTS = Counter(
    "diloco_operator_api_requests", "Kubernetes API requests of the reconcile loops", ["call"]
)


async def _api(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call` (a kubernetes client method) off the event loop, with REQUEST_TIMEOUT."""
    API_REQUESTS.labels(getattr(call, "__name__", "call")).inc()
    return await asyncio.to_thread(
        functools.partial(call, *args, _request_timeout=REQUEST_TIMEOUT, **kwargs)
    )


def warm_up() -> None:
    _apis()


def server_version() -> tuple[int, int] | None:
    """The API server's (major, minor); None when it cannot be read or parsed."""
    try:
        info = client.VersionApi(_apis()[0].api_client).get_code(_request_timeout=REQUEST_TIMEOUT)
        return int(info.major), int(str(info.minor).rstrip("+"))
    except (ApiException, ValueError, OSError) as exc:
        log.warning("event=server_version_unknown error=%r", exc)
        return None


def _extensions() -> client.ApiextensionsV1Api:
    return client.ApiextensionsV1Api(_apis()[0].api_client)


def read_crd(name: str) -> dict[str, Any]:
    """A CustomResourceDefinition as the API server returns it (plain JSON, not a client model:
    it goes back in a replace unchanged but for what we set)."""
    read: Callable[..., Any] = _extensions().read_custom_resource_definition
    r = read(name, _preload_content=False, _request_timeout=REQUEST_TIMEOUT)
    crd: dict[str, Any] = json.loads(r.data)
    return crd


def replace_crd(name: str, body: dict[str, Any]) -> None:
    """Conditional on body's resourceVersion: 409 when someone wrote it since it was read."""
    replace: Callable[..., Any] = _extensions().replace_custom_resource_definition
    replace(name, body, _request_timeout=REQUEST_TIMEOUT)


# Children of kinds that are custom resources (Gateway API routes): kind -> (group, plural).
CUSTOM_KINDS = {
    "TLSRoute": ("gateway.networking.k8s.io", "tlsroutes"),
    "HTTPRoute": ("gateway.networking.k8s.io", "httproutes"),
}
CUSTOM_VERSION = "v1"


def _creator(kind: str) -> Callable[..., Any]:
    core, apps, batch, custom = _apis()
    if kind in CUSTOM_KINDS:
        group, plural = CUSTOM_KINDS[kind]
        create = custom.create_namespaced_custom_object

        def create_custom(ns: str, body: dict[str, Any], **kwargs: Any) -> Any:
            return create(group, CUSTOM_VERSION, ns, plural, body, **kwargs)

        return create_custom
    creators: dict[str, Callable[..., Any]] = {
        "Service": core.create_namespaced_service,
        "Secret": core.create_namespaced_secret,
        "ConfigMap": core.create_namespaced_config_map,
        "PersistentVolumeClaim": core.create_namespaced_persistent_volume_claim,
        "Deployment": apps.create_namespaced_deployment,
        "Job": batch.create_namespaced_job,
        "NetworkPolicy": _networking().create_namespaced_network_policy,
        "PodDisruptionBudget": _policy().create_namespaced_pod_disruption_budget,
    }
    return creators[kind]


class ChildError(Exception):
    """A child object that could not be created; `reason` is the Event/condition reason."""

    def __init__(self, reason: str, kind: str, name: str, detail: str) -> None:
        super().__init__(f"{kind} {name}: {detail}")
        self.reason = reason


def _reader(kind: str) -> Callable[..., Any]:
    core, apps, batch, custom = _apis()
    if kind in CUSTOM_KINDS:
        group, plural = CUSTOM_KINDS[kind]
        read = custom.get_namespaced_custom_object

        def read_custom(name: str, ns: str, **kwargs: Any) -> Any:
            return read(group, CUSTOM_VERSION, ns, plural, name, **kwargs)

        return read_custom
    readers: dict[str, Callable[..., Any]] = {
        "Service": core.read_namespaced_service,
        "Secret": core.read_namespaced_secret,
        "ConfigMap": core.read_namespaced_config_map,
        "PersistentVolumeClaim": core.read_namespaced_persistent_volume_claim,
        "Deployment": apps.read_namespaced_deployment,
        "Job": batch.read_namespaced_job,
        "NetworkPolicy": _networking().read_namespaced_network_policy,
        "PodDisruptionBudget": _policy().read_namespaced_pod_disruption_budget,
    }
    return readers[kind]


def _controller(meta: dict[str, Any]) -> str | None:
    refs = meta.get("ownerReferences") or []
    return next((r.get("uid") for r in refs if r.get("controller")), None)


def ours(existing: dict[str, Any], wanted: dict[str, Any], run_uid: str) -> bool:
    """Whether an object found under a child's name is that child (made by an earlier pass):
    controlled by this run; or, for a child made without an owner (a retained checkpoint PVC,
    kept for the next run of the same name), uncontrolled and labelled with this run's name."""
    have = existing.get("metadata") or {}
    owner = _controller(have)
    if owner is not None:
        return owner == run_uid
    run_label = (have.get("labels") or {}).get(LABEL_RUN)
    return (
        _controller(wanted["metadata"]) is None
        and run_label == wanted["metadata"]["labels"][LABEL_RUN]
    )


def _api_message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)


async def create(obj: dict[str, Any], run_uid: str) -> bool:
    """Create an object; True if created, False if this run's object already exists (names are
    deterministic, so it is the one an earlier pass created). ChildError when the API server
    refuses it, or when the name is taken by an object that is not this run's."""
    ns, kind, name = obj["metadata"]["namespace"], obj["kind"], obj["metadata"]["name"]
    try:
        await _api(_creator(kind), ns, obj)
    except ApiException as exc:
        if exc.status == 404 and kind in CUSTOM_KINDS:
            raise ChildError(
                "ChildRejected",
                kind,
                name,
                f"this cluster does not serve {CUSTOM_KINDS[kind][0]}/{CUSTOM_VERSION} "
                f"{kind}: install the Gateway API CRDs (standard channel) and a Gateway "
                "implementation, or expose the syncer as a LoadBalancer",
            ) from exc
        if exc.status != 409:
            if exc.status is not None and 400 <= exc.status < 500:
                raise ChildError("ChildRejected", kind, name, _api_message(exc)) from exc
            raise
        existing = await _api(_reader(kind), name, ns)
        found = _apis()[0].api_client.sanitize_for_serialization(existing)
        if not ours(found, obj, run_uid):
            owners = [
                f"{r.get('kind')}/{r.get('name')}"
                for r in (found.get("metadata") or {}).get("ownerReferences") or []
            ]
            raise ChildError(
                "NameConflict",
                kind,
                name,
                f"the name is taken by an object this run does not own (owners: "
                f"{', '.join(owners) or 'none'}); rename or delete it",
            ) from exc
        return False
    log.info("created kind=%s name=%s namespace=%s", kind, name, ns)
    return True


async def delete_unit(namespace: str, name: str) -> None:
    """Delete a unit's Job with foreground propagation: the Job stays visible (Terminating) until
    its pods are gone, which is exactly the 'wait until gone' the planner needs. (Background
    propagation, creating the next attempt while the old pods go, was measured slower: 2,304
    new pods the scheduler cannot place yet cost the control plane more than they save; see
    docs/experiments/2026-12-06-huge-unit-recreate.md.)"""
    body = client.V1DeleteOptions(propagation_policy="Foreground")
    core, _, batch, _ = _apis()
    deletes: list[tuple[Callable[..., Any], dict[str, Any]]] = [
        (batch.delete_namespaced_job, {"body": body}),
        (core.delete_namespaced_service, {}),
    ]
    for delete, extra in deletes:
        try:
            await _api(delete, name, namespace, **extra)
        except ApiException as exc:
            if exc.status != 404:
                raise
    log.info("deleted unit=%s namespace=%s", name, namespace)


async def suspend_job(namespace: str, name: str, suspend: bool) -> None:
    """Suspend (the Job controller deletes its pods) or resume a unit's Job; 404 = gone, fine."""
    try:
        await _api(_apis()[2].patch_namespaced_job, name, namespace, {"spec": {"suspend": suspend}})
    except ApiException as exc:
        if exc.status != 404:
            raise
    log.info("job=%s namespace=%s suspend=%s", name, namespace, suspend)


async def scale_deployment(namespace: str, name: str, replicas: int) -> None:
    """Through the scale subresource (RBAC: deployments/scale patch, nothing else)."""
    try:
        await _api(
            _apis()[1].patch_namespaced_deployment_scale,
            name,
            namespace,
            {"spec": {"replicas": replicas}},
        )
    except ApiException as exc:
        if exc.status != 404:
            raise
    log.info("deployment=%s namespace=%s replicas=%d", name, namespace, replicas)


KUEUE_GROUP = "kueue.x-k8s.io"
# v1beta2 is Kueue's current API (v0.15+); v1beta1 is what older installations serve.
KUEUE_VERSIONS = ("v1beta2", "v1beta1")


async def local_queue(namespace: str, name: str) -> Literal["found", "missing", "no-kueue"]:
    """Whether Kueue's LocalQueue `name` exists in `namespace` ("no-kueue": the API server
    serves no localqueues resource in any version we know)."""
    for version in KUEUE_VERSIONS:
        try:
            await _api(
                _apis()[3].get_namespaced_custom_object,
                KUEUE_GROUP,
                version,
                namespace,
                "localqueues",
                name,
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            try:
                details = json.loads(exc.body or "{}").get("details") or {}
            except (ValueError, AttributeError):
                details = {}
            # A missing object is a NotFound naming it; a resource the server does not serve
            # is a bare 404 ("the server could not find the requested resource").
            if details.get("name") == name:
                return "missing"
            continue
        return "found"
    return "no-kueue"


async def patch_status(namespace: str, name: str, status: dict[str, Any]) -> None:
    await _api(
        _apis()[3].patch_namespaced_custom_object_status,
        GROUP,
        VERSION,
        namespace,
        PLURAL,
        name,
        {"status": status},
    )


async def annotate_run(namespace: str, name: str, annotations: dict[str, str]) -> None:
    await _api(
        _apis()[3].patch_namespaced_custom_object,
        GROUP,
        VERSION,
        namespace,
        PLURAL,
        name,
        {"metadata": {"annotations": annotations}},
    )


async def read_token(namespace: str, secret: str, key: str) -> str | None:
    try:
        obj = await _api(_apis()[0].read_namespaced_secret, secret, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    data = (obj.data or {}).get(key)
    return base64.b64decode(data).decode() if data else None


def release_runs(namespaces: list[str] | None, finalizer: str) -> int:
    """Drop `finalizer` from every DilocoRun in `namespaces` (None: all); returns how many."""
    api = _apis()[3]
    if namespaces is None:
        listing: Any = api.list_cluster_custom_object(GROUP, VERSION, PLURAL)
        items = listing["items"]
    else:
        items = []
        for ns in namespaces:
            page: Any = api.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)
            items.extend(page["items"])
    released = 0
    for item in items:
        meta = item["metadata"]
        kept = [f for f in meta.get("finalizers") or [] if f != finalizer]
        if kept != (meta.get("finalizers") or []):
            patch = {"metadata": {"finalizers": kept or None}}
            api.patch_namespaced_custom_object(
                GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], patch
            )
            released += 1
    return released


async def kill_pods(namespace: str, selector: str) -> list[str]:
    """Delete the pods matching `selector` with no grace period: the kubelet SIGKILLs their
    containers at once, as a crash would. Returns the pods' names."""
    core = _apis()[0]
    pods = await _api(core.list_namespaced_pod, namespace, label_selector=selector)
    names = [
        str(p.metadata.name)
        for p in pods.items
        if p.metadata is not None and not p.metadata.deletion_timestamp
    ]
    body = client.V1DeleteOptions(grace_period_seconds=0)
    for name in names:
        try:
            await _api(core.delete_namespaced_pod, name, namespace, body=body)
        except ApiException as exc:
            if exc.status != 404:
                raise
    return names


async def pod_nodes(namespace: str, selector: str) -> list[str]:
    pods = await _api(_apis()[0].list_namespaced_pod, namespace, label_selector=selector)
    return sorted({p.spec.node_name for p in pods.items if p.spec and p.spec.node_name})


async def mark_node_not_ready(node: str, reason: str, message: str) -> None:
    """Set the node's Ready condition to False (its kubelet, or KWOK, sets it back with its next
    status update): what the control plane sees when a host stops reporting."""
    now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    cond = {
        "type": "Ready",
        "status": "False",
        "reason": reason,
        "message": message,
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    await _api(_apis()[0].patch_node_status, node, {"status": {"conditions": [cond]}})

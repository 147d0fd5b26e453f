"""Kubernetes objects of a run, as plain dicts (pure functions; tests round-trip them through the
`kubernetes` package's models).

Per learner unit: a headless Service (the pods' DNS subdomain) and an Indexed Job with one pod
per TPU host. Per run: the bearer-token Secret, the ConfigMap holding the config file both
programs read, and per syncer shard (one unless `syncer.shards`; syncer_shards.py) a Deployment +
Service + PodDisruptionBudget and the checkpoint PVC.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from diloco_operator.api import (
    API_VERSION,
    KIND,
    LABEL_ATTEMPT,
    LABEL_COMPONENT,
    LABEL_GROUP,
    LABEL_INDEX,
    LABEL_RUN,
    LABEL_UNIT,
    ResourceRequirements,
)
from diloco_operator.api.accelerators import (
    TPU_RESOURCE,
)
from diloco_operator.api.pod_security import secure_pod
from diloco_operator.api.pod_template import apply_template
from diloco_operator.api.unit_group import UnitGroup
from diloco_operator.k8s import in_place, kueue
from diloco_operator.k8s.cross_cluster import (
    add_learner_transport,
    add_syncer_tls,
    expose,
    syncer_route,
)
from diloco_operator.k8s.learner_env import LEARNER_METRICS_PORT as LEARNER_METRICS_PORT
from diloco_operator.k8s.learner_env import LOG_FORMAT_ENV, learner_env
from diloco_operator.k8s.object_meta import LEARNER as LEARNER
from diloco_operator.k8s.object_meta import SYNCER as SYNCER
from diloco_operator.k8s.object_meta import child_meta, labels
from diloco_operator.k8s.placement import group_placement, place_learner_pod
from diloco_operator.k8s.run_ref import Run
from diloco_operator.k8s.run_secrets import (
    syncer_tls_secret,
    token_secret,
    unit_token_secret,
)
from diloco_operator.k8s.syncer_disruption import disruption_budget, keep_on_its_node
from diloco_operator.k8s.syncer_shards import lock_dir, shard_env, shard_labels
from diloco_operator.k8s.syncer_standby import STANDBY, add_standby, lock_env
from diloco_operator.planner import CreateUnit
from diloco_operator.planner.placement import roster_document

CONFIG_DIR = "/etc/diloco"
CONFIG_FILE = "run.yaml"
UNITS_FILE = "units.json"  # the syncer's roster at creation (syncer/roster.py in the trainer)
CHECKPOINT_MOUNT = "/var/lib/diloco/checkpoints"


def _resources(res: ResourceRequirements | None, tpu_chips: int = 0) -> dict[str, Any]:
    out = res.to_wire() if res else {}
    out = {k: {rk: str(rv) for rk, rv in v.items()} for k, v in out.items()}
    if tpu_chips:
        # TPU chips are an extended resource: requests must equal limits.
        for kind in ("requests", "limits"):
            out.setdefault(kind, {})[TPU_RESOURCE] = str(tpu_chips)
    return out


def config_map(run: Run) -> dict[str, Any]:
    """The config file of learners and the syncer: a DilocoRun manifest reduced to its training
    block (`load_training_config` reads spec.training from it)."""
    doc = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": run.name, "namespace": run.namespace},
        "spec": {"training": run.spec.training.to_wire()},
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_meta(run, run.config_map, "config"),
        "data": {
            CONFIG_FILE: yaml.safe_dump(doc, sort_keys=False),
            # Revision 0: the operator's PUT of the roster (revision = generation) supersedes it.
            UNITS_FILE: json.dumps(roster_document(run.name, run.spec, 0)),
        },
    }


def checkpoint_claim(run: Run, shard: int = 0) -> dict[str, Any] | None:
    """The PVC the operator creates for syncer shard `shard`, or None (bucket, ephemeral, or a
    user-provided claim, which every shard shares).

    Not owned by the run unless retentionPolicy is Delete: `training` is immutable, so changing
    it means deleting and re-creating the run, which must not take its checkpoints along."""
    ckpt = run.spec.syncer.checkpoint
    if ckpt.ephemeral or ckpt.is_bucket or ckpt.path:
        return None
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": str(ckpt.size)}},
    }
    if ckpt.storage_class:
        spec["storageClassName"] = ckpt.storage_class
    meta = child_meta(run, run.shard_claim(shard), SYNCER, **shard_labels(run, shard))
    if ckpt.retention_policy == "Retain":
        del meta["ownerReferences"]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def _config_volume(run: Run) -> dict[str, Any]:
    return {"name": "config", "configMap": {"name": run.config_map}}


def _config_mount() -> dict[str, Any]:
    return {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}


def _syncer_volumes(run: Run, shard: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The syncer's config and, unless it checkpoints to a bucket, its checkpoint volume."""
    ckpt = run.spec.syncer.checkpoint
    volumes = [_config_volume(run)]
    mounts = [_config_mount()]
    if not ckpt.is_bucket:
        volumes.append(
            {"name": "checkpoints", "emptyDir": {}}
            if ckpt.ephemeral
            else {
                "name": "checkpoints",
                "persistentVolumeClaim": {"claimName": run.shard_claim(shard)},
            }
        )
        mounts.append({"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT})
    return volumes, mounts


def syncer_deployment(run: Run, shard: int = 0) -> dict[str, Any]:
    spec = run.spec
    ckpt = spec.syncer.checkpoint
    port = spec.syncer.port
    env = [
        {"name": "DILOCO_SYNCER_PORT", "value": str(port)},
        {"name": "DILOCO_UNITS_FILE", "value": f"{CONFIG_DIR}/{UNITS_FILE}"},
        dict(LOG_FORMAT_ENV),
        {
            "name": "DILOCO_CHECKPOINT_PATH",
            "value": ckpt.path if ckpt.is_bucket else CHECKPOINT_MOUNT,
        },
        *shard_env(run, shard),
    ]
    volumes, mounts = _syncer_volumes(run, shard)
    # Readiness is /readyz: a syncer that cannot merge or persist shows NotReady (and the run's
    # Ready condition says SyncerNotReady) while its Service keeps sending it pushes and polls;
    # liveness stays /healthz, so a full disk does not restart it and lose what it holds.
    probe = {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 5}
    readiness = {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 5}
    pod_labels = labels(run, SYNCER, **shard_labels(run, shard))
    pod_spec: dict[str, Any] = {
        "containers": [
            {
                "name": SYNCER,
                "image": spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                "command": ["diloco-syncer", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"],
                # A syncer that cannot start (exit 2: a config error, a checkpoint bucket it
                # cannot use) says why in its last log line: that becomes the pod's
                # lastState.terminated.message, shown by `kubectl describe pod`.
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "env": env,
                "ports": [{"name": "http", "containerPort": port}],
                "readinessProbe": readiness,
                "livenessProbe": {**probe, "failureThreshold": 6, "initialDelaySeconds": 10},
                "resources": _resources(spec.syncer.resources),
                "volumeMounts": mounts,
            }
        ],
        "volumes": volumes,
    }
    if spec.syncer.node_selector:
        pod_spec["nodeSelector"] = dict(spec.syncer.node_selector)
    if spec.syncer.tolerations:
        pod_spec["tolerations"] = [t.to_wire() for t in spec.syncer.tolerations]
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    claim_lock = lock_dir(run, shard, CHECKPOINT_MOUNT) if ckpt.on_claim else None
    env.extend(lock_env(claim_lock, spec.syncer.standby))
    secure_pod(pod_spec, run.token_secret)
    template = apply_template(
        {"metadata": {"labels": pod_labels}, "spec": pod_spec}, spec.syncer.template
    )
    if spec.syncer.standby:
        add_standby(template, port)
    add_syncer_tls(template, run, (SYNCER, STANDBY))
    keep_on_its_node(template)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _shard_meta(run, shard),
        "spec": {
            "replicas": 1,
            # A rollout stops the old pod before it starts the new one; a pod deleted or evicted
            # is replaced at once, and the serving lock on the claim (syncer_standby) keeps the
            # new pod's syncer waiting until the old one has exited.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": _syncer_selector(run, shard)},
            "template": template,
        },
    }


def _syncer_selector(run: Run, shard: int) -> dict[str, str]:
    return {LABEL_RUN: run.name, LABEL_COMPONENT: SYNCER, **shard_labels(run, shard)}


def _shard_meta(run: Run, shard: int) -> dict[str, Any]:
    return child_meta(run, run.shard_name(shard), SYNCER, **shard_labels(run, shard))


def syncer_disruption_budget(run: Run, shard: int = 0) -> dict[str, Any]:
    """The syncer pod's PodDisruptionBudget (syncer_disruption.py): no eviction moves it."""
    return disruption_budget(_shard_meta(run, shard), _syncer_selector(run, shard))


def syncer_service(run: Run, shard: int = 0) -> dict[str, Any]:
    return expose(_syncer_service(run, shard), run)


def _syncer_service(run: Run, shard: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _shard_meta(run, shard),
        "spec": {
            "selector": _syncer_selector(run, shard),
            "ports": [{"name": "http", "port": run.spec.syncer.port, "targetPort": "http"}],
            # an unready syncer (cannot merge or persist) still takes pushes it can keep
            "publishNotReadyAddresses": True,
        },
    }


def unit_labels(run: Run, unit: CreateUnit) -> dict[str, str]:
    return labels(
        run,
        LEARNER,
        **{
            LABEL_GROUP: unit.group,
            LABEL_UNIT: unit.name,
            LABEL_INDEX: str(unit.index),
            LABEL_ATTEMPT: str(unit.attempt),
        },
    )


def unit_service(run: Run, unit: CreateUnit) -> dict[str, Any]:
    """Headless Service = the pods' subdomain, so hosts of a slice find each other by name. It
    selects one attempt: the pods of the attempt before keep the same hostnames while the garbage
    collector deletes them, and a host must never resolve its peer to one of those."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(
            run, unit.name, LEARNER, **{LABEL_GROUP: unit.group, LABEL_UNIT: unit.name}
        ),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_UNIT: unit.name, LABEL_ATTEMPT: str(unit.attempt)},
        },
    }


def unit_job(
    run: Run, unit: CreateUnit, kubelet_rule_ok: bool = True, token_secret: str | None = None
) -> dict[str, Any]:
    """`token_secret`: the unit's token Secret (run_secrets.py; default its home name)."""
    spec = run.spec
    group: UnitGroup | None = spec.group(unit.group)
    if group is None:
        raise ValueError(f"unit {unit.name}: group {unit.group!r} is not in spec.unitGroups")
    env = learner_env(run, unit)
    node_selector, tolerations, chips = group_placement(group)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "subdomain": unit.name,
        "containers": [
            {
                "name": LEARNER,
                "image": spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                "command": ["diloco-learner", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"],
                "env": env,
                "ports": [{"name": "metrics", "containerPort": LEARNER_METRICS_PORT}],
                "resources": _resources(group.resources, chips),
                "volumeMounts": [_config_mount()],
            }
        ],
        "volumes": [_config_volume(run)],
    }
    in_place.restart_in_place(pod_spec, spec.failure_policy, kubelet_rule_ok)
    place_learner_pod(pod_spec, group, unit.name, node_selector, tolerations)
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    token = token_secret or f"{unit.name}-token"
    secure_pod(pod_spec, token)
    add_learner_transport(pod_spec, run, token)
    job_labels = unit_labels(run, unit)
    queue_labels = kueue.job_labels(run.labels)
    job_meta = child_meta(
        run,
        unit.name,
        LEARNER,
        **{k: v for k, v in job_labels.items() if k.startswith("diloco.dev/")},
        **queue_labels,
    )
    if group.capacity and group.capacity.job_annotations():
        job_meta["annotations"] = {
            **job_meta.get("annotations", {}),
            **group.capacity.job_annotations(),
        }
    pod_meta: dict[str, Any] = {"labels": job_labels}
    if group.kueue_topology:
        pod_meta["annotations"] = group.kueue_topology.pod_annotations()
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": job_meta,
        "spec": {
            # Queued through Kueue: created suspended, Kueue admits it by unsuspending it.
            **({"suspend": True} if queue_labels else {}),
            "completionMode": "Indexed",
            "completions": unit.hosts,
            "parallelism": unit.hosts,
            # A slice is atomic: any lost host fails the Job, and the operator replaces the unit.
            "backoffLimit": 0,
            "podFailurePolicy": {
                "rules": [
                    {
                        "action": "FailJob",
                        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                    },
                    {
                        # Exit 2 = config error (docs/contracts.md): retrying cannot help.
                        "action": "FailJob",
                        "onExitCodes": {"containerName": LEARNER, "operator": "In", "values": [2]},
                    },
                ]
            },
            "template": apply_template({"metadata": pod_meta, "spec": pod_spec}, group.template),
        },
    }


def run_objects(run: Run, token: str | None = None) -> list[dict[str, Any]]:
    """Every per-run object (not the units), in creation order: each kind for every syncer
    shard before the next kind, so all the Services resolve before any syncer starts (shard 0
    evaluates with the others' fragments)."""
    tls = syncer_tls_secret(run)
    objs = [token_secret(run, token), config_map(run), *([tls] if tls else [])]
    shards = range(run.shards)
    objs += [c for c in (checkpoint_claim(run, i) for i in shards) if c is not None]
    objs += [syncer_service(run, i) for i in shards]
    objs += [r for r in (syncer_route(run),) if r is not None]
    # The budgets before the Deployments: a syncer pod is never without its budget.
    objs += [syncer_disruption_budget(run, i) for i in shards]
    objs += [syncer_deployment(run, i) for i in shards]
    return objs


def unit_objects(
    run: Run, unit: CreateUnit, run_token: str, kubelet_rule_ok: bool = True
) -> list[dict[str, Any]]:
    """The children of one unit, Service first so the pods' names resolve from the start, and
    the unit's token before the Job whose pods mount it (`kubelet_rule_ok`: k8s/in_place.py).
    An away run creates no syncer, whose children include the config file the learners mount:
    its units bring it (creating it again is a no-op)."""
    away = [config_map(run)] if run.spec.syncer.external is not None else []
    secret = unit_token_secret(run, unit.name, run_token)
    return [
        *away,
        unit_service(run, unit),
        secret,
        unit_job(run, unit, kubelet_rule_ok, secret["metadata"]["name"]),
    ]

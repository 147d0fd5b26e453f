"""What learner and syncer pods share beyond their role: the Pod Security "restricted" profile,
writable scratch space on a read-only root filesystem, and the run's token as a file; and the
places where a user's pod template names a Secret, none of which may be one of the run's token
Secrets (as Python checks, as the CRD's CEL and as the chart's admission policy). How far a
template may loosen the restricted profile is pod_baseline.py.

Pure functions over plain dicts, used by `builders` (docs/e2e.md lists what real pods exposed),
`pod_template`, `api` and `crd_rules` (docs/operator.md, "Who may put what in a pod template").
"""

from __future__ import annotations

import re
from typing import Any

from diloco_operator.api.field_paths import cel_joined, values_at

TOKEN_KEY = "token"
TOKEN_DIR = "/var/run/diloco/token"
CACHE_DIR = "/var/cache/diloco"
# The images' user (docker/*.Dockerfile); files on mounted volumes are made its group's.
RUN_AS = 65532


def _token_volume(secret: str) -> dict[str, Any]:
    # A file, not an env var: env vars leak into crash dumps, `kubectl describe` and child
    # processes; the mounted file is readable by the pod's group only.
    return {
        "name": "token",
        "secret": {
            "secretName": secret,
            "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}],
            "defaultMode": 0o440,
        },
    }


def _scratch_volumes() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Writable places for a read-only root filesystem: /tmp and the trainer's caches (the
    compiled-program cache, the stdlib corpus) for a user without a home directory."""
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True},
    ]
    return volumes, mounts


def _runtime_env() -> list[dict[str, Any]]:
    return [
        {"name": "DILOCO_TOKEN_FILE", "value": f"{TOKEN_DIR}/{TOKEN_KEY}"},
        {"name": "DILOCO_CACHE_DIR", "value": CACHE_DIR},
        {"name": "HOME", "value": "/tmp"},
    ]


def pod_security_context() -> dict[str, Any]:
    """The Pod Security "restricted" profile, and volumes (PVC, Secret) owned by the user's group
    so a non-root syncer can write its checkpoints on a fresh disk."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def secure_pod(pod_spec: dict[str, Any], token_secret: str) -> dict[str, Any]:
    """What learner and syncer pods share: identity, scratch space, the token file."""
    volumes, mounts = _scratch_volumes()
    container = pod_spec["containers"][0]
    container["env"] = [*container["env"], *_runtime_env()]
    container["volumeMounts"] = [*container["volumeMounts"], *mounts]
    container["securityContext"] = container_security_context()
    pod_spec["volumes"] = [*pod_spec["volumes"], *volumes, _token_volume(token_secret)]
    pod_spec["securityContext"] = pod_security_context()
    # Learners and the syncer never call the Kubernetes API.
    pod_spec["automountServiceAccountToken"] = False
    return pod_spec


# --- Secrets a pod template names ---------------------------------------------------------------
#
# Every place of a pod template that names a Secret of the namespace: the run's own token must
# appear in none (CRD and models), and admission (the chart's ValidatingAdmissionPolicy) asks
# whether the requesting user may read each one.

# A template's own containers, beside the main one; the baseline checks walk the same lists.
CONTAINER_LISTS = ("containers", "initContainers")
SECRET_REFERENCES = (
    "spec.volumes[].secret.secretName",
    "spec.volumes[].projected.sources[].secret.name",
    "spec.volumes[].csi.nodePublishSecretRef.name",
    "spec.volumes[].azureFile.secretName",
    *(
        f"spec.volumes[].{source}.secretRef.name"
        for source in ("cephfs", "cinder", "flexVolume", "iscsi", "rbd", "scaleIO", "storageos")
    ),
    *(
        f"spec.{lst}[].{ref}"
        for lst in CONTAINER_LISTS
        for ref in ("env[].valueFrom.secretKeyRef.name", "envFrom[].secretRef.name")
    ),
    "mainContainer.env[].valueFrom.secretKeyRef.name",
    "spec.imagePullSecrets[].name",
)


def secret_references(template: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, Secret name) of each Secret a pod template (manifest form) names."""
    return [
        (where, name)
        for path in SECRET_REFERENCES
        for where, name in values_at(template, path)
        if isinstance(name, str) and name
    ]


RUN_TOKEN_WHY = (
    "a token Secret of the run (<run>-token mints every unit's credential, "
    "<run>-<group>-<index>-token is a unit's): the operator mounts each pod's own unit token, "
    "and no pod template may name one"
)


def run_token_pattern(run: str) -> str:
    """The names of a run's token Secrets: `{run}-token` (it mints every unit's credential) and
    each unit's `{run}-{group}-{index}-token` (builders.py names them)."""
    return f"^{re.escape(run)}-(.+-[0-9]+-)?token$"


def secrets_joined_cel(root: str) -> str:
    """CEL: the Secret names the pod template `root` names, joined by commas."""
    return " + ',' + ".join(cel_joined(root, path) for path in SECRET_REFERENCES)

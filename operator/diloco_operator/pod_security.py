"""What learner and syncer pods share beyond their role: the Pod Security "restricted" profile,
writable scratch space on a read-only root filesystem, and the run's token as a file.

Pure functions over plain dicts, used by `builders` (docs/e2e.md lists what real pods exposed).
"""

from __future__ import annotations

from typing import Any

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

"""Pod template overrides (`unitGroups[].template`, `syncer.template`): what a user may add to the
pods the operator builds, what stays the operator's, and the merge of the two.

Precedence (docs/design.md, "Pod template overrides"):
- Operator-owned fields cannot be overridden, and trying is an error (pydantic here, the same
  rules as CEL in the CRD): labels and annotations under `diloco.dev/` and the operator's
  `app.kubernetes.io/` labels, env vars `DILOCO_*` and `TPU_*`, the volume names and mount paths
  of OWNED_VOLUMES / OWNED_MOUNT_PATHS, the main container's name. TPU and spot node selectors
  are guarded on the unit group (api.py), not here: a template carries no nodeSelector.
- Everything else the user states wins over an operator default: the pod securityContext is the
  operator's restricted profile updated key by key with the user's; a user env var replaces the
  operator's var of the same name (only HOME is not owned).
- Lists are appended after the operator's items: volumes, the main container's volumeMounts and
  env (so user values may refer to $(DILOCO_UNIT)), imagePullSecrets, extra containers (after the
  main one, which stays first) and initContainers. Extra and init containers without a
  securityContext get the operator's restricted container profile.
- What a template adds stays within the Pod Security "baseline" level unless it says
  podSecurity: privileged (pod_baseline.py), and names none of the run's token Secrets
  (pod_security.py; who may say privileged, or name which Secret, is the chart's admission
  policy).

The typed fields a template may set are in pod_fields.py (containers, env, securityContext) and
pod_volumes.py (volumes and mounts); this module holds the template, its owned-field rules in
Python and CEL, and the merge.
"""

from __future__ import annotations

import copy
from typing import Annotated, Any, Literal

from diloco_trainer.config import Strict
from pydantic import Field, model_validator

from diloco_operator.api.kubesyntax import LABEL_VALUE, QUALIFIED_NAME, keys_rule
from diloco_operator.api.pod_baseline import (
    LEVEL_FIELD,
    PRIVILEGED,
    baseline_cel_rules,
    baseline_problems,
    system_priority_problems,
)
from diloco_operator.api.pod_fields import (
    EnvVar,
    ExtraContainer,
    LocalObjectReference,
    PodSecurityContext,
)
from diloco_operator.api.pod_security import CACHE_DIR, TOKEN_DIR, container_security_context
from diloco_operator.api.pod_volumes import Volume, VolumeMount

OWNED_PREFIX = "diloco.dev/"
OWNED_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/component",
)
OWNED_ENV_PREFIXES = ("DILOCO_", "TPU_")
OWNED_VOLUMES = ("config", "token", "tmp", "cache", "checkpoints")
# builders.CONFIG_DIR and CHECKPOINT_MOUNT (builders imports this module, so they are spelled
# here; tests/operator/test_pod_template.py checks every mount the builders make is listed).
OWNED_MOUNT_PATHS = ("/etc/diloco", TOKEN_DIR, "/tmp", CACHE_DIR, "/var/lib/diloco/checkpoints")
MAIN_CONTAINERS = ("learner", "syncer", "syncer-standby")

# Label and annotation keys have the same syntax ([prefix/]name); the API server would refuse
# the Job or Deployment of a run whose template breaks it, so admission refuses the run.
MetaKey = Annotated[str, Field(max_length=317, pattern=QUALIFIED_NAME)]
_KEYS_RULE = keys_rule(QUALIFIED_NAME, "label and annotation keys ([prefix/]name)")


def _overlaps(path: str, owned: str) -> bool:
    # String prefixes are path prefixes: mount paths are normal (kubesyntax.NORMAL_PATH).
    return path == owned or path.startswith(owned + "/") or owned.startswith(path + "/")


class PodTemplateMetadata(Strict):
    """Labels and annotations added to the pods."""

    labels: (
        Annotated[
            dict[MetaKey, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]],
            Field(max_length=64, json_schema_extra=_KEYS_RULE),
        ]
        | None
    ) = Field(None, description="Extra pod labels.")
    annotations: (
        Annotated[
            dict[MetaKey, Annotated[str, Field(max_length=4096)]],
            Field(max_length=64, json_schema_extra=_KEYS_RULE),
        ]
        | None
    ) = Field(None, description='Extra pod annotations (e.g. gke-gcsfuse/volumes: "true").')


class PodSpecFragment(Strict):
    """Pod spec fields merged into the operator's pod (same names and meaning as a Pod spec)."""

    volumes: list[Volume] | None = Field(None, max_length=32, description="Extra volumes.")
    containers: list[ExtraContainer] | None = Field(
        None, max_length=8, description="Extra containers, after the main one."
    )
    init_containers: list[ExtraContainer] | None = Field(
        None, max_length=8, description="Init containers."
    )
    image_pull_secrets: list[LocalObjectReference] | None = Field(
        None, max_length=8, description="Secrets to pull the images with."
    )
    priority_class_name: str | None = Field(
        None, max_length=253, description="PriorityClass of the pods."
    )
    security_context: PodSecurityContext | None = Field(
        None,
        description="Pod securityContext keys; each replaces the operator's key of that name.",
    )
    termination_grace_period_seconds: int | None = Field(
        None, ge=0, le=86400, description="Seconds between SIGTERM and SIGKILL."
    )
    host_network: bool | None = Field(
        None, description="The node's network namespace (only at podSecurity: privileged)."
    )
    host_pid: bool | None = Field(
        None,
        alias="hostPID",
        description="The node's process namespace (only at podSecurity: privileged).",
    )
    host_ipc: bool | None = Field(
        None,
        alias="hostIPC",
        description="The node's IPC namespace (only at podSecurity: privileged).",
    )


class MainContainer(Strict):
    """Additions to the main container (learner or syncer)."""

    env: list[EnvVar] | None = Field(
        None, max_length=64, description="Env vars after the operator's (not DILOCO_*, TPU_*)."
    )
    volume_mounts: list[VolumeMount] | None = Field(
        None, max_length=32, description="Mounts of template.spec.volumes."
    )


class PodTemplate(Strict):
    """Pod customisation merged into the pods the operator builds; operator-owned fields are
    refused (docs/operator.md, "Who may put what in a pod template")."""

    pod_security: Literal["baseline", "privileged"] = Field(
        "baseline",
        description="What the template may add to the operator's restricted pods: baseline "
        "(the Pod Security Standards' baseline level: no privileged containers, added "
        "capabilities, host namespaces, ports or paths, unsafe sysctls, unconfined profiles) "
        "or privileged (no such limit; the chart's admission policy admits it only for users "
        "and namespaces the cluster admin allows).",
    )
    metadata: PodTemplateMetadata | None = Field(None, description="Pod labels, annotations.")
    spec: PodSpecFragment | None = Field(None, description="Pod spec fields.")
    main_container: MainContainer | None = Field(
        None, description="Additions to the learner (or syncer) container."
    )

    @model_validator(mode="after")
    def _nothing_owned(self) -> PodTemplate:
        problems = conflicts(self)
        wire = self.to_wire()
        problems += system_priority_problems(wire)
        if self.pod_security != PRIVILEGED:
            problems += baseline_problems(wire)
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _owned_label(key: str) -> bool:
    return key.startswith(OWNED_PREFIX) or key in OWNED_LABELS


def conflicts(template: PodTemplate) -> list[str]:
    """Every way `template` touches what the operator owns, one message per field."""
    meta = template.metadata or PodTemplateMetadata()
    spec = template.spec or PodSpecFragment()
    main = template.main_container or MainContainer()
    volumes = [v.name for v in spec.volumes or []]
    found = [
        f"metadata.labels: {k} is set by the operator (diloco.dev/*, {', '.join(OWNED_LABELS)})"
        for k in meta.labels or {}
        if _owned_label(k)
    ]
    found += [
        f"metadata.annotations: {k} is the operator's (diloco.dev/*)"
        for k in meta.annotations or {}
        if k.startswith(OWNED_PREFIX)
    ]
    found += [
        f"spec.volumes: {n} is a volume of the operator" for n in volumes if n in OWNED_VOLUMES
    ]
    for field, extra in (
        ("spec.containers", spec.containers),
        ("spec.initContainers", spec.init_containers),
    ):
        found += [
            f"{field}: {c.name} is the name of one of the operator's containers"
            for c in extra or []
            if c.name in MAIN_CONTAINERS
        ]
    found += [
        f"mainContainer.env: {e.name} is set by the operator (DILOCO_*, TPU_*)"
        for e in main.env or []
        if e.name.startswith(OWNED_ENV_PREFIXES)
    ]
    for m in main.volume_mounts or []:
        owned = next((p for p in OWNED_MOUNT_PATHS if _overlaps(m.mount_path, p)), None)
        if owned is not None:
            found.append(
                f"mainContainer.volumeMounts: {m.mount_path} overlaps the operator's mount {owned}"
            )
        if m.name not in volumes:
            found.append(
                f"mainContainer.volumeMounts: {m.name} is not a volume of template.spec.volumes"
            )
    return found


# --- the same rules as CEL on the PodTemplate node of the CRD (crdgen adds them) ---------------


def _cel_strings(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(repr(i) for i in items) + "]"


def _has(*chain: str) -> str:
    """`has(self.a) && has(self.a.b) ...` for a field chain."""
    return " && ".join(f"has(self.{'.'.join(chain[: i + 1])})" for i in range(len(chain)))


def _rule(chain: tuple[str, ...], body: str, message: str) -> dict[str, str]:
    return {
        "rule": f"!({_has(*chain)}) || self.{'.'.join(chain)}.{body}",
        "message": message,
        "fieldPath": "." + ".".join(chain),
    }


def _cel_rules() -> list[dict[str, str]]:
    prefixes = " && ".join(f"!e.name.startsWith({p!r})" for p in OWNED_ENV_PREFIXES)
    overlap = (
        "m.mountPath != p && !m.mountPath.startsWith(p + '/') && !p.startsWith(m.mountPath + '/')"
    )
    volume_named = (
        "(has(self.spec) && has(self.spec.volumes) && "
        "self.spec.volumes.exists(v, v.name == m.name))"
    )
    main = _cel_strings(MAIN_CONTAINERS)
    return [
        _rule(
            ("metadata", "labels"),
            f"all(k, !k.startsWith({OWNED_PREFIX!r}) && !(k in {_cel_strings(OWNED_LABELS)}))",
            "metadata.labels: diloco.dev/* and the operator's app.kubernetes.io labels are set "
            "by the operator",
        ),
        _rule(
            ("metadata", "annotations"),
            f"all(k, !k.startsWith({OWNED_PREFIX!r}))",
            "metadata.annotations: diloco.dev/* annotations are the operator's",
        ),
        _rule(
            ("spec", "volumes"),
            f"all(v, !(v.name in {_cel_strings(OWNED_VOLUMES)}))",
            "spec.volumes: config, token, tmp, cache and checkpoints are volumes of the operator",
        ),
        _rule(
            ("spec", "containers"),
            f"all(c, !(c.name in {main}))",
            "spec.containers: learner, syncer and syncer-standby are the names of the operator's "
            "containers",
        ),
        _rule(
            ("spec", "initContainers"),
            f"all(c, !(c.name in {main}))",
            "spec.initContainers: learner, syncer and syncer-standby are the names of the "
            "operator's containers",
        ),
        _rule(
            ("mainContainer", "env"),
            f"all(e, {prefixes})",
            "mainContainer.env: DILOCO_* and TPU_* variables are set by the operator",
        ),
        _rule(
            ("mainContainer", "volumeMounts"),
            f"all(m, {_cel_strings(OWNED_MOUNT_PATHS)}.all(p, {overlap}))",
            "mainContainer.volumeMounts: a mountPath overlaps a mount of the operator "
            f"({', '.join(OWNED_MOUNT_PATHS)})",
        ),
        _rule(
            ("mainContainer", "volumeMounts"),
            f"all(m, {volume_named})",
            "mainContainer.volumeMounts: every name must be a volume of template.spec.volumes",
        ),
    ]


CEL_RULES: dict[str, list[dict[str, str]]] = {"PodTemplate": _cel_rules() + baseline_cel_rules()}
assert PodTemplate.model_fields["pod_security"].alias == LEVEL_FIELD


# --- the merge ----------------------------------------------------------------------------------


def _with_security(container: dict[str, Any]) -> dict[str, Any]:
    if "securityContext" in container:
        return container
    return {**container, "securityContext": container_security_context()}


def _merge_env(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    replaced = {e["name"]: e for e in theirs}
    kept = [replaced.pop(e["name"], e) for e in ours]
    return kept + [e for e in theirs if e["name"] in replaced]


def apply_template(pod: dict[str, Any], template: PodTemplate | None) -> dict[str, Any]:
    """The pod template `pod` ({"metadata", "spec"} as the builders make it, main container
    first) with `template` merged in by the precedence rules above; `pod` is not changed."""
    merged = copy.deepcopy(pod)
    if template is None:
        return merged
    wire = template.to_wire()
    meta, spec, main = wire.get("metadata", {}), wire.get("spec", {}), wire.get("mainContainer", {})
    out_meta, out_spec = merged.setdefault("metadata", {}), merged["spec"]
    for key in ("labels", "annotations"):
        if meta.get(key):
            # The operator's own keys go last: they win even over an unvalidated template.
            out_meta[key] = {**meta[key], **out_meta.get(key, {})}
    container = out_spec["containers"][0]
    container["env"] = _merge_env(container.get("env", []), main.get("env", []))
    container["volumeMounts"] = [*container.get("volumeMounts", []), *main.get("volumeMounts", [])]
    for key in ("volumes", "imagePullSecrets"):
        if spec.get(key):
            out_spec[key] = [*out_spec.get(key, []), *spec[key]]
    out_spec["containers"] += [_with_security(c) for c in spec.get("containers", [])]
    if spec.get("initContainers"):
        inits = [_with_security(c) for c in spec["initContainers"]]
        out_spec["initContainers"] = [*out_spec.get("initContainers", []), *inits]
    if "securityContext" in spec:
        out_spec["securityContext"] = {
            **out_spec.get("securityContext", {}),
            **spec["securityContext"],
        }
    for key in (
        "priorityClassName",
        "terminationGracePeriodSeconds",
        "hostNetwork",
        "hostPID",
        "hostIPC",
    ):
        if key in spec:
            out_spec[key] = spec[key]
    return merged

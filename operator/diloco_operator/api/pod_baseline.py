"""How far a user's pod template may loosen the operator's restricted pods by default: the Pod
Security Standards' "baseline" level, as Python checks (the models refuse a template) and as CEL
rules on the CRD's pod template node; plus the refusal of Kubernetes' system priority classes.
`podSecurity: privileged` lifts the baseline checks; who may set it is the chart's admission
policy (docs/operator.md, "Who may put what in a pod template").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diloco_operator.api.field_paths import cel_all, values_at
from diloco_operator.api.pod_security import CONTAINER_LISTS

# The operator's own pods are "restricted"; a pod template (pod_template.py) may loosen them, but
# at the default level only as far as the Pod Security Standards' baseline allows, so that a
# DilocoRun author cannot have the operator create pods the author could not create. The values
# are those of k8s.io/pod-security-admission's baseline checks at Kubernetes 1.37. Each check is
# stated once and turned both into Python (the models) and into CEL (the CRD), so the two refuse
# the same templates naming the same field.

BASELINE_CAPABILITIES = (
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
)
SAFE_SYSCTLS = (
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.ping_group_range",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_notsent_lowat",
    "net.ipv4.tcp_rmem",
    "net.ipv4.tcp_slow_start_after_idle",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.tcp_wmem",
)
SELINUX_TYPES = ("", "container_t", "container_init_t", "container_kvm_t", "container_engine_t")
PROFILE_TYPES = ("RuntimeDefault", "Localhost")  # AppArmor; seccomp allows the same two
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
HANDLERS = (
    "livenessProbe",
    "readinessProbe",
    "startupProbe",
    "lifecycle.postStart",
    "lifecycle.preStop",
)
LEVEL_FIELD = "podSecurity"
PRIVILEGED = "privileged"
SYSTEM_PRIORITY_PREFIX = "system-"


def _cel_in(items: tuple[str, ...]) -> Callable[[str], str]:
    listed = "[" + ", ".join(repr(i) for i in items) + "]"
    return lambda v: f"{v} in {listed}"


@dataclass(frozen=True)
class Check:
    """Every value at each of `paths` (below a pod template) must satisfy `allowed`, spelled
    in Python and in CEL (absent values pass; with `absent` there must be none); `field` names
    them in messages (`[]` for any list item)."""

    field: str
    paths: tuple[str, ...]
    allowed: Callable[[Any], bool]
    cel: Callable[[str], str]
    why: str
    absent: bool = False

    @property
    def message(self) -> str:
        return f"{self.field}: {self.why}"

    @property
    def field_path(self) -> str:
        """The CEL rule's fieldPath: the message's field up to its first list."""
        return "." + self.field.split("[", 1)[0]

    def cel_rule(self) -> str:
        return " && ".join(cel_all("self", p, self.cel, self.absent) for p in self.paths)


def _false(v: Any) -> bool:
    return v is False


def _cel_false(v: str) -> str:
    return f"!{v}"


def _cel_empty(v: str) -> str:
    return f"{v} == ''"


def _containers(field: str, suffixes: tuple[str, ...] = (), **kw: Any) -> list[Check]:
    return [
        Check(
            field=f"spec.{lst}[].{field}",
            paths=tuple(f"spec.{lst}[].{p}" for p in suffixes or (field,)),
            **kw,
        )
        for lst in CONTAINER_LISTS
    ]


def _pod_and_containers(field: str, **kw: Any) -> list[Check]:
    pod = f"spec.securityContext.{field}"
    return [Check(field=pod, paths=(pod,), **kw), *_containers(f"securityContext.{field}", **kw)]


_BASELINE = "refused at the baseline Pod Security level"
_LIFT = "unless podSecurity: privileged, which the cluster admin grants"


def _why(what: str) -> str:
    return f"{what} is {_BASELINE} ({_LIFT})"


BASELINE_CHECKS: list[Check] = [
    *(
        Check(
            field=f"spec.{ns}",
            paths=(f"spec.{ns}",),
            allowed=_false,
            cel=_cel_false,
            why=_why("sharing the node's namespaces"),
        )
        for ns in ("hostNetwork", "hostPID", "hostIPC")
    ),
    Check(
        field="spec.volumes[].hostPath",
        paths=("spec.volumes[].hostPath",),
        allowed=lambda v: False,
        cel=_cel_false,
        why=_why("a hostPath volume (the node's files)"),
        absent=True,
    ),
    *_pod_and_containers(
        "windowsOptions.hostProcess",
        allowed=_false,
        cel=_cel_false,
        why=_why("a Windows host process"),
    ),
    *_containers(
        "securityContext.privileged",
        allowed=_false,
        cel=_cel_false,
        why=_why("a privileged container"),
    ),
    *_containers(
        "securityContext.capabilities.add",
        ("securityContext.capabilities.add[]",),
        allowed=lambda v: v in BASELINE_CAPABILITIES,
        cel=_cel_in(BASELINE_CAPABILITIES),
        why=_why(
            "adding a capability beyond the runtime's defaults "
            f"({', '.join(BASELINE_CAPABILITIES)})"
        ),
    ),
    *_containers(
        "ports[].hostPort",
        allowed=lambda v: v == 0,
        cel=lambda v: f"{v} == 0",
        why=_why("a port of the node (hostPort)"),
    ),
    *_pod_and_containers(
        "appArmorProfile.type",
        allowed=lambda v: v in PROFILE_TYPES,
        cel=_cel_in(PROFILE_TYPES),
        why=_why("an AppArmor profile other than RuntimeDefault or Localhost"),
    ),
    *_pod_and_containers(
        "seLinuxOptions.type",
        allowed=lambda v: v in SELINUX_TYPES,
        cel=_cel_in(SELINUX_TYPES),
        why=_why(f"an SELinux type other than {', '.join(SELINUX_TYPES[1:])}"),
    ),
    *(
        check
        for role in ("user", "role")
        for check in _pod_and_containers(
            f"seLinuxOptions.{role}",
            allowed=lambda v: v == "",
            cel=_cel_empty,
            why=_why(f"an SELinux {role}"),
        )
    ),
    *_containers(
        "securityContext.procMount",
        allowed=lambda v: v == "Default",
        cel=lambda v: f"{v} == 'Default'",
        why=_why("an unmasked /proc (procMount Unmasked)"),
    ),
    *_pod_and_containers(
        "seccompProfile.type",
        allowed=lambda v: v in PROFILE_TYPES,
        cel=_cel_in(PROFILE_TYPES),
        why=_why("seccomp Unconfined"),
    ),
    Check(
        field="spec.securityContext.sysctls[].name",
        paths=("spec.securityContext.sysctls[].name",),
        allowed=lambda v: v in SAFE_SYSCTLS,
        cel=_cel_in(SAFE_SYSCTLS),
        why=_why(f"a sysctl outside the safe set ({', '.join(SAFE_SYSCTLS)})"),
    ),
    *_containers(
        "<probe or lifecycle handler>.httpGet|tcpSocket.host",
        tuple(f"{h}.{kind}.host" for h in HANDLERS for kind in ("httpGet", "tcpSocket")),
        allowed=lambda v: v == "",
        cel=_cel_empty,
        why=_why("a probe or handler aimed at another host (the kubelet connects to it)"),
    ),
]

APPARMOR_ANNOTATION_MESSAGE = (
    f"metadata.annotations: {APPARMOR_ANNOTATION}* other than runtime/default or localhost/* is "
    f"{_BASELINE} ({_LIFT})"
)
SYSTEM_PRIORITY_MESSAGE = (
    "spec.priorityClassName: system-* classes (system-node-critical, system-cluster-critical) are "
    "Kubernetes' own; a training pod must not preempt the node's and the cluster's system pods"
)


def _apparmor_annotation_allowed(value: str) -> bool:
    return value in ("", "runtime/default") or value.startswith("localhost/")


def baseline_problems(template: dict[str, Any]) -> list[str]:
    """What a pod template (manifest form) sets beyond the baseline level, one message per
    value, naming its concrete field."""
    found = [
        f"{where}: {check.why}"
        for check in BASELINE_CHECKS
        for path in check.paths
        for where, value in values_at(template, path)
        if not check.allowed(value)
    ]
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    found += [
        f"metadata.annotations[{key}]: {APPARMOR_ANNOTATION}* other than runtime/default or "
        f"localhost/* is {_BASELINE} ({_LIFT})"
        for key, value in annotations.items()
        if key.startswith(APPARMOR_ANNOTATION) and not _apparmor_annotation_allowed(value)
    ]
    return found


def system_priority_problems(template: dict[str, Any]) -> list[str]:
    name = (template.get("spec") or {}).get("priorityClassName") or ""
    return [SYSTEM_PRIORITY_MESSAGE] if name.startswith(SYSTEM_PRIORITY_PREFIX) else []


def baseline_cel_rules() -> list[dict[str, str]]:
    """The baseline checks as CEL rules on the pod template node, each lifted by
    `podSecurity: privileged` (admission decides who may set it)."""
    lifted = f"(has(self.{LEVEL_FIELD}) && self.{LEVEL_FIELD} == '{PRIVILEGED}')"
    rules = [
        {
            "rule": f"{lifted} || ({check.cel_rule()})",
            "message": check.message,
            "fieldPath": check.field_path,
        }
        for check in BASELINE_CHECKS
    ]
    annotations = "self.metadata.annotations"
    rules.append(
        {
            "rule": f"{lifted} || !has(self.metadata) || !has({annotations}) || "
            f"{annotations}.all(k, !k.startsWith({APPARMOR_ANNOTATION!r}) || "
            f"{annotations}[k] in ['', 'runtime/default'] || "
            f"{annotations}[k].startsWith('localhost/'))",
            "message": APPARMOR_ANNOTATION_MESSAGE,
            "fieldPath": ".metadata.annotations",
        }
    )
    rules.append(
        {
            "rule": "!has(self.spec) || !has(self.spec.priorityClassName) || "
            f"!self.spec.priorityClassName.startsWith({SYSTEM_PRIORITY_PREFIX!r})",
            "message": SYSTEM_PRIORITY_MESSAGE,
            "fieldPath": ".spec.priorityClassName",
        }
    )
    return rules

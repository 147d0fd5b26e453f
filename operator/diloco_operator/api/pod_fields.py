"""The typed fields of a pod spec and its containers that a pod template may set: environment
variables (and the Secrets they read), pod and container securityContexts, ports, probe and
lifecycle handlers, and extra containers, each as in a Pod spec.

The security-relevant fields are typed so that the Pod Security "baseline" checks
(pod_baseline.py) and the token-Secret checks (pod_security.py) see them; what else a container,
an env source or a handler carries passes through as given. The volumes a template adds are in
pod_volumes.py, the template itself in pod_template.py.
"""

from __future__ import annotations

from typing import Annotated, Literal

from diloco_trainer.config import Strict
from pydantic import ConfigDict, Field

from diloco_operator.api.kubesyntax import DNS_LABEL, ENV_NAME

Name = Annotated[str, Field(max_length=253)]
# uid and gid values as the API server accepts them in a securityContext.
Id = Annotated[int, Field(ge=0, le=2147483647)]


class SecretKeySelector(Strict):
    """A key of a Secret of the run's namespace."""

    name: Name | None = Field(None, description="The Secret's name.")
    key: str = Field(max_length=253, description="The key in the Secret.")
    optional: bool | None = Field(None, description="Whether the Secret or key may be absent.")


class EnvVarSource(Strict):
    """As in a container's env[].valueFrom; secretKeyRef is checked, the other sources
    (fieldRef, configMapKeyRef, ...) are passed through."""

    model_config = ConfigDict(extra="allow")

    secret_key_ref: SecretKeySelector | None = Field(
        None, description="A key of a Secret (not the run's token Secret)."
    )


class EnvVar(Strict):
    """An environment variable, as in a container spec."""

    name: str = Field(min_length=1, max_length=253, pattern=ENV_NAME, description="Variable name.")
    value: str | None = Field(None, max_length=32768, description="Value; $(VAR) expands.")
    value_from: EnvVarSource | None = Field(
        None, description="As in a container's env[].valueFrom."
    )


class SidecarEnvVar(Strict):
    """An environment variable of an extra container, as in a container spec."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=253, description="Variable name.")
    value: str | None = Field(None, max_length=32768, description="Value; $(VAR) expands.")
    value_from: EnvVarSource | None = Field(
        None, description="As in a container's env[].valueFrom."
    )


class SecretEnvSource(Strict):
    """As in a container's envFrom[].secretRef."""

    name: Name | None = Field(None, description="The Secret's name.")
    optional: bool | None = Field(None, description="Whether the Secret may be absent.")


class EnvFromSource(Strict):
    """As in a container's envFrom[]; secretRef is checked, configMapRef and prefix pass."""

    model_config = ConfigDict(extra="allow")

    secret_ref: SecretEnvSource | None = Field(
        None, description="Every key of a Secret as a variable (not the run's token Secret)."
    )


class SeccompProfile(Strict):
    """As in a securityContext."""

    type: Literal["RuntimeDefault", "Localhost", "Unconfined"] = Field(
        description="RuntimeDefault or Localhost (Unconfined only at podSecurity: privileged)."
    )
    localhost_profile: str | None = Field(
        None, max_length=4096, description="Profile file on the node, with type Localhost."
    )


class AppArmorProfile(Strict):
    """As in a securityContext."""

    type: Literal["RuntimeDefault", "Localhost", "Unconfined"] = Field(
        description="RuntimeDefault or Localhost (Unconfined only at podSecurity: privileged)."
    )
    localhost_profile: str | None = Field(
        None, max_length=4096, description="Profile loaded on the node, with type Localhost."
    )


class SELinuxOptions(Strict):
    """As in a securityContext."""

    user: str | None = Field(None, max_length=253, description="Only at podSecurity: privileged.")
    role: str | None = Field(None, max_length=253, description="Only at podSecurity: privileged.")
    type: str | None = Field(
        None,
        max_length=253,
        description="container_t, container_init_t, container_kvm_t or container_engine_t "
        "(others only at podSecurity: privileged).",
    )
    level: str | None = Field(None, max_length=253, description="SELinux level label.")


class WindowsOptions(Strict):
    """As in a securityContext."""

    gmsa_credential_spec_name: str | None = Field(
        None, max_length=253, description="GMSA credential spec resource."
    )
    gmsa_credential_spec: str | None = Field(
        None, max_length=65536, description="GMSA credential spec content."
    )
    run_as_user_name: str | None = Field(None, max_length=256, description="Windows user name.")
    host_process: bool | None = Field(
        None, description="A Windows host process (only at podSecurity: privileged)."
    )


class Sysctl(Strict):
    """A namespaced kernel parameter of the pod."""

    name: str = Field(max_length=253, description="Sysctl name (baseline: the safe set).")
    value: str = Field(max_length=1024, description="Its value.")


class PodSecurityContext(Strict):
    """Pod securityContext fields, as in a Pod spec; each one given replaces the operator's."""

    run_as_user: Id | None = Field(None, description="UID of the containers' processes.")
    run_as_group: Id | None = Field(None, description="GID of the containers' processes.")
    run_as_non_root: bool | None = Field(None, description="Refuse to start as root.")
    fs_group: Id | None = Field(None, description="Group owning mounted volumes.")
    fs_group_change_policy: Literal["OnRootMismatch", "Always"] | None = Field(
        None, description="When volume ownership is changed to fsGroup."
    )
    supplemental_groups: list[Id] | None = Field(
        None, max_length=32, description="Further GIDs of the containers' processes."
    )
    supplemental_groups_policy: Literal["Merge", "Strict"] | None = Field(
        None, description="Whether the image's groups are added to supplementalGroups."
    )
    seccomp_profile: SeccompProfile | None = Field(None, description="Seccomp profile.")
    app_armor_profile: AppArmorProfile | None = Field(None, description="AppArmor profile.")
    se_linux_options: SELinuxOptions | None = Field(None, description="SELinux context.")
    se_linux_change_policy: Literal["MountOption", "Recursive"] | None = Field(
        None, description="How volumes get the pod's SELinux label."
    )
    sysctls: list[Sysctl] | None = Field(
        None, max_length=16, description="Namespaced sysctls (baseline: the safe set)."
    )
    windows_options: WindowsOptions | None = Field(None, description="Windows settings.")


class Capabilities(Strict):
    """Linux capabilities added to or dropped from the runtime's default set."""

    add: list[Annotated[str, Field(max_length=64)]] | None = Field(
        None, max_length=64, description="Added (baseline: only the runtime's default set)."
    )
    drop: list[Annotated[str, Field(max_length=64)]] | None = Field(
        None, max_length=64, description="Dropped (e.g. ALL)."
    )


class SecurityContext(Strict):
    """A container securityContext, as in a container spec."""

    allow_privilege_escalation: bool | None = Field(None, description="no_new_privs unset.")
    capabilities: Capabilities | None = Field(None, description="Capabilities to add or drop.")
    privileged: bool | None = Field(None, description="Only at podSecurity: privileged.")
    proc_mount: Literal["Default", "Unmasked"] | None = Field(
        None, description="Unmasked only at podSecurity: privileged."
    )
    read_only_root_filesystem: bool | None = Field(None, description="Read-only root.")
    run_as_user: Id | None = Field(None, description="UID of the process.")
    run_as_group: Id | None = Field(None, description="GID of the process.")
    run_as_non_root: bool | None = Field(None, description="Refuse to start as root.")
    seccomp_profile: SeccompProfile | None = Field(None, description="Seccomp profile.")
    app_armor_profile: AppArmorProfile | None = Field(None, description="AppArmor profile.")
    se_linux_options: SELinuxOptions | None = Field(None, description="SELinux context.")
    windows_options: WindowsOptions | None = Field(None, description="Windows settings.")


class ContainerPort(Strict):
    """A port of an extra container, as in a container spec."""

    container_port: int = Field(ge=1, le=65535, description="Port in the pod's network.")
    host_port: int | None = Field(
        None, ge=0, le=65535, description="A node port (only at podSecurity: privileged)."
    )
    host_ip: str | None = Field(
        None, alias="hostIP", max_length=64, description="Node address of hostPort."
    )
    name: str | None = Field(None, max_length=15, description="Port name.")
    protocol: Literal["TCP", "UDP", "SCTP"] | None = Field(None, description="Protocol.")


class HandlerTarget(Strict):
    """httpGet or tcpSocket of a probe or lifecycle handler; its host is checked."""

    model_config = ConfigDict(extra="allow")

    host: str | None = Field(
        None,
        max_length=253,
        description="Another host for the kubelet to connect to (only at podSecurity: "
        "privileged); default: the pod.",
    )


class Handler(Strict):
    """A probe or lifecycle handler, as in a container spec; passed through but for the host
    of httpGet and tcpSocket."""

    model_config = ConfigDict(extra="allow")

    http_get: HandlerTarget | None = Field(None, description="An HTTP GET.")
    tcp_socket: HandlerTarget | None = Field(None, description="A TCP connection.")


class Lifecycle(Strict):
    """Lifecycle hooks of a container, as in a container spec."""

    model_config = ConfigDict(extra="allow")

    post_start: Handler | None = Field(None, description="After the container starts.")
    pre_stop: Handler | None = Field(None, description="Before the container stops.")


class ExtraContainer(Strict):
    """A further container (sidecar or init container) as in a Pod spec, passed through."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL,
        description="Container name, not learner, syncer or syncer-standby; the other fields are "
        "passed through "
        "(no securityContext: the operator's restricted one).",
    )
    image: str = Field(min_length=1, max_length=512, description="Container image.")
    security_context: SecurityContext | None = Field(
        None, description="Its securityContext (absent: the operator's restricted one)."
    )
    ports: list[ContainerPort] | None = Field(None, max_length=16, description="Its ports.")
    env: list[SidecarEnvVar] | None = Field(
        None, max_length=64, description="Its environment variables."
    )
    env_from: list[EnvFromSource] | None = Field(
        None, max_length=8, description="Variables from ConfigMaps and Secrets."
    )
    liveness_probe: Handler | None = Field(None, description="As in a container spec.")
    readiness_probe: Handler | None = Field(None, description="As in a container spec.")
    startup_probe: Handler | None = Field(None, description="As in a container spec.")
    lifecycle: Lifecycle | None = Field(None, description="As in a container spec.")


class LocalObjectReference(Strict):
    """A reference to an object in the run's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Name of a Secret.")

"""The volumes a pod template adds, and the main container's mounts of them, as in a Pod spec.

A volume is a name and one source. The sources that name a Secret (checked against the run's
token Secrets, pod_security.py) or the node's files (hostPath, refused at the baseline level,
pod_baseline.py) are declared; every other source passes through unchecked.
"""

from __future__ import annotations

from typing import Any, Literal

from diloco_trainer.config import Strict
from pydantic import ConfigDict, Field

from diloco_operator.api.kubesyntax import DNS_LABEL, NORMAL_PATH
from diloco_operator.api.pod_fields import Name


class VolumeMount(Strict):
    """A volume mount of the main container, as in a container spec."""

    name: str = Field(min_length=1, max_length=63, description="A volume of template.spec.")
    mount_path: str = Field(
        max_length=512,
        pattern=NORMAL_PATH,
        description="Absolute path without . or .. segments or a trailing slash; it must not "
        "overlap the operator's mounts.",
    )
    read_only: bool | None = Field(None, description="Mount read-only.")
    sub_path: str | None = Field(None, max_length=512, description="Path within the volume.")
    sub_path_expr: str | None = Field(
        None, max_length=512, description="subPath with $(VAR) expansion."
    )
    mount_propagation: Literal["None", "HostToContainer", "Bidirectional"] | None = Field(
        None, description="As in a container's volumeMounts."
    )
    recursive_read_only: Literal["Disabled", "IfPossible", "Enabled"] | None = Field(
        None, description="As in a container's volumeMounts."
    )


class SecretRef(Strict):
    """A Secret of the run's namespace, by name."""

    name: Name | None = Field(None, description="The Secret's name.")


class HostPathVolumeSource(Strict):
    """A directory or file of the node."""

    path: str = Field(max_length=4096, description="Path on the node.")
    type: str | None = Field(None, max_length=64, description="What must be there.")


class SecretVolumeSource(Strict):
    """As in a Pod's volumes[].secret."""

    model_config = ConfigDict(extra="allow")

    secret_name: Name | None = Field(None, description="The Secret (not the run's token).")


class SecretProjection(Strict):
    """As in a projected volume's sources[].secret."""

    model_config = ConfigDict(extra="allow")

    name: Name | None = Field(None, description="The Secret (not the run's token).")


class VolumeProjection(Strict):
    """One source of a projected volume; secret is checked, the others pass through."""

    model_config = ConfigDict(extra="allow")

    secret: SecretProjection | None = Field(None, description="Keys of a Secret.")


class ProjectedVolumeSource(Strict):
    """As in a Pod's volumes[].projected."""

    model_config = ConfigDict(extra="allow")

    sources: list[VolumeProjection] | None = Field(
        None, max_length=8, description="What the volume holds."
    )


class SecretRefVolumeSource(Strict):
    """A volume source that reads its credentials from a Secret (secretRef); the other fields
    pass through."""

    model_config = ConfigDict(extra="allow")

    secret_ref: SecretRef | None = Field(None, description="The Secret (not the run's token).")


class CSIVolumeSource(Strict):
    """As in a Pod's volumes[].csi; passed through but for its Secret."""

    model_config = ConfigDict(extra="allow")

    node_publish_secret_ref: SecretRef | None = Field(
        None, description="A Secret for the driver (not the run's token)."
    )


class AzureFileVolumeSource(Strict):
    """As in a Pod's volumes[].azureFile; passed through but for its Secret."""

    model_config = ConfigDict(extra="allow")

    secret_name: Name | None = Field(None, description="The Secret (not the run's token).")


def _secret_source(what: str, alias: str | None = None) -> Any:
    return Field(None, alias=alias, description=f"{what}; its secretRef is checked.")


class Volume(Strict):
    """A pod volume as in a Pod spec: a name and one source (csi, persistentVolumeClaim, ...).
    Sources that name a Secret or the node's files are declared (and checked); the others pass
    through unchecked."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL,
        description="Volume name, not one of the operator's (config, token, tmp, cache, "
        "checkpoints); the source fields next to it are passed through unchecked.",
    )
    host_path: HostPathVolumeSource | None = Field(
        None, description="The node's files (only at podSecurity: privileged)."
    )
    secret: SecretVolumeSource | None = Field(None, description="The keys of a Secret.")
    projected: ProjectedVolumeSource | None = Field(None, description="Several sources in one.")
    csi: CSIVolumeSource | None = Field(None, description="A CSI driver's volume.")
    azure_file: AzureFileVolumeSource | None = Field(None, description="An Azure file share.")
    cephfs: SecretRefVolumeSource | None = _secret_source("A CephFS mount")
    cinder: SecretRefVolumeSource | None = _secret_source("An OpenStack Cinder volume")
    flex_volume: SecretRefVolumeSource | None = _secret_source("A FlexVolume driver's volume")
    iscsi: SecretRefVolumeSource | None = _secret_source("An iSCSI disk")
    rbd: SecretRefVolumeSource | None = _secret_source("A Ceph RBD image")
    scale_io: SecretRefVolumeSource | None = _secret_source("A ScaleIO volume", alias="scaleIO")
    storageos: SecretRefVolumeSource | None = _secret_source("A StorageOS volume")

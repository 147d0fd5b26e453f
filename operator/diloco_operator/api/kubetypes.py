"""Kubernetes-shaped parts of the DilocoRun spec (quantities, resources, node selectors,
tolerations), with the syntax and rules the API server applies to the same fields of a Pod, so
that a run the server admits never has children it refuses (kubesyntax.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from diloco_trainer.config import Strict
from pydantic import Field, model_validator

from diloco_operator.api.kubesyntax import (
    INT64_MAX,
    LABEL_VALUE,
    OPTIONAL_QUALIFIED_NAME,
    QUALIFIED_NAME,
    QUANTITY,
    RESOURCE_NAME,
    keys_rule,
)

# Kubernetes quantity: "500m", "2Gi" or a plain number (x-kubernetes-int-or-string in the CRD).
Quantity = Annotated[
    Annotated[int, Field(ge=0, le=INT64_MAX)]
    | Annotated[str, Field(pattern=QUANTITY, max_length=64)],
    Field(description="A Kubernetes quantity, e.g. 500m or 2Gi."),
]
ResourceName = Annotated[str, Field(max_length=253, pattern=RESOURCE_NAME)]
LabelKey = Annotated[str, Field(max_length=253, pattern=QUALIFIED_NAME)]
NodeSelector = Annotated[
    dict[LabelKey, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]],
    Field(max_length=16, json_schema_extra=keys_rule(QUALIFIED_NAME, "label keys ([prefix/]name)")),
]
ResourceMap = Annotated[
    dict[ResourceName, Quantity],
    Field(
        max_length=16,
        json_schema_extra=keys_rule(
            RESOURCE_NAME, "cpu, memory, ephemeral-storage, hugepages-* or a domain/name"
        ),
    ),
]


class ResourceRequirements(Strict):
    """Container resources, as in a Pod spec."""

    requests: ResourceMap | None = Field(
        None, description="Resource name -> amount the scheduler reserves."
    )
    limits: ResourceMap | None = Field(
        None, description="Resource name -> most the container may use."
    )


class Toleration(Strict):
    """A Pod toleration, as in a Pod spec."""

    key: str | None = Field(
        None,
        max_length=253,
        pattern=OPTIONAL_QUALIFIED_NAME,
        description="Taint key; empty with operator Exists: every taint.",
    )
    operator: Literal["Exists", "Equal"] | None = Field(
        None, description="Exists: any value; Equal (the default): the value must match."
    )
    value: str | None = Field(
        None, max_length=63, pattern=LABEL_VALUE, description="Taint value (for Equal)."
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; empty: every effect."
    )
    toleration_seconds: int | None = Field(
        None,
        ge=-INT64_MAX,
        le=INT64_MAX,
        description="For NoExecute: seconds the pod stays after the taint; empty: forever.",
    )

    @model_validator(mode="after")
    def _pod_rules(self) -> Toleration:
        # The rules kube-apiserver applies to a Pod's tolerations.
        if self.operator == "Exists" and self.value:
            raise ValueError("value: must be empty when operator is Exists")
        if not self.key and self.operator != "Exists":
            raise ValueError("operator: must be Exists when key is empty")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("effect: must be NoExecute when tolerationSeconds is set")
        return self

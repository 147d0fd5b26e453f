"""Test helper: round-trip a manifest dict through the `kubernetes` package's typed models.

Deserializing into e.g. V1Job drops any field the model does not know, and serializing it back
gives the canonical form; equality therefore proves every field we set is a real field with
the right shape."""

from __future__ import annotations

from typing import Any

from kubernetes.client import ApiClient

MODELS = {
    ("batch/v1", "Job"): "V1Job",
    ("v1", "Service"): "V1Service",
    ("v1", "Secret"): "V1Secret",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
}


def roundtrip(obj: dict[str, Any]) -> dict[str, Any]:
    client = ApiClient()
    model = client._ApiClient__deserialize(obj, MODELS[(obj["apiVersion"], obj["kind"])])  # type: ignore[attr-defined]
    back: dict[str, Any] = client.sanitize_for_serialization(model)
    return back

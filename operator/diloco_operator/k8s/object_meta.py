"""The metadata every child of a run carries: the run's labels and its owner reference (so the
API server's garbage collector removes children with their run, and no finalizer is needed)."""

from __future__ import annotations

from typing import Any

from diloco_operator.api import API_VERSION, KIND, LABEL_COMPONENT, LABEL_RUN
from diloco_operator.k8s.run_ref import Run

MANAGED_BY = "diloco-operator"
# the components (app.kubernetes.io/component) of a run's pods
LEARNER, SYNCER = "learner", "syncer"


def labels(run: Run, component: str, **extra: str) -> dict[str, str]:
    base = {
        "app.kubernetes.io/name": "diloco",
        "app.kubernetes.io/instance": run.name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_COMPONENT: component,
        LABEL_RUN: run.name,
    }
    return {**base, **extra}


def owner_reference(run: Run) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": run.name,
        "uid": run.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_meta(run: Run, name: str, component: str, **extra: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": run.namespace,
        "labels": labels(run, component, **extra),
        "ownerReferences": [owner_reference(run)],
    }

"""The environment of a learner container: who it is in the run (its unit, group and attempt),
where the syncer is, how its group compresses pushes, and the TPU runtime's view of its slice's
hosts (docs/contracts.md lists every variable)."""

from __future__ import annotations

from typing import Any

from diloco_operator.k8s.run_ref import Run
from diloco_operator.planner import CreateUnit

COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
# Learners serve Prometheus metrics here (DILOCO_METRICS_PORT); the chart's monitors scrape the
# container port named "metrics". Pods log JSON for Cloud Logging (docs/gke.md, "Logs").
LEARNER_METRICS_PORT = 9100
LOG_FORMAT_ENV = {"name": "DILOCO_LOG_FORMAT", "value": "json"}


def _worker_hostnames(unit: CreateUnit) -> str:
    # Indexed Job pods are named <job>-<index>; with subdomain=<service> they resolve as below.
    return ",".join(f"{unit.name}-{i}.{unit.name}" for i in range(unit.hosts))


def _learner_observability_env() -> list[dict[str, str]]:
    return [
        {"name": "DILOCO_METRICS_PORT", "value": str(LEARNER_METRICS_PORT)},
        dict(LOG_FORMAT_ENV),
    ]


def _group_env(run: Run, group_name: str) -> list[dict[str, str]]:
    group = run.spec.group(group_name)
    own = group.learner_env() if group is not None else {}
    return [{"name": k, "value": v} for k, v in own.items()]


def learner_env(run: Run, unit: CreateUnit) -> list[dict[str, Any]]:
    return [
        {"name": "DILOCO_SYNCER_ADDR", "value": run.syncer_address},
        {"name": "DILOCO_UNIT", "value": str(unit.global_index)},
        {"name": "DILOCO_UNIT_NAME", "value": unit.name},
        {"name": "DILOCO_NUM_UNITS", "value": str(unit.num_units)},
        {"name": "DILOCO_ATTEMPT", "value": str(unit.attempt)},
        {"name": "DILOCO_GROUP", "value": unit.group},
        *_group_env(run, unit.group),
        *_learner_observability_env(),
        {
            "name": "TPU_WORKER_ID",
            "valueFrom": {
                "fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}
            },
        },
        {"name": "TPU_WORKER_HOSTNAMES", "value": _worker_hostnames(unit)},
    ]

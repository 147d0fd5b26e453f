"""A group's capacity and Kueue topology passthroughs: the node selectors of a reservation and of
flex-start VMs, the queued-provisioning run duration on the Job, the topology request on the pod
template, and the combinations the API refuses."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_operator.api import parse_spec
from diloco_operator.api.capacity import (
    FLEX_START_LABEL,
    MAX_RUN_DURATION_ANNOTATION,
    PREFERRED_TOPOLOGY_ANNOTATION,
    REQUIRED_TOPOLOGY_ANNOTATION,
    RESERVATION_AFFINITY_LABEL,
    RESERVATION_NAME_LABEL,
    RESERVATION_PROJECT_LABEL,
)
from diloco_operator.k8s import builders
from diloco_operator.planner import CreateUnit

TPU = {"accelerator": "tpu-v6e-slice", "topology": "2x4"}
BLOCK = "cloud.google.com/gce-topology-block"


def unit_job(run_labels: dict[str, str] | None = None, **group: Any) -> dict[str, Any]:
    spec = parse_spec(
        {
            "image": "trainer:1",
            "replicas": 1,
            "unitGroups": [{"name": "v6e", "tpu": TPU, **group}],
            "training": {"totalSteps": 1000},
        }
    )
    run = builders.Run("r", "ml", "uid", spec, labels=run_labels or {})
    return builders.unit_job(run, CreateUnit("r-v6e-0", "v6e", 0, 0, 0, 2, 2))


def selector(job: dict[str, Any]) -> dict[str, str]:
    found: dict[str, str] = job["spec"]["template"]["spec"]["nodeSelector"]
    return found


def test_a_reservation_selects_its_nodes_and_keeps_the_tpu_selectors() -> None:
    job = unit_job(capacity={"reservation": {"name": "v6e-res", "project": "shared-proj"}})
    wanted = {
        RESERVATION_NAME_LABEL: "v6e-res",
        RESERVATION_AFFINITY_LABEL: "specific",
        RESERVATION_PROJECT_LABEL: "shared-proj",
    }
    assert {key: selector(job).get(key) for key in wanted} == wanted
    assert selector(job)["cloud.google.com/gke-tpu-topology"] == "2x4"
    assert RESERVATION_PROJECT_LABEL not in selector(
        unit_job(capacity={"reservation": {"name": "v6e-res"}})
    )


def test_flex_start_selects_flex_start_nodes() -> None:
    job = unit_job(capacity={"flexStart": True})
    assert selector(job)[FLEX_START_LABEL] == "true"
    assert RESERVATION_NAME_LABEL not in selector(job)


def test_queued_provisioning_run_duration_is_a_job_annotation() -> None:
    job = unit_job({"kueue.x-k8s.io/queue-name": "tpu"}, capacity={"maxRunDurationSeconds": 7200})
    assert job["metadata"]["annotations"][MAX_RUN_DURATION_ANNOTATION] == "7200"
    assert job["spec"]["suspend"] is True  # queued: Kueue's admission check provisions first
    assert "annotations" not in unit_job()["metadata"]


@pytest.mark.parametrize(
    ("request_", "annotation"),
    [("required", REQUIRED_TOPOLOGY_ANNOTATION), ("preferred", PREFERRED_TOPOLOGY_ANNOTATION)],
)
def test_kueue_topology_is_a_pod_template_annotation(request_: str, annotation: str) -> None:
    job = unit_job({"kueue.x-k8s.io/queue-name": "tpu"}, kueueTopology={request_: BLOCK})
    assert job["spec"]["template"]["metadata"]["annotations"] == {annotation: BLOCK}


def test_template_annotations_merge_with_the_topology_request() -> None:
    job = unit_job(
        kueueTopology={"required": BLOCK},
        template={"metadata": {"annotations": {"team": "llm"}}},
    )
    assert job["spec"]["template"]["metadata"]["annotations"] == {
        REQUIRED_TOPOLOGY_ANNOTATION: BLOCK,
        "team": "llm",
    }


@pytest.mark.parametrize(
    ("group", "field"),
    [
        ({"capacity": {"reservation": {"name": "r"}, "flexStart": True}}, "capacity"),
        ({"spot": True, "capacity": {"flexStart": True}}, "spot"),
        ({"kueueTopology": {}}, "kueueTopology"),
        ({"capacity": {"maxRunDurationSeconds": 30}}, "maxRunDurationSeconds"),
        (
            {"capacity": {"flexStart": True}, "nodeSelector": {FLEX_START_LABEL: "false"}},
            "nodeSelector",
        ),
    ],
)
def test_contradictions_are_refused_naming_the_field(group: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        unit_job(**group)


def test_spot_with_only_a_run_duration_is_fine() -> None:
    job = unit_job(spot=True, capacity={"maxRunDurationSeconds": 3600})
    assert selector(job)["cloud.google.com/gke-spot"] == "true"

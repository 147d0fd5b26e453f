"""Paths the training reads against what the run's pods have (api/pod_paths.py): refused on
Kubernetes with the field and the path named, accepted by the local runtime."""

from __future__ import annotations

import re
from typing import Any

import pytest
from diloco_operator.api import parse_spec

MOUNTED = {
    "spec": {"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "tokens"}}]},
    "mainContainer": {"volumeMounts": [{"name": "data", "mountPath": "/data"}]},
}


def spec(
    data_path: str | None = None,
    init_from: str | None = None,
    group: dict[str, Any] | None = None,
    syncer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    training: dict[str, Any] = {"model": {"preset": "tiny"}, "totalSteps": 10}
    if data_path:
        training["data"] = {"source": "memmap", "path": data_path}
    if init_from:
        training["model"]["initFrom"] = init_from
    return {
        "image": "t",
        "replicas": 1,
        "unitGroups": [{"name": "cpu", **(group or {})}],
        "syncer": syncer or {},
        "training": training,
    }


@pytest.mark.parametrize(
    "doc",
    [
        spec("/data/tokens", group={"template": MOUNTED}, syncer={"template": MOUNTED}),
        spec("/data", group={"template": MOUNTED}, syncer={"template": MOUNTED}),
        spec("/home/diloco/tokens.bin"),  # baked into the image
        spec("gs://bucket/tokens"),
        spec(init_from="gs://bucket/weights.safetensors"),
        spec(init_from="/data/w.safetensors", syncer={"template": MOUNTED}),
    ],
)
def test_what_the_pods_have_is_accepted(doc: dict[str, Any]) -> None:
    parse_spec(doc, pods=True)


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        (
            spec("/data/tokens"),
            "training.data.path: /data/tokens: no volume of the unitGroups[0] learners",
        ),
        (
            spec("/data/tokens", group={"template": MOUNTED}),
            "/data/tokens: no volume of the syncer",
        ),
        (
            spec("/datasets/x", group={"template": MOUNTED}, syncer={"template": MOUNTED}),
            "/datasets",
        ),
        (spec("/database", group={"template": MOUNTED}, syncer={"template": MOUNTED}), "/database"),
        (spec("tokens.bin"), "training.data.path: tokens.bin is relative"),
        (spec(init_from="/w.safetensors", group={"template": MOUNTED}), "training.model.initFrom"),
    ],
)
def test_what_they_lack_is_refused_naming_field_and_path(
    doc: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(expected)):
        parse_spec(doc, pods=True)
    parse_spec(doc)  # the local runtime reads the machine's own files


def test_an_away_run_has_no_syncer_to_check() -> None:
    doc = spec("/data/tokens", group={"template": MOUNTED})
    doc["unitGroups"] = [{"name": "far", "template": MOUNTED}]
    doc["syncer"] = {
        "external": {
            "address": "https://syncer.home.example:8470",
            "ca": {"name": "home-ca", "key": "ca.crt"},
            "credential": {"name": "join", "key": "credential"},
        }
    }
    parse_spec(doc, pods=True)

"""The operator's own CRD upgrade (k8s/crd_upgrade.py): when it replaces the cluster's CRD, what
the replacement keeps, and the chart's narrow grant for it."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from diloco_operator.api import crdgen
from diloco_operator.k8s.crd_upgrade import Installed, upgraded, verdict, version_key
from diloco_operator.k8s.main import parse_args
from test_crd_chart import CHART, HELM
from test_hardening_chart import render

OURS = crdgen.crd()
VERSION = OURS["metadata"]["annotations"][crdgen.VERSION_ANNOTATION]
DIGEST = OURS["metadata"]["annotations"][crdgen.SCHEMA_ANNOTATION]


def test_versions_order_by_their_numbers() -> None:
    assert version_key("0.10.0") > version_key("0.9.7")
    assert version_key("v1.2") == (1, 2)
    assert version_key("0.2.0rc1") == version_key("0.2.0")
    assert version_key("dev") == ()


@pytest.mark.parametrize(
    ("installed", "expected"),
    [
        (Installed(VERSION, DIGEST), "current"),
        (Installed(None, DIGEST), "current"),  # same schema, whoever wrote it
        (Installed(None, None), "upgrade"),  # a CRD from before versions were recorded
        (Installed("0.1.0", "0123456789abcdef"), "upgrade"),
        (Installed(VERSION, "0123456789abcdef"), "upgrade"),  # ours is this version's schema
        (Installed("99.0.0", "0123456789abcdef"), "newer"),  # never downgrade
    ],
)
def test_verdict(installed: Installed, expected: str) -> None:
    assert verdict(installed, VERSION, DIGEST) == expected


def test_the_rendered_crd_carries_its_version_and_the_digest_of_its_spec() -> None:
    assert crdgen.schema_digest(OURS["spec"]) == DIGEST
    changed = {**OURS["spec"], "scope": "Cluster"}
    assert crdgen.schema_digest(changed) != DIGEST


def test_an_upgrade_keeps_the_objects_metadata_and_takes_our_spec() -> None:
    current: dict[str, Any] = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": "dilocoruns.diloco.dev",
            "resourceVersion": "4711",
            "labels": {"app.kubernetes.io/managed-by": "Helm"},
            "annotations": {"meta.helm.sh/release-name": "diloco"},
        },
        "spec": {"group": "diloco.dev", "versions": []},
        "status": {"storedVersions": ["v1alpha1"]},
    }
    body = upgraded(current, OURS)
    assert body["metadata"]["resourceVersion"] == "4711"  # the replace is conditional
    assert body["metadata"]["labels"] == current["metadata"]["labels"]
    assert body["metadata"]["annotations"] == {
        "meta.helm.sh/release-name": "diloco",
        crdgen.VERSION_ANNOTATION: VERSION,
        crdgen.SCHEMA_ANNOTATION: DIGEST,
    }
    assert body["spec"] == OURS["spec"]
    assert current["spec"] == {"group": "diloco.dev", "versions": []}  # not modified in place


def test_cli_manages_the_crd_only_when_asked() -> None:
    assert parse_args([]).manage_crd is False
    assert parse_args(["--manage-crd"]).manage_crd is True


def crd_rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    return [
        r
        for r in role["rules"]
        if "customresourcedefinitions" in r["resources"] and "update" in r["verbs"]
    ]


def operator_args(docs: list[dict[str, Any]]) -> list[str]:
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    args: list[str] = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


@pytest.mark.skipif(HELM is None, reason="helm neither on PATH nor built (make e2e-deps)")
def test_chart_grants_update_of_this_one_crd_and_only_when_managing_it() -> None:
    docs = render()
    assert crd_rules(docs) == [
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "resourceNames": [OURS["metadata"]["name"]],
            "verbs": ["get", "update"],
        }
    ]
    assert "--manage-crd" in operator_args(docs)
    off = render("--set", "crds.manage=false")
    assert crd_rules(off) == [] and "--manage-crd" not in operator_args(off)


@pytest.mark.skipif(HELM is None, reason="helm neither on PATH nor built (make e2e-deps)")
def test_values_schema_takes_a_boolean_crds_manage_and_names_anything_else() -> None:
    assert HELM is not None
    ok = subprocess.run(
        [HELM, "lint", str(CHART), "--set", "crds.manage=false"], capture_output=True
    )
    assert ok.returncode == 0, ok.stdout
    for bad in (["--set-string", "crds.manage=yes"], ["--set", "crds.upgrade=true"]):
        refused = subprocess.run([HELM, "lint", str(CHART), *bad], capture_output=True, text=True)
        assert refused.returncode != 0
        assert "crds" in refused.stdout + refused.stderr

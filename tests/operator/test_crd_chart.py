"""The Helm chart: values validate against values.schema.json, and the RBAC it grants is exactly
what the operator's code calls (least privilege). With a `helm` binary on PATH (the e2e
toolchain builds one) the chart is also linted and rendered."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "diloco-operator"
OPERATOR = Path(__file__).resolve().parents[2] / "operator" / "diloco_operator"

# (apiGroup, resource, verb) the operator needs inside a managed namespace, and why.
NEEDED = {
    ("diloco.dev", "dilocoruns", "get"),  # kopf
    ("diloco.dev", "dilocoruns", "list"),
    ("diloco.dev", "dilocoruns", "watch"),
    ("diloco.dev", "dilocoruns", "patch"),  # kopf annotations + finalizer
    ("diloco.dev", "dilocoruns/status", "get"),
    ("diloco.dev", "dilocoruns/status", "patch"),  # kube.patch_status
    ("batch", "jobs", "get"),  # kube.create: is an existing object the run's own?
    ("batch", "jobs", "list"),
    ("batch", "jobs", "watch"),
    ("batch", "jobs", "create"),
    ("batch", "jobs", "delete"),
    ("batch", "jobs", "patch"),  # kube.suspend_job (spec.suspend)
    ("", "pods", "list"),
    ("", "pods", "watch"),
    ("", "services", "get"),
    ("", "services", "create"),
    ("", "services", "delete"),
    ("apps", "deployments", "get"),
    ("apps", "deployments", "list"),
    ("apps", "deployments", "watch"),
    ("apps", "deployments", "create"),
    ("apps", "deployments/scale", "patch"),  # kube.scale_deployment (syncer at 0 while suspended)
    ("kueue.x-k8s.io", "localqueues", "get"),  # kube.local_queue (condition QueueFound)
    ("", "secrets", "get"),  # kube.read_token
    ("", "secrets", "create"),
    ("", "configmaps", "get"),
    ("", "configmaps", "create"),
    ("", "persistentvolumeclaims", "get"),
    ("", "persistentvolumeclaims", "create"),
    # Only with networkPolicy.enabled (the per-run NetworkPolicy).
    ("networking.k8s.io", "networkpolicies", "get"),
    ("networking.k8s.io", "networkpolicies", "create"),
    ("", "events", "create"),
    ("events.k8s.io", "events", "create"),
}


def values(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CHART / name).read_text())
    return loaded


def merged(*names: str) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        for k, v in b.items():
            a[k] = (
                merge(dict(a.get(k) or {}), v)
                if isinstance(v, dict) and isinstance(a.get(k), dict)
                else v
            )
        return a

    for name in names:
        out = merge(out, values(name))
    return out


def test_values_files_match_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(values("values.yaml"), schema)
    jsonschema.validate(merged("values.yaml", "values-gke-tpu.yaml"), schema)
    bad = {**values("values.yaml"), "watchNamespaces": ["Not_A_Namespace"]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def namespaced_rules() -> list[dict[str, Any]]:
    text = (CHART / "templates" / "_helpers.tpl").read_text()
    block = text.split('define "diloco-operator.namespacedRules"', 1)[1]
    block = block.split("{{- if .Values.ha.enabled }}", 1)[0]
    lines = [line for line in block.splitlines()[1:] if "{{" not in line]
    rules: list[dict[str, Any]] = yaml.safe_load("\n".join(lines))
    return rules


def test_rbac_is_exactly_what_the_code_uses() -> None:
    granted = {
        (group, resource, verb)
        for rule in namespaced_rules()
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == NEEDED
    # No wildcard anywhere in the chart's RBAC.
    assert '"*"' not in (CHART / "templates" / "rbac.yaml").read_text()


def test_every_kind_the_operator_creates_is_granted() -> None:
    kube_py = (OPERATOR / "k8s" / "kube.py").read_text()
    created = set(re.findall(r'"(\w+)": [\w()]+\.create_namespaced_', kube_py))
    plural = {
        "Service": "services",
        "Secret": "secrets",
        "ConfigMap": "configmaps",
        "PersistentVolumeClaim": "persistentvolumeclaims",
        "Deployment": "deployments",
        "Job": "jobs",
        "NetworkPolicy": "networkpolicies",
    }
    assert created == set(plural)
    creatable = {r for (_, r, v) in NEEDED if v == "create"}
    assert {plural[k] for k in created} <= creatable
    # A create that meets an existing object reads it (kube.ours): every created kind is gettable.
    readable = {r for (_, r, v) in NEEDED if v == "get"}
    read = set(re.findall(r'"(\w+)": [\w()]+\.read_namespaced_', kube_py))
    assert read == created and {plural[k] for k in read} <= readable


def _helm() -> str | None:
    """helm on PATH, else the one `make e2e-deps` built (version pinned in e2e/cluster/versions.env)."""
    if found := shutil.which("helm"):
        return found
    versions = (ROOT / "e2e" / "cluster" / "versions.env").read_text()
    match = re.search(r"^HELM_VERSION=(\S+)", versions, re.MULTILINE)
    if not match:
        return None
    built = Path.home() / ".cache" / "diloco-e2e" / f"helm-{match.group(1)}" / "bin" / "helm"
    return str(built) if built.exists() else None


HELM = _helm()


@pytest.mark.skipif(HELM is None, reason="helm neither on PATH nor built (make e2e-deps)")
@pytest.mark.parametrize(
    "extra", [[], ["-f", str(CHART / "values-gke-tpu.yaml")], ["--set", "watchNamespaces={a,b}"]]
)
def test_helm_lint_and_template(extra: list[str]) -> None:
    assert HELM is not None
    subprocess.run([HELM, "lint", str(CHART), *extra], check=True, capture_output=True)
    out = subprocess.run(
        [HELM, "template", "t", str(CHART), "--include-crds", *extra],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    kinds = [d["kind"] for d in yaml.safe_load_all(out) if d]
    assert "Deployment" in kinds and "CustomResourceDefinition" in kinds and "ClusterRole" in kinds

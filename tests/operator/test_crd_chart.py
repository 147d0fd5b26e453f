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
    ("policy", "poddisruptionbudgets", "get"),  # the syncer's budget (builders.run_objects)
    ("policy", "poddisruptionbudgets", "create"),
    # A syncer behind a Gateway API route (syncer.expose.gateway).
    ("gateway.networking.k8s.io", "tlsroutes", "get"),
    ("gateway.networking.k8s.io", "tlsroutes", "create"),
    ("gateway.networking.k8s.io", "httproutes", "get"),
    ("gateway.networking.k8s.io", "httproutes", "create"),
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


# `.Values.<key>` and `$.Values.<key>` in any template or helper: the top-level keys it reads.
VALUES_READ = re.compile(r"\.Values\.([A-Za-z_][A-Za-z0-9_]*)")


def keys_the_templates_read() -> set[str]:
    return {
        key
        for path in (CHART / "templates").iterdir()
        for key in VALUES_READ.findall(path.read_text())
    }


def test_every_value_the_templates_read_is_allowed_by_the_schema() -> None:
    # The schema refuses unknown top-level keys (additionalProperties: false): a key a template
    # reads but the schema lacks can never be set (helm install --set nameOverride=x failed).
    schema = json.loads((CHART / "values.schema.json").read_text())
    read = keys_the_templates_read()
    assert {"image", "nameOverride", "fullnameOverride"} <= read
    assert sorted(read - set(schema["properties"])) == []
    # ... and nothing in the schema is dead: every key it allows is read somewhere.
    assert sorted(set(schema["properties"]) - read) == []


@pytest.mark.parametrize("key", ["nameOverride", "fullnameOverride"])
def test_name_overrides_are_dns_labels(key: str) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    for good in ("", "x", "my-operator", "a" * 63):
        jsonschema.validate({**values("values.yaml"), key: good}, schema)
    for bad in ("Not_A_Label", "-x", "x-", "a" * 64, 5):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**values("values.yaml"), key: bad}, schema)


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


def built_children() -> list[dict[str, Any]]:
    """Every child the operator builds for a run with an operator-made checkpoint claim and the
    network policy, and for one of its units."""
    from diloco_operator.api import parse_spec
    from diloco_operator.k8s import builders
    from diloco_operator.k8s.netpolicy import OperatorIdentity, run_objects_with_policy
    from diloco_operator.planner import CreateUnit

    run = builders.Run("r", "ns", "uid", parse_spec({"image": "t", "training": {"totalSteps": 5}}))
    unit = CreateUnit("r-default-0", "default", 0, 0, 0, 1, 1)
    routed = [
        builders.Run(
            "r",
            "ns",
            "uid",
            parse_spec(
                {
                    "image": "t",
                    "training": {"totalSteps": 5},
                    "syncer": {
                        "tls": {},
                        "expose": {
                            "type": "Gateway",
                            "gateway": {
                                "parentRef": {"name": "gw"},
                                "hostname": "syncer.example.internal",
                                "kind": kind,
                            },
                        },
                    },
                }
            ),
        )
        for kind in ("TLSRoute", "HTTPRoute")
    ]
    return [
        *run_objects_with_policy(run, OperatorIdentity("ops")),
        *builders.unit_objects(run, unit, "run-secret"),
        *(o for r in routed for o in builders.run_objects(r)),
    ]


def test_every_kind_the_operator_creates_is_granted() -> None:
    from diloco_operator.k8s import kube

    kube_py = (OPERATOR / "k8s" / "kube.py").read_text()
    # The typed clients' kinds, and the custom resources' (created through one generic call).
    created = set(re.findall(r'"(\w+)": [\w()]+\.create_namespaced_', kube_py))
    created |= set(kube.CUSTOM_KINDS)
    plural = {
        **{kind: plural for kind, (_, plural) in kube.CUSTOM_KINDS.items()},
        "Service": "services",
        "Secret": "secrets",
        "ConfigMap": "configmaps",
        "PersistentVolumeClaim": "persistentvolumeclaims",
        "Deployment": "deployments",
        "Job": "jobs",
        "NetworkPolicy": "networkpolicies",
        "PodDisruptionBudget": "poddisruptionbudgets",
    }
    assert created == set(plural)
    # ... and every kind the builders make for a run is one kube.create can create.
    built = {o["kind"] for o in built_children()}
    assert sorted(built - created) == []
    creatable = {r for (_, r, v) in NEEDED if v == "create"}
    assert {plural[k] for k in created} <= creatable
    # A create that meets an existing object reads it (kube.ours): every created kind is gettable.
    readable = {r for (_, r, v) in NEEDED if v == "get"}
    read = set(re.findall(r'"(\w+)": [\w()]+\.read_namespaced_', kube_py))
    read |= set(kube.CUSTOM_KINDS)
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


@pytest.mark.skipif(HELM is None, reason="helm neither on PATH nor built (make e2e-deps)")
def test_helm_accepts_the_name_overrides() -> None:
    assert HELM is not None

    def names(*extra: str) -> tuple[set[str], set[str]]:
        subprocess.run([HELM, "lint", str(CHART), *extra], check=True, capture_output=True)
        out = subprocess.run(
            [HELM, "template", "t", str(CHART), *extra],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        docs = [d for d in yaml.safe_load_all(out) if d]
        deployment = next(d for d in docs if d["kind"] == "Deployment")
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        return {deployment["metadata"]["name"]}, {labels["app.kubernetes.io/name"]}

    assert names() == ({"t-diloco-operator"}, {"diloco-operator"})
    assert names("--set", "nameOverride=x") == ({"t-x"}, {"x"})
    assert names("--set", "fullnameOverride=op") == ({"op"}, {"diloco-operator"})
    refused = subprocess.run(
        [HELM, "lint", str(CHART), "--set", "nameOverride=Not_A_Label"], capture_output=True
    )
    assert refused.returncode != 0

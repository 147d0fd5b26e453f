"""The chart's ValidatingAdmissionPolicy on DilocoRun pod templates: what a run's templates
reference is checked against the rights of the user who writes the run (the API server's own
authorizer, no webhook). Rendered with helm; evaluated by vapcheck, which runs kube-apiserver's
own ValidatingAdmissionPolicy code with a table of grants in place of RBAC. The real API server
with real RBAC: e2e/tests/test_11_pod_template_policy.py."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_operator.api import crdgen
from diloco_operator.api.field_paths import cel_joined
from diloco_operator.api.pod_security import SECRET_REFERENCES
from test_crd_chart import CHART, HELM
from test_pod_security_templates import place

VAPCHECK = Path.home() / ".cache" / "diloco-e2e" / "bin" / "vapcheck"
needs_helm = pytest.mark.skipif(HELM is None, reason="helm neither on PATH nor built")
needs_vapcheck = pytest.mark.skipif(
    HELM is None or not VAPCHECK.exists(), reason="helm or vapcheck not built (crds/validate)"
)
NS = "team-a"
USER = "alice"
GROUP = {"name": "v6e", "tpu": {"accelerator": "tpu-v6e-slice", "topology": "2x4"}}


def test_chart_helpers_are_generated_from_the_models() -> None:
    path = CHART / "templates" / crdgen.HELPERS_FILE
    assert path.read_text() == crdgen.render_chart_helpers(), f"{path} is stale: make crds"


def test_crdgen_writes_the_chart_helpers(tmp_path: Path) -> None:
    args = ["--out", str(tmp_path / "a"), "--chart", "", "--chart-templates", str(tmp_path)]
    assert crdgen.main(args) == 0
    assert (tmp_path / crdgen.HELPERS_FILE).read_text() == crdgen.render_chart_helpers()


def render(*extra: str, namespace: str = "ops") -> list[dict[str, Any]]:
    assert HELM is not None
    out = subprocess.run(
        [HELM, "template", "t", str(CHART), "--namespace", namespace, *extra],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def policy_and_binding(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    (policy,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    (binding,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    return policy, binding


def expressions(policy: dict[str, Any]) -> str:
    spec = policy["spec"]
    parts = [v["expression"] for v in spec["variables"] + spec["validations"]]
    return "\n".join(parts)


@needs_helm
def test_policy_is_on_by_default_fails_closed_and_binds_the_managed_namespaces() -> None:
    policy, binding = policy_and_binding(render())
    assert policy["spec"]["failurePolicy"] == "Fail"
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == ["diloco.dev"] and rule["resources"] == ["dilocoruns"]
    assert sorted(rule["operations"]) == ["CREATE", "UPDATE"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    (selector,) = binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]
    assert selector["key"] == "kubernetes.io/metadata.name" and selector["values"] == ["ops"]
    _, watched = policy_and_binding(render("--set", "watchNamespaces={a,b}"))
    values = watched["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0]
    assert values["values"] == ["a", "b"]
    _, everywhere = policy_and_binding(render("--set", "clusterWide=true"))
    assert "matchResources" not in everywhere["spec"]


@needs_helm
def test_turning_the_policy_off_is_an_explicit_value() -> None:
    kinds = {d["kind"] for d in render("--set", "podTemplates.admissionPolicy.enabled=false")}
    assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


@needs_helm
def test_a_cluster_without_validating_admission_policies_is_told_so() -> None:
    assert HELM is not None
    # What discovery of a cluster without the v1 API says (helm install, or --validate).
    discovered = ["--api-versions", "v1/Pod", "--api-versions", "admissionregistration.k8s.io/v1"]
    old = subprocess.run(
        [HELM, "template", "t", str(CHART), *discovered], capture_output=True, text=True
    )
    assert old.returncode != 0 and "needs Kubernetes 1.30+" in old.stderr, old.stderr
    off = ["--set", "podTemplates.admissionPolicy.enabled=false"]
    subprocess.run([HELM, "template", "t", str(CHART), *discovered, *off], check=True)
    served = [
        *discovered,
        "--api-versions",
        "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy",
    ]
    assert policy_and_binding(render(*served))


@needs_helm
def test_every_secret_reference_of_the_models_is_checked() -> None:
    text = expressions(policy_and_binding(render())[0])
    for path in SECRET_REFERENCES:
        assert cel_joined("t", path) in text, path


@needs_helm
def test_allow_lists_and_the_privileged_opt_in_reach_the_expressions() -> None:
    docs = render(
        "--set",
        "podTemplates.allowPrivileged=true",
        "--set",
        "podTemplates.privilegedNamespaces={gpu-lab}",
        "--set",
        "podTemplates.serviceAccounts={runner}",
        "--set",
        "podTemplates.priorityClasses={batch-low}",
        "--set",
        "podTemplates.secrets={registry-pull}",
    )
    text = expressions(policy_and_binding(docs)[0])
    for listed in ('["gpu-lab"]', '["runner"]', '["batch-low"]', '["registry-pull"]'):
        assert listed in text, listed
    assert "|| true\n" in text or "|| true " in text


@needs_helm
def test_authorization_checks_fit_the_policys_cel_budget() -> None:
    """An authorizer check() costs 350000 of the 1000000 of one expression and of the
    10000000 of one policy evaluation: at most one per expression, and fewer than 28 in all."""
    policy, _ = policy_and_binding(render())
    per_validation = [v["expression"].count(".check(") for v in policy["spec"]["validations"]]
    assert max(per_validation) == 1 and sum(per_validation) <= 20, per_validation
    assert not any(".check(" in v["expression"] for v in policy["spec"]["variables"])


# --- evaluated by kube-apiserver's own code ------------------------------------------------------


def run(name: str = "r", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DilocoRun",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"image": "t:1", "unitGroups": [GROUP], "training": {"totalSteps": 9}, **spec},
    }


def with_template(template: dict[str, Any], where: str = "group", **spec: Any) -> dict[str, Any]:
    doc = run(**spec)
    if where == "group":
        doc["spec"]["unitGroups"] = [{**GROUP, "template": copy.deepcopy(template)}]
    else:
        doc["spec"]["syncer"] = {"template": copy.deepcopy(template)}
    return doc


def mounts(secret: str) -> dict[str, Any]:
    return {"spec": {"volumes": [{"name": "data", "secret": {"secretName": secret}}]}}


def grant(verb: str, resource: str, name: str = "", group: str = "", **kw: str) -> dict[str, str]:
    return {"verb": verb, "group": group, "resource": resource, "name": name, "namespace": NS, **kw}


def case(
    name: str,
    obj: dict[str, Any],
    grants: list[dict[str, str]] | None = None,
    old: dict[str, Any] | None = None,
    user: str = USER,
) -> dict[str, Any]:
    return {
        "name": name,
        "operation": "UPDATE" if old else "CREATE",
        "namespace": NS,
        "user": user,
        "object": obj,
        "oldObject": old,
        "grants": grants or [],
    }


def evaluate(tmp_path: Path, cases: list[dict[str, Any]], *values: str) -> dict[str, str]:
    policy, _ = policy_and_binding(render(*values))
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = subprocess.run(
        [str(VAPCHECK), str(tmp_path / "policy.yaml"), str(tmp_path / "cases.json")],
        capture_output=True,
        text=True,
    )
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and lines[0] == "COMPILED 1.30", out.stdout + out.stderr
    verdicts = {line.split(" ", 2)[1]: line for line in lines[1:]}
    assert set(verdicts) == {c["name"] for c in cases}
    return verdicts


def admitted(verdicts: dict[str, str], name: str) -> bool:
    return verdicts[name].startswith("ADMIT ")


@needs_vapcheck
def test_a_secret_the_user_may_not_read_is_refused_naming_it(tmp_path: Path) -> None:
    read = [grant("get", "secrets", "data")]
    cases = [
        case("no-template", run()),
        case("mount", with_template(mounts("data"))),
        case("mount-syncer", with_template(mounts("data"), "syncer")),
        case("mount-granted", with_template(mounts("data")), read),
        case("granted-elsewhere", with_template(mounts("data")), [{**read[0], "namespace": "b"}]),
        case("other-secret-granted", with_template(mounts("data")), [grant("get", "secrets", "x")]),
        case("any-secret-granted", with_template(mounts("data")), [grant("get", "secrets")]),
        case("allow-listed", with_template(mounts("registry-pull"))),
    ]
    verdicts = evaluate(tmp_path, cases, "--set", "podTemplates.secrets={registry-pull}")
    for name in ("no-template", "mount-granted", "any-secret-granted", "allow-listed"):
        assert admitted(verdicts, name), verdicts[name]
    for name in ("mount", "mount-syncer", "granted-elsewhere", "other-secret-granted"):
        line = verdicts[name]
        assert line.startswith("DENY") and "names Secret data, which user alice may not get" in line
        assert f"in namespace {NS}" in line, line


@needs_vapcheck
def test_every_kind_of_secret_reference_is_checked(tmp_path: Path) -> None:
    cases = [
        case(f"{i}-{where}", with_template(place(path, f"s{i}"), where))
        for i, path in enumerate(SECRET_REFERENCES)
        for where in ("group", "syncer")
    ]
    verdicts = evaluate(tmp_path, cases)
    for i, path in enumerate(SECRET_REFERENCES):
        for where in ("group", "syncer"):
            line = verdicts[f"{i}-{where}"]
            assert line.startswith("DENY") and f"names Secret s{i}," in line, (path, line)


@needs_vapcheck
def test_service_accounts_and_priority_classes_need_use(tmp_path: Path) -> None:
    high = {"spec": {"priorityClassName": "high"}}
    use_high = grant("use", "priorityclasses", "high", group="scheduling.k8s.io", namespace="")
    cases = [
        case("sa", run(serviceAccountName="runner")),
        case(
            "sa-granted",
            run(serviceAccountName="runner"),
            [grant("use", "serviceaccounts", "runner")],
        ),
        case("sa-allow-listed", run(serviceAccountName="shared")),
        case("pc", with_template(high)),
        case("pc-syncer", with_template(high, "syncer")),
        case("pc-granted", with_template(high), [use_high]),
        case("pc-allow-listed", with_template({"spec": {"priorityClassName": "batch-low"}})),
    ]
    values = ["--set", "podTemplates.serviceAccounts={shared}"]
    values += ["--set", "podTemplates.priorityClasses={batch-low}"]
    verdicts = evaluate(tmp_path, cases, *values)
    for name in ("sa-granted", "sa-allow-listed", "pc-granted", "pc-allow-listed"):
        assert admitted(verdicts, name), verdicts[name]
    assert "spec.serviceAccountName: user alice may not use ServiceAccount runner" in verdicts["sa"]
    for name in ("pc", "pc-syncer"):
        assert "names PriorityClass high, which user alice may not use" in verdicts[name]


@needs_vapcheck
def test_privileged_templates_are_the_cluster_admins_decision(tmp_path: Path) -> None:
    template = {"podSecurity": "privileged", "spec": {"hostNetwork": True}}
    use = grant("use", "dilocoruns", group="diloco.dev", subresource="privileged")
    cases = [
        case("author", with_template(template)),
        case("syncer", with_template(template, "syncer")),
        case("granted", with_template(template), [use]),
        case("granted-elsewhere", with_template(template), [{**use, "namespace": "b"}]),
        case("baseline", with_template({"podSecurity": "baseline"})),
    ]
    verdicts = evaluate(tmp_path, cases)
    assert admitted(verdicts, "granted") and admitted(verdicts, "baseline")
    for name in ("author", "syncer", "granted-elsewhere"):
        assert "sets podSecurity: privileged" in verdicts[name], verdicts[name]
        assert "user alice may not in namespace team-a" in verdicts[name], verdicts[name]
    for values in (
        ["--set", f"podTemplates.privilegedNamespaces={{{NS}}}"],
        ["--set", "podTemplates.allowPrivileged=true"],
    ):
        opted_in = evaluate(tmp_path, cases[:2], *values)
        assert all(v.startswith("ADMIT") for v in opted_in.values()), opted_in


@needs_vapcheck
def test_updates_check_what_they_change(tmp_path: Path) -> None:
    """kopf's writes (finalizer, annotations) and changes beside the templates pass; a changed
    template is checked whole, so no one adds a sidecar to pods that hold a Secret they may not
    read."""
    old = with_template(mounts("data"), serviceAccountName="runner")
    annotated = copy.deepcopy(old)
    annotated["metadata"]["annotations"] = {"kopf.zalando.org/last-handled": "x"}
    suspended = copy.deepcopy(old)
    suspended["spec"]["suspend"] = True
    sidecar = copy.deepcopy(old)
    sidecar["spec"]["unitGroups"][0]["template"]["spec"]["containers"] = [
        {"name": "cat", "image": "busybox:1", "volumeMounts": [{"name": "data", "mountPath": "/d"}]}
    ]
    operator = "system:serviceaccount:diloco-system:diloco-operator"
    cases = [
        case("kopf", annotated, old=old, user=operator),
        case("suspend", suspended, old=old),
        case("sidecar", sidecar, old=old),
        case(
            "sidecar-granted",
            sidecar,
            [grant("get", "secrets", "data"), grant("use", "serviceaccounts", "runner")],
            old=old,
        ),
    ]
    verdicts = evaluate(tmp_path, cases)
    for name in ("kopf", "suspend", "sidecar-granted"):
        assert admitted(verdicts, name), verdicts[name]
    assert "names Secret data" in verdicts["sidecar"], verdicts["sidecar"]
    # The pods' ServiceAccount is checked again too: a sidecar may mount its token.
    assert "may not use ServiceAccount runner" in verdicts["sidecar"], verdicts["sidecar"]


@needs_vapcheck
def test_distinct_secrets_are_checked_once_and_too_many_are_refused(tmp_path: Path) -> None:
    shared = {"spec": {"imagePullSecrets": [{"name": "pull"}]}}
    groups = [{"name": f"g{i}", "replicas": 1, "template": shared} for i in range(1, 16)]
    many = run(unitGroups=[{**GROUP, "template": shared}, *groups], syncer={"template": shared})
    thirteen = {"spec": {"imagePullSecrets": [{"name": f"s{i}"} for i in range(8)]}}
    thirteen["spec"]["volumes"] = [
        {"name": f"v{i}", "secret": {"secretName": f"s{i}"}} for i in range(8, 13)
    ]
    cases = [
        case("one-secret-in-17-templates", many, [grant("get", "secrets", "pull")]),
        case("thirteen", with_template(thirteen), [grant("get", "secrets")]),
    ]
    verdicts = evaluate(tmp_path, cases)
    assert admitted(verdicts, "one-secret-in-17-templates"), verdicts
    assert "adds 13 Secrets to the pod templates, more than the 12" in verdicts["thirteen"]

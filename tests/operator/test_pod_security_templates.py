"""What a pod template may add to the operator's pods, for everyone: nothing beyond the Pod
Security "baseline" level unless the template says podSecurity: privileged, no mount or
reference of the run's own token Secrets, no system-* priority class. The pydantic models (the
operator, the local runtime) and the CRD (the API server's own validation code, crdcheck) refuse
the same templates, each naming the field. Who may set podSecurity: privileged, and which
Secrets, ServiceAccounts and priority classes a user may reach, is the chart's admission policy
(test_pod_template_policy.py)."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import ROOT, openapi_schema
from diloco_operator.api import parse_manifest, parse_spec
from diloco_operator.api.field_paths import values_at
from diloco_operator.api.pod_baseline import BASELINE_CHECKS
from diloco_operator.api.pod_security import SECRET_REFERENCES
from diloco_operator.api.pod_template import PodTemplate, apply_template

CRDCHECK = Path.home() / ".cache" / "diloco-e2e" / "bin" / "crdcheck"
needs_crdcheck = pytest.mark.skipif(
    not CRDCHECK.exists(), reason="crdcheck not built (crds/validate/build.sh)"
)
RUN = "t"
GROUP = {"name": "v6e", "tpu": {"accelerator": "tpu-v6e-slice", "topology": "2x4"}}
BASE = {"image": "trainer:1", "replicas": 2, "unitGroups": [GROUP], "training": {"totalSteps": 9}}


def sidecar(**fields: Any) -> dict[str, Any]:
    return {"name": "side", "image": "busybox:1", **fields}


def in_sidecar(security: dict[str, Any], where: str = "containers") -> dict[str, Any]:
    return {"spec": {where: [sidecar(securityContext=security)]}}


def pod_security(context: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"securityContext": context}}


# (template, the field pydantic names, the field the CRD's rule names where it is not pydantic's
# with [] for list indices): one per feature class the baseline level refuses.
BASELINE_CASES = [
    (in_sidecar({"privileged": True}), "spec.containers[0].securityContext.privileged", None),
    (
        in_sidecar({"privileged": True}, "initContainers"),
        "spec.initContainers[0].securityContext.privileged",
        None,
    ),
    (
        in_sidecar({"capabilities": {"add": ["CHOWN", "SYS_ADMIN"]}}),
        "spec.containers[0].securityContext.capabilities.add[1]",
        "spec.containers[].securityContext.capabilities.add",
    ),
    (
        {"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}},
        "spec.volumes[0].hostPath",
        "spec.volumes[].hostPath",
    ),
    (
        {"spec": {"containers": [sidecar(ports=[{"containerPort": 22, "hostPort": 22}])]}},
        "spec.containers[0].ports[0].hostPort",
        "spec.containers[].ports[].hostPort",
    ),
    ({"spec": {"hostNetwork": True}}, "spec.hostNetwork", None),
    ({"spec": {"hostPID": True}}, "spec.hostPID", None),
    ({"spec": {"hostIPC": True}}, "spec.hostIPC", None),
    (
        pod_security({"seccompProfile": {"type": "Unconfined"}}),
        "spec.securityContext.seccompProfile.type",
        None,
    ),
    (
        in_sidecar({"seccompProfile": {"type": "Unconfined"}}),
        "spec.containers[0].securityContext.seccompProfile.type",
        "spec.containers[].securityContext.seccompProfile.type",
    ),
    (
        pod_security({"appArmorProfile": {"type": "Unconfined"}}),
        "spec.securityContext.appArmorProfile.type",
        None,
    ),
    (
        {
            "metadata": {
                "annotations": {"container.apparmor.security.beta.kubernetes.io/side": "unconfined"}
            }
        },
        "metadata.annotations[container.apparmor.security.beta.kubernetes.io/side]",
        "metadata.annotations",
    ),
    (
        pod_security({"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}),
        "spec.securityContext.sysctls[0].name",
        "spec.securityContext.sysctls[].name",
    ),
    (
        in_sidecar({"procMount": "Unmasked"}),
        "spec.containers[0].securityContext.procMount",
        "spec.containers[].securityContext.procMount",
    ),
    (
        pod_security({"seLinuxOptions": {"type": "spc_t"}}),
        "spec.securityContext.seLinuxOptions.type",
        None,
    ),
    (
        in_sidecar({"seLinuxOptions": {"user": "system_u"}}, "initContainers"),
        "spec.initContainers[0].securityContext.seLinuxOptions.user",
        "spec.initContainers[].securityContext.seLinuxOptions.user",
    ),
    (
        pod_security({"seLinuxOptions": {"role": "sysadm_r"}}),
        "spec.securityContext.seLinuxOptions.role",
        None,
    ),
    (
        pod_security({"windowsOptions": {"hostProcess": True}}),
        "spec.securityContext.windowsOptions.hostProcess",
        None,
    ),
    (
        {
            "spec": {
                "containers": [sidecar(livenessProbe={"httpGet": {"host": "10.0.0.1", "port": 80}})]
            }
        },
        "spec.containers[0].livenessProbe.httpGet.host",
        "spec.containers[].<probe or lifecycle handler>.httpGet|tcpSocket.host",
    ),
    (
        {
            "spec": {
                "initContainers": [
                    sidecar(lifecycle={"preStop": {"tcpSocket": {"host": "metadata", "port": 80}}})
                ]
            }
        },
        "spec.initContainers[0].lifecycle.preStop.tcpSocket.host",
        "spec.initContainers[].<probe or lifecycle handler>.httpGet|tcpSocket.host",
    ),
]
BASELINE_IDS = [case[1] for case in BASELINE_CASES]


def crd_field(field: str, explicit: str | None) -> str:
    return explicit or re.sub(r"\[\d+\]", "[]", field)


CRD_FIELDS = [crd_field(field, crd) for _, field, crd in BASELINE_CASES]

# What the baseline level allows, beside each refused value above.
BASELINE_ALLOWED = {
    "metadata": {
        "annotations": {"container.apparmor.security.beta.kubernetes.io/side": "runtime/default"}
    },
    "spec": {
        "hostNetwork": False,
        "containers": [
            sidecar(
                securityContext={
                    "privileged": False,
                    "capabilities": {"add": ["CHOWN", "NET_BIND_SERVICE"], "drop": ["ALL"]},
                    "procMount": "Default",
                    "seccompProfile": {"type": "Localhost", "localhostProfile": "p.json"},
                    "seLinuxOptions": {"type": "container_t", "level": "s0:c1,c2"},
                    # Root is not a baseline matter (the restricted level's): a namespace that
                    # enforces restricted refuses such pods when the operator creates them.
                    "runAsUser": 0,
                },
                ports=[{"containerPort": 8080, "hostPort": 0}],
                readinessProbe={"httpGet": {"path": "/", "port": 8080}},
            )
        ],
        "securityContext": {
            "sysctls": [{"name": "net.ipv4.tcp_syncookies", "value": "1"}],
            "appArmorProfile": {"type": "RuntimeDefault"},
            "windowsOptions": {"hostProcess": False},
        },
    },
}


def manifest(template: dict[str, Any], where: str = "group") -> dict[str, Any]:
    spec = copy.deepcopy(BASE)
    if where == "group":
        spec["unitGroups"][0]["template"] = copy.deepcopy(template)
    else:
        spec["syncer"] = {"template": copy.deepcopy(template)}
    return {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DilocoRun",
        "metadata": {"name": RUN},
        "spec": spec,
    }


def privileged(template: dict[str, Any]) -> dict[str, Any]:
    return {**copy.deepcopy(template), "podSecurity": "privileged"}


def crdcheck(docs: list[dict[str, Any]], tmp_path: Path) -> list[str]:
    """The API server's verdict on each manifest: 'ACCEPT ...' or 'REJECT ... :: errors'."""
    paths = []
    for i, doc in enumerate(docs):
        path = tmp_path / f"{i:03d}.yaml"
        path.write_text(yaml.safe_dump(doc))
        paths.append(str(path))
    out = subprocess.run(
        [str(CRDCHECK), str(ROOT / "crds" / "diloco.dev_dilocoruns.yaml"), *paths],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert out[0] == "CRD OK", out[0]
    verdicts = {line.split(" ", 2)[1]: line for line in out[1:]}
    return [verdicts[p] for p in paths]


@pytest.mark.parametrize(("template", "field", "crd_field"), BASELINE_CASES, ids=BASELINE_IDS)
def test_pydantic_refuses_beyond_baseline_naming_the_field(
    template: dict[str, Any], field: str, crd_field: str | None
) -> None:
    for where, prefix in (
        ("group", "spec.unitGroups.0.template"),
        ("syncer", "spec.syncer.template"),
    ):
        with pytest.raises(ValueError) as info:
            parse_manifest(manifest(template, where))
        message = str(info.value)
        assert f"{prefix}: " in message and f"{field}: " in message, message
        assert "baseline Pod Security level" in message, message


@pytest.mark.parametrize(("template", "field", "crd_field"), BASELINE_CASES, ids=BASELINE_IDS)
def test_privileged_level_lifts_the_baseline_checks_in_pydantic(
    template: dict[str, Any], field: str, crd_field: str | None
) -> None:
    for where in ("group", "syncer"):
        parse_manifest(manifest(privileged(template), where))


# A value the baseline level refuses, by the name of the field that holds it.
BAD_VALUES: dict[str, Any] = {
    "hostNetwork": True,
    "hostPID": True,
    "hostIPC": True,
    "hostPath": {"path": "/etc"},
    "hostProcess": True,
    "privileged": True,
    "add": "NET_ADMIN",
    "hostPort": 8080,
    "type": "Unconfined",
    "user": "system_u",
    "role": "object_r",
    "procMount": "Unmasked",
    "name": "vm.overcommit_memory",
    "host": "169.254.169.254",
}


def test_every_baseline_check_refuses_each_of_its_fields_in_both_validators(
    tmp_path: Path,
) -> None:
    """Beyond one case per feature class above: every path of every check, pod and container
    level, containers and initContainers, each probe and handler."""
    docs, expected = [], []
    for check in BASELINE_CHECKS:
        for path in check.paths:
            leaf = path.rsplit(".", 1)[-1].removesuffix("[]")
            value = "spc_t" if path.endswith("seLinuxOptions.type") else BAD_VALUES[leaf]
            template = place(path, value)
            with pytest.raises(ValueError, match="baseline Pod Security level") as info:
                parse_manifest(manifest(template))
            concrete = values_at(template, path)[0][0]
            assert f"{concrete}: " in str(info.value), (path, str(info.value))
            parse_manifest(manifest(privileged(template)))
            docs += [manifest(template), manifest(privileged(template), "syncer")]
            expected += [check.field, None]
    if not CRDCHECK.exists():
        pytest.skip("crdcheck not built (crds/validate/build.sh)")
    for line, field in zip(crdcheck(docs, tmp_path), expected, strict=True):
        if field is None:
            assert line.startswith("ACCEPT"), line
        else:
            assert line.startswith("REJECT") and f"{field}: " in line, (field, line)


def test_every_baseline_check_names_a_declared_field() -> None:
    node = openapi_schema()["properties"]["spec"]["properties"]["syncer"]["properties"]
    template = node["template"]
    for check in BASELINE_CHECKS:
        for path in check.paths:
            cursor = template
            for part in path.split("."):
                name = part.removesuffix("[]")
                assert name in cursor.get("properties", {}), f"{path}: {name} is not in the CRD"
                cursor = cursor["properties"][name]
                if part.endswith("[]"):
                    cursor = cursor["items"]


def test_baseline_allows_its_defaults_beside_each_refused_value() -> None:
    for where in ("group", "syncer"):
        parse_manifest(manifest(BASELINE_ALLOWED, where))


@needs_crdcheck
def test_api_server_refuses_beyond_baseline_unless_privileged_and_allows_the_defaults(
    tmp_path: Path,
) -> None:
    refused = [manifest(t, where) for t, _, _ in BASELINE_CASES for where in ("group", "syncer")]
    lifted = [privileged(t) for t, _, _ in BASELINE_CASES]
    accepted = [manifest(t, where) for t in lifted for where in ("group", "syncer")]
    accepted += [manifest(BASELINE_ALLOWED, where) for where in ("group", "syncer")]
    verdicts = crdcheck(refused + accepted, tmp_path)
    fields = [field for field in CRD_FIELDS for _ in ("group", "syncer")]
    prefixes = ["spec.unitGroups[0].template", "spec.syncer.template"] * len(BASELINE_CASES)
    for line, field, prefix in zip(verdicts, fields, prefixes, strict=False):
        assert line.startswith("REJECT") and f"{field}: " in line, (field, line)
        assert prefix in line and "baseline Pod Security level" in line, line
    for line in verdicts[len(refused) :]:
        assert line.startswith("ACCEPT"), line


def test_host_namespaces_of_a_privileged_template_reach_the_pod() -> None:
    template = PodTemplate.model_validate(
        privileged({"spec": {"hostNetwork": True, "hostPID": True, "hostIPC": False}})
    )
    pod = {"metadata": {}, "spec": {"containers": [{"name": "learner"}]}}
    spec = apply_template(pod, template)["spec"]
    assert (spec["hostNetwork"], spec["hostPID"], spec["hostIPC"]) == (True, True, False)


def test_security_contexts_are_checked_fields_not_pass_through() -> None:
    """An unknown securityContext key could be a way around the checks of tomorrow's fields:
    refused by pydantic, pruned (strict field validation: reported) by the API server."""
    with pytest.raises(ValueError, match=r"template\.spec\.securityContext\.hostUsers"):
        parse_spec({**BASE, "syncer": {"template": pod_security({"hostUsers": False})}})
    with pytest.raises(ValueError, match=r"containers\.0\.securityContext\.privilegedish"):
        parse_spec({**BASE, "syncer": {"template": in_sidecar({"privilegedish": True})}})
    node = openapi_schema()["properties"]["spec"]["properties"]["syncer"]["properties"]
    context = node["template"]["properties"]["spec"]["properties"]["securityContext"]
    assert "x-kubernetes-preserve-unknown-fields" not in context


# --- the run's own token Secrets ----------------------------------------------------------------

LIST_ITEMS = {
    "volumes": {"name": "v"},
    "containers": {"name": "side", "image": "busybox:1"},
    "initContainers": {"name": "init", "image": "busybox:1"},
    "env": {"name": "TOKEN"},
    "ports": {"containerPort": 8080},
    "sysctls": {"value": "1"},
}


def place(path: str, value: Any) -> dict[str, Any]:
    """A pod template that holds `value` at `path` (items of the lists on the way get the
    fields they require)."""
    parts = path.split(".")
    doc: dict[str, Any] = {}
    cursor = doc
    for i, part in enumerate(parts):
        field = part.removesuffix("[]")
        if i == len(parts) - 1:
            cursor[field] = [value] if part.endswith("[]") else value
        elif part.endswith("[]"):
            item = dict(LIST_ITEMS.get(field, {}))
            cursor[field] = [item]
            cursor = item
        else:
            cursor = cursor.setdefault(field, {})
        if field == "secretKeyRef":
            cursor["key"] = "token"
    return doc


TOKENS = [f"{RUN}-token", f"{RUN}-v6e-3-token", f"{RUN}-other-group-12-token"]
NOT_TOKENS = [f"{RUN}-hf-token", f"{RUN}x-token", "other-token", f"{RUN}-v6e-3-tokens"]


@pytest.mark.parametrize("path", SECRET_REFERENCES)
def test_pydantic_refuses_the_runs_token_secrets_in_every_reference(path: str) -> None:
    for where, prefix in (
        ("group", "spec.unitGroups[0].template"),
        ("syncer", "spec.syncer.template"),
    ):
        for token in TOKENS:
            with pytest.raises(ValueError) as info:
                parse_manifest(manifest(place(path, token), where))
            concrete = values_at(place(path, token), path)[0][0]
            assert f"{prefix}.{concrete}: {token} is a token Secret of the run" in str(
                info.value
            ), str(info.value)
        for name in NOT_TOKENS:
            parse_manifest(manifest(place(path, name), where))


def test_without_the_run_name_the_token_check_is_skipped() -> None:
    """parse_spec alone cannot know the run's name: callers that have it pass it (the
    operator's handler, parse_manifest)."""
    spec = manifest(place("spec.imagePullSecrets[].name", f"{RUN}-token"))["spec"]
    parse_spec(spec)
    with pytest.raises(ValueError, match="token Secret of the run"):
        parse_spec(spec, run=RUN)


@needs_crdcheck
def test_api_server_refuses_the_runs_token_secrets_in_every_reference(tmp_path: Path) -> None:
    refused = [
        manifest(place(path, token), where)
        for path in SECRET_REFERENCES
        for token in TOKENS
        for where in ("group", "syncer")
    ]
    accepted = [
        manifest(place(path, name), where)
        for path in SECRET_REFERENCES
        for name in NOT_TOKENS
        for where in ("group", "syncer")
    ]
    verdicts = crdcheck(refused + accepted, tmp_path)
    for doc, line in zip(refused, verdicts, strict=False):
        assert line.startswith("REJECT") and "token Secret of the run" in line, (doc, line)
        where = (
            "spec.syncer.template"
            if "template" in doc["spec"].get("syncer", {})
            else "spec.unitGroups"
        )
        assert where in line, line
    for doc, line in zip(accepted, verdicts[len(refused) :], strict=True):
        assert line.startswith("ACCEPT"), (doc, line)


def test_secret_references_cover_every_secret_field_of_the_schema() -> None:
    """A Secret-naming field added to the models without a SECRET_REFERENCES entry would be a
    way around the token check and the admission policy."""
    names = {"secretName": "", "secretRef": ".name", "secretKeyRef": ".name"}
    names |= {"nodePublishSecretRef": ".name", "imagePullSecrets": "[].name"}
    found: set[str] = set()

    def walk(node: dict[str, Any], path: str) -> None:
        for key, child in (node.get("properties") or {}).items():
            here = f"{path}.{key}" if path else key
            if key in names:
                found.add(here + names[key])
            if key == "secret" and "name" in child.get("properties", {}):
                found.add(here + ".name")  # a projected volume's source
            if child.get("type") == "array":
                walk(child["items"], here + "[]")
            else:
                walk(child, here)

    node = openapi_schema()["properties"]["spec"]["properties"]["syncer"]["properties"]
    walk(node["template"], "")
    assert found == set(SECRET_REFERENCES)


# --- priority classes ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["system-node-critical", "system-cluster-critical"])
def test_system_priority_classes_are_refused_at_every_level(name: str) -> None:
    for template in (
        {"spec": {"priorityClassName": name}},
        privileged({"spec": {"priorityClassName": name}}),
    ):
        with pytest.raises(ValueError, match=r"spec\.priorityClassName: system-\*"):
            parse_manifest(manifest(template))
    parse_manifest(manifest({"spec": {"priorityClassName": "training-high"}}))


@needs_crdcheck
def test_api_server_refuses_system_priority_classes(tmp_path: Path) -> None:
    docs = [
        manifest({"spec": {"priorityClassName": "system-node-critical"}}),
        manifest(privileged({"spec": {"priorityClassName": "system-cluster-critical"}}), "syncer"),
        manifest({"spec": {"priorityClassName": "training-high"}}),
    ]
    refused_group, refused_syncer, accepted = crdcheck(docs, tmp_path)
    for line in (refused_group, refused_syncer):
        assert line.startswith("REJECT") and "spec.priorityClassName: system-*" in line, line
    assert accepted.startswith("ACCEPT"), accepted

"""Who may put what in a pod template, on a real control plane with real RBAC: the chart's
ValidatingAdmissionPolicy asks the API server's authorizer, for the user who writes a DilocoRun
(impersonated here with --as), whether they may get each Secret its pod templates name and use
its ServiceAccount and priority classes; the CRD refuses, for everyone, pods beyond the baseline
Pod Security level and mounts of the run's own token. Server-side dry runs: admission runs in
full, nothing is stored, no operator is needed."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import kubectl, wait_for

USER = "e2e-run-author"
SECRET = "private-data"
PRIORITY = "e2e-team-high"
ACCOUNT = "trainer"
RUN = "policy"


def run(template: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    group: dict[str, Any] = {"name": "cpu"}
    if template is not None:
        group["template"] = copy.deepcopy(template)
    return {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DilocoRun",
        "metadata": {"name": RUN},
        "spec": {
            "image": "trainer:1",
            "unitGroups": [group],
            "training": {"totalSteps": 10},
            "syncer": {"checkpoint": {"ephemeral": True}},
            **spec,
        },
    }


def mounts(secret: str) -> dict[str, Any]:
    return {
        "spec": {"volumes": [{"name": "data", "secret": {"secretName": secret}}]},
        "mainContainer": {"volumeMounts": [{"name": "data", "mountPath": "/data"}]},
    }


def dry_run(
    cluster: Any, namespace: str, doc: dict[str, Any], user: str | None = USER
) -> subprocess.CompletedProcess[str]:
    who = ["--as", user] if user else []
    return kubectl(
        cluster,
        "create",
        "--dry-run=server",
        "-n",
        namespace,
        *who,
        "-f",
        "-",
        input=json.dumps(doc),
        check=False,
    )


def refused(result: subprocess.CompletedProcess[str], *words: str) -> bool:
    return result.returncode != 0 and all(w in result.stderr for w in words)


def apply(cluster: Any, *docs: dict[str, Any]) -> None:
    kubectl(
        cluster,
        "apply",
        "-f",
        "-",
        input=json.dumps({"kind": "List", "apiVersion": "v1", "items": list(docs)}),
    )


def role_binding(namespace: str, name: str, rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    meta = {"name": name, "namespace": namespace}
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}],
        },
    ]


@pytest.fixture(scope="module")
def author(cluster: Any, crd: str, namespace: str) -> Iterator[str]:
    """A user who may create DilocoRuns in the namespace and nothing else; a Secret there."""
    apply(
        cluster,
        *role_binding(
            namespace,
            "run-author",
            [
                {
                    "apiGroups": ["diloco.dev"],
                    "resources": ["dilocoruns"],
                    "verbs": ["create", "get", "list", "update", "patch"],
                }
            ],
        ),
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": SECRET, "namespace": namespace},
            "stringData": {"key": "not for the author"},
        },
    )
    # The policy is served once the API server's policy informers have it: wait for its first
    # refusal rather than for a fixed time.
    wait_for(
        "the chart's pod-template policy to refuse a Secret the author may not get",
        lambda: refused(dry_run(cluster, namespace, run(mounts(SECRET))), "denied request"),
        timeout=90,
        every=1,
    )
    yield USER
    if not os.environ.get("DILOCO_E2E_KEEP"):
        kubectl(
            cluster,
            "delete",
            "clusterrole,clusterrolebinding",
            "-l",
            f"e2e-policy={namespace}",
            check=False,
        )


def test_a_secret_the_author_may_not_get_is_refused_naming_it(
    cluster: Any, namespace: str, author: str
) -> None:
    for template_of in ("group", "syncer"):
        doc = run(mounts(SECRET))
        if template_of == "syncer":
            doc = run()
            doc["spec"]["syncer"]["template"] = mounts(SECRET)
        result = dry_run(cluster, namespace, doc)
        assert refused(result, f"names Secret {SECRET}", f"user {author} may not get"), (
            result.stderr
        )
    # envFrom of a sidecar: the same Secret through another kind of reference.
    sidecar = {"name": "peek", "image": "busybox:1", "envFrom": [{"secretRef": {"name": SECRET}}]}
    result = dry_run(cluster, namespace, run({"spec": {"containers": [sidecar]}}))
    assert refused(result, f"names Secret {SECRET}"), result.stderr
    # Without any Secret the author's run is admitted.
    assert dry_run(cluster, namespace, run()).returncode == 0


def test_the_same_author_with_get_on_the_secret_is_admitted(
    cluster: Any, namespace: str, author: str
) -> None:
    apply(
        cluster,
        *role_binding(
            namespace,
            "read-private-data",
            [
                {
                    "apiGroups": [""],
                    "resources": ["secrets"],
                    "resourceNames": [SECRET],
                    "verbs": ["get"],
                }
            ],
        ),
    )
    doc = run(mounts(SECRET))
    wait_for(
        "the run admitted once the author may get the Secret",
        lambda: dry_run(cluster, namespace, doc).returncode == 0,
        timeout=30,
    )
    # Only that Secret: another one is still refused.
    result = dry_run(cluster, namespace, run(mounts("other-secret")))
    assert refused(result, "names Secret other-secret"), result.stderr


def test_a_priority_class_not_granted_is_refused_then_granted(
    cluster: Any, namespace: str, author: str
) -> None:
    doc = run({"spec": {"priorityClassName": PRIORITY}})
    result = dry_run(cluster, namespace, doc)
    assert refused(result, f"names PriorityClass {PRIORITY}", f"user {author} may not use"), (
        result.stderr
    )
    labels = {"e2e-policy": namespace}
    name = f"use-{PRIORITY}-{namespace}"[:63]
    apply(
        cluster,
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": name, "labels": labels},
            "rules": [
                {
                    "apiGroups": ["scheduling.k8s.io"],
                    "resources": ["priorityclasses"],
                    "resourceNames": [PRIORITY],
                    "verbs": ["use"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name, "labels": labels},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": name,
            },
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}],
        },
    )
    wait_for(
        "the run admitted once the author may use the priority class",
        lambda: dry_run(cluster, namespace, doc).returncode == 0,
        timeout=30,
    )


def test_a_service_account_needs_use(cluster: Any, namespace: str, author: str) -> None:
    doc = run(serviceAccountName=ACCOUNT)
    result = dry_run(cluster, namespace, doc)
    assert refused(result, f"may not use ServiceAccount {ACCOUNT}"), result.stderr
    apply(
        cluster,
        *role_binding(
            namespace,
            "use-trainer",
            [
                {
                    "apiGroups": [""],
                    "resources": ["serviceaccounts"],
                    "resourceNames": [ACCOUNT],
                    "verbs": ["use"],
                }
            ],
        ),
    )
    wait_for(
        "the run admitted once the author may use the ServiceAccount",
        lambda: dry_run(cluster, namespace, doc).returncode == 0,
        timeout=30,
    )


def test_lifting_the_baseline_level_is_the_cluster_admins_decision(
    cluster: Any, namespace: str, author: str
) -> None:
    sidecar = {"name": "root", "image": "busybox:1", "securityContext": {"privileged": True}}
    baseline = {"spec": {"containers": [sidecar]}}
    # The CRD refuses it for everyone, naming the field...
    for user in (author, None):
        result = dry_run(cluster, namespace, run(baseline), user=user)
        assert refused(result, "securityContext.privileged", "baseline Pod Security level"), (
            result.stderr
        )
    # ...podSecurity: privileged lifts it, which the author may not set and the admin may.
    lifted = run({**baseline, "podSecurity": "privileged"})
    result = dry_run(cluster, namespace, lifted)
    assert refused(result, "podSecurity: privileged", f"user {author} may not"), result.stderr
    assert dry_run(cluster, namespace, lifted, user=None).returncode == 0


def test_the_runs_own_token_is_refused_even_to_the_admin(
    cluster: Any, namespace: str, author: str
) -> None:
    for token in (f"{RUN}-token", f"{RUN}-cpu-0-token"):
        result = dry_run(cluster, namespace, run(mounts(token)), user=None)
        assert refused(result, "token Secret of the run"), result.stderr

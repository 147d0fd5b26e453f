"""The chart and HA, hardened: replicas get distinct peering priorities (kopf pauses every
replica of a tied priority), namespaced RBAC is the chart's default (no Secrets outside the
watched namespaces), and the optional per-run NetworkPolicy admits only the run's learners and
the operator to the syncer."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_operator.api import parse_spec
from diloco_operator.k8s import builders
from diloco_operator.k8s.main import auto_priority, parse_args
from diloco_operator.k8s.netpolicy import OperatorIdentity, run_objects_with_policy
from diloco_operator.planner import CreateUnit
from test_crd_chart import CHART, HELM

OBJCHECK = Path.home() / ".cache" / "diloco-e2e" / "bin" / "objcheck"
SPEC = {"image": "t", "replicas": 2, "training": {"totalSteps": 5}}


def test_peering_replicas_never_tie_and_the_oldest_leads() -> None:
    older, newer = auto_priority(1_700_000_000.000, 999), auto_priority(1_700_000_000.001, 0)
    assert older > newer  # kopf: the highest priority acts, the others pause
    same_ms = {auto_priority(1_700_000_000.5, j) for j in range(1000)}
    assert len(same_ms) == 1000
    assert auto_priority(9_000_000_000.0, 999) > -(2**63)  # an int64 for centuries


def test_cli_priority_is_auto_by_default_and_explicit_when_given() -> None:
    a = parse_args(["--peering", "p"]).priority
    b = parse_args(["--peering", "p", "--priority", "auto"]).priority
    assert isinstance(a, int) and isinstance(b, int)
    assert a != 0 and b != 0  # never kopf's shared default 0
    assert parse_args(["--priority", "7"]).priority == 7
    with pytest.raises(SystemExit):
        parse_args(["--priority", "high"])
    with pytest.raises(SystemExit):
        parse_args(["--peering-lifetime", "1"])
    assert parse_args([]).peering_lifetime == 15


def test_cli_network_policy_needs_the_operator_identity() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--syncer-network-policy"])
    args = parse_args(
        [
            "--syncer-network-policy",
            "--operator-namespace=diloco-system",
            '--operator-pod-labels={"app.kubernetes.io/name": "diloco-operator"}',
        ]
    )
    assert args.operator_pod_labels == {"app.kubernetes.io/name": "diloco-operator"}
    assert parse_args(["--operator-pod-labels", "a=1,b=2"]).operator_pod_labels == {
        "a": "1",
        "b": "2",
    }


def policy_objects(identity: OperatorIdentity | None) -> list[dict[str, Any]]:
    run = builders.Run("r", "ns", "uid-1", parse_spec(SPEC))
    return run_objects_with_policy(run, identity)


def test_network_policy_admits_only_the_runs_learners_and_the_operator() -> None:
    assert "NetworkPolicy" not in [o["kind"] for o in policy_objects(None)]
    objs = policy_objects(OperatorIdentity("diloco-system", {"app.kubernetes.io/name": "op"}))
    kinds = [o["kind"] for o in objs]
    assert kinds.index("NetworkPolicy") < kinds.index("Deployment")  # never an open syncer
    policy = objs[kinds.index("NetworkPolicy")]
    deployment = objs[kinds.index("Deployment")]
    selected = policy["spec"]["podSelector"]["matchLabels"]
    syncer_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selected.items() <= syncer_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    learners, operator = rule["from"]
    unit = builders.unit_job(
        builders.Run("r", "ns", "uid-1", parse_spec(SPEC)),
        CreateUnit("r-default-0", "default", 0, 0, 0, 2, 1),
    )
    learner_labels = unit["spec"]["template"]["metadata"]["labels"]
    assert learners["podSelector"]["matchLabels"].items() <= learner_labels.items()
    assert learners["podSelector"]["matchLabels"]["diloco.dev/run"] == "r"
    assert operator["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "diloco-system"
    }
    assert operator["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "op"}
    assert rule["ports"] == [{"protocol": "TCP", "port": 8470}]


@pytest.mark.skipif(not OBJCHECK.exists(), reason="objcheck not built (make validators)")
def test_network_policy_passes_apiserver_validation() -> None:
    objs = [
        o
        for o in policy_objects(OperatorIdentity("ns2", {"a": "b"}))
        if o["kind"] == "NetworkPolicy"
    ]
    out = subprocess.run(
        [str(OBJCHECK)], input=yaml.safe_dump_all(objs), capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and out.stdout.startswith("VALID NetworkPolicy/"), out.stdout


def render(*extra: str) -> list[dict[str, Any]]:
    assert HELM is not None
    out = subprocess.run(
        [HELM, "template", "t", str(CHART), "--namespace", "ops", *extra],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def grants_secrets(role: dict[str, Any]) -> bool:
    return any(
        "secrets" in rule.get("resources", []) and rule.get("apiGroups") == [""]
        for rule in role.get("rules", [])
    )


@pytest.mark.skipif(HELM is None, reason="helm neither on PATH nor built (make e2e-deps)")
def test_default_is_namespaced_without_cluster_wide_secrets() -> None:
    docs = render()
    cluster_roles = [d for d in docs if d["kind"] == "ClusterRole"]
    assert cluster_roles and not any(grants_secrets(r) for r in cluster_roles)
    roles = [d for d in docs if d["kind"] == "Role"]
    assert [r["metadata"]["namespace"] for r in roles] == ["ops"]  # the release namespace
    assert grants_secrets(roles[0])
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert "--namespace=ops" in args and "--all-namespaces" not in args
    watched = render("--set", "watchNamespaces={a,b}")
    assert sorted(r["metadata"]["namespace"] for r in watched if r["kind"] == "Role") == ["a", "b"]


@pytest.mark.skipif(HELM is None, reason="helm neither on PATH nor built (make e2e-deps)")
def test_cluster_wide_is_an_explicit_choice() -> None:
    docs = render("--set", "clusterWide=true")
    assert any(grants_secrets(d) for d in docs if d["kind"] == "ClusterRole")
    assert not [d for d in docs if d["kind"] == "Role"]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert "--all-namespaces" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    both = subprocess.run(
        [
            HELM,
            "template",
            "t",
            str(CHART),
            "--set",
            "clusterWide=true",
            "--set",
            "watchNamespaces={a}",
        ],
        capture_output=True,
        text=True,
    )
    assert both.returncode != 0 and "exclusive" in both.stderr


@pytest.mark.skipif(HELM is None, reason="helm neither on PATH nor built (make e2e-deps)")
def test_ha_replicas_get_auto_priorities_and_a_short_peering_lifetime() -> None:
    docs = render("--set", "ha.enabled=true")
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert "--peering=diloco-operator" in args and "--priority=auto" in args
    assert "--peering-lifetime=15" in args
    assert [d["metadata"]["namespace"] for d in docs if d["kind"] == "KopfPeering"] == ["ops"]
    parse_args([a for a in args if not a.startswith("--liveness")])  # the operator takes them


@pytest.mark.skipif(HELM is None, reason="helm neither on PATH nor built (make e2e-deps)")
def test_network_policy_value_passes_the_operator_identity() -> None:
    docs = render("--set", "networkPolicy.enabled=true")
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    parsed = parse_args(args)
    assert parsed.syncer_network_policy and parsed.operator_namespace == "ops"
    assert parsed.operator_pod_labels["app.kubernetes.io/name"] == "diloco-operator"
    role = next(d for d in docs if d["kind"] == "Role")
    assert any("networkpolicies" in r["resources"] for r in role["rules"])


def paused_replicas(priorities: dict[str, int]) -> set[str]:
    """Which replicas kopf's own peering logic pauses when all of them are alive in one
    peering object (kopf.engines.peering.process_peering_event, as the operator runs it)."""
    from datetime import UTC, datetime

    import kopf
    from kopf._cogs.aiokits.aiotoggles import Toggle
    from kopf._core.engines.peering import Identity, process_peering_event

    now = datetime.now(UTC).isoformat()
    body = {
        "metadata": {"name": "diloco-operator"},
        "status": {
            ident: {"priority": prio, "lifetime": 15, "lastseen": now}
            for ident, prio in priorities.items()
        },
    }

    async def verdict(ident: str, priority: int) -> bool:
        settings = kopf.OperatorSettings()
        settings.peering.name, settings.peering.priority = "diloco-operator", priority
        paused, awake = Toggle(False), asyncio.Event()
        awake.set()  # do not sleep until the peers' deadlines
        await process_peering_event(
            raw_event={"type": "MODIFIED", "object": body},  # type: ignore[typeddict-item]
            namespace=None,
            resource=None,  # type: ignore[arg-type]
            identity=Identity(ident),
            settings=settings,
            autoclean=False,
            stream_pressure=awake,
            conflicts_found=paused,
        )
        return paused.is_on()

    return {i for i, p in priorities.items() if asyncio.run(verdict(i, p))}


def test_kopf_pauses_every_tied_replica_but_exactly_one_acts_with_auto_priorities() -> None:
    # What the chart ran before: --peering without --priority, i.e. 0 for every replica.
    tied = {f"pod-{i}": parse_args(["--peering", "p", "--priority", "0"]).priority for i in "ab"}
    assert paused_replicas(tied) == {"pod-a", "pod-b"}  # nobody reconciles
    auto = {"pod-a": auto_priority(1_700_000_000.0, 5), "pod-b": auto_priority(1_700_000_003.0, 5)}
    auto["pod-c"] = parse_args(["--peering", "p"]).priority  # started now: the youngest
    assert paused_replicas(auto) == {"pod-b", "pod-c"}  # the oldest acts, alone

"""Monitoring: every metric the Grafana dashboard queries is one the code exports, and the chart's
monitors select the pods the operator really builds, on ports those pods really open."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_operator.api import parse_spec
from diloco_operator.k8s import builders
from diloco_operator.planner import CreateUnit
from prometheus_client import CollectorRegistry, Metric

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "diloco-operator"
DASHBOARD = CHART / "dashboards" / "diloco.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def series_names(registry: CollectorRegistry) -> set[str]:
    """The series names a registry exposes, whether or not a labelled metric has children yet."""
    names: set[str] = set()
    for collector in list(registry._collector_to_names):  # every registered collector
        families: list[Metric] = list(collector.collect())
        describe = getattr(collector, "describe", None)
        if not families and describe is not None:
            families = list(describe())
        for family in families:
            names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
    return names


def exported_names() -> set[str]:
    # Importing the operator's modules registers their metrics in the default registry.
    from diloco_operator.k8s import handlers, run_metrics  # noqa: F401
    from diloco_trainer.learner.metrics import LearnerMetrics
    from diloco_trainer.syncer.metrics import SyncerMetrics
    from prometheus_client import REGISTRY

    return (
        series_names(REGISTRY)
        | series_names(SyncerMetrics().registry)
        | series_names(LearnerMetrics("u", "g", 1.0, 1.0).registry)
    )


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    for var in dash["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def queried_names(exprs: list[str]) -> set[str]:
    return {name for expr in exprs for name in re.findall(r"\bdiloco_[a-z_]+\b", expr)}


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    queried = queried_names(dashboard_queries())
    assert queried, "the dashboard queries no diloco metric"
    assert sorted(queried - exported_names()) == []


def test_the_check_catches_a_metric_the_code_does_not_export() -> None:
    exprs = [*dashboard_queries(), "rate(diloco_syncer_tokens[5m])"]  # the old gauge's name
    assert queried_names(exprs) - exported_names() == {"diloco_syncer_tokens"}


def test_the_dashboard_covers_what_an_operator_watches() -> None:
    queried = queried_names(dashboard_queries())
    for needed in (
        "diloco_syncer_eval_loss",  # loss
        "diloco_syncer_tokens_total",  # tokens/s
        "diloco_operator_units_online",  # units online
        "diloco_syncer_merges_total",  # merges
        "diloco_syncer_bytes_received_total",  # bytes
        "diloco_operator_unit_useful_seconds_total",  # goodput
        "diloco_learner_mfu_ratio",
    ):
        assert needed in queried, needed


def test_counters_are_named_as_prometheus_expects() -> None:
    # A counter's series end in _total; nothing else may (a gauge named *_total misleads rate()).
    from diloco_operator.k8s import handlers, run_metrics  # noqa: F401
    from diloco_trainer.learner.metrics import LearnerMetrics
    from diloco_trainer.syncer.metrics import SyncerMetrics
    from prometheus_client import REGISTRY

    for registry in (REGISTRY, SyncerMetrics().registry, LearnerMetrics("u", "g", 1, 1).registry):
        for collector in list(registry._collector_to_names):
            for family in getattr(collector, "describe", collector.collect)():
                if family.name.startswith("diloco_") and family.type != "counter":
                    assert not family.name.endswith("_total"), family.name


# --- the chart's monitors against the pods the operator builds -------------------------------

HELM_EXTRA = [
    "--set",
    "monitoring.serviceMonitor.enabled=true",
    "--set",
    "monitoring.podMonitoring.enabled=true",
    "--set",
    "monitoring.dashboard.enabled=true",
]


def run_pods() -> dict[str, dict[str, Any]]:
    """component -> pod template of what the operator creates for a small run."""
    run = builders.Run(
        "r", "ml", "uid", parse_spec({"image": "t:1", "training": {"totalSteps": 10}})
    )
    unit = CreateUnit("r-default-0", "default", 0, 0, 0, 1, 1)
    syncer = builders.syncer_deployment(run)["spec"]["template"]
    learner = builders.unit_job(run, unit)["spec"]["template"]
    return {"syncer": syncer, "learner": learner}


# The Job controller labels every pod of an Indexed Job with its completion index (Kubernetes
# 1.28+); the learner of index 0 is the unit's leader, the only host that serves its metrics.
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


def learner_pod_labels(index: int) -> dict[str, str]:
    """The labels of a multi-host unit's learner pod `index`, as the Job controller creates it."""
    run = builders.Run(
        "r",
        "ml",
        "uid",
        parse_spec(
            {
                "image": "t:1",
                "unitGroups": [
                    {"name": "v6e", "tpu": {"accelerator": "tpu-v6e-slice", "topology": "2x4"}}
                ],
                "training": {"totalSteps": 10},
            }
        ),
    )
    unit = CreateUnit("r-v6e-0", "v6e", 0, 0, 0, 1, 2)
    template = builders.unit_job(run, unit)["spec"]["template"]
    return {**template["metadata"]["labels"], COMPLETION_INDEX: str(index)}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def ports(template: dict[str, Any]) -> set[str]:
    return {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}


def rendered(*extra: str) -> list[dict[str, Any]]:
    from test_crd_chart import HELM

    if HELM is None:
        pytest.skip("helm neither on PATH nor built (make e2e-deps)")
    out = subprocess.run(
        [HELM, "template", "t", str(CHART), "--namespace", "ops", *HELM_EXTRA, *extra],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_run_monitors_select_the_operators_pods_on_their_metrics_ports() -> None:
    docs = rendered("--set", "clusterWide=true")
    pods = run_pods()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for kind in ("PodMonitor", "ClusterPodMonitoring"):
        for component, template in pods.items():
            monitor = next(
                d
                for d in docs
                if d["kind"] == kind and d["metadata"]["name"].endswith(component + "s")
            )
            selector = monitor["spec"]["selector"]["matchLabels"]
            labels = template["metadata"]["labels"]
            if component == "learner":  # the leader's pod, as the Job controller labels it
                labels = {**labels, COMPLETION_INDEX: "0"}
            assert selects(selector, labels), (kind, component)
            endpoints = monitor["spec"].get("podMetricsEndpoints") or monitor["spec"]["endpoints"]
            assert {e["port"] for e in endpoints} <= ports(template), (kind, component)
    assert ("ServiceMonitor", "t-diloco-operator") in kinds
    assert ("PodMonitoring", "t-diloco-operator") in kinds


@pytest.mark.parametrize("scope", [[], ["--set", "clusterWide=true"]])
def test_learner_monitors_scrape_the_unit_leader_only(scope: list[str]) -> None:
    # Only process 0 of a unit serves learner metrics: the other hosts of a slice would be
    # targets that are always down.
    docs = rendered(*scope)
    learners = [d for d in docs if d["metadata"]["name"].endswith("-learners")]
    assert {d["kind"] for d in learners} >= {"PodMonitor"}
    assert len(learners) == 2  # the Prometheus operator's and GMP's
    for monitor in learners:
        selector = monitor["spec"]["selector"]["matchLabels"]
        assert selects(selector, learner_pod_labels(0)), monitor["kind"]
        assert not selects(selector, learner_pod_labels(1)), monitor["kind"]
    syncers = [d for d in docs if d["metadata"]["name"].endswith("-syncers")]
    for monitor in syncers:
        assert COMPLETION_INDEX not in monitor["spec"]["selector"]["matchLabels"]


def operator_monitors(docs: list[dict[str, Any]]) -> set[str]:
    return {
        d["kind"]
        for d in docs
        if d["kind"] in ("ServiceMonitor", "PodMonitoring")
        and d["metadata"]["name"] == "t-diloco-operator"
    }


def test_operator_monitors_render_only_with_the_operators_metrics() -> None:
    # metrics.enabled=false: the operator serves no metrics port and the metrics Service is not
    # rendered, so a monitor of it would select nothing; the run pods' monitors stay (they serve
    # whatever the operator does).
    assert operator_monitors(rendered()) == {"ServiceMonitor", "PodMonitoring"}
    off = rendered("--set", "metrics.enabled=false")
    assert operator_monitors(off) == set()
    assert not [d for d in off if d["kind"] == "Service"]
    deployment = next(d for d in off if d["kind"] == "Deployment")
    assert "--metrics-port=0" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    runs = {(d["kind"], d["metadata"]["name"]) for d in off if d["metadata"]["name"].endswith("s")}
    assert ("PodMonitor", "t-diloco-operator-learners") in runs
    assert ("PodMonitoring", "t-diloco-operator-syncers") in runs


def run_monitor_scopes(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """kind -> where the run-pod monitors look (PodMonitor: its namespaceSelector; GMP: the
    namespaces of its PodMonitorings, or "cluster" for ClusterPodMonitoring)."""
    runs = [d for d in docs if d["metadata"]["name"].endswith(("-syncers", "-learners"))]
    gmp = sorted(
        {d["metadata"].get("namespace", "cluster") for d in runs if "Monitoring" in d["kind"]}
    )
    (selector,) = {
        json.dumps(d["spec"]["namespaceSelector"]) for d in runs if d["kind"] == "PodMonitor"
    }
    return {"PodMonitor": json.loads(selector), "gmp": gmp}


def test_run_monitors_watch_where_the_operator_manages_runs() -> None:
    # Namespaced by default (the release namespace), watchNamespaces, or clusterWide.
    assert run_monitor_scopes(rendered()) == {"PodMonitor": {"matchNames": ["ops"]}, "gmp": ["ops"]}
    assert run_monitor_scopes(rendered("--set", "watchNamespaces={a,b}")) == {
        "PodMonitor": {"matchNames": ["a", "b"]},
        "gmp": ["a", "b"],
    }
    assert run_monitor_scopes(rendered("--set", "clusterWide=true")) == {
        "PodMonitor": {"any": True},
        "gmp": ["cluster"],
    }


def test_operator_monitors_select_the_operator_and_the_dashboard_ships_verbatim() -> None:
    docs = rendered()
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = next(d for d in docs if d["kind"] == "Service" and "metrics" in d["metadata"]["name"])
    gmp = next(
        d
        for d in docs
        if (d["kind"], d["metadata"]["name"]) == ("PodMonitoring", "t-diloco-operator")
    )
    assert gmp["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert "--log-format=json" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    assert json.loads(config_map["data"]["diloco.json"]) == json.loads(DASHBOARD.read_text())


def test_run_pods_log_json_and_learners_serve_metrics() -> None:
    for component, template in run_pods().items():
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
        assert env["DILOCO_LOG_FORMAT"] == "json", component
    learner_env = {
        e["name"]: e.get("value") for e in run_pods()["learner"]["spec"]["containers"][0]["env"]
    }
    assert learner_env["DILOCO_METRICS_PORT"] == str(builders.LEARNER_METRICS_PORT)

"""Helpers of the e2e tests: load an example manifest with test-sized overrides, apply it, and
read a run's children and status back from the API server (kubectl, JSON)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from conftest import say

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
BAD_MANIFESTS = REPO / "tests" / "manifests" / "bad"

LABEL_RUN = "diloco.dev/run"
LABEL_UNIT = "diloco.dev/unit"
LABEL_ATTEMPT = "diloco.dev/attempt"
LABEL_COMPONENT = "app.kubernetes.io/component"
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
TPU = "google.com/tpu"


def example(name: str, **spec_overrides: Any) -> dict[str, Any]:
    """examples/<name>.yaml with spec keys replaced (failurePolicy merged key by key)."""
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    for key, value in spec_overrides.items():
        if isinstance(value, dict) and isinstance(doc["spec"].get(key), dict):
            doc["spec"][key] = {**doc["spec"][key], **value}
        else:
            doc["spec"][key] = value
    return doc


def apply(c: Any, namespace: str, doc: dict[str, Any]) -> None:
    """`kubectl apply` the run, after the Kubernetes service account it names (the GKE examples
    name one for Workload Identity; a user creates it first, docs/gke.md section 3, and pods
    naming a missing one are refused by the API server)."""
    account = doc.get("spec", {}).get("serviceAccountName")
    if account:
        sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}}
        c.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(sa))
    c.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(doc))


@contextlib.contextmanager
def restricted_run(
    c: Any, namespace: str, doc: dict[str, Any], what: str
) -> Iterator[dict[str, Any]]:
    """`doc` applied in `namespace`, which first enforces the "restricted" Pod Security level
    (the operator's pods must pass it); yields {"ns", "t0"} and says how long `what` took from
    the apply to the end."""
    enforce = "pod-security.kubernetes.io/enforce"
    c.kubectl("label", "namespace", namespace, f"{enforce}=restricted")
    t0 = time.monotonic()
    apply(c, namespace, doc)
    yield {"ns": namespace, "t0": t0}
    say(f"{what}: {time.monotonic() - t0:.1f}s from apply to the end")


def items(c: Any, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = c.kubectl_json("get", kind, "-n", namespace, "-l", selector)[
        "items"
    ]
    return out


def run_selector(run: str, component: str | None = None) -> str:
    sel = f"{LABEL_RUN}={run}"
    return f"{sel},{LABEL_COMPONENT}={component}" if component else sel


def jobs(c: Any, namespace: str, run: str) -> dict[str, dict[str, Any]]:
    """Learner Jobs by name, Terminating ones included."""
    return {
        j["metadata"]["name"]: j for j in items(c, "jobs", namespace, run_selector(run, "learner"))
    }


def live_jobs(c: Any, namespace: str, run: str) -> dict[str, dict[str, Any]]:
    return {
        n: j
        for n, j in jobs(c, namespace, run).items()
        if not j["metadata"].get("deletionTimestamp")
    }


def learner_pods(c: Any, namespace: str, run: str) -> list[dict[str, Any]]:
    return items(c, "pods", namespace, run_selector(run, "learner"))


def pods_of(c: Any, namespace: str, unit: str, attempt: int | None = None) -> list[dict[str, Any]]:
    sel = f"{LABEL_UNIT}={unit}" + (f",{LABEL_ATTEMPT}={attempt}" if attempt is not None else "")
    return [p for p in items(c, "pods", namespace, sel) if LABEL_ATTEMPT in p["metadata"]["labels"]]


def running(pod: dict[str, Any]) -> bool:
    return bool(
        pod.get("status", {}).get("phase") == "Running"
        and not pod["metadata"].get("deletionTimestamp")
        and pod["spec"].get("nodeName")
    )


def run_obj(c: Any, namespace: str, run: str) -> dict[str, Any]:
    out: dict[str, Any] = c.kubectl_json("get", "dlr", run, "-n", namespace)
    return out


def status(c: Any, namespace: str, run: str) -> dict[str, Any]:
    st: dict[str, Any] = run_obj(c, namespace, run).get("status") or {}
    return st


def unit_status(c: Any, namespace: str, run: str) -> dict[str, dict[str, Any]]:
    return {u["name"]: u for u in status(c, namespace, run).get("units", [])}


def condition(st: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((x for x in st.get("conditions", []) if x["type"] == type_), None)


def events(c: Any, namespace: str, run: str, reason: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = c.kubectl_json(
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        f"involvedObject.name={run},involvedObject.kind=DilocoRun,reason={reason}",
    )["items"]
    return out


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    """name -> value, or the valueFrom mapping for references."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def job_attempt(job: dict[str, Any]) -> int:
    return int(job["metadata"]["labels"][LABEL_ATTEMPT])


def all_units_online(c: Any, namespace: str, run: str, n: int) -> bool:
    units = unit_status(c, namespace, run)
    return len(units) == n and all(u["state"] == "Online" for u in units.values())


def node_of(c: Any, name: str) -> dict[str, Any]:
    out: dict[str, Any] = c.kubectl_json("get", "node", name)
    return out


def record_timings(name: str, timings: dict[str, Any]) -> None:
    """What a real-pods module measured, for bench/cluster/real_pods.py: `<name>.json` beside
    the file DILOCO_E2E_TIMINGS names (unset: not recorded)."""
    out = os.environ.get("DILOCO_E2E_TIMINGS")
    if out:
        Path(out).with_name(f"{name}.json").write_text(json.dumps(timings))

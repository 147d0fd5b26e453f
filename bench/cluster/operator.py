"""The operator's failure latency and footprint, on the real local control plane of e2e/cluster
(etcd, kube-apiserver, kube-controller-manager, kube-scheduler, KWOK fake nodes) with the real
`diloco-operator` process:

1. Failure latency: a unit's pod is patched to Failed (status subresource) 20 times; for each,
   the time until the DilocoRun status shows the unit Offline and until the replacement Job
   (attempt+1) exists. Target: Offline within 2 s median; replacement within 5 s median beyond
   the configured restartBackoffSeconds.
2. Scale: 50 runs x 16 units created at once; the operator's RSS and CPU (psutil, sampled every
   0.5 s) until every unit is Online and for a steady-state window after. Target: RSS < 300 MiB.

Runs are CPU-only groups (examples/kind-cpu.yaml, no TPU selectors) on a fake pool of CPU nodes
large enough that every unit's pod schedules and runs under KWOK (see NODES below).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from bench.lib.common import REPO, BenchContext, Section, log, md_table
from bench.lib.live import stop
from bench.lib.plots import axes, save

# The harness is stdlib-only scripting code kept out of this package's type check; load it as a
# plain module object.
harness: Any = importlib.import_module("e2e.cluster.harness")

NS = "bench"
FAILURES = 20
BACKOFF_S = 1
RUNS = 50
UNITS_PER_RUN = 16
# 50 x 16 learner pods + 50 syncers = 850 pods; kubelets take 110 pods each.
NODES = 10
GROUP = "cpu"  # the group name in examples/kind-cpu.yaml


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def run_manifest(name: str, replicas: int) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / "kind-cpu.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NS}
    doc["spec"]["replicas"] = replicas
    doc["spec"]["failurePolicy"] = {
        "maxUnitRestarts": 1000,
        "restartBackoffSeconds": BACKOFF_S,
        "offlineAfterSeconds": 300,
    }
    return doc


def node_pools() -> list[Any]:
    return [
        harness.NodePool("default-pool", 2, "e2-standard-8", "8", "32Gi"),
        harness.NodePool("bench-cpu", NODES, "n2-standard-64", "64", "256Gi"),
    ]


class Api:
    """The few API calls the bench makes, through the kubernetes client (one connection pool:
    polling at 20 Hz through kubectl would measure kubectl's start-up instead)."""

    def __init__(self, kubeconfig: Path) -> None:
        from kubernetes import client, config

        # Any: the bench reads the client's models loosely (None checks would be noise here).
        self.api_client: Any = config.new_client_from_config(str(kubeconfig))
        self.core: Any = client.CoreV1Api(self.api_client)
        self.batch: Any = client.BatchV1Api(self.api_client)
        self.custom: Any = client.CustomObjectsApi(self.api_client)

    def run(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = self.custom.get_namespaced_custom_object(
            "diloco.dev", "v1alpha1", NS, "dilocoruns", name
        )
        return out

    def runs(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.custom.list_namespaced_custom_object(
            "diloco.dev", "v1alpha1", NS, "dilocoruns"
        )["items"]
        return out

    def create_run(self, doc: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object("diloco.dev", "v1alpha1", NS, "dilocoruns", doc)

    def job_attempt(self, name: str) -> int | None:
        from kubernetes.client.exceptions import ApiException

        try:
            job = self.batch.read_namespaced_job(name, NS)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        if job.metadata.deletion_timestamp:
            return None
        return int(job.metadata.labels["diloco.dev/attempt"])

    def running_pod(self, unit: str, attempt: int) -> str | None:
        pods = self.core.list_namespaced_pod(
            NS, label_selector=f"diloco.dev/unit={unit},diloco.dev/attempt={attempt}"
        ).items
        for p in pods:
            if p.status.phase == "Running" and not p.metadata.deletion_timestamp:
                return str(p.metadata.name)
        return None

    def fail_pod(self, pod: str) -> None:
        body = {"status": {"phase": "Failed", "reason": "Error", "message": "bench: crashed"}}
        self.core.patch_namespaced_pod_status(pod, NS, body)


def unit_state(run: dict[str, Any], unit: str) -> dict[str, Any] | None:
    for u in (run.get("status") or {}).get("units", []):
        if u["name"] == unit:
            return dict(u)
    return None


def poll(what: str, fn: Any, timeout: float, every: float = 0.05) -> Any:
    end = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


@contextlib.contextmanager
def operator_process(kubeconfig: Path, log_path: Path) -> Iterator[tuple[psutil.Process, int]]:
    metrics = harness.free_port()
    health = harness.free_port()
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    argv = [
        str(Path(sys.executable).parent / "diloco-operator"),
        "--namespace",
        NS,
        f"--liveness=http://127.0.0.1:{health}/healthz",
        f"--metrics-port={metrics}",
        # Fake syncers: refuse at once rather than resolve *.svc names.
        "--syncer-url=http://127.0.0.1:9/{namespace}/{name}",
    ]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        poll("operator liveness", lambda: _http_ok(f"http://127.0.0.1:{health}/healthz"), 60, 0.2)
        yield psutil.Process(proc.pid), metrics
    finally:
        stop(proc, 20)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def metric_sum(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


# ------------------------------------------------------------------------------------------------
# 1. failure latency


@dataclass
class Latency:
    offline: list[float] = field(default_factory=list)
    replaced: list[float] = field(default_factory=list)


def measure_failures(api: Api, n: int) -> Latency:
    name = "bench-latency"
    unit = f"{name}-{GROUP}-0"
    api.create_run(run_manifest(name, 2))
    out = Latency()
    for attempt in range(n):
        pod = poll(
            f"{unit} attempt {attempt} running",
            lambda a=attempt: api.running_pod(unit, a),
            120,
        )
        poll(
            f"{unit} Online",
            lambda: (unit_state(api.run(name), unit) or {}).get("state") == "Online",
            60,
        )
        t0 = time.monotonic()
        api.fail_pod(pod)

        def offline(a: int = attempt) -> bool:
            u = unit_state(api.run(name), unit)
            return bool(u and u["attempt"] == a and u["state"] in ("Offline", "Recreating"))

        poll(f"{unit} Offline", offline, 60, every=0.02)
        t_off = time.monotonic() - t0
        poll(
            f"{unit} attempt {attempt + 1}",
            lambda a=attempt: api.job_attempt(unit) == a + 1,
            60,
            0.02,
        )
        t_rep = time.monotonic() - t0
        out.offline.append(t_off)
        out.replaced.append(t_rep)
        log(f"failure {attempt + 1}/{n}: offline {t_off:.2f}s, replacement job {t_rep:.2f}s")
    return out


# ------------------------------------------------------------------------------------------------
# 2. RSS and CPU at scale


@dataclass
class Sample:
    t: float
    rss: float  # bytes
    cpu_s: float  # user+system seconds so far
    online: int


def measure_scale(
    api: Api, proc: psutil.Process, timeout: float, steady_s: float
) -> dict[str, Any]:
    samples: list[Sample] = []
    online = [0]
    stop = threading.Event()
    t_start = time.monotonic()

    def sampler() -> None:
        while not stop.is_set():
            times = proc.cpu_times()
            samples.append(
                Sample(
                    time.monotonic() - t_start,
                    proc.memory_info().rss,
                    times.user + times.system,
                    online[0],
                )
            )
            stop.wait(0.5)

    cpu0 = sum(proc.cpu_times()[:2])
    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    for r in range(RUNS):
        api.create_run(run_manifest(f"bench-scale-{r:02d}", UNITS_PER_RUN))
    created_s = time.monotonic() - t_start
    log(f"created {RUNS} runs in {created_s:.1f}s")
    target = RUNS * UNITS_PER_RUN
    all_online_s: float | None = None
    deadline = time.monotonic() + timeout
    last_log = 0.0
    while time.monotonic() < deadline:
        runs = [r for r in api.runs() if r["metadata"]["name"].startswith("bench-scale-")]
        online[0] = sum(int((r.get("status") or {}).get("unitsOnline") or 0) for r in runs)
        if time.monotonic() - last_log > 10:
            log(f"units online: {online[0]}/{target}")
            last_log = time.monotonic()
        if online[0] >= target:
            all_online_s = time.monotonic() - t_start
            break
        time.sleep(1)
    ramp_end = time.monotonic() - t_start
    time.sleep(steady_s)  # steady state: every unit Online, the operator only polls
    stop.set()
    thread.join()
    cpu1 = sum(proc.cpu_times()[:2])
    steady = [s for s in samples if s.t >= ramp_end]
    steady_cpu = (
        (steady[-1].cpu_s - steady[0].cpu_s) / (steady[-1].t - steady[0].t)
        if len(steady) > 1 and steady[-1].t > steady[0].t
        else float("nan")
    )
    ramp = [s for s in samples if s.t < ramp_end]
    ramp_cpu = (
        (ramp[-1].cpu_s - ramp[0].cpu_s) / max(1e-9, ramp[-1].t - ramp[0].t)
        if len(ramp) > 1
        else float("nan")
    )
    return {
        "samples": samples,
        "created_s": created_s,
        "all_online_s": all_online_s,
        "online": online[0],
        "target": target,
        "peak_rss": max(s.rss for s in samples),
        "steady_rss": statistics.median(s.rss for s in steady) if steady else float("nan"),
        "cpu_total_s": cpu1 - cpu0,
        "ramp_cpu": ramp_cpu,
        "steady_cpu": steady_cpu,
        "ramp_end": ramp_end,
    }


def plot(samples: list[Sample], ramp_end: float, target: int, path: Path) -> None:
    t = [s.t for s in samples]
    fig, ax = axes((8, 4))
    ax.plot(t, [s.rss / 2**20 for s in samples], label="operator RSS (MiB)", color="tab:blue")
    cpu = [0.0] + [
        100 * (b.cpu_s - a.cpu_s) / max(1e-9, b.t - a.t) for a, b in itertools.pairwise(samples)
    ]
    ax.plot(t, cpu, label="operator CPU (% of one core)", color="tab:orange", alpha=0.7)
    ax.axhline(300, color="tab:red", linestyle="--", linewidth=1, label="RSS target 300 MiB")
    ax.axvline(ramp_end, color="grey", linestyle=":", linewidth=1, label="all units Online")
    ax2 = ax.twinx()
    ax2.plot(t, [s.online for s in samples], color="tab:green", label="units Online")
    ax2.set_ylim(0, target * 1.05)
    ax2.set_ylabel("units Online")
    ax.set_xlabel("seconds since the first run was created")
    ax.set_title(f"diloco-operator: {RUNS} runs x {UNITS_PER_RUN} units on a real control plane")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
    save(fig, path)


# ------------------------------------------------------------------------------------------------


def run(ctx: BenchContext) -> Section:
    failures = 8 if ctx.quick else FAILURES
    work = Path(tempfile.mkdtemp(prefix="diloco-operator-bench-"))
    state = harness.cache_root() / "state-bench"
    cluster = harness.LocalCluster(state, node_pools=node_pools())
    log(f"starting the local control plane in {state}")
    cluster.start(timeout=300)
    try:
        cluster.kubectl(
            "apply", "--server-side", "-f", str(REPO / "crds" / "diloco.dev_dilocoruns.yaml")
        )
        cluster.kubectl("wait", "--for=condition=Established", "crd/dilocoruns.diloco.dev")
        cluster.kubectl("create", "namespace", NS)
        api = Api(cluster.kubeconfig)
        with operator_process(cluster.kubeconfig, work / "operator.log") as (proc, port):
            lat = measure_failures(api, failures)
            log("latency done; scale test")
            scale = measure_scale(api, proc, timeout=600 if not ctx.quick else 300, steady_s=30)
            passes = metric_sum(port, "diloco_operator_reconcile_passes_total")
            pass_sum = metric_sum(port, "diloco_operator_reconcile_seconds_sum")
            pass_count = metric_sum(port, "diloco_operator_reconcile_seconds_count")
        timings = dict(cluster.timings)
    finally:
        cluster.stop()
    png = ctx.plot_path("operator_scale.png")
    plot(scale["samples"], scale["ramp_end"], scale["target"], png)

    off_med, rep_med = statistics.median(lat.offline), statistics.median(lat.replaced)
    rows = [
        (
            "pod Failed -> unit Offline in status",
            f"{off_med:.2f} s",
            f"{pct(lat.offline, 95):.2f} s",
            "median <= 2 s",
            "yes" if off_med <= 2 else "no",
        ),
        (
            "pod Failed -> replacement Job created",
            f"{rep_med:.2f} s",
            f"{pct(lat.replaced, 95):.2f} s",
            "-",
            "-",
        ),
        (
            f"same, beyond the {BACKOFF_S} s restartBackoff",
            f"{rep_med - BACKOFF_S:.2f} s",
            f"{pct(lat.replaced, 95) - BACKOFF_S:.2f} s",
            "median <= 5 s",
            "yes" if rep_med - BACKOFF_S <= 5 else "no",
        ),
    ]
    mib = 2**20
    online_s = scale["all_online_s"]
    scale_rows = [
        ("units Online at the end", f"{scale['online']}/{scale['target']}"),
        ("runs created (API calls)", f"{scale['created_s']:.1f} s"),
        ("all units Online after", f"{online_s:.0f} s" if online_s else "not reached"),
        (
            "operator peak RSS",
            f"{scale['peak_rss'] / mib:.0f} MiB (target < 300 MiB: "
            f"{'yes' if scale['peak_rss'] < 300 * mib else 'no'})",
        ),
        ("operator median RSS, steady state (30 s)", f"{scale['steady_rss'] / mib:.0f} MiB"),
        ("operator CPU while ramping up", f"{100 * scale['ramp_cpu']:.0f}% of one core"),
        ("operator CPU, steady state", f"{100 * scale['steady_cpu']:.0f}% of one core"),
        ("operator CPU seconds, whole scale test", f"{scale['cpu_total_s']:.0f} s"),
        (
            "reconcile passes / mean pass time",
            f"{passes:.0f} / {1000 * pass_sum / max(1, pass_count):.0f} ms",
        ),
    ]
    body = "\n".join(
        [
            f"Real control plane (kube-apiserver, kube-controller-manager, kube-scheduler "
            f"{cluster.versions['K8S_VERSION']}, etcd, KWOK) started in "
            f"{timings.get('total_start_s', '?')} s; the operator is the real "
            "`diloco-operator` process (kopf), talking to it over HTTPS.",
            "",
            f"### Failure latency ({failures} pod failures, one unit of a 2-unit run)",
            "",
            "Each failure: the Running pod of unit 0 is patched to `Failed` through the status "
            "subresource; times are from that patch to the DilocoRun status showing the unit "
            "Offline, and to the replacement Job (attempt+1) existing (both polled every 20 ms).",
            "",
            md_table(["what", "median", "p95", "target", "met"], rows),
            "",
            f"### {RUNS} runs x {UNITS_PER_RUN} units",
            "",
            f"CPU-only units (examples/kind-cpu.yaml, 16 replicas each) on {NODES} fake 64-CPU nodes, "
            f"so every one of the {RUNS * UNITS_PER_RUN} learner pods and {RUNS} syncer pods is "
            "scheduled and Running under KWOK. RSS/CPU of the operator process sampled with psutil "
            "every 0.5 s.",
            "",
            md_table(["what", "value"], scale_rows),
            "",
            f"![operator RSS and CPU]({ctx.link(png)})",
            "",
            "The whole machine (2 cores) runs the control plane, KWOK and the operator together, "
            "shared with other work; the ramp-up time is mostly the controller-manager and scheduler "
            "creating and placing 850 pods.",
        ]
    )
    config = (
        f"{failures} failures, restartBackoffSeconds={BACKOFF_S}; {RUNS} runs x "
        f"{UNITS_PER_RUN} units, {NODES} fake CPU nodes; operator --poll-interval 5 (default)"
    )
    return Section(
        "operator",
        "Operator on a real control plane",
        body,
        ctx.command,
        config,
        quick=ctx.quick,
    )


if __name__ == "__main__":
    from bench.run import main

    raise SystemExit(main(["--only", "operator", *sys.argv[1:]]))

"""A run of several huge units at once, on the real local control plane with KWOK fake nodes.

One run of 4 tpu7x 16x24x24 units (2,304 hosts each: 9,216 learner pods) and the real
`diloco-operator` process: created -> every pod Running; the operator's RSS and CPU and its API
requests per reconcile pass with every pod Running; one host of one unit fails -> that unit's
pods replaced, no other unit touched; the run deleted -> no pod left.

Thousands of fake nodes per unit are beyond a 2-core machine's control plane (their leases
alone), so each fake node here has 64 chips and takes 16 hosts' pods: the pods, Jobs and watch
events are those of 4 real slices, the nodes a sixteenth. Each unit still gets its own node pool
(the exclusive-topology affinity keeps one unit per pool). 16 such units (36,864 pods) were
tried on 2026-12-06 and stopped after 10 minutes: 18,500 pods created, 486 Running, the API
server at 8.8 GiB and the scheduler at 3.9 GiB resident, on 24 GiB (docs/design.md, "Units of
thousands of hosts").
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from bench.cluster.huge_units import (
    ACCELERATOR,
    FULL,
    NS,
    QUICK,
    Sampler,
    cluster_with,
    cpu_rate,
    kwok,
    requests_per_pass,
    run_manifest,
    timed,
    tpu7x_pool,
)
from bench.cluster.operator import Api, metric_sum, operator_process
from bench.lib.common import BenchContext, Section, md_table

HOSTS_PER_NODE = 16
UNITS, QUICK_UNITS = 4, 2
RUN = "fleet"


def fleet_pools(units: int, topology: str, hosts: int) -> list[Any]:
    nodes = -(-hosts // HOSTS_PER_NODE)
    return [
        kwok.NodePool("default-pool", 2, "e2-standard-8", "8", "32Gi"),
        *(
            tpu7x_pool(f"tpu7x-{topology}-{i}", nodes, topology, HOSTS_PER_NODE)
            for i in range(units)
        ),
    ]


class Jobs:
    """The run's Jobs as raw JSON: tens of small objects where its pods are tens of thousands."""

    def __init__(self, api: Api) -> None:
        self.batch = api.batch
        self.core = api.core

    def of(self) -> list[dict[str, Any]]:
        raw = self.batch.list_namespaced_job(
            NS,
            label_selector=f"diloco.dev/run={RUN},app.kubernetes.io/component=learner",
            _preload_content=False,
        )
        items: list[dict[str, Any]] = json.loads(raw.data)["items"]
        return [j for j in items if not j["metadata"].get("deletionTimestamp")]

    def ready(self, attempt: int | None = None, unit: str | None = None) -> int:
        """Ready pods of the run's live Jobs (of `attempt`, of `unit`)."""
        return sum(
            int(j.get("status", {}).get("ready") or 0)
            for j in self.of()
            if (attempt is None or j["metadata"]["labels"]["diloco.dev/attempt"] == str(attempt))
            and (unit is None or j["metadata"]["name"] == unit)
        )

    def attempts(self) -> dict[str, int]:
        return {
            j["metadata"]["name"]: int(j["metadata"]["labels"]["diloco.dev/attempt"])
            for j in self.of()
        }

    def any_pod_left(self) -> bool:
        raw = self.core.list_namespaced_pod(
            NS, label_selector=f"diloco.dev/run={RUN}", limit=1, _preload_content=False
        )
        return bool(json.loads(raw.data)["items"])

    def a_pod_of(self, unit: str) -> str:
        raw = self.core.list_namespaced_pod(
            NS, label_selector=f"diloco.dev/unit={unit}", limit=1, _preload_content=False
        )
        name: str = json.loads(raw.data)["items"][0]["metadata"]["name"]
        return name


def fleet_manifest(units: int, topology: str) -> dict[str, Any]:
    doc = run_manifest(RUN, topology)
    doc["spec"]["replicas"] = units
    return doc


def measure(units: int, topology: str, hosts: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="diloco-huge-fleet-"))
    pools = fleet_pools(units, topology, hosts)
    with cluster_with(pools) as cluster:
        out["cluster_start_s"] = cluster.timings.get("total_start_s")
        out["nodes"] = sum(p.nodes for p in pools)
        api = Api(cluster.kubeconfig)
        jobs = Jobs(api)
        with operator_process(cluster.kubeconfig, work / "operator.log") as (proc, port):
            sampler = Sampler(proc)
            cpu0 = sampler.cpu_s()
            api.create_run(fleet_manifest(units, topology))
            out["create_s"] = timed(
                f"{units} units of {hosts} pods: created -> every pod Ready",
                lambda: jobs.ready() >= units * hosts,
                3600,
            )
            out["requests_per_pass"] = requests_per_pass(port, 30)
            out["steady_cpu"] = cpu_rate(sampler, 30)
            out["steady_rss"] = proc.memory_info().rss

            victim_unit = f"{RUN}-tpu7x-0"
            before = jobs.attempts()
            api.core.patch_namespaced_pod(
                jobs.a_pod_of(victim_unit),
                NS,
                {"metadata": {"labels": {kwok.POD_FAIL_LABEL: "true"}}},
            )
            out["recreate_s"] = timed(
                f"one host of {victim_unit} Failed -> every pod of its next attempt Ready",
                lambda: jobs.ready(attempt=1, unit=victim_unit) >= hosts,
                1800,
            )
            after = jobs.attempts()
            out["others_untouched"] = all(
                after.get(name) == attempt
                for name, attempt in before.items()
                if name != victim_unit
            )
            api.custom.delete_namespaced_custom_object(
                "diloco.dev", "v1alpha1", NS, "dilocoruns", RUN
            )
            out["delete_s"] = timed(
                "run deleted -> no pod left", lambda: not jobs.any_pod_left(), 3600
            )
            out["operator_cpu_s"] = sampler.cpu_s() - cpu0
            out["requests_total"] = metric_sum(port, "diloco_operator_api_requests_total")
            out["passes"] = metric_sum(port, "diloco_operator_reconcile_passes_total")
            sampler.stop()
            out["peak_rss"] = max(r for _, r in sampler.rss)
    return out


def run(ctx: BenchContext) -> Section:
    units = QUICK_UNITS if ctx.quick else UNITS
    topology, hosts = QUICK if ctx.quick else FULL
    m = measure(units, topology, hosts)
    mib = 2**20
    pods = units * hosts
    rows = [
        (f"control plane start ({m['nodes']} fake nodes)", f"{m['cluster_start_s']} s", "-", "-"),
        (f"created -> all {pods} pods Ready", f"{m['create_s']:.1f} s", "-", "-"),
        (
            "API requests per reconcile pass, every pod Running",
            f"{m['requests_per_pass']:.1f}",
            "independent of the pods",
            "**met**" if m["requests_per_pass"] <= 1 else "not met",
        ),
        (
            "operator RSS, every pod Running / peak",
            f"{m['steady_rss'] / mib:.0f} / {m['peak_rss'] / mib:.0f} MiB",
            "< 1 GiB",
            "**met**" if m["peak_rss"] < 2**30 else "not met",
        ),
        ("operator CPU, steady", f"{100 * m['steady_cpu']:.0f}%", "-", "-"),
        (
            f"one host Failed -> all {hosts} pods of its unit's next attempt Ready",
            f"{m['recreate_s']:.1f} s",
            "-",
            "-",
        ),
        (
            "the other units kept their attempt",
            "yes" if m["others_untouched"] else "NO",
            "yes",
            "**met**" if m["others_untouched"] else "not met",
        ),
        ("run deleted -> no pod left", f"{m['delete_s']:.1f} s", "-", "-"),
        (
            "API requests of the whole bench / passes",
            f"{m['requests_total']:.0f} / {m['passes']:.0f}",
            "-",
            "-",
        ),
        ("operator CPU over the whole bench", f"{m['operator_cpu_s']:.0f} s", "-", "-"),
    ]
    body = "\n".join(
        [
            __doc__.split("\n\n")[1],
            "",
            __doc__.split("\n\n")[2],
            "",
            md_table(["what", "measured", "target", "met"], rows),
        ]
    )
    config = (
        f"one run of {units} {ACCELERATOR} {topology} units ({hosts} hosts each, {pods} pods) "
        f"on {m['nodes']} fake nodes of {HOSTS_PER_NODE} hosts' chips; fake syncers; operator "
        "--poll-interval 5 (default)"
    )
    return Section("huge_fleet", "Huge units: a fleet", body, ctx.command, config, quick=ctx.quick)


if __name__ == "__main__":
    import sys

    from bench.run import main

    raise SystemExit(main(["--only", "huge_fleet", *sys.argv[1:]]))

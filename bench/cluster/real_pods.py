"""Real pods on the e2e cluster's real node: apply -> first training step in the run's status, and
a killed learner -> its replacement training again (docs/e2e.md, "The real node").

The scenarios are e2e modules themselves, run by pytest on one fresh local cluster:
`e2e/tests/test_09_real_workload.py` (a chaos kill from the manifest, a SIGKILL inside a
learner's container five times: its supervisor forks a new one; once with the supervisor: the
kubelet restarts the container; then once more: recreated; and a deleted pod, each timed from
the fault to the new learner having joined with the global parameters), `test_15_multi_host_unit`
(one host of a two-pod unit SIGKILLed: both restart in their pods) and `test_16_warm_spare` (a
unit's pod deleted: a warm spare covers it until the recreated pod is back) and
`test_17_goodput_under_crashes` (two units, each one's learner SIGKILLed once a minute for five
minutes: each unit's goodput over the window, >= 0.95). The modules write
what they measured beside DILOCO_E2E_TIMINGS; this section reads it. Needs root (the real
node); targets: restarts in place <= 3 s, recreations <= 5 s (medians), a spare's takeover
<= 2 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.lib.common import REPO, BenchContext, Section, log, md_table, median

MODULE = "e2e/tests/test_09_real_workload.py"
MODULES = (
    MODULE,
    "e2e/tests/test_15_multi_host_unit.py",
    "e2e/tests/test_16_warm_spare.py",
    "e2e/tests/test_17_goodput_under_crashes.py",
)
SPARE_TAKEOVER_TARGET_S = 2.0  # unit pod lost -> the spare joined as the unit
GOODPUT_TARGET = 0.95  # each unit, one learner crash per unit per minute
IN_PLACE_SAMPLES = 6  # SIGKILLs of one learner in its pod: 5 of the learner, then its container
IN_PLACE_TARGET_S = 3.0  # median, crash -> training again in the same pod
RECREATE_TARGET_S = 5.0  # median, pod lost -> training again in a new pod


def _median_row(what: str, samples: list[float], target: float) -> list[str]:
    med = median(samples)
    return [what, f"{med:.1f} s", f"{'met' if med <= target else 'NOT met'} (<= {target:g} s)"]


def run(ctx: BenchContext) -> Section:
    out = Path(tempfile.mkdtemp(prefix="real-pods-")) / "timings.json"
    env = {
        **os.environ,
        "DILOCO_E2E_TIMINGS": str(out),
        "DILOCO_E2E_REQUIRE": "1",
        "DILOCO_E2E_IN_PLACE_RESTARTS": str(IN_PLACE_SAMPLES),
    }
    log(f"pytest {' '.join(MODULES)} (a fresh local cluster with the real node)")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", *MODULES, "-p", "no:cacheprovider"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"{MODULES} failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-2000:]}"
        )
    t = json.loads(out.read_text())
    unit = json.loads(out.with_name("multi_host.json").read_text())
    spare = json.loads(out.with_name("spare.json").read_text())
    crashes = json.loads(out.with_name("goodput.json").read_text())
    worst = min(crashes["ratios"].values())
    samples = list(zip(t["replacement_what"], [float(x) for x in t["replacement_s"]], strict=True))
    supervised = [x for what, x in samples if "by its supervisor" in what]
    by_kubelet = [x for what, x in samples if "by the kubelet" in what]
    recreated = [x for what, x in samples if "in its pod" not in what and "syncer" not in what]
    rows = [
        ["kubectl apply -> first training step in status", f"{t['first_step_s']:.1f} s", "-"],
        *[[f"{i + 1}: {what} -> joined", f"{x:.1f} s", ""] for i, (what, x) in enumerate(samples)],
        _median_row(
            f"learner crash -> forked again by its supervisor, median of {len(supervised)}",
            supervised,
            IN_PLACE_TARGET_S,
        ),
        [
            f"container crash -> restarted by the kubelet, median of {len(by_kubelet)}",
            f"{median(by_kubelet):.1f} s",
            "-",
        ],
        _median_row(
            f"learner pod lost -> recreated, median of {len(recreated)}",
            recreated,
            RECREATE_TARGET_S,
        ),
        [
            "syncer pod deleted -> new syncer restored its checkpoint",
            f"{t['syncer_restore_s']:.1f} s",
            "-",
        ],
        _median_row(
            "two-pod unit, one host's learner SIGKILLed -> both restarted in their pods, "
            "training again (1 sample)",
            [float(unit["restart_s"])],
            IN_PLACE_TARGET_S,
        ),
        _median_row(
            "unit pod deleted -> a warm spare joined as the unit (1 sample)",
            [float(spare["takeover_joined_s"])],
            SPARE_TAKEOVER_TARGET_S,
        ),
        [
            "unit pod deleted -> the spare's first step as the unit",
            f"{float(spare['takeover_step_s']):.1f} s",
            "-",
        ],
        [
            "unit pod deleted -> recreated unit Online, the spare waiting again",
            f"{float(spare['handback_s']):.1f} s",
            "-",
        ],
        [
            f"goodput, one learner crash per unit per minute ({crashes['crashes']} crashes "
            f"over {crashes['window_s']:.0f} s), the lower unit's; each: "
            + ", ".join(f"{r:.3f}" for r in crashes["ratios"].values()),
            f"{worst:.3f}",
            f"{'met' if worst >= GOODPUT_TARGET else 'NOT met'} (>= {GOODPUT_TARGET:g})",
        ],
    ]
    final = t.get("final_status", {})
    units = [
        [
            u["name"],
            u["state"],
            u["attempt"],
            u.get("restarts", 0),
            u.get("restartsInPlace", 0),
            (u.get("goodput") or {}).get("ratio"),
        ]
        for u in final.get("units", [])
    ]
    body = "\n".join(
        [
            md_table(["what", "measured", "target"], rows),
            "",
            f"The run at the end: phase {final.get('phase')}, outer step {final.get('outerStep')}, "
            f"tokens {final.get('tokens')}, finalLoss {final.get('finalLoss')}.",
            "",
            md_table(["unit", "state", "attempt", "restarts", "in place", "goodput"], units),
            "",
            "```",
            t.get("get_dlr", "").strip(),
            "```",
            "",
            "The cluster's nodes (KWOK's fake GKE pools and the real node):",
            "",
            "```",
            t.get("nodes", "").strip(),
            "```",
            "",
            "Each is timed from the fault (the chaos kill's Event, the SIGKILL, the delete) to "
            "the new learner process having joined the syncer with the global parameters. A "
            "restart by the supervisor is a fork of a process that imported JAX already, the "
            "compile from the pod's cache and the join; by the kubelet, its RestartAllContainers "
            "rule, the container start and the JAX import too; a recreation adds the "
            "operator noticing, the Job's deletion and recreation and scheduling. The last "
            "SIGKILL of the learner comes after its restarts in place are spent: it exits 3 and "
            "the unit is recreated. The first step includes the syncer's and learners' start "
            "and their first compile.",
            "",
            "The two-pod unit's restart is timed from the SIGKILL of host 1's learner to the "
            "run's tokens rising again: both supervisors restart their learners and the two "
            "form the JAX program again (jax.distributed's coordinator and gloo) before the "
            "first step. The spare's takeover is timed from the deletion of the unit's pod to "
            "the spare's log line of its join (and of its first step) as the unit, both in the "
            "spare pod's own log clock (one machine). Goodput is the operator's per-unit "
            "account over the window (seconds between consecutive heartbeats of one learner "
            "process whose step advanced, over the seconds the unit should have trained), each "
            "unit's learner SIGKILLed once a minute from the node.",
        ]
    )
    return Section(
        name="real_pods",
        title="Real pods: latencies on the e2e cluster's real node",
        body=body,
        command=ctx.command,
        config=f"{MODULE}: 2 CPU units (tiny model) and the syncer as containers of the "
        "trainer image; test_15: one unit of two pods; test_16: one unit and one warm spare; "
        "operator in-cluster from its image, warm images",
        quick=ctx.quick,
    )

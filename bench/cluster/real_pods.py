"""Real pods on the e2e cluster's real node: apply -> first training step in the run's status, and
a killed learner -> its replacement training again (docs/e2e.md, "The real node").

The scenario is the real-workload e2e module itself (`e2e/tests/test_09_real_workload.py`), run
by pytest on a fresh local cluster: a chaos kill from the manifest, a SIGKILL inside a learner's
container and a deleted pod, each timed from the fault to the new pod having joined with the
global parameters. The module writes what it measured to DILOCO_E2E_TIMINGS; this section reads it.
Needs root (the real node); the target is a median <= 15 s beyond the restart backoff.
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
TARGET_S = 15.0


def run(ctx: BenchContext) -> Section:
    out = Path(tempfile.mkdtemp(prefix="real-pods-")) / "timings.json"
    env = {**os.environ, "DILOCO_E2E_TIMINGS": str(out), "DILOCO_E2E_REQUIRE": "1"}
    log(f"pytest {MODULE} (a fresh local cluster with the real node)")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", MODULE, "-p", "no:cacheprovider"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"{MODULE} failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-2000:]}"
        )
    t = json.loads(out.read_text())
    replacements = [float(x) for x in t["replacement_s"]]
    med = median(replacements)
    backoff = float(t["backoff_s"])
    rows = [
        ["kubectl apply -> first training step in status", f"{t['first_step_s']:.1f} s", "-"],
        *[
            [f"replacement {i + 1}: {what} -> new pod joined", f"{x:.1f} s", ""]
            for i, (what, x) in enumerate(zip(t["replacement_what"], replacements, strict=True))
        ],
        [
            "replacement, median",
            f"{med:.1f} s",
            f"{'met' if med - backoff <= TARGET_S else 'NOT met'} (<= {TARGET_S:g} s beyond "
            f"a {backoff:g} s backoff)",
        ],
        [
            "syncer pod deleted -> new syncer restored its checkpoint",
            f"{t['syncer_restore_s']:.1f} s",
            "-",
        ],
    ]
    final = t.get("final_status", {})
    units = [
        [
            u["name"],
            u["state"],
            u["attempt"],
            u.get("restarts", 0),
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
            md_table(["unit", "state", "attempt", "restarts", "goodput"], units),
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
            "A replacement is timed from the fault (the chaos kill's Event, the SIGKILL, the "
            "delete) to the new pod's learner having joined the syncer with the global "
            "parameters; it includes the operator noticing, the Job's deletion and recreation, "
            "scheduling, the container start (JAX import) and the join. The first step includes "
            "the syncer's and learners' start and their first compile.",
        ]
    )
    return Section(
        name="real_pods",
        title="Real pods: latencies on the e2e cluster's real node",
        body=body,
        command=ctx.command,
        config=f"{MODULE}: 2 CPU units (tiny model) and the syncer as containers of the "
        "trainer image, operator in-cluster from its image, warm images",
        quick=ctx.quick,
    )

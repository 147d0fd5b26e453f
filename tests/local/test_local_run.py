"""`diloco local run` end to end with the real syncer and learners as processes: a killed unit
rejoins (a warm spare takes it over) and the run completes; SIGTERM leaves no orphans, spare
included; a corrupt checkpoint is a clear error.

Kept small: a 1-layer width-32 model and 200k tokens (about 35 s of the fast unit beside the
rest of the run on two cores, so the syncer merges and evaluates after even a warm spare's
near-instant rejoin; the eval loss is near 2.7 by then); `slowdown` stretches
the slow unit's steps with sleep, so the run lasts long enough for a restart to rejoin without
burning CPU.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from diloco_operator.local.manifest import load_manifest
from diloco_operator.local.runtime import LocalRuntime, RunAborted, RunOptions
from rich.console import Console

pytestmark = pytest.mark.slow

BUDGET_TOKENS = 200_000


def manifest(tmp_path: Path, **training: Any) -> Path:
    doc = {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DilocoRun",
        "metadata": {"name": "t"},
        "spec": {
            "image": "local",
            # Global indices: the fixed groups first (slow-0 = 0), then the first group
            # (fast-0 = 1). The slow unit alone needs long for the budget, so the killed fast
            # unit surely rejoins before the run completes, and finishes it once back.
            "replicas": 1,
            "unitGroups": [{"name": "fast"}, {"name": "slow", "replicas": 1}],
            "training": {
                "model": {"preset": "tiny", "dModel": 32, "nLayers": 1, "nHeads": 2, "seqLen": 32},
                "data": {"batchSize": 4, "maxBytes": 65536},
                "innerSteps": 5,
                "fragments": 2,
                "totalTokens": BUDGET_TOKENS,
                "heartbeatSeconds": 0.5,
                "checkpoint": {"everySeconds": 2},
                "eval": {"everySeconds": 2, "batches": 1},
                **training,
            },
            # Chaos hits a unit only once it has run healthily (Online this long, past step 0).
            # At the default 10 s the fast unit could finish the whole budget first (it trains
            # it in about 10 s on an idle machine) and never be killed.
            "failurePolicy": {
                "restartBackoffSeconds": 0.5,
                "offlineAfterSeconds": 60,
                "healthyAfterSeconds": 1,
            },
            # Kill the fast unit as soon as it may be hit (chaos waits for its target).
            "chaos": {
                "schedule": [{"atSeconds": 0, "action": "kill", "unit": 1}],
                "slowdown": {"slow": 50},
            },
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def diloco(*args: str) -> list[str]:
    return [sys.executable, "-m", "diloco_operator.cli", "local", "run", *args]


def processes_of(manifest_path: Path) -> list[psutil.Process]:
    """Live processes whose command line names this path (unique to the test)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = proc.info["cmdline"] or []
            mine = any(str(manifest_path) in arg for arg in cmd)
            if mine and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def events(report: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (report / "events.jsonl").read_text().splitlines()]


def test_killed_unit_rejoins_and_run_completes(tmp_path: Path) -> None:
    path = manifest(tmp_path)
    report = tmp_path / "report"
    done = subprocess.run(
        diloco(str(path), "--chaos", "--report-dir", str(report)),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"report: {report.resolve()}" in done.stderr
    summary = json.loads((report / "summary.json").read_text())
    assert summary["complete"] is True
    assert summary["tokens"] >= BUDGET_TOKENS
    assert summary["unitKills"] == 1 and summary["killsSurvived"] == 1
    assert summary["restarts"] >= 1 and summary["rejoins"] >= 1
    # The final eval loss is the syncer's evaluation at the budget, not the last periodic one.
    assert summary["finalEvalLossSource"] == "final"
    assert summary["lastPeriodicEvalLoss"] is not None
    # It learned through the kill: below an untrained byte model's ln(256) = 5.55 by a margin
    # (one learner alone reaches ~2.4 on this config; before pushes carried only new progress
    # and the syncer compiled its outer step ahead, runs of this test ended at 7.5-9.9).
    assert 0 < summary["finalEvalLoss"] < 4.0
    assert 0.0 < summary["goodput"] <= 1.0

    story = [(e["kind"], e["unit"], e["message"]) for e in events(report)]
    kinds = [k for k, _, _ in story]
    unit0 = "t-fast-0"
    kill = story.index(("chaos-kill", unit0, "SIGKILL"))
    failed = next(i for i, (k, u, _) in enumerate(story) if k == "unit-failed" and u == unit0)
    restarted = story.index(("unit-restarted", unit0, f"{unit0} recreated as attempt 1"))
    rejoined = story.index(("unit-online", unit0, f"{unit0} attempt 1 online"))
    assert kill < failed < restarted < rejoined < kinds.index("run-complete")
    final = [e for e in events(report) if e["kind"] == "final-eval"]
    assert len(final) == 1 and final[0]["data"]["loss"] == summary["finalEvalLoss"]
    assert kinds.index("run-complete") < kinds.index("final-eval") < kinds.index("stopped")
    assert "event=final_eval " in (report / "logs" / "syncer.log").read_text()
    # Attempt 1 is the warm spare started with the run (it had imported JAX and compiled the
    # train step already), and the runtime started another spare in its place.
    taken = [e for e in events(report) if e["kind"] == "spare-taken" and e["unit"] == unit0]
    assert len(taken) == 1 and taken[0]["message"].startswith("attempt 1 is warm spare pid")
    assert kinds.count("spare-started") >= 2
    unit_log = (report / "logs" / f"{unit0}.log").read_text()
    assert f"event=standby_taken unit={unit0} attempt=1 pid={taken[0]['data']['pid']}" in unit_log
    assert "event=joined unit=t-fast-0 attempt=1" in unit_log
    # Attempt 1 continues the LR schedule where the syncer counted attempt 0's steps, or
    # further on when the run went on without it (it catches up with the run, never back).
    after = unit_log[unit_log.index("event=joined unit=t-fast-0 attempt=1") :]
    resume = re.search(r"resume_step=(\d+)", after)
    assert resume is not None
    offsets = [
        int(schedule_step) - int(step)
        for step, schedule_step in re.findall(
            r"event=progress \S+ step=(\d+) schedule_step=(\d+)", after
        )
    ]
    assert offsets and offsets[0] >= int(resume.group(1)) and offsets == sorted(offsets)
    assert "event=standby_ready" in (report / "logs" / "spares.log").read_text()
    for name in ("loss_vs_time.png", "loss_vs_tokens.png", "timeline.png"):
        assert (report / name).stat().st_size > 5000
    assert (report / "logs" / f"{unit0}.log").read_text()
    assert processes_of(path) == []


def test_sigterm_stops_everything_without_orphans(tmp_path: Path) -> None:
    path = manifest(tmp_path, totalTokens=10_000_000)
    report = tmp_path / "report"
    sup = subprocess.Popen(
        diloco(str(path), "--report-dir", str(report)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        spares: list[int] = []
        while time.monotonic() < deadline and not spares:
            time.sleep(0.2)
            if (report / "events.jsonl").exists():
                spares = [e["data"]["pid"] for e in events(report) if e["kind"] == "spare-started"]
        assert spares, "supervisor did not start a warm spare"
        # The syncer, the fork server, both learners and the spare (forked: its parent is the
        # fork server, so it is a descendant of the supervisor, not a direct child); all busy
        # importing and compiling when the SIGTERM comes.
        pids = _descendants_once(sup.pid, spares[0], deadline)
        assert len(pids) >= 5, pids
        assert spares[0] in pids
        os.kill(sup.pid, signal.SIGTERM)
        _, err = sup.communicate(timeout=60)
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
    assert sup.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
    left = [pid for pid in pids if psutil.pid_exists(pid) and _not_zombie(pid)]
    assert not left, [_cmdline(pid) for pid in left]
    assert processes_of(path) == []
    summary = json.loads((report / "summary.json").read_text())
    assert summary["exitReason"] == "interrupted by SIGTERM"
    assert summary["complete"] is False
    assert [e["kind"] for e in events(report)][-1] == "stopped"


def _descendants_once(pid: int, spare: int, deadline: float) -> list[int]:
    """The supervisor's descendants as soon as they include the spare and number five or more
    (or whatever they are at `deadline`)."""
    while True:
        pids = [p.pid for p in psutil.Process(pid).children(recursive=True)]
        if (len(pids) >= 5 and spare in pids) or time.monotonic() > deadline:
            return pids
        time.sleep(0.1)


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:200]
    except psutil.Error:
        return f"{pid} (gone)"


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_corrupt_checkpoint_is_rejected_before_start(tmp_path: Path) -> None:
    path = manifest(tmp_path)
    ckpt = tmp_path / "ckpt"
    (ckpt / "ckpt-0000000001").mkdir(parents=True)
    (ckpt / "ckpt-0000000001" / "manifest.json").write_text("{not json")
    report = tmp_path / "r"
    done = subprocess.run(
        diloco(str(path), "--resume-from", str(ckpt), "--report-dir", str(report)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--resume-from: checkpoint.path" in done.stderr
    assert "holds no valid checkpoint" in done.stderr and "manifest.json unreadable" in done.stderr
    assert "Traceback" not in done.stderr
    assert not report.exists()


def test_syncer_that_cannot_start_aborts_with_its_message(tmp_path: Path) -> None:
    """The abort path for a syncer that dies before serving (e.g. a checkpoint of another
    model): a real process that fails the way diloco-syncer does."""
    run = load_manifest(manifest(tmp_path))
    failing = "import sys; print('diloco-syncer: cannot start: shapes differ'); sys.exit(1)"
    opts = RunOptions(
        report_dir=tmp_path / "r",
        live=False,
        syncer_argv=(sys.executable, "-c", failing),
        learner_argv=(sys.executable, "-c", "import time; time.sleep(60)"),
    )
    with pytest.raises(RunAborted, match="diloco-syncer: cannot start: shapes differ"):
        LocalRuntime(run, opts, console=Console(file=io.StringIO())).execute()
    assert processes_of(tmp_path) == []
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["exitReason"].startswith("aborted: the syncer failed to start (exit code 1)")

"""`diloco local run` with `syncer.shards: 2`: two syncer processes split the fragments, each with
its warm standby. SIGKILL one shard's serving syncer: its standby serves every version it
published, the other shard never stops merging, and the run completes with shard 0's final
evaluation of the whole model."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.local.test_local_run import diloco, events, manifest, processes_of
from tests.local.test_local_syncer_standby import _text, kinds, wait_for

pytestmark = pytest.mark.slow


def sharded_manifest(tmp_path: Path) -> Path:
    # Checkpoints every 10 minutes: what the killed shard merged lives only in its journal.
    path = manifest(tmp_path, fragments=4, totalTokens=180_000, checkpoint={"everySeconds": 600})
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["syncer"] = {"shards": 2}
    doc["spec"]["chaos"]["schedule"] = []
    path.write_text(yaml.safe_dump(doc))
    return path


def merged(log: str) -> dict[int, int]:
    """fragment -> the newest version a syncer's log says it merged."""
    found: dict[int, int] = {}
    for f, v in re.findall(r"event=merged fragment=(\d+) version=(\d+)", log):
        found[int(f)] = max(found.get(int(f), 0), int(v))
    return found


def test_a_killed_shard_fails_over_alone_and_the_run_completes(tmp_path: Path) -> None:
    path = sharded_manifest(tmp_path)
    report = tmp_path / "report"
    logs = report / "logs"
    sup = subprocess.Popen(
        diloco(str(path), "--report-dir", str(report)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        for key in ("syncer", "syncer-1"):
            wait_for(
                f"{key}'s standby",
                lambda key=key: "event=standby_ready" in _text(logs / f"{key}-standby-1.log"),
            )
        wait_for(
            "merges on shard 1", lambda: sum(merged(_text(logs / "syncer-1.log")).values()) >= 4
        )
        lead_before = merged(_text(logs / "syncer.log"))
        os.kill(int((logs / "syncer-1.lock").read_text()), signal.SIGKILL)
        wait_for("the take-over", lambda: "syncer-standby-took-over" in kinds(report))
        killed = merged(_text(logs / "syncer-1.log"))
        standby_log = _text(logs / "syncer-1-standby-1.log")
        took = re.search(r"event=took_over seconds=\S+ versions=\[([\d, ]+)\]", standby_log)
        assert took is not None, standby_log[-2000:]
        taken = [int(v) for v in took.group(1).split(",")]
        # Every version the killed shard published is served by its standby (one more at most:
        # a merge journaled but not yet logged when the kill fell), none renumbered.
        for f, version in killed.items():
            assert version <= taken[f] <= version + 1, (f, version, taken)
        assert "versions_lost" not in standby_log
        _, err = sup.communicate(timeout=400)
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
    assert sup.returncode == 0, err.decode()[-3000:]
    lead_log = _text(logs / "syncer.log")
    # The shards hold disjoint fragments, and shard 0 kept merging its own through the kill.
    assert set(merged(lead_log)).isdisjoint(killed) and set(merged(lead_log)) | set(killed) == {
        0,
        1,
        2,
        3,
    }
    assert sum(merged(lead_log).values()) > sum(lead_before.values())
    # The standby merged after taking over (pushes it refused as not_joined were sent again).
    assert "event=merged " in _text(logs / "syncer-1-standby-1.log")[took.end() :]
    summary = json.loads((report / "summary.json").read_text())
    assert summary["complete"] is True and summary["finalEvalLossSource"] == "final"
    assert 0 < summary["finalEvalLoss"] < 4.0
    took_over = [e for e in events(report) if e["kind"] == "syncer-standby-took-over"]
    assert [e["unit"] for e in took_over] == ["syncer-1"]
    assert processes_of(path) == []

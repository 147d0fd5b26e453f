"""Goodput, rejoins and the report files of a local run, from hand-made observations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from diloco_operator.local.recorder import GlobalSample, Heartbeat, Recorder
from diloco_operator.local.report import (
    build_summary,
    compute_goodput,
    count_rejoins,
    eval_points,
    state_spans,
    write_report,
)
from diloco_trainer.status import SyncerStatus


def hb(unit: str, attempt: int, t: float, step: int) -> Heartbeat:
    return Heartbeat(unit=unit, attempt=attempt, time=t, step=step, tokens=step * 10)


def test_goodput_counts_progress_between_heartbeats_only() -> None:
    beats = [
        # unit a: compiling (step 0) until 100 s, steady progress to 104 s, killed; attempt 1
        # heartbeats from 115 s (restart cost counts against it), progress from 117 s
        hb("a", 0, 98, 0),
        hb("a", 0, 100, 0),
        hb("a", 0, 102, 5),
        hb("a", 0, 104, 10),
        hb("a", 1, 115, 10),
        hb("a", 1, 117, 10),
        hb("a", 1, 120, 15),
        # unit b: progress, then a heartbeat without progress (stalled), then progress
        hb("b", 0, 101, 3),
        hb("b", 0, 103, 3),
        hb("b", 0, 105, 8),
        # unit c: joined but never trained: not accounted
        hb("c", 0, 101, 0),
        hb("c", 0, 110, 0),
    ]
    good = compute_goodput(beats, [], {"a": 90.0, "b": 91.0, "c": 92.0}, end=120.0)
    # a: useful 4 (attempt 0) + 3 (attempt 1) of 20 s; b: useful 2 of 17 s (from 103 s).
    assert good.useful_seconds == pytest.approx(9.0)
    assert good.total_seconds == pytest.approx(37.0)
    assert good.ratio == pytest.approx(9 / 37)
    assert good.startup_seconds == pytest.approx(10.0 + 12.0)
    assert good.per_unit["a"] == pytest.approx(7 / 20)
    assert "c" not in good.per_unit


def test_goodput_ends_when_the_budget_is_reached() -> None:
    """Learner-seconds after the end (the budget reached) are no part of the run: an interval
    that straddles it counts up to it, later ones not at all."""
    beats = [hb("a", 0, 0, 0), hb("a", 0, 1, 5), hb("a", 0, 2, 10), hb("a", 0, 3, 15)]
    good = compute_goodput(beats, [], {}, end=1.5)
    assert good.useful_seconds == pytest.approx(1.5)
    assert good.total_seconds == pytest.approx(1.5)
    assert good.ratio == pytest.approx(1.0)


def test_goodput_subtracts_time_a_unit_was_stopped() -> None:
    beats = [hb("a", 0, 0, 0), hb("a", 0, 10, 20)]
    good = compute_goodput(beats, [("a", 2.0, 6.0), ("other", 0.0, 10.0)], {}, end=10.0)
    assert good.useful_seconds == pytest.approx(6.0)
    assert good.ratio == pytest.approx(0.6)


def test_goodput_without_heartbeats_is_zero_not_an_error() -> None:
    good = compute_goodput([], [], {"a": 0.0}, end=10.0)
    assert (good.useful_seconds, good.total_seconds, good.ratio) == (0.0, 0.0, 0.0)


def test_rejoins_count_restarted_attempts_that_reached_the_syncer() -> None:
    beats = [hb("a", 1, 5, 1), hb("a", 1, 6, 2), hb("a", 3, 9, 1), hb("b", 0, 1, 1)]
    assert count_rejoins(beats) == 2


def sample(t: float, loss: float | None, tokens: int = 0) -> GlobalSample:
    return GlobalSample(t, 0, 0, tokens, loss, None, 0, 0)


def test_eval_points_keep_each_evaluation_once() -> None:
    points = eval_points([sample(0, None), sample(1, 5.0), sample(2, 5.0), sample(3, 4.0)])
    assert [(p.time, p.loss) for p in points] == [(1, 5.0), (3, 4.0)]


def test_state_spans_cover_until_the_end() -> None:
    rec = Recorder(started_at=100.0)
    rec.state(100.0, "u", "pending")
    rec.state(101.0, "u", "online")
    rec.state(101.5, "u", "online")  # no change: not stored
    rec.state(104.0, "u", "offline")
    assert state_spans(rec.states, end=110.0, t0=100.0)["u"] == [
        (0.0, 1.0, "pending"),
        (1.0, 3.0, "online"),
        (4.0, 6.0, "offline"),
    ]


def test_write_report_files(tmp_path: Path) -> None:
    rec = Recorder(started_at=1000.0, events_path=tmp_path / "events.jsonl")
    status = {
        "outerStep": 3,
        "steps": 40,
        "tokens": 4000,
        "loss": 4.5,
        "trainLoss": 4.7,
        "bytesSent": 123,
        "bytesReceived": 456,
        "learners": {"u0": {"attempt": 0, "lastHeartbeat": 1001.0, "step": 1}},
    }
    rec.observe_status(1001.0, SyncerStatus.from_json(status))
    rec.observe_status(
        1003.0,
        SyncerStatus.from_json(
            {
                **status,
                "loss": 4.1,
                "tokens": 8000,
                "learners": {"u0": {"attempt": 0, "lastHeartbeat": 1003.0, "step": 9}},
            }
        ),
    )
    rec.state(1000.0, "u0", "pending")
    rec.state(1001.0, "u0", "online")
    rec.event(1002.0, "chaos-kill", "u0", "SIGKILL")
    summary = write_report(
        rec,
        tmp_path,
        run_name="r",
        ended_at=1004.0,
        complete=True,
        unit_started={"u0": 1000.0},
        exit_reason="complete",
    )
    rec.close()
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == summary
    assert summary["finalEvalLoss"] == 4.1 and summary["lastPeriodicEvalLoss"] == 4.1
    assert summary["finalEvalLossSource"] == "periodic"  # no final evaluation was given
    assert summary["tokens"] == 8000
    assert summary["bytesSent"] == 123
    assert summary["unitKills"] == 1 and summary["killsSurvived"] == 1
    assert summary["goodput"] == pytest.approx(2 / 3, abs=1e-3)
    for name in ("loss_vs_time.png", "loss_vs_tokens.png", "timeline.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(x["kind"], x["elapsed"]) for x in lines] == [("chaos-kill", 2.0)]


def test_summary_prefers_the_syncers_final_evaluation() -> None:
    rec = Recorder(started_at=1000.0)
    rec.observe_status(1001.0, SyncerStatus(loss=4.5, tokens=10))
    summary = build_summary(
        rec,
        run_name="r",
        ended_at=1004.0,
        complete=True,
        unit_started={},
        exit_reason="complete",
        final_eval_loss=4.2,
    )
    assert summary["finalEvalLoss"] == 4.2 and summary["finalEvalLossSource"] == "final"
    assert summary["lastPeriodicEvalLoss"] == 4.5
    empty = build_summary(
        Recorder(started_at=1000.0),
        run_name="r",
        ended_at=1004.0,
        complete=False,
        unit_started={},
        exit_reason="stopped",
    )
    assert empty["finalEvalLoss"] is None and empty["finalEvalLossSource"] is None

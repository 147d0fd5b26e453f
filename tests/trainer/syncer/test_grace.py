"""The grace window policy (pure)."""

from __future__ import annotations

import pytest
from diloco_trainer.syncer.grace import Ema, grace_window, slack_seconds


def test_slack_is_overlap_steps_minus_time_already_spent() -> None:
    assert slack_seconds(2, 0.5, quorum_elapsed=0.2, sync_time=0.1, max_seconds=5) == pytest.approx(
        0.7
    )
    assert slack_seconds(2, 0.5, quorum_elapsed=2.0, sync_time=0.1, max_seconds=5) == 0.0
    assert slack_seconds(100, 1.0, 0.0, 0.0, max_seconds=3) == 3.0  # never above maxSeconds
    assert slack_seconds(2, None, 0.0, 0.0, max_seconds=1.5) == 1.5  # no estimate yet


def test_modes() -> None:
    assert grace_window("none", 2.0, [None], slack=1.0) == 0.0
    assert grace_window("fixed", 2.0, [0.1], slack=0.0) == 2.0
    assert grace_window("fixed", 2.0, [], slack=1.0) == 0.0  # everybody is in: no wait


def test_adaptive_waits_for_expected_stragglers_only() -> None:
    assert grace_window("adaptive", 5.0, [0.2, 0.4], slack=1.0) == pytest.approx(0.5)  # 1.25 x 0.4
    assert grace_window("adaptive", 5.0, [0.2, 3.0], slack=1.0) == pytest.approx(
        0.25
    )  # 3.0 won't make it
    assert grace_window("adaptive", 5.0, [3.0], slack=1.0) == 0.0
    assert grace_window("adaptive", 5.0, [0.9], slack=1.0) == pytest.approx(1.0)  # capped at slack
    assert grace_window("adaptive", 5.0, [None, 0.1], slack=1.0) == 1.0  # unknown: whole slack
    assert grace_window("adaptive", 5.0, [0.1], slack=0.0) == 0.0
    # Phase-locked: anyone expected within the slack gets all of it; later ones still do not.
    assert grace_window("adaptive", 5.0, [0.2, 3.0], slack=1.0, whole_slack=True) == 1.0
    assert grace_window("adaptive", 5.0, [3.0], slack=1.0, whole_slack=True) == 0.0


def test_ema() -> None:
    e = Ema(0.5)
    assert e.value is None
    assert e.update(4.0) == 4.0
    assert e.update(2.0) == 3.0


def test_expected_arrival_from_last_push_and_step_time() -> None:
    from diloco_trainer.syncer.fragment import expected_arrival

    assert expected_arrival(100.0, 0.02, 50, now=100.4) == pytest.approx(0.6)
    assert expected_arrival(100.0, 0.02, 50, now=102.0) is None  # overdue: may come any moment
    assert expected_arrival(None, 0.02, 50, now=100.0) is None
    assert expected_arrival(100.0, None, 50, now=100.0) is None

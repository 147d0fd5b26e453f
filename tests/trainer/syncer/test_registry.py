"""The syncer's learner registry: who a phase-locked merge waits for and is a share of."""

from __future__ import annotations

from diloco_trainer.syncer.registry import LearnerRegistry


def test_in_phase_drops_silent_units_and_attempts_newer_than_the_last_merge() -> None:
    reg = LearnerRegistry(offline_after=10.0)
    for unit in ("a", "b", "c"):
        reg.seen(unit, 0, "default", now=100.0)
    reg.heartbeat("a", 0, "default", 50, 100, 1.0, None, now=110.0)
    reg.heartbeat("b", 0, "default", 50, 100, 1.0, None, now=107.0)  # silent for 4 s at 111
    reg.seen("c", 1, "default", now=108.0)  # a replacement of c, joined after the merge at 105
    assert reg.online(111.0) == ["a", "b", "c"]
    assert reg.in_phase(111.0, fresh_within=2.0, last_merge=105.0) == ["a"]
    assert reg.in_phase(111.0, fresh_within=5.0, last_merge=105.0) == ["a", "b"]
    # After the next merge the replacement has installed a version: in step again.
    assert reg.in_phase(111.0, fresh_within=5.0, last_merge=109.0) == ["a", "b", "c"]
    # A fragment never merged: every fresh unit starts its countdown at the same step.
    assert reg.in_phase(111.0, fresh_within=5.0, last_merge=None) == ["a", "b", "c"]


def test_in_phase_falls_back_to_every_fresh_unit_when_all_restarted() -> None:
    reg = LearnerRegistry()
    reg.seen("a", 3, "default", now=200.0)
    reg.seen("b", 2, "default", now=201.0)
    assert reg.in_phase(202.0, fresh_within=5.0, last_merge=150.0) == ["a", "b"]


def test_restored_units_count_as_in_phase() -> None:
    reg = LearnerRegistry()
    reg.seen("a", 0, "default", now=10.0)
    restored = LearnerRegistry()
    restored.load_json(reg.to_json(), now=500.0)
    restored.heartbeat("a", 0, "default", 5, 10, 1.0, None, now=501.0)
    assert restored.in_phase(502.0, fresh_within=5.0, last_merge=400.0) == ["a"]


def test_a_superseded_attempt_counts_up_to_its_last_accepted_push() -> None:
    """Attempt 0 trained 50 steps and pushed at step 40, then died; attempt 1 resumes the data
    from the step-40 position and trains steps 41-50 again. Counting all 50 of attempt 0 would
    count those ten steps (and their data) twice."""
    reg = LearnerRegistry()
    reg.seen("a", 0, "default", now=1.0)
    reg.pushed("a", 0, 20)
    reg.pushed("a", 0, 40)
    reg.pushed("a", 0, 30)  # a retried older push changes nothing
    reg.heartbeat("a", 0, "default", 50, 50 * 64, 1.0, None, now=2.0)
    assert reg.totals() == (50, 50 * 64)  # the newest attempt counts all it reported
    reg.seen("a", 1, "default", now=3.0)  # attempt 1 joins
    assert reg.totals() == (40, 40 * 64)
    assert reg.resume_step("a", 1) == 40  # its LR schedule continues where its data does
    reg.heartbeat("a", 1, "default", 7, 7 * 64, 1.0, None, now=4.0)
    assert reg.totals() == (47, 47 * 64)
    reg.seen("a", 2, "default", now=5.0)  # attempt 1 died before its first push
    assert reg.totals() == (40, 40 * 64)
    status = reg.status(now=6.0)["a"]
    assert (status.step, status.tokens) == (40, 40 * 64)


def test_counted_pushes_survive_a_checkpoint_and_older_checkpoints_count_every_step() -> None:
    reg = LearnerRegistry()
    reg.seen("a", 0, "default", now=1.0)
    reg.heartbeat("a", 0, "default", 50, 50 * 64, 1.0, None, now=2.0)
    reg.pushed("a", 0, 40)
    reg.seen("a", 1, "default", now=3.0)
    restored = LearnerRegistry()
    restored.load_json(reg.to_json(), now=10.0)
    assert restored.totals() == (40, 40 * 64)
    older = reg.to_json()
    del older["a"]["pushed"]  # written before pushes were recorded
    legacy = LearnerRegistry()
    legacy.load_json(older, now=10.0)
    assert legacy.totals() == (50, 50 * 64)

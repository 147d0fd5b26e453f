"""What the supervisors rely on in the syncer's learner status (docs/contracts.md): a restarted
attempt is never reported with the dead attempt's heartbeat, which would look stale at once."""

from __future__ import annotations

from diloco_trainer.syncer.registry import LearnerRegistry


def test_new_attempt_does_not_inherit_the_old_heartbeat() -> None:
    reg = LearnerRegistry()
    reg.heartbeat("u", 0, "g", 5, 50, 1.0, 2.0, now=100.0)
    reg.seen("u", 1, "g", now=200.0)  # attempt 1 joins 100 s after attempt 0's last beat
    status = reg.status(201.0)["u"]
    assert status.attempt == 1
    assert status.age_seconds == 1.0
    reg.heartbeat("u", 1, "g", 1, 10, 1.0, 2.0, now=230.0)
    assert reg.status(231.0)["u"].last_heartbeat == 230.0

"""A learner restarted in its own pod counts its starts in the pod's volume, is a new attempt
at the syncer each time, and gives up (exit 3: the unit is recreated) once its restarts in place
are spent."""

from __future__ import annotations

from pathlib import Path

import pytest
from diloco_trainer.attempts import EXIT_GIVE_UP, STRIDE, split, wire_attempt
from diloco_trainer.learner.in_place import RestartsSpent, count_start
from diloco_trainer.learner.main import build_parser, main, resolve


def test_starts_are_counted_until_the_allowed_restarts_are_spent(tmp_path: Path) -> None:
    assert [count_start(tmp_path, 2) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RestartsSpent, match="the 2 restarts in place allowed"):
        count_start(tmp_path, 2)
    (tmp_path / "starts").write_text("garbage")
    with pytest.raises(RestartsSpent, match="not a count of starts"):
        count_start(tmp_path, 2)


def test_the_attempt_grows_with_either_kind_of_restart_and_splits_back() -> None:
    seen = [wire_attempt(r, i) for r in range(3) for i in range(3)]
    assert seen == sorted(set(seen))
    assert split(wire_attempt(4, 7)) == (4, 7)
    assert split(7) == (0, 7)
    with pytest.raises(ValueError, match="outside"):
        wire_attempt(1, STRIDE)


CONFIG = "totalSteps: 10\n"  # a bare training block


def learner_env(tmp_path: Path, allowed: int) -> dict[str, str]:
    return {
        "DILOCO_SYNCER_ADDR": "http://127.0.0.1:9",
        "DILOCO_UNIT": "0",
        "DILOCO_ATTEMPT": "2",
        "DILOCO_TOKEN": "t",
        "DILOCO_RESTART_DIR": str(tmp_path),
        "DILOCO_IN_PLACE_RESTARTS": str(allowed),
    }


def test_each_start_in_the_pod_is_a_new_attempt_at_the_syncer(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG)
    env = learner_env(tmp_path, 3)
    attempts = []
    for _ in range(3):
        args = build_parser(env).parse_args(["--config", str(config)])
        attempts.append(resolve(args, env)[1]["attempt"])
    assert attempts == [2 * STRIDE, 2 * STRIDE + 1, 2 * STRIDE + 2]


def test_a_learner_whose_restarts_are_spent_exits_to_be_recreated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG)
    (tmp_path / "starts").write_text("2")  # the first start and one restart in place
    assert main(["--config", str(config)], learner_env(tmp_path, 1)) == EXIT_GIVE_UP == 3
    assert "restarts in place allowed in this pod are spent" in capsys.readouterr().err

"""Learner pieces that need no syncer: delta sign, backoff, horizon, the CLI's bad-input exits."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from diloco_trainer.config import TrainingConfig
from diloco_trainer.learner import learner_horizon
from diloco_trainer.learner_main import build_parser, main
from diloco_trainer.standby import IdentityError, take_identity, wait_for_identity
from diloco_trainer.sync_link import Backoff, PendingPush, fragment_delta


def test_delta_is_base_minus_local_in_float32() -> None:
    base = {"a": np.array([1.0, 2.0], np.float32)}
    theta = {"a": jnp.array([0.5, 3.0], jnp.float32)}
    delta = fragment_delta(PendingPush(0, 3, base, theta, 4, 100, 4))
    assert delta["a"].dtype == np.float32
    np.testing.assert_allclose(delta["a"], [0.5, -1.0])


def test_backoff_grows_is_capped_and_resets() -> None:
    backoff = Backoff(first=0.1, cap=1.0)
    delays = [backoff.next_delay() for _ in range(8)]
    assert all(0.05 <= d <= 1.0 for d in delays)
    assert delays[-1] > delays[0] or delays[-1] >= 0.5
    backoff.reset()
    assert backoff.next_delay() <= 0.1


def test_learner_horizon_splits_the_budget() -> None:
    by_steps = TrainingConfig.model_validate({"totalSteps": 1000})
    assert learner_horizon(by_steps, 4) == 250
    by_tokens = TrainingConfig.model_validate(
        {"totalTokens": 16 * 128 * 90, "data": {"batchSize": 16}}
    )
    assert learner_horizon(by_tokens, 4) == 23


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_cli_config_error_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _write(tmp_path, "totalSteps: 10\ninnerSteps: 0\n")
    assert (
        main(["--config", config, "--unit", "0", "--syncer", "http://x:1", "--token", "t"], {}) == 2
    )
    assert "innerSteps" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--syncer", "http://x:1", "--token", "t"], {}, "--unit (or DILOCO_UNIT) is required"),
        (["--unit", "0", "--token", "t"], {}, "--syncer (or DILOCO_SYNCER_ADDR) is required"),
        (["--unit", "0", "--syncer", "http://x:1"], {}, "DILOCO_TOKEN_FILE"),
        (["--unit", "x", "--syncer", "http://x:1", "--token", "t"], {}, "must be an integer"),
        (
            ["--unit", "3", "--num-units", "3", "--syncer", "http://x:1", "--token", "t"],
            {},
            "< --num-units",
        ),
        (
            ["--unit", "0", "--syncer", "http://x:1", "--token", "t"],
            {"DILOCO_SLOWDOWN": "0.5"},
            ">= 1",
        ),
        (
            ["--syncer", "http://x:1"],
            {"DILOCO_UNIT": "0", "DILOCO_TOKEN_FILE": "/nonexistent"},
            "cannot read",
        ),
    ],
)
def test_cli_usage_errors_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    env: dict[str, str],
    message: str,
) -> None:
    config = _write(tmp_path, "totalSteps: 10\n")
    assert main(["--config", config, *argv], env) == 2
    assert message in capsys.readouterr().err


def test_standby_identity_is_one_json_line_and_end_of_input_releases() -> None:
    assert wait_for_identity(io.StringIO("")) is None
    identity = wait_for_identity(io.StringIO('{"unit": 2, "attempt": 1}\n{"ignored": 1}\n'))
    assert identity == {"unit": 2, "attempt": 1}
    with pytest.raises(IdentityError, match="not JSON"):
        wait_for_identity(io.StringIO("unit 2\n"))
    with pytest.raises(IdentityError, match="needs at least a unit"):
        wait_for_identity(io.StringIO('{"attempt": 1}\n'))


def test_standby_identity_becomes_the_learner_flags(tmp_path: Path) -> None:
    args = build_parser({}).parse_args(["--config", "x", "--standby"])
    take_identity(
        args,
        {"unit": 2, "unitName": "r-default-2", "numUnits": 4, "attempt": 3, "slowdown": 1.5},
    )
    assert (args.unit, args.unit_name, args.num_units, args.attempt, args.slowdown) == (
        "2",
        "r-default-2",
        "4",
        "3",
        "1.5",
    )
    assert args.group == "default"


@pytest.mark.slow
def test_standby_warms_up_then_validates_its_identity_like_flags(tmp_path: Path) -> None:
    """A real spare: it compiles first, then a bad identity is a usage error (exit 2) naming the
    flag, exactly as the same value given as a flag would be."""
    config = _write(
        tmp_path,
        "totalSteps: 10\nmodel: {preset: tiny, dModel: 32, nLayers: 1, nHeads: 2, seqLen: 32}\n"
        "data: {batchSize: 4, maxBytes: 65536}\n",
    )
    env = {**os.environ, "DILOCO_NUM_UNITS": "2", "DILOCO_TOKEN": "t", "JAX_PLATFORMS": "cpu"}
    env["DILOCO_SYNCER_ADDR"] = "http://127.0.0.1:1"
    done = subprocess.run(
        [sys.executable, "-m", "diloco_trainer.learner_main", "--config", config, "--standby"],
        input='{"unit": 5, "attempt": 1}\n',
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "event=standby_ready" in done.stderr
    assert "--unit 5 must be < --num-units 2" in done.stderr

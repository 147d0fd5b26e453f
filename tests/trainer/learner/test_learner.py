"""Learner pieces that need no syncer: delta sign, backoff, horizon, the CLI's bad-input exits."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from diloco_trainer.config import ConfigError, TrainingConfig
from diloco_trainer.learner.client import PushReply, SyncerRejected, SyncerUnavailable
from diloco_trainer.learner.loop import learner_horizon
from diloco_trainer.learner.main import build_parser, main
from diloco_trainer.learner.standby import IdentityError, take_identity, wait_for_identity
from diloco_trainer.learner.sync_link import (
    Backoff,
    PendingPush,
    Progress,
    SyncLink,
    combine,
    fragment_delta,
    retry_until,
)


def test_delta_is_base_minus_local_in_float32() -> None:
    base = {"a": np.array([1.0, 2.0], np.float32)}
    theta = {"a": jnp.array([0.5, 3.0], jnp.float32)}
    delta = fragment_delta(PendingPush(0, 3, base, theta, 4, 100, 4))
    assert delta["a"].dtype == np.float32
    np.testing.assert_allclose(delta["a"], [0.5, -1.0])


def test_pushes_queued_in_a_row_telescope_to_one_delta() -> None:
    """Each push carries the progress since the previous one (its base is the previous push's
    theta), so two queued pushes fold into base0 - theta2 with both counters: nothing counted
    twice, nothing lost, nothing computed on the training thread."""
    base0 = {"a": np.array([1.0, 1.0], np.float32)}
    theta1 = {"a": jnp.array([0.8, 1.1], jnp.float32)}
    theta2 = {"a": jnp.array([0.5, 1.5], jnp.float32)}
    first = PendingPush(0, 2, base0, theta1, 5, 50, 5)
    second = PendingPush(0, 2, theta1, theta2, 5, 50, 10)
    both = combine(first, second)
    assert (both.c_steps, both.c_tokens, both.step, both.carry) == (10, 100, 10, None)
    assert both.base is base0 and both.theta is theta2
    sum_of_parts = fragment_delta(first)["a"] + fragment_delta(second)["a"]
    np.testing.assert_allclose(fragment_delta(both)["a"], sum_of_parts, rtol=1e-6)


def test_a_push_queued_across_an_install_is_carried_not_dropped() -> None:
    """An install between two queued pushes breaks the chain: the older one's progress is
    computed and carried in the newer, on top of what the newer measured from the install."""
    base0 = {"a": np.array([1.0, 1.0], np.float32)}
    theta1 = {"a": jnp.array([0.8, 1.1], jnp.float32)}
    installed = {"a": np.array([2.0, 2.0], np.float32)}  # a new global version overwrote theta
    theta2 = {"a": jnp.array([1.9, 2.5], jnp.float32)}
    first = PendingPush(0, 2, base0, theta1, 5, 50, 5)
    second = PendingPush(0, 3, installed, theta2, 3, 30, 8)
    both = combine(first, second)
    assert (both.base_version, both.c_steps, both.c_tokens, both.step) == (3, 8, 80, 8)
    np.testing.assert_allclose(fragment_delta(both)["a"], [0.2 + 0.1, -0.1 - 0.5], atol=1e-6)
    third = PendingPush(0, 3, theta2, {"a": jnp.array([1.0, 2.0], jnp.float32)}, 2, 20, 10)
    # third continues from both (its base is both's theta): the carry stays, the rest telescopes
    np.testing.assert_allclose(fragment_delta(combine(both, third))["a"], [1.2, -0.1], atol=1e-6)


class FlakyClient:
    """Records pushes; the first one fails as if the request timed out (unknown outcome)."""

    def __init__(self) -> None:
        self.pushes: list[tuple[int, int, int, list[float]]] = []

    def push(
        self,
        fragment: int,
        base_version: int,
        delta: dict[str, np.ndarray],
        c_steps: int,
        c_tokens: int,
        step: int = 0,
    ) -> PushReply:
        self.pushes.append((fragment, step, c_steps, delta["a"].tolist()))
        if len(self.pushes) == 1:
            raise SyncerUnavailable("timed out")
        return PushReply(True, False, 0, 8, 0.0)

    def poll(self, fragment: int, after: int, wait: float) -> None:
        time.sleep(0.05)

    def heartbeat(self, *args: object) -> object:
        raise SyncerUnavailable("not needed here")

    def link_of(self, fragment: int) -> int:
        return 0


def test_a_failed_push_is_resent_exactly_before_the_newer_one() -> None:
    """A push whose request failed may have been applied (a timeout after the syncer got it),
    so it is resent unchanged (the syncer drops a repeat by its step) and never folded into the
    newer push queued meanwhile, which follows it."""
    client = FlakyClient()
    link = SyncLink(client, [0], 60.0, Progress())  # type: ignore[arg-type]
    base0 = {"a": np.array([1.0], np.float32)}
    theta1 = {"a": jnp.array([0.5], jnp.float32)}
    theta2 = {"a": jnp.array([0.25], jnp.float32)}
    link.enqueue_push(PendingPush(0, 0, base0, theta1, 5, 50, 5))
    link.enqueue_push(PendingPush(0, 0, theta1, theta2, 5, 50, 10))  # folds into the first
    link.start()
    deadline = time.monotonic() + 10
    while len(client.pushes) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    theta3 = {"a": jnp.array([0.0], jnp.float32)}
    link.enqueue_push(PendingPush(0, 0, theta2, theta3, 5, 50, 15))  # queued behind the retry
    while len(client.pushes) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # the sender records the sent push right after the request returns
    link.stop()
    # The reference for the next push moves to the host copy the sender made of the last sent
    # theta (its device memory can go), once; any other reference is left as it is.
    settled = link.settled(0, theta3)
    assert isinstance(settled["a"], np.ndarray) and settled["a"].tolist() == [0.0]
    assert link.settled(0, theta3) is theta3
    assert client.pushes == [
        (0, 10, 10, [0.75]),  # first and second, folded; its request fails
        (0, 10, 10, [0.75]),  # resent exactly
        (0, 15, 5, [0.25]),  # then the newer one, measured from where the resent one ended
    ]


class HalfDownClient(FlakyClient):
    """Two syncer shards: fragment 0's answers, fragment 1's is down."""

    def push(
        self,
        fragment: int,
        base_version: int,
        delta: dict[str, np.ndarray],
        c_steps: int,
        c_tokens: int,
        step: int = 0,
    ) -> PushReply:
        self.pushes.append((fragment, step, c_steps, delta["a"].tolist()))
        if fragment == 1:
            raise SyncerUnavailable("connection refused")
        return PushReply(True, False, 0, 8, 0.0)

    def link_of(self, fragment: int) -> int:
        return fragment


def test_a_shard_that_is_down_holds_back_only_its_own_fragments() -> None:
    """Fragment 1's shard refuses every push: it is retried with backoff while fragment 0's
    pushes, queued after it, go out one after the other."""
    client = HalfDownClient()
    link = SyncLink(client, [0, 0], 60.0, Progress())  # type: ignore[arg-type]
    link.start()
    theta = {"a": np.array([1.0], np.float32)}
    try:
        link.enqueue_push(PendingPush(1, 0, theta, {"a": jnp.array([0.5])}, 5, 50, 5))
        deadline = time.monotonic() + 10
        for step in range(10, 60, 10):
            link.enqueue_push(PendingPush(0, 0, theta, {"a": jnp.array([0.5])}, 5, 50, step))
            while not any(p[:2] == (0, step) for p in client.pushes):
                assert time.monotonic() < deadline, client.pushes
                time.sleep(0.01)
    finally:
        link.stop()
    sent = [p[1] for p in client.pushes if p[0] == 0]
    assert sent == [10, 20, 30, 40, 50]
    tries = [p for p in client.pushes if p[0] == 1]
    assert 1 <= len(tries) < 20  # retried, and backed off rather than hammered
    assert link.pending_pushes() == 1  # fragment 1's, kept for when its shard is back


def test_backoff_grows_is_capped_and_resets() -> None:
    backoff = Backoff(first=0.1, cap=1.0)
    delays = [backoff.next_delay() for _ in range(8)]
    assert all(0.05 <= d <= 1.0 for d in delays)
    assert delays[-1] > delays[0] or delays[-1] >= 0.5
    backoff.reset()
    assert backoff.next_delay() <= 0.1


def _refused_then(answers: list[Exception | str]) -> Callable[[], str]:
    """A call that raises or returns each of `answers` in turn."""

    def call() -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return call


def test_a_shut_out_unit_waits_at_its_data_claim_instead_of_crashing() -> None:
    # A revoked credential refuses every request: the claim at the end of a shard must wait for
    # the refusal to be lifted (or the unit recreated) as heartbeats and pushes do, not raise
    # out of the training loop and crash the learner into a restart loop.
    revoked = SyncerRejected(403, "credential_revoked", "join credential x is revoked")
    down = SyncerUnavailable("POST /v1/data/claim: connection refused")
    call = _refused_then([revoked, down, revoked, "lease"])
    assert retry_until(call, threading.Event(), "data_claim", cap=0.05) == "lease"


def test_a_refusal_that_is_no_shut_out_still_ends_the_wait() -> None:
    superseded = SyncerRejected(409, "superseded", "attempt 2 is the unit now")
    call = _refused_then([superseded, "lease"])
    with pytest.raises(SyncerRejected, match="superseded"):
        retry_until(call, threading.Event(), "data_claim", cap=0.05)
    assert [SyncerRejected(403, r, "").shut_out for r in ("credential_expired", "bad_token")] == [
        True,
        True,
    ]


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
        [sys.executable, "-m", "diloco_trainer.learner.main", "--config", config, "--standby"],
        input='{"unit": 5, "attempt": 1}\n',
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "event=standby_ready" in done.stderr
    assert "--unit 5 must be < --num-units 2" in done.stderr


def test_the_unit_token_is_read_from_a_file_by_flag_or_environment(tmp_path: Path) -> None:
    """Kubernetes mounts each unit's token as a file (a Secret volume), not an env value."""
    from diloco_trainer.learner.main import resolve

    config = _write(tmp_path, "totalSteps: 10\n")
    token_file = tmp_path / "token"
    token_file.write_text("unit-token-from-file\n")
    base = ["--config", config, "--unit", "0", "--syncer", "http://x:1"]
    parser = build_parser({})
    by_flag = resolve(parser.parse_args([*base, "--token-file", str(token_file)]), {})
    assert by_flag[1]["token"] == "unit-token-from-file"
    # An explicit flag wins over the environment's token.
    env = {"DILOCO_TOKEN": "from-env"}
    assert (
        resolve(parser.parse_args([*base, "--token-file", str(token_file)]), env)[1]["token"]
        == "unit-token-from-file"
    )
    by_env = resolve(parser.parse_args(base), {"DILOCO_TOKEN_FILE": str(token_file)})
    assert by_env[1]["token"] == "unit-token-from-file"
    token_file.write_text("\n")
    assert main([*base, "--token-file", str(token_file)], {}) == 2


def test_a_spare_takes_its_units_token_from_the_identity() -> None:
    args = build_parser({}).parse_args(["--config", "x", "--standby"])
    take_identity(args, {"unit": 1, "unitName": "r-default-1", "token": "t1"})
    assert args.token == "t1"


def test_a_group_pushes_with_its_own_compression_over_the_runs(tmp_path: Path) -> None:
    """DILOCO_COMPRESSION (the operator's, from unitGroups[].compression) replaces the fields it
    names; the downlink and the rest stay the run's; bad ones name the flag and the field."""
    from diloco_trainer.learner.main import resolve

    config = _write(
        tmp_path,
        "totalSteps: 10\ncompression: {scheme: int8, downlink: int4, blockSize: 64}\n",
    )
    base = ["--config", config, "--unit", "0", "--syncer", "http://x:1", "--token", "t"]
    parser = build_parser({})
    run_own = resolve(parser.parse_args(base), {})[0].compression
    assert (run_own.scheme, run_own.downlink, run_own.error_feedback) == ("int8", "int4", False)
    env = {"DILOCO_COMPRESSION": '{"scheme": "int2", "errorFeedback": true}'}
    own = resolve(build_parser(env).parse_args(base), env)[0].compression
    assert (own.scheme, own.error_feedback, own.downlink, own.block_size) == (
        "int2",
        True,
        "int4",
        64,
    )
    spare = build_parser({}).parse_args(["--config", config, "--standby"])
    take_identity(spare, {"unit": 0, "compression": '{"scheme": "int4"}'})
    assert spare.compression == '{"scheme": "int4"}'
    for bad, field in (('{"scheme": "int3"}', "scheme"), ('{"blockSize": 101}', "blockSize")):
        env = {"DILOCO_COMPRESSION": bad}
        with pytest.raises(ConfigError, match=f"DILOCO_COMPRESSION.*{field}"):
            resolve(build_parser(env).parse_args(base), env)

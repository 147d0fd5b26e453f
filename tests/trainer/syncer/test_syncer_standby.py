"""The warm standby syncer (standby.py): it follows the fragment journal while another syncer
serves, and a SIGKILLed serving syncer is replaced by it with no published version lost."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from diloco_trainer.auth import unit_token
from diloco_trainer.config import SERVING_LOCK_FILE
from diloco_trainer.learner.client import SyncerClient
from diloco_trainer.outer import OuterOptimizer
from diloco_trainer.syncer.checkpoint import CheckpointStore
from diloco_trainer.syncer.core import Syncer
from diloco_trainer.syncer.standby import ServingLock, serving_pid
from processes import syncer_argv

from tests.trainer.syncer.test_syncer import TOKEN as LIVE_TOKEN
from tests.trainer.syncer.test_syncer import LiveSyncer, fragment_delta, tiny_cfg
from tests.trainer.syncer.test_syncer_process import (
    TOKEN,
    SyncerProcess,
    delta_for,
    procs,  # noqa: F401  (fixture)
    start,
    write_config,
)


def test_a_standby_follows_the_journal_and_takes_over_the_newest_versions(tmp_path: Path) -> None:
    cfg = tiny_cfg(checkpoint={"path": str(tmp_path), "everySeconds": 3600})
    serving = LiveSyncer(Syncer(cfg, LIVE_TOKEN, store=CheckpointStore(tmp_path), eval_fn=None))
    standby = Syncer(cfg, LIVE_TOKEN, store=CheckpointStore(tmp_path), eval_fn=None, standby=True)
    try:
        learner = serving.client()
        learner.join()
        assert standby.follow() == []  # nothing merged yet
        learner.push(0, 0, fragment_delta(serving, 0), 2, 64)
        assert learner.poll(0, 0, wait=10) is not None
        assert standby.follow() == [0]
        assert standby.versions() == serving.syncer.versions() == [1, 0, 0]
        learner.push(1, 0, fragment_delta(serving, 1), 2, 64)
        held = learner.poll(1, 0, wait=10)
        assert held is not None
        serving.loop.call_soon_threadsafe(serving.loop.stop)  # dies without a checkpoint
        serving.thread.join(10)
        standby.take_over()
        assert standby.versions() == [1, 1, 0]  # fragment 1 read at the take-over
        for name, value in held[1].items():
            np.testing.assert_array_equal(standby.frags[1].params[name], value)
        for want, got in zip(
            OuterOptimizer.state_leaves(serving.syncer.frags[1].opt_state),
            OuterOptimizer.state_leaves(standby.frags[1].opt_state),
            strict=True,
        ):
            np.testing.assert_array_equal(got, want)
        assert CheckpointStore(tmp_path).recorded_versions() == [1, 1, 0]  # not renumbered
    finally:
        standby.close()


def test_the_lock_goes_to_one_holder_at_a_time(tmp_path: Path) -> None:
    first, second = ServingLock(tmp_path / "lock"), ServingLock(tmp_path / "lock")
    assert first.try_acquire()
    first.announce()
    assert not second.try_acquire()
    assert serving_pid(tmp_path / "lock") == os.getpid()
    os.close(first.fd)  # what a dying holder's kernel does
    assert second.try_acquire()


def log_has(log: Path, pattern: str, timeout: float = 90.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} in {log}:\n{log.read_text(errors='replace')}")


@contextlib.contextmanager
def serving_and_standby(
    tmp_path: Path,
    procs: list[SyncerProcess],  # noqa: F811
    lock_in_checkpoints: bool = False,
) -> Iterator[tuple[SyncerProcess, subprocess.Popen[bytes], Path, Path]]:
    """A syncer serving under a lock (its flag from the environment) and a second one given the
    flag: the serving one, the standby, the standby's log and the lock file (in the checkpoint
    directory, as the operator puts it on a claim, or beside it)."""
    config = write_config(tmp_path / "run.yaml", checkpoint={"everySeconds": 3600, "keep": 2})
    ckpt = tmp_path / "ckpt"
    lock = ckpt / SERVING_LOCK_FILE if lock_in_checkpoints else tmp_path / "syncer.lock"
    os.environ["DILOCO_SYNCER_LOCK"] = str(lock)
    try:
        first = start(procs, config, ckpt, tmp_path / "first.log")
    finally:
        del os.environ["DILOCO_SYNCER_LOCK"]
    standby_log = tmp_path / "standby.log"
    standby = subprocess.Popen(
        [
            *syncer_argv(str(config), str(first.port)),
            "--checkpoint-dir",
            str(ckpt),
            "--lock",
            str(lock),
        ],
        stdout=subprocess.DEVNULL,
        stderr=standby_log.open("ab"),
        env={**os.environ, "JAX_PLATFORMS": "cpu", "DILOCO_TOKEN": TOKEN},
    )
    try:
        yield first, standby, standby_log, lock
    finally:
        if standby.poll() is None:
            standby.kill()
        standby.wait(10)


def test_sigkilled_syncer_is_replaced_by_its_standby_with_every_version(
    tmp_path: Path,
    procs: list[SyncerProcess],  # noqa: F811
) -> None:
    """Checkpoints every hour: every version merged here lives only in the journal."""
    with serving_and_standby(tmp_path, procs) as (first, standby, standby_log, lock):
        log_has(standby_log, r"event=standby_ready")
        assert serving_pid(lock) == first.proc.pid
        learner = SyncerClient(first.url, unit_token(TOKEN, "unit-0"), "unit-0", 0, timeout=5)
        join = learner.join()
        held: dict[int, tuple[int, dict[str, np.ndarray]]] = {}
        for i in range(3):
            for p in range(2):
                learner.push(p, i, delta_for(learner, join.layout, p, 10 * i + p), 4, 256)
                got = learner.poll(p, i, wait=10)
                assert got is not None
                held[p] = got
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
        log_has(standby_log, r"event=listening")
        assert serving_pid(lock) == standby.pid
        status = learner.status()
        assert [f.version for f in status.fragments] == [3, 3]
        for p, (version, values) in held.items():
            assert learner.poll(p, version, wait=0.2) is None  # nothing newer: the same version
            served = learner.poll(p, version - 1, wait=5)
            assert served is not None and served[0] == version
            for name, value in values.items():
                np.testing.assert_array_equal(served[1][name], value)
        learner.join()  # a new attempt, as a learner that lost its syncer makes
        learner.push(0, 3, delta_for(learner, join.layout, 0, 99), 4, 256)
        got = learner.poll(0, 3, wait=10)
        assert got is not None and got[0] == 4


def test_a_standby_told_to_stop_with_the_serving_syncer_exits_without_serving(
    tmp_path: Path,
    procs: list[SyncerProcess],  # noqa: F811
) -> None:
    """The kubelet stops every container of a deleted pod at once. The serving syncer frees the
    lock as it exits; the standby must not take it and serve on from a pod on its way out,
    beside the syncer of the pod that replaces it (two syncers, one checkpoint volume)."""
    with serving_and_standby(tmp_path, procs) as (first, standby, standby_log, lock):
        log_has(standby_log, r"event=standby_ready")
        standby.send_signal(signal.SIGTERM)
        assert first.stop(signal.SIGTERM) == 0
        assert standby.wait(30) == 0
        text = standby_log.read_text(errors="replace")
        assert "event=standby_stopped reason=signal" in text, text[-3000:]
        assert "event=took_over" not in text and "event=listening" not in text, text[-3000:]
        assert serving_pid(lock) == first.proc.pid  # no one else ever announced itself


def test_a_replacement_syncer_waits_for_the_old_one_on_the_checkpoint_lock(
    tmp_path: Path,
    procs: list[SyncerProcess],  # noqa: F811
) -> None:
    """A Deployment replaces a deleted syncer pod at once: the new pod's syncer finds the lock on
    the checkpoint directory held, waits, and serves what the old one published once it is gone.
    The lock file in a fresh checkpoint directory does not make it look foreign."""
    with serving_and_standby(tmp_path, procs, lock_in_checkpoints=True) as (
        first,
        second,
        second_log,
        lock,
    ):
        log_has(second_log, r"event=standby_ready")
        learner = SyncerClient(first.url, unit_token(TOKEN, "unit-0"), "unit-0", 0, timeout=5)
        join = learner.join()
        for p in range(2):
            learner.push(p, 0, delta_for(learner, join.layout, p, p), 4, 256)
            assert learner.poll(p, 0, wait=10) is not None
        assert first.stop(signal.SIGTERM) == 0
        log_has(second_log, r"event=listening")
        assert serving_pid(lock) == second.pid
        assert [f.version for f in learner.status().fragments] == [1, 1]


def test_a_restoring_syncer_takes_shapes_not_values_from_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restoring (a cold restart, a standby) needs the model's shapes to check the checkpoint,
    not a numeric init of the whole model (time and a second copy of the parameters)."""
    from diloco_trainer.workload.check import Workload

    cfg = tiny_cfg(checkpoint={"path": str(tmp_path)})
    first = Syncer(cfg, LIVE_TOKEN, store=CheckpointStore(tmp_path), eval_fn=None)
    CheckpointStore(tmp_path).save(first.snapshot())
    first.close()

    def no_init(self: Workload) -> None:
        raise AssertionError("the model was initialised although a checkpoint was restored")

    monkeypatch.setattr(Workload, "initial_params", no_init)
    again = Syncer(cfg, LIVE_TOKEN, store=CheckpointStore(tmp_path), eval_fn=None, standby=True)
    try:
        for f, g in zip(first.frags, again.frags, strict=True):
            for name in f.names:
                np.testing.assert_array_equal(f.params[name], g.params[name])
    finally:
        again.close()

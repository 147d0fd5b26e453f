"""initFrom and `diloco export` against a real `diloco-syncer` process and its checkpoints."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.flax
import safetensors.numpy
from diloco_operator.cli import main as diloco
from diloco_trainer.auth import unit_token
from diloco_trainer.config import load_training_config
from diloco_trainer.learner.client import SyncerClient
from diloco_trainer.models.gpt import init_params
from diloco_trainer.syncer import main as syncer_main
from diloco_trainer.syncer.checkpoint import CheckpointStore
from diloco_trainer.syncer.persist import config_hash
from processes import syncer_argv
from test_syncer_process import (
    TOKEN,
    SyncerProcess,
    delta_for,
    procs,
    small_model,
    start,
    write_config,
)

__all__ = ["procs"]  # the fixture, imported for its use below


def _starting_weights(config: Path, out: Path, offset: float = 0.5) -> dict[str, np.ndarray]:
    cfg = load_training_config(config)
    weights = {n: leaf + offset for n, leaf in init_params(cfg.model, seed=cfg.seed + 1).items()}
    safetensors.numpy.save_file(weights, out)
    return weights


def _wait_for_checkpoint(ckpt: Path, versions: list[int]) -> None:
    store, deadline = CheckpointStore(ckpt), time.monotonic() + 30
    while True:
        snap = store.load_latest(remove_stray=False)
        if snap is not None and snap.versions == versions:
            return
        assert time.monotonic() < deadline, f"no checkpoint with versions {versions}"
        time.sleep(0.1)


def test_init_from_seeds_a_fresh_run_and_export_gives_the_trained_model_back(
    tmp_path: Path, procs: list[SyncerProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    weights_file, ckpt, log = tmp_path / "start.safetensors", tmp_path / "ckpt", tmp_path / "log"
    probe = write_config(tmp_path / "probe.yaml")
    weights = _starting_weights(probe, weights_file)
    config = write_config(
        tmp_path / "run.yaml",
        model=small_model(initFrom=str(weights_file)),
    )
    syncer = start(procs, config, ckpt, log)
    learner = SyncerClient(syncer.url, unit_token(TOKEN, "unit-0"), "unit-0", 0, timeout=5)
    join = learner.join()
    pulled, versions = learner.pull_all()  # what a joining learner starts from
    assert versions == [0, 0] and sorted(pulled) == sorted(weights)
    for name, leaf in weights.items():
        np.testing.assert_array_equal(pulled[name], leaf)
    assert "event=init_from source=" in log.read_text()

    learner.push(0, 0, delta_for(learner, join.layout, 0, 7), c_steps=4, c_tokens=256)
    assert learner.poll(0, 0, wait=10) is not None
    trained, _ = learner.pull_all()
    assert not np.array_equal(trained[join.layout[0][0]], weights[join.layout[0][0]])
    _wait_for_checkpoint(ckpt, [1, 0])
    assert syncer.stop(signal.SIGTERM) == 0

    out = tmp_path / "model.safetensors"
    assert diloco(["export", str(ckpt), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    as_jax = safetensors.flax.load_file(out)
    as_numpy = safetensors.numpy.load_file(out)
    assert sorted(as_jax) == sorted(as_numpy) == sorted(weights)
    for name, leaf in trained.items():
        np.testing.assert_array_equal(np.asarray(as_jax[name]), leaf)
        np.testing.assert_array_equal(as_numpy[name], leaf)
    with safetensors.safe_open(out, framework="numpy") as f:
        meta = f.metadata()
    assert meta["run"] == "run" and meta["outerStep"] == "1"
    assert json.loads(meta["versions"]) == [1, 0]
    assert meta["configHash"] == config_hash(load_training_config(config))

    # Resuming from its own checkpoint, the syncer ignores initFrom (here a file that is gone).
    weights_file.unlink()
    again = start(procs, config, ckpt, log)
    assert "event=init_from_ignored reason=resuming_checkpoint" in log.read_text()
    resumed, versions = SyncerClient(
        again.url, unit_token(TOKEN, "unit-0"), "unit-0", 0, timeout=5
    ).pull_all()
    assert versions == [1, 0]
    for name, leaf in as_numpy.items():
        np.testing.assert_array_equal(resumed[name], leaf)


def test_a_syncer_with_unfit_weights_exits_2_before_serving(tmp_path: Path) -> None:
    weights_file = tmp_path / "wide.safetensors"
    wide = write_config(
        tmp_path / "wide.yaml",
        model=small_model(dModel=32),
    )
    _starting_weights(wide, weights_file)
    config = write_config(
        tmp_path / "run.yaml",
        model=small_model(initFrom=str(weights_file)),
    )
    done = subprocess.run(
        [
            *syncer_argv(str(config), "0"),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--token",
            TOKEN,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "event=listening" not in done.stderr
    assert (
        f"training.model.initFrom: {weights_file}: embed has shape (256, 32), "
        "the model expects (256, 16)"
    ) in done.stderr
    assert not (tmp_path / "ckpt").exists()  # nothing written for a run that never started


def test_a_missing_or_corrupt_init_file_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\xff" * 64)
    for path, reason in ((tmp_path / "absent.safetensors", "no such file"), (broken, "readable")):
        config = write_config(
            tmp_path / "run.yaml",
            model=small_model(initFrom=str(path)),
        )
        code = syncer_main.main(
            ["--config", str(config), "--token", "t", "--checkpoint-dir", str(tmp_path / "c")]
        )
        assert code == 2
        err = capsys.readouterr().err
        assert f"cannot start: training.model.initFrom: {path}: " in err and reason in err

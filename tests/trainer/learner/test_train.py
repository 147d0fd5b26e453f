"""Inner optimizer and train step: learning on the stdlib corpus, SPMD equals single device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from diloco_trainer.config import InnerOptimizerConfig
from diloco_trainer.learner.distributed import DistributedArgs, distributed_args
from diloco_trainer.learner.train import check_batch_divisible, learning_rate_schedule

# Runs as a script in a subprocess so XLA_FLAGS can fake several host devices.
SPMD_SCRIPT = """
import sys, numpy as np, jax
from diloco_trainer.config import TrainingConfig
from diloco_trainer.data.corpus import train_batches
from diloco_trainer.models.gpt import init_params
from diloco_trainer.learner.train import (init_opt_state, make_mesh, make_optimizer, make_train_step,
                                  place_params, shard_batch, step_key)
cfg = TrainingConfig.model_validate({"totalSteps": 1, "seed": 3, "data": {"batchSize": 8,
    "maxBytes": 262144}, "model": {"dModel": 32, "nLayers": 1, "nHeads": 2, "seqLen": 32},
    "innerOptimizer": {"lr": 3e-3, "warmupSteps": 2}})
steps = int(sys.argv[1])
mesh = make_mesh()
opt = make_optimizer(cfg.inner_optimizer, steps)
params = place_params(init_params(cfg.model, cfg.seed), mesh)
state = init_opt_state(opt, params, mesh)
step = make_train_step(opt, mesh)
batches = train_batches(cfg, unit=0, num_units=1)
losses = []
for i in range(steps):
    params, state, loss, _ = step(params, state, shard_batch(next(batches), mesh), step_key(0, i))
    losses.append(float(loss))
assert params["embed"].sharding.mesh.devices.size == len(jax.devices())
np.savez(sys.argv[2], losses=np.array(losses), devices=len(jax.devices()),
         **{k: np.asarray(v) for k, v in params.items()})
"""


def _start_training(steps: int, devices: int, out: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.Popen([sys.executable, "-c", SPMD_SCRIPT, str(steps), str(out)], env=env)


def test_loss_decreases_and_four_device_spmd_matches_one_device(tmp_path: Path) -> None:
    # Two independent processes, run side by side: each is mostly single-threaded (import,
    # trace, compile), so together they take the time of one on the suite's two cores.
    outs = {devices: tmp_path / f"devices-{devices}.npz" for devices in (1, 4)}
    runs = {devices: _start_training(30, devices, out) for devices, out in outs.items()}
    try:
        assert {d: run.wait(timeout=180) for d, run in runs.items()} == {1: 0, 4: 0}
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
    with np.load(outs[1]) as one, np.load(outs[4]) as four:
        single, quad = dict(one), dict(four)
    assert int(single["devices"]) == 1 and int(quad["devices"]) == 4
    losses = single["losses"]
    assert losses[-5:].mean() < losses[:5].mean() - 0.5, losses
    np.testing.assert_allclose(quad["losses"], losses, rtol=1e-4)
    for name in ("embed", "blocks.0.attn.wqkv", "ln_f.scale"):
        np.testing.assert_allclose(quad[name], single[name], atol=1e-5)


def test_schedule_warms_up_then_decays() -> None:
    cfg = InnerOptimizerConfig(lr=1e-3, warmup_steps=10, schedule="cosine")
    schedule = learning_rate_schedule(cfg, 100)
    assert float(schedule(0)) == 0.0
    assert float(schedule(10)) == pytest.approx(1e-3)
    assert float(schedule(100)) == pytest.approx(1e-4, rel=1e-3)
    flat = learning_rate_schedule(cfg.model_copy(update={"schedule": "constant"}), 100)
    assert float(flat(100)) == pytest.approx(1e-3)


def test_distributed_args_from_tpu_environment() -> None:
    assert distributed_args({}) is None
    assert distributed_args({"TPU_WORKER_HOSTNAMES": "h0", "TPU_WORKER_ID": "0"}) is None
    env = {"TPU_WORKER_HOSTNAMES": "h0.svc, h1.svc,h2.svc", "TPU_WORKER_ID": "2"}
    assert distributed_args(env) == DistributedArgs("h0.svc:8476", 3, 2)
    with pytest.raises(ValueError, match="TPU_WORKER_ID 5 outside"):
        distributed_args({**env, "TPU_WORKER_ID": "5"})
    with pytest.raises(ValueError, match="must be an integer"):
        distributed_args({**env, "TPU_WORKER_ID": "x"})


def test_batch_must_divide_over_devices() -> None:
    check_batch_divisible(16, 4)
    with pytest.raises(
        ValueError, match=r"data\.batchSize \(16\) must be divisible by the unit's 3"
    ):
        check_batch_divisible(16, 3)


def test_resumed_schedule_new_unit_starts_at_zero_and_rejoin_continues() -> None:
    from diloco_trainer.learner.train import resumed_learning_rate, rewarmup_steps

    cfg = InnerOptimizerConfig(lr=1e-3, warmup_steps=50, schedule="cosine")
    schedule = learning_rate_schedule(cfg, 1000)
    ramp = rewarmup_steps(cfg)
    assert ramp == 20 and rewarmup_steps(cfg.model_copy(update={"warmup_steps": 5})) == 5
    for count in (0, 10, 49, 50, 400):  # a new unit (start 0): the plain schedule
        assert float(resumed_learning_rate(schedule, count, 0, ramp)) == float(schedule(count))
    # A unit rejoining at step 600: a linear ramp to the scheduled LR, then the schedule.
    assert float(resumed_learning_rate(schedule, 600, 600, ramp)) == pytest.approx(
        float(schedule(600)) / 20
    )
    assert float(resumed_learning_rate(schedule, 609, 600, ramp)) == pytest.approx(
        float(schedule(609)) / 2
    )
    for count in (619, 620, 800):
        assert float(resumed_learning_rate(schedule, count, 600, ramp)) == pytest.approx(
            float(schedule(count))
        )
    assert float(schedule(600)) < 0.6 * cfg.lr  # late in the run: well below the peak


def test_resume_schedule_sets_the_optimizer_count_and_ramps_its_first_update() -> None:
    import jax.numpy as jnp
    from diloco_trainer.learner.train import make_optimizer, resume_schedule

    cfg = InnerOptimizerConfig(lr=1e-2, warmup_steps=50, weight_decay=0.0, grad_clip=None)
    opt = make_optimizer(cfg, 1000)
    schedule = learning_rate_schedule(cfg, 1000)
    params = {"w": jnp.ones((4, 4))}
    grads = {"w": jnp.full((4, 4), 0.5)}
    fresh = opt.init(params)
    assert float(opt.update(grads, fresh, params)[0]["w"][0, 0]) == 0.0  # warmup step 0: LR 0
    resumed = resume_schedule(fresh, 700)
    updates, state = opt.update(grads, resumed, params)
    # Fresh Adam moments: the first update is ~ -lr per coordinate; lr = schedule(700) / 20.
    assert float(updates["w"][0, 0]) == pytest.approx(-float(schedule(700)) / 20, rel=1e-3)
    for _ in range(19):
        updates, state = opt.update(grads, state, params)
    assert float(updates["w"][0, 0]) == pytest.approx(-float(schedule(719)), rel=1e-3)

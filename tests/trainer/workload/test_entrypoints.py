"""The model/data API: entrypoints resolve, the built-in GPT is one implementation among others,
and every bad entrypoint is one clear error naming the manifest field."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from diloco_trainer.api import EntrypointError
from diloco_trainer.config import TrainingConfig
from diloco_trainer.learner.train import (
    init_opt_state,
    make_mesh,
    make_optimizer,
    make_train_step,
    place_params,
    shard_batch,
    step_key,
)
from diloco_trainer.workload.check import Workload, prepare

SIZES = {"dModel": 32, "nLayers": 1, "nHeads": 2, "seqLen": 32}


def _cfg(
    model: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    inner: dict[str, Any] | None = None,
) -> TrainingConfig:
    return TrainingConfig.model_validate(
        {
            "totalSteps": 10,
            "innerOptimizer": inner or {},
            "model": model if model is not None else dict(SIZES),
            "data": {"batchSize": 4, "maxBytes": 1 << 18, **(data or {})},
            "eval": {"batches": 2},
        }
    )


def _train(workload: Workload, cfg: TrainingConfig, steps: int) -> list[float]:
    mesh = make_mesh()
    opt = make_optimizer(cfg.inner_optimizer, steps)
    step = make_train_step(opt, mesh, workload.flat_loss())
    params = place_params(workload.initial_params(), mesh)
    state = init_opt_state(opt, params, mesh)
    source = workload.source(0, 1, seed=0, batch_size=4, split="train", position=0)
    losses = []
    for i, batch in zip(range(steps), source, strict=False):
        params, state, loss, _ = step(params, state, shard_batch(batch, mesh), step_key(0, i))
        losses.append(float(loss))
    return losses


def test_the_builtin_gpt_through_its_entrypoint_is_the_builtin_path() -> None:
    builtin = prepare(_cfg())
    entry = prepare(_cfg({"entrypoint": "diloco_trainer.models.gpt:build", "args": SIZES, **SIZES}))
    assert builtin.shapes == entry.shapes
    a, b = builtin.initial_params(), entry.initial_params()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert _train(builtin, _cfg(), 4) == _train(entry, _cfg(), 4)


@pytest.mark.parametrize("module", ["flax_nnx", "flax_linen"])
def test_flax_models_train_through_the_same_path(module: str) -> None:
    pytest.importorskip("flax")
    args = {"vocab": 256, "width": 32, "depth": 1, "heads": 2, "context": 32}
    model = {"entrypoint": f"diloco_trainer.models.{module}:build", "args": args, **SIZES}
    cfg = _cfg(model, inner={"lr": 0.01, "warmupSteps": 2, "schedule": "constant"})
    workload = prepare(cfg)
    names = list(workload.shapes)
    assert any(name.endswith("kernel") for name in names) and "." in names[0]
    losses = _train(workload, cfg, 16)
    # It learns: byte text starts at ~5.5 nats and loses the first nat in a few steps.
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.5, losses


USER_MODULE = '''
import jax, jax.numpy as jnp, numpy as np

class Mlp:
    """Nested-dict params, a metric, and data from a user-defined source."""
    def __init__(self, width=16, **broken):
        self.width, self.broken = width, broken
    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        shape = (8, self.width) if not self.broken.get("unstable") else (8, int(np.random.randint(2, 99)))
        w1, w2 = jax.random.normal(k1, shape), jax.random.normal(k2, (self.width, 1))
        return {"layers": [{"w": 0.3 * w1}, {"w": 0.1 * w2}]}
    def loss(self, params, batch, rng):
        h = jnp.tanh(batch["x"] @ params["layers"][0]["w"])
        err = jnp.mean((h @ params["layers"][1]["w"] - batch["y"]) ** 2)
        if self.broken.get("vector_loss"):
            return jnp.ones(3), {}
        if self.broken.get("tuple_out"):
            return err
        return err, {"rmse": jnp.sqrt(err)}

def build(**kw):
    return Mlp(**kw)

def not_a_model(**kw):
    return object()

def regression(shard, num_shards, *, seed, batch_size, split, position, rows=None):
    rng = np.random.default_rng([seed, shard, split == "eval"])
    while True:
        x = rng.normal(size=(rows or batch_size, 8)).astype(np.float32)
        yield {"x": x, "y": 0.5 * x[:, :1] - 0.25 * x[:, 1:2]}

def broken_source(shard, num_shards, **kw):
    raise OSError("bucket not found")

VALUE = 3
'''


@pytest.fixture()
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "user_models.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_models"
    sys.modules.pop("user_models", None)


def test_a_user_model_with_nested_params_and_its_own_data(user_module: str) -> None:
    cfg = _cfg(
        {"entrypoint": f"{user_module}:build", "args": {"width": 16}},
        {"entrypoint": f"{user_module}:regression"},
        {"lr": 0.03, "warmupSteps": 1, "schedule": "constant"},
    )
    workload = prepare(cfg)
    assert list(workload.shapes) == ["layers.0.w", "layers.1.w"]
    losses = _train(workload, cfg, 40)
    assert np.mean(losses[-8:]) < np.mean(losses[:8]), losses
    _, metrics = jax.jit(workload.flat_loss())(
        workload.initial_params(),
        next(iter(workload.source(0, 1, seed=0, batch_size=4, split="eval", position=0))),
        step_key(0, 0),
    )
    assert set(metrics) == {"rmse"}


BAD = [
    (
        {"entrypoint": "no_such_module_xyz:build"},
        None,
        "training.model.entrypoint: cannot import module 'no_such_module_xyz'",
    ),
    (
        {"entrypoint": "{m}:nope"},
        None,
        "training.model.entrypoint: '{m}:nope': module '{m}' has no attribute 'nope'",
    ),
    (
        {"entrypoint": "{m}:VALUE"},
        None,
        "training.model.entrypoint: '{m}:VALUE' is a int, not callable",
    ),
    (
        {"entrypoint": "{m}:not_a_model"},
        None,
        "returned a object without init(), loss(); a model needs init(rng)",
    ),
    ({"entrypoint": "{m}:build", "args": {"vocab": 3}}, None, None),  # accepted by **broken
    (
        {"entrypoint": "{m}:build", "args": {"vector_loss": True}},
        "{m}:regression",
        "training.model.entrypoint: {m}:build: loss must be a scalar, got shape (3,)",
    ),
    (
        {"entrypoint": "{m}:build", "args": {"tuple_out": True}},
        "{m}:regression",
        "loss must return (scalar loss, dict of metrics)",
    ),
    (
        {"entrypoint": "{m}:build", "args": {"unstable": True}},
        "{m}:regression",
        "init returned different parameters on a second call",
    ),
    (
        {"entrypoint": "{m}:build"},
        "{m}:broken_source",
        "training.data.entrypoint: the data source failed: OSError: bucket not found",
    ),
    (dict(SIZES), "{m}:regression", "training.model.entrypoint: the built-in model: loss failed"),
]


@pytest.mark.parametrize(("model", "data", "message"), BAD)
def test_bad_entrypoints_fail_with_the_field_named(
    user_module: str, model: dict[str, Any], data: str | None, message: str | None
) -> None:
    model = {k: (v.format(m=user_module) if isinstance(v, str) else v) for k, v in model.items()}
    data_block = {"entrypoint": data.format(m=user_module)} if data else None
    if message is None:
        data_block = {"entrypoint": f"{user_module}:regression"}
        prepare(_cfg(model, data_block))  # the control: this one is fine
        return
    with pytest.raises(EntrypointError) as caught:
        prepare(_cfg(model, data_block))
    assert message.format(m=user_module) in str(caught.value)
    assert isinstance(caught.value, ValueError)  # what learner and syncer exit 2 on


def test_a_batch_with_the_wrong_rows_is_refused(user_module: str) -> None:
    cfg = _cfg(
        {"entrypoint": f"{user_module}:build"},
        {"entrypoint": f"{user_module}:regression", "args": {"rows": 3}},
    )
    with pytest.raises(
        EntrypointError,
        match=r"training.data.entrypoint: batch arrays need data.batchSize=4 rows on axis 0; one has shape \(3, 8\)",
    ):
        prepare(cfg)


def test_an_entrypoint_that_is_not_module_colon_name_is_refused_by_the_schema() -> None:
    with pytest.raises(ValueError, match="entrypoint"):
        _cfg({"entrypoint": "my-pkg.models"})

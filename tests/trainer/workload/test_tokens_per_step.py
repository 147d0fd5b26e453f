"""Tokens per step come from the batch the model trains on, not from `model.seqLen`: the rule of
`workload.check.batch_tokens`, the one count learners and the syncer both use."""

from __future__ import annotations

import logging
import re
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from diloco_trainer.api import EntrypointError
from diloco_trainer.auth import unit_token
from diloco_trainer.config import TrainingConfig
from diloco_trainer.learner.loop import learner_horizon, run_learner
from diloco_trainer.learner.options import LearnerOptions
from diloco_trainer.syncer.core import Syncer
from diloco_trainer.workload.check import batch_tokens, prepare, tokens_per_step

from tests.trainer.syncer.test_syncer import TOKEN, LiveSyncer

# Written as a user outside the project would: plain JAX, its own data, no project code.
OUTSIDE = """
import jax, jax.numpy as jnp, numpy as np

class Bigram:
    def __init__(self, vocab=64, width=16, declare=None):
        self.vocab, self.width = vocab, width
        if declare is not None:
            self.tokens_per_batch = declare
    def init(self, rng):
        k1, k2 = jax.random.split(rng)
        return {"embed": 0.1 * jax.random.normal(k1, (self.vocab, self.width)),
                "out": 0.1 * jax.random.normal(k2, (self.width, self.vocab))}
    def loss(self, params, batch, rng):
        tokens = batch["tokens"] if isinstance(batch, dict) else batch
        logits = jnp.tanh(params["embed"][tokens[:, :-1]]) @ params["out"]
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1)), {}

def build(**kw):
    return Bigram(**kw)

def windows(shard, num_shards, *, seed, batch_size, split, position, window=16, extra=None,
            dictionary=False):
    rng = np.random.default_rng([seed, shard, split == "eval"])
    for _ in range(position):
        rng.integers(0, 64, size=(batch_size, window))
    while True:
        tokens = rng.integers(0, 64, size=(batch_size, window)).astype(np.int32)
        if extra == "same":
            yield {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1)}
        elif extra == "lengths":
            yield {"tokens": tokens, "lengths": np.full(batch_size, window, np.int32)}
        elif dictionary:
            yield {"tokens": tokens}
        else:
            yield tokens

def counted(shard, num_shards, **kw):
    return windows(shard, num_shards, **kw)

counted.tokens_per_batch = lambda batch: 100
"""


@pytest.fixture()
def outside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "outside_tokens.py").write_text(textwrap.dedent(OUTSIDE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "outside_tokens"
    sys.modules.pop("outside_tokens", None)


def _cfg(
    module: str,
    model_args: dict[str, Any] | None = None,
    data_args: dict[str, Any] | None = None,
    source: str = "windows",
    **extra: Any,
) -> TrainingConfig:
    return TrainingConfig.model_validate(
        {
            "totalTokens": 512 * 400,
            # seqLen is not given: it stays at the preset's 128, which the batch does not hold.
            "model": {"entrypoint": f"{module}:build", "args": model_args or {}},
            "data": {"entrypoint": f"{module}:{source}", "args": data_args or {}, "batchSize": 32},
            **extra,
        }
    )


def test_an_outside_model_on_16_token_windows_counts_what_its_batch_holds(outside: str) -> None:
    cfg = _cfg(outside)
    assert cfg.model.context == 128  # what the count used to be: 32 x 128 = 4,096
    workload = prepare(cfg)
    assert workload.tokens_per_step == 32 * 16 == tokens_per_step(cfg)
    # The LR schedule's horizon follows: 204,800 tokens are 400 steps of 512, not 50 of 4,096.
    assert learner_horizon(cfg, 1, workload.tokens_per_step) == 400
    with pytest.raises(ValueError, match=r"workload.check.tokens_per_step\(cfg\)"):
        cfg.tokens_per_step  # noqa: B018


@pytest.mark.parametrize(
    ("model_args", "data_args", "source", "tokens"),
    [
        ({}, {"dictionary": True}, "windows", 512),  # one integer array in a dict
        ({}, {"extra": "same"}, "windows", 512),  # inputs and targets of the same size
        ({}, {"window": 24}, "windows", 32 * 24),
        ({"declare": 480}, {}, "windows", 480),  # the model says, as an int
        ({}, {}, "counted", 100),  # the data source says
        ({"declare": 7}, {}, "counted", 7),  # the model first
    ],
)
def test_the_rule(
    outside: str,
    model_args: dict[str, Any],
    data_args: dict[str, Any],
    source: str,
    tokens: int,
) -> None:
    assert prepare(_cfg(outside, model_args, data_args, source)).tokens_per_step == tokens


def test_a_declared_method_gets_the_batch(outside: str) -> None:
    workload = prepare(_cfg(outside))
    model: Any = workload.model
    model.tokens_per_batch = lambda batch: int(batch.shape[0] * (batch.shape[1] - 1))
    assert batch_tokens(model, workload.source, np.zeros((32, 16), np.int32), 32) == 480


def test_features_without_token_ids_count_one_token_per_row(outside: str) -> None:
    # Such a batch would not train this model: the check's own function counts it.
    workload = prepare(_cfg(outside))
    assert batch_tokens(workload.model, workload.source, {"x": np.zeros((32, 8))}, 32) == 32


@pytest.mark.parametrize(
    ("model_args", "data_args", "message"),
    [
        (
            {},
            {"extra": "lengths"},
            r"training.data.entrypoint: the batch's integer arrays differ in size "
            r"\(\['lengths'\] \(32,\), \['tokens'\] \(32, 16\)\).*tokens_per_batch\(batch\)",
        ),
        ({"declare": 0}, {}, r"training.model.entrypoint: tokens_per_batch gave 0; it must be"),
        ({"declare": 2.5}, {}, r"training.model.entrypoint: tokens_per_batch gave 2.5"),
        ({"declare": True}, {}, r"training.model.entrypoint: tokens_per_batch gave True"),
    ],
)
def test_ambiguous_or_wrong_counts_are_refused_naming_the_field(
    outside: str, model_args: dict[str, Any], data_args: dict[str, Any], message: str
) -> None:
    with pytest.raises(EntrypointError, match=message):
        prepare(_cfg(outside, model_args, data_args))


def test_the_builtin_workloads_count_batch_size_times_seq_len() -> None:
    sizes = {"dModel": 32, "nLayers": 1, "nHeads": 2, "seqLen": 24}
    data = {"batchSize": 4, "maxBytes": 1 << 18}
    builtin = TrainingConfig.model_validate({"totalSteps": 5, "model": sizes, "data": data})
    assert prepare(builtin).tokens_per_step == 4 * 24 == builtin.tokens_per_step
    entry = {"entrypoint": "diloco_trainer.models.gpt:build", "args": sizes, **sizes}
    through = TrainingConfig.model_validate({"totalSteps": 5, "model": entry, "data": data})
    assert prepare(through).tokens_per_step == 4 * 24


def test_learner_and_syncer_count_the_same_tokens(outside: str, caplog: Any) -> None:
    """A real learner against an in-process syncer: every push carries c_steps x 512 tokens,
    and the heartbeats count 512 a step."""
    cfg = _cfg(
        outside,
        innerSteps=3,
        fragments=2,
        heartbeatSeconds=0.1,
        eval={"everySeconds": None},
        grace={"mode": "none"},
    )
    live = LiveSyncer(Syncer(cfg, TOKEN, run="tokens", store=None, eval_fn=None))
    try:
        opts = LearnerOptions(
            syncer=live.url,
            token=unit_token(TOKEN, "unit-0"),
            unit=0,
            num_units=1,
            unit_name="unit-0",
            log_every=100,
            max_steps=9,
        )
        with caplog.at_level(logging.INFO, logger="diloco.syncer"):
            result = run_learner(cfg, opts)
            time.sleep(0.3)  # the pushes and heartbeats still in flight
        assert result.steps == 9 and result.tokens == 9 * 512
        pushes = re.findall(r"event=push_accepted .* c_steps=(\d+) c_tokens=(\d+)", caplog.text)
        assert pushes, caplog.text
        assert all(int(tok) == int(steps) * 512 for steps, tok in pushes), pushes
        # Whether a heartbeat of a step > 0 lands before a 9-step run ends is timing; what the
        # syncer holds must agree with the learner's count whatever it saw, and none of it was
        # refused as impossible (the syncer bounds tokens by its own tokens per step).
        counted = live.syncer.learners.get("unit-0")
        assert counted.tokens == counted.steps * 512 and counted.refusals == 0
        assert live.syncer.tokens_per_step == 512
    finally:
        live.close()

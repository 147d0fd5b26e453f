"""The training config schema: manifest spelling, field-naming errors, lossless round trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from diloco_trainer.config import ConfigError, TrainingConfig, load_training_config


def test_round_trip_keeps_explicit_nulls() -> None:
    cfg = TrainingConfig.model_validate(
        {"totalSteps": 10, "innerOptimizer": {"gradClip": None}, "eval": {"everySeconds": None}}
    )
    again = TrainingConfig.model_validate(cfg.to_wire())
    assert again.inner_optimizer.grad_clip is None
    assert again.eval.every_seconds is None
    assert again == cfg


def test_manifest_errors_name_the_field(tmp_path: Path) -> None:
    manifest = {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DilocoRun",
        "spec": {"training": {"totalSteps": 10, "innerSteps": 0}},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(manifest))
    with pytest.raises(ConfigError, match=r"spec\.training\.innerSteps"):
        load_training_config(path)


def test_unknown_field_is_an_error() -> None:
    with pytest.raises(ValueError, match="innerStep"):
        TrainingConfig.model_validate({"totalSteps": 10, "innerStep": 5})


def test_budget_required() -> None:
    with pytest.raises(ValueError, match="totalSteps or totalTokens"):
        TrainingConfig.model_validate({})


@pytest.mark.parametrize("block", ["model", "data"])
def test_tokens_per_step_is_known_from_the_config_only_for_the_builtin_workload(
    block: str,
) -> None:
    builtin = TrainingConfig.model_validate(
        {"totalSteps": 1, "model": {"seqLen": 64}, "data": {"batchSize": 8}}
    )
    assert builtin.tokens_per_step == 8 * 64
    # A user's model or data decides with its batch (workload.check.batch_tokens), not seqLen.
    user = TrainingConfig.model_validate(
        {"totalSteps": 1, block: {"entrypoint": "my_pkg.things:build"}}
    )
    with pytest.raises(ValueError, match=r"workload\.check\.tokens_per_step\(cfg\)"):
        user.tokens_per_step  # noqa: B018

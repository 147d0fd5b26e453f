"""Reading, checking and writing weight files (`training.model.initFrom`, `diloco export`)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from diloco_trainer.config import ModelConfig, TrainingConfig
from diloco_trainer.models.gpt import init_params
from diloco_trainer.workload import weights
from diloco_trainer.workload.weights import (
    WeightsError,
    fit_to_model,
    init_from,
    read_weights,
    write_orbax,
    write_safetensors,
)
from safetensors.numpy import load_file, save_file

MODEL = ModelConfig(vocab_size=16, d_model=8, n_layers=2, n_heads=2, seq_len=4)
CFG = TrainingConfig(model=MODEL, total_steps=1)


def _init(cfg: TrainingConfig) -> dict[str, np.ndarray]:
    return init_params(cfg.model, cfg.seed)


def _model_params() -> dict[str, np.ndarray]:
    return init_params(MODEL, seed=3)


def _shifted() -> dict[str, np.ndarray]:
    return {name: leaf + 1.0 for name, leaf in _model_params().items()}


def test_a_matching_file_gives_its_values_in_the_model_order(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file(_shifted(), path)
    got = init_from(path, _init)(CFG)
    assert list(got) == list(_model_params())
    for name, leaf in _shifted().items():
        np.testing.assert_array_equal(got[name], leaf)
        assert got[name].dtype == np.float32


def test_a_shape_mismatch_names_the_field_the_file_and_the_leaf(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    wide = init_params(ModelConfig(vocab_size=16, d_model=16, n_layers=2, n_heads=2, seq_len=4), 0)
    save_file(wide, path)
    with pytest.raises(WeightsError) as err:
        init_from(path, _init)(CFG)
    message = str(err.value)
    assert message.startswith(f"training.model.initFrom: {path}: ")
    assert "blocks.0.attn.wqkv has shape (16, 3, 2, 8), the model expects (8, 3, 2, 4)" in message
    assert "(and " in message  # more than five leaves differ: the rest are counted, not listed


def test_missing_and_unexpected_leaves_are_named(tmp_path: Path) -> None:
    weights = _shifted()
    del weights["ln_f.scale"]
    weights["head.bias"] = np.zeros(3, np.float32)
    with pytest.raises(WeightsError) as err:
        fit_to_model(weights, _model_params(), "w.safetensors")
    assert str(err.value) == (
        "training.model.initFrom: w.safetensors: ln_f.scale is missing; "
        "head.bias is not a leaf of the model"
    )


def test_other_float_dtypes_are_cast_to_float32_with_a_note(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "w.safetensors"
    half = {n: leaf.astype(ml_dtypes.bfloat16) for n, leaf in _shifted().items()}
    half["embed"] = _shifted()["embed"].astype(np.float16)
    save_file(half, path)
    with caplog.at_level(logging.INFO, logger="diloco.weights"):
        got = fit_to_model(read_weights(path), _model_params(), path)
    assert {leaf.dtype for leaf in got.values()} == {np.dtype(np.float32)}
    np.testing.assert_array_equal(got["embed"], half["embed"].astype(np.float32))
    assert "event=init_from_cast" in caplog.text and "from=bfloat16,float16" in caplog.text


def test_integer_leaves_are_refused(tmp_path: Path) -> None:
    weights = _shifted()
    weights["ln_f.scale"] = np.ones(8, np.int32)
    with pytest.raises(WeightsError, match=r"ln_f\.scale has dtype int32, not a floating-point"):
        fit_to_model(weights, _model_params(), "w")


def test_an_absent_or_unreadable_file_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match=r"^training\.model\.initFrom: .*nope: no such file"):
        read_weights(tmp_path / "nope")
    garbage = tmp_path / "w.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(WeightsError, match="not a readable safetensors file"):
        read_weights(garbage)


def test_an_orbax_directory_needs_orbax_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # import now raises ImportError
    with pytest.raises(WeightsError, match="install orbax-checkpoint"):
        read_weights(tmp_path)


def test_an_orbax_checkpoint_flattens_to_path_names(tmp_path: Path) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    tree = {"params": {"Dense_0": {"kernel": np.arange(6.0).reshape(2, 3), "bias": np.ones(3)}}}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((tmp_path / "run" / "7").resolve(), tree)
    checkpointer.wait_until_finished()
    got = read_weights(tmp_path / "run")  # a manager's directory: its newest numbered step
    assert sorted(got) == ["params.Dense_0.bias", "params.Dense_0.kernel"]
    np.testing.assert_array_equal(got["params.Dense_0.kernel"], np.arange(6.0).reshape(2, 3))


def test_a_directory_that_is_no_orbax_checkpoint_is_an_error(tmp_path: Path) -> None:
    pytest.importorskip("orbax.checkpoint")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(WeightsError, match="not a readable orbax checkpoint"):
        read_weights(tmp_path)


def test_write_is_atomic_and_keeps_metadata(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"old")
    write_safetensors(_shifted(), out, {"run": "r1"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no temp left
    got = load_file(out)
    np.testing.assert_array_equal(got["embed"], _shifted()["embed"])
    with pytest.raises(OSError):
        write_safetensors(_shifted(), tmp_path, {})  # a directory


def test_a_failed_write_leaves_the_old_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"old")

    def refuse(src: object, dst: object) -> None:
        assert Path(str(src)).exists()  # the temp file was written before the rename
        raise OSError("disk went away")

    monkeypatch.setattr(weights.os, "replace", refuse)
    with pytest.raises(OSError, match="disk went away"):
        write_safetensors(_shifted(), out, {})
    assert out.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_write_orbax_nests_dotted_names_and_never_replaces_a_directory(tmp_path: Path) -> None:
    pytest.importorskip("orbax.checkpoint")
    flat = {"params.Dense_0.kernel": np.ones((2, 3), np.float32), "step_scale": np.zeros(1)}
    out = write_orbax(flat, tmp_path / "o", {"run": "r"})
    assert (out / "d").is_dir()  # orbax's layout, in place: no temporary directory left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    got = read_weights(tmp_path / "o")
    assert sorted(got) == sorted(flat)
    np.testing.assert_array_equal(got["params.Dense_0.kernel"], flat["params.Dense_0.kernel"])
    with pytest.raises(FileExistsError):
        write_orbax(flat, tmp_path / "o", {})

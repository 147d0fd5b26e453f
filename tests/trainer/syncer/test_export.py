"""`diloco export`: where it finds the checkpoint, what it writes, and every refusal (exit 2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy
from diloco_operator.cli import main as diloco
from diloco_trainer.config import ModelConfig, TrainingConfig
from diloco_trainer.models.gpt import init_params
from diloco_trainer.syncer.checkpoint import CheckpointStore, Snapshot
from diloco_trainer.workload.weights import init_from, read_weights

GPT = ModelConfig(vocab_size=16, d_model=8, n_layers=2, n_heads=2, seq_len=4)


def _snapshot(value: float, outer_step: int) -> Snapshot:
    params = {
        "params.Dense_0.kernel": np.full((2, 3), value, np.float32),
        "params.Dense_0.bias": np.full(3, -value, np.float32),
    }
    return Snapshot(
        params=params,
        outer_state=[[np.ones((2, 3), np.float32), np.ones(3, np.float32)]],  # momentum
        versions=[outer_step],
        layout=[sorted(params)],
        outer_step=outer_step,
        extra={"run": "mine", "configHash": "abc123"},
    )


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    checkpoints = CheckpointStore(tmp_path / "run" / "checkpoints", keep=5)
    checkpoints.save(_snapshot(1.0, 1))
    checkpoints.save(_snapshot(2.0, 2))
    return checkpoints


def _exported(out: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    with safetensors.safe_open(out, framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118


def test_a_checkpoint_directory_exports_its_newest_checkpoint_without_momentum(
    store: CheckpointStore, tmp_path: Path
) -> None:
    out = tmp_path / "m.safetensors"
    assert diloco(["export", str(store.root), "--out", str(out)]) == 0
    tensors, meta = _exported(out)
    assert sorted(tensors) == ["params.Dense_0.bias", "params.Dense_0.kernel"]
    np.testing.assert_array_equal(tensors["params.Dense_0.kernel"], np.full((2, 3), 2.0))
    assert meta == {
        "format": "diloco-export/1",
        "run": "mine",
        "outerStep": "2",
        "versions": "[2]",
        "checkpointSeq": "2",
        "configHash": "abc123",
        "checkpoint": str((store.root / "ckpt-0000000002").resolve()),
    }


def test_a_local_run_folder_and_a_single_checkpoint_are_sources_too(
    store: CheckpointStore, tmp_path: Path
) -> None:
    out = tmp_path / "m.safetensors"
    assert diloco(["export", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert _exported(out)[1]["outerStep"] == "2"
    assert diloco(["export", str(store.root / "ckpt-0000000001"), "--out", str(out)]) == 0
    tensors, meta = _exported(out)
    assert meta["outerStep"] == "1"
    np.testing.assert_array_equal(tensors["params.Dense_0.bias"], np.full(3, -1.0))


def test_a_corrupt_newest_checkpoint_falls_back_and_a_corrupt_single_one_is_refused(
    store: CheckpointStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    newest = store.root / "ckpt-0000000002" / "params.safetensors"
    newest.write_bytes(newest.read_bytes()[:-4] + b"\x00\x00\x00\x01")
    out = tmp_path / "m.safetensors"
    assert diloco(["export", str(store.root), "--out", str(out)]) == 0
    assert _exported(out)[1]["outerStep"] == "1"
    assert diloco(["export", str(newest.parent), "--out", str(out)]) == 2
    assert "params.safetensors checksum mismatch" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("source", "out", "message"),
    [
        ("absent", "m.safetensors", "absent: no such file or directory"),
        ("a-file", "m.safetensors", "a-file: not a directory"),
        ("empty-dir", "m.safetensors", "empty-dir: holds no checkpoint"),
        ("run", "m.bin", "the file name must end in .safetensors"),
        ("run", "nowhere/m.safetensors", "nowhere does not exist"),
        ("run", "/proc/m.safetensors", "--out /proc/m.safetensors: cannot write"),
        ("run", "out-dir.safetensors", "cannot write"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(
    store: CheckpointStore,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    source: str,
    out: str,
    message: str,
) -> None:
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "out-dir.safetensors").mkdir()
    target = out if out.startswith("/") else str(tmp_path / out)
    assert diloco(["export", str(tmp_path / source), "--out", target]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diloco export: ") and message in err


def test_a_checkpoint_directory_with_only_broken_checkpoints_is_refused(
    store: CheckpointStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for ckpt in store.root.glob("ckpt-*"):
        (ckpt / "manifest.json").write_text("{")
    assert diloco(["export", str(store.root), "--out", str(tmp_path / "m.safetensors")]) == 2
    assert "holds no valid checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "m.safetensors").exists()


def _gpt_store(root: Path) -> tuple[CheckpointStore, dict[str, np.ndarray]]:
    params = init_params(GPT, 0)
    store = CheckpointStore(root, keep=5)
    store.save(
        Snapshot(
            params=params,
            outer_state=[[np.zeros_like(leaf) for leaf in params.values()]],
            versions=[3],
            layout=[list(params)],
            outer_step=3,
            extra={"run": "gpt", "configHash": "h"},
        )
    )
    return store, params


def test_hf_names_write_gpt2_tensor_names_a_pt_format_and_an_honest_config(
    tmp_path: Path,
) -> None:
    store, params = _gpt_store(tmp_path / "ckpt")
    out = tmp_path / "hf" / "model.safetensors"
    out.parent.mkdir()
    assert diloco(["export", str(store.root), "--out", str(out), "--names", "hf"]) == 0
    tensors, meta = _exported(out)
    assert "transformer.h.1.attn.c_attn.weight" in tensors and "lm_head.weight" not in tensors
    np.testing.assert_array_equal(
        tensors["transformer.h.0.attn.c_attn.weight"], params["blocks.0.attn.wqkv"].reshape(8, 24)
    )
    assert (meta["format"], meta["exportFormat"], meta["names"]) == (
        "pt",
        "diloco-export/1",
        "hf-gpt2",
    )
    config = json.loads((out.parent / "config.json").read_text())
    assert config["model_type"] == "diloco-gpt" and config["n_layer"] == 2
    # Exporting again replaces the config.json it wrote.
    assert diloco(["export", str(store.root), "--out", str(out), "--names", "hf"]) == 0


def test_hf_names_refuse_another_model_naming_its_leaf(
    store: CheckpointStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.safetensors"
    assert diloco(["export", str(store.root), "--out", str(out), "--names", "hf"]) == 2
    err = capsys.readouterr().err
    assert "--names hf: leaf params.Dense_0." in err and "covers only the bundled GPT" in err
    assert not out.exists() and not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--format", "orbax"], "--names hf writes safetensors only"),
        ([], "config.json exists and was not written by diloco export"),
    ],
)
def test_hf_names_refuse_orbax_and_a_foreign_config_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    store, _ = _gpt_store(tmp_path / "ckpt")
    (tmp_path / "config.json").write_text('{"model_type": "mine"}')
    out = tmp_path / ("m" if extra else "m.safetensors")
    assert diloco(["export", str(store.root), "--out", str(out), "--names", "hf", *extra]) == 2
    assert message in capsys.readouterr().err
    assert json.loads((tmp_path / "config.json").read_text()) == {"model_type": "mine"}


def test_an_orbax_export_is_what_init_from_reads_back(tmp_path: Path) -> None:
    pytest.importorskip("orbax.checkpoint")
    store, params = _gpt_store(tmp_path / "ckpt")
    out = tmp_path / "orbax-model"
    assert diloco(["export", str(store.root), "--out", str(out), "--format", "orbax"]) == 0
    cfg = TrainingConfig(
        model=GPT,
        total_steps=1,
        seed=5,  # another seed: the values must come from the export
    )
    got = init_from(out, lambda c: init_params(c.model, c.seed))(cfg)
    assert list(got) == list(params)
    for name, leaf in params.items():
        np.testing.assert_array_equal(got[name], leaf)
    import orbax.checkpoint as ocp

    meta = ocp.StandardCheckpointer().metadata(out.resolve()).custom_metadata
    assert meta["outerStep"] == "3" and meta["format"] == "diloco-export/1"


def test_an_orbax_export_keeps_flax_style_names_nested(
    store: CheckpointStore, tmp_path: Path
) -> None:
    pytest.importorskip("orbax.checkpoint")
    out = tmp_path / "orbax-model"
    assert diloco(["export", str(store.root), "--out", str(out), "--format", "orbax"]) == 0
    got = read_weights(out)
    assert sorted(got) == ["params.Dense_0.bias", "params.Dense_0.kernel"]
    np.testing.assert_array_equal(got["params.Dense_0.kernel"], np.full((2, 3), 2.0))


def test_an_orbax_export_refuses_an_existing_out_and_a_missing_orbax(
    store: CheckpointStore,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    args = ["export", str(store.root), "--format", "orbax", "--out"]
    assert diloco([*args, str(tmp_path / "taken")]) == 2
    assert "exists; an orbax export writes a new directory" in capsys.readouterr().err
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # import now raises ImportError
    assert diloco([*args, str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err
    assert "--format orbax needs the orbax-checkpoint package" in err
    assert "install orbax-checkpoint, or export to safetensors" in err
    assert not (tmp_path / "new").exists()

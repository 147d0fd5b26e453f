"""`training.model.initFrom: gs://...` against a real GCS-compatible server (fake-gcs-server):
a safetensors object, an orbax checkpoint under a prefix, and the errors naming field and URL."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import Bucket
from diloco_trainer.config import ModelConfig, TrainingConfig
from diloco_trainer.models.gpt import init_params
from diloco_trainer.syncer.bucket_weights import local_path, read_weights_anywhere, split_object_url
from diloco_trainer.syncer.gcs import BucketPrefix
from diloco_trainer.syncer.storage import StorageUnavailable
from diloco_trainer.workload.weights import (
    WeightsError,
    WeightsUnavailable,
    init_from,
    write_orbax,
)
from safetensors.numpy import save

MODEL = ModelConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, seq_len=4)
CFG = TrainingConfig(model=MODEL, total_steps=1)


def _init(cfg: TrainingConfig) -> dict[str, np.ndarray]:
    return init_params(cfg.model, cfg.seed)


def _trained() -> dict[str, np.ndarray]:
    return {name: leaf + 1.0 for name, leaf in init_params(MODEL, 7).items()}


def test_a_safetensors_object_seeds_the_model(bucket: Bucket) -> None:
    bucket.put("weights/start.safetensors", save(_trained()))
    bucket.put("weights/start.safetensors.bak", b"not this one")  # a sibling with that prefix
    got = init_from(bucket.url("weights/start.safetensors"), _init, read_weights_anywhere)(CFG)
    assert list(got) == list(_trained())
    for name, leaf in _trained().items():
        np.testing.assert_array_equal(got[name], leaf)


def test_an_orbax_checkpoint_under_a_prefix_is_read_whole(bucket: Bucket, tmp_path: Path) -> None:
    pytest.importorskip("orbax.checkpoint")
    local = write_orbax(_trained(), tmp_path / "ckpt", {"run": "r"})
    for file in (f for f in local.rglob("*") if f.is_file()):
        bucket.put(f"models/ckpt/{file.relative_to(local).as_posix()}", file.read_bytes())
    got = read_weights_anywhere(bucket.url("models/ckpt/"))
    assert sorted(got) == sorted(_trained())
    np.testing.assert_array_equal(got["blocks.0.attn.wqkv"], _trained()["blocks.0.attn.wqkv"])


def test_a_mismatch_names_the_field_and_the_url(bucket: Bucket) -> None:
    wide = init_params(ModelConfig(vocab_size=32, d_model=8, n_layers=1, n_heads=2, seq_len=4), 0)
    bucket.put("w.safetensors", save(wide))
    url = bucket.url("w.safetensors")
    with pytest.raises(WeightsError) as err:
        init_from(url, _init, read_weights_anywhere)(CFG)
    assert str(err.value).startswith(f"training.model.initFrom: {url}: embed has shape (32, 8)")


@pytest.mark.parametrize(
    ("key", "data", "message"),
    [
        ("absent.safetensors", None, "no such object, and no objects under it"),
        ("junk.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json", "not a readable"),
    ],
)
def test_an_absent_or_unreadable_object_names_the_field_and_the_url(
    bucket: Bucket, key: str, data: bytes | None, message: str
) -> None:
    if data is not None:
        bucket.put(key, data)
    url = bucket.url(key)
    with pytest.raises(WeightsError) as err:
        read_weights_anywhere(url)
    assert str(err.value).startswith(f"training.model.initFrom: {url}: ")
    assert message in str(err.value) and not isinstance(err.value, WeightsUnavailable)


def test_a_missing_bucket_is_a_setting_to_fix(bucket: Bucket) -> None:
    url = "gs://no-such-bucket-for-weights/w.safetensors"
    with pytest.raises(WeightsError) as err:
        read_weights_anywhere(url)
    message = str(err.value)
    assert message.startswith(f"training.model.initFrom: {url}: bucket no-such-bucket-for-weights")
    assert "does not exist" in message and not isinstance(err.value, WeightsUnavailable)


def test_a_storage_service_that_fails_may_be_retried(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service failing (not the setting) is WeightsUnavailable: the syncer exits 1, to be
    restarted, not 2. (Raised in place of the listing: a dead endpoint costs the client's
    whole retry deadline, two minutes.)"""
    url = bucket.url("w.safetensors")

    def down(self: BucketPrefix, sub: str) -> list[str]:
        raise StorageUnavailable(f"{self.field} {self.url}: list objects failed: 503")

    monkeypatch.setattr(BucketPrefix, "objects", down)
    with pytest.raises(WeightsUnavailable) as err:
        read_weights_anywhere(url)
    assert str(err.value) == f"training.model.initFrom: {url}: list objects failed: 503"


def test_urls_and_object_names_that_cannot_be_read_into_a_directory() -> None:
    assert split_object_url("gs://b/dir/w.safetensors") == ("gs://b/dir", "w.safetensors")
    assert split_object_url("gs://b/ckpt/") == ("gs://b", "ckpt")
    with pytest.raises(ValueError, match="gs://BUCKET/PATH"):
        split_object_url("gs://b")
    assert local_path(Path("/t"), "ckpt/d/x") == Path("/t/ckpt/d/x")
    for bad in ("ckpt/../../etc/passwd", "/etc/passwd", ""):
        with pytest.raises(ValueError, match="does not stay inside the prefix"):
            local_path(Path("/t"), bad)

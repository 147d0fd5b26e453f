"""The top-k sparse code of the bytes_sparse experiment (bench/lib/sparse_topk.py)."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_trainer.feedback import PushFeedback

from bench.lib.sparse_topk import TopK


def test_only_the_k_largest_of_each_chunk_survive_with_their_signs() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 100)).astype(np.float32)  # 300 values: chunks of 128, 128, 44
    code = TopK(chunk=128, k=8)
    got = code.roundtrip(x)
    assert got.shape == x.shape and got.dtype == np.float32
    flat, out = x.ravel(), got.ravel()
    for start in (0, 128, 256):
        chunk, kept = flat[start : start + 128], out[start : start + 128]
        assert np.count_nonzero(kept) == 8
        largest = set(np.argsort(-np.abs(chunk))[:8].tolist())
        assert set(np.flatnonzero(kept).tolist()) == largest
        assert np.all(np.sign(kept[kept != 0]) == np.sign(chunk[kept != 0]))
    assert np.all(np.isfinite(got))


def test_zeros_stay_zeros() -> None:
    assert not np.any(TopK(chunk=64, k=4).roundtrip(np.zeros(200, np.float32)))


def test_with_error_feedback_every_value_gets_through_in_time() -> None:
    """What a push leaves out is owed and sent later: the debt stops growing (a 1/16 density
    keeps about 9x one delta owed), so the receiver's sum approaches the sender's."""
    rng = np.random.default_rng(1)
    delta = {"w": rng.normal(size=4096).astype(np.float32)}
    code, feedback = TopK(chunk=1024, k=64), PushFeedback()
    received = np.zeros(4096, np.float32)
    owed = []
    for _ in range(512):
        sent = feedback.compensated(0, delta)
        applied = {"w": code.roundtrip(sent["w"])}
        feedback.settle(0, sent, applied)
        received += applied["w"]
        owed.append(feedback.owed_norm(0))
    assert owed[-1] < 1.1 * owed[255]  # bounded, not growing
    total = 512 * delta["w"]
    assert np.linalg.norm(received - total) / np.linalg.norm(total) < 0.05


def test_bytes_count_positions_codes_and_scales() -> None:
    code = TopK(chunk=4096, k=64)
    assert code.nbytes(4096) == 64 * 2 + 16 + 4
    assert code.nbytes(8192 + 10) == (128 + 10) * 2 + (138 * 2 + 7) // 8 + 3 * 4
    assert TopK(chunk=256, k=8).nbytes(256) == 8 + 2 + 4  # one-byte positions


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="k <= chunk"):
        TopK(chunk=16, k=32)

"""Payloads in pieces are safetensors payloads (safetensors' own loader reads them) whose
tensor bytes are the arrays' memory, not copies."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_trainer.payload import safetensors_pieces
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((7, 5)).astype(np.float32),
        "b": rng.standard_normal(3).astype(np.float64),
        "q": rng.integers(-128, 127, 11).astype(np.int8),
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
        "strided": np.arange(20, dtype=np.int32)[::2],  # not contiguous: copied once
        "flags": np.array([True, False, True]),
    }


def test_safetensors_reads_what_the_pieces_make() -> None:
    given = tensors()
    pieces = safetensors_pieces(given, {"kind": "params", "versions": "[3]"})
    payload = pieces.joined()
    assert len(payload) == pieces.size
    back = st_load(payload)
    assert sorted(back) == sorted(given)
    for name, a in given.items():
        assert back[name].dtype == a.dtype and back[name].shape == a.shape
        np.testing.assert_array_equal(back[name], a)
    # the same tensors as safetensors' own encoder makes (given contiguous arrays: of a strided
    # one it saves the underlying buffer's first bytes, seen here)
    contiguous = {k: np.ascontiguousarray(v) if v.ndim else v for k, v in given.items()}
    assert {k: v.tobytes() for k, v in st_load(st_save(contiguous)).items()} == {
        k: v.tobytes() for k, v in back.items()
    }
    header_len = int.from_bytes(payload[:8], "little")
    assert header_len % 8 == 0 and b'"kind":"params"' in payload[8 : 8 + header_len]


def test_the_tensor_bytes_are_views_of_the_arrays() -> None:
    w = np.ones((1000, 100), np.float32)
    pieces = safetensors_pieces({"w": w}, {})
    (chunk,) = pieces.chunks
    assert np.shares_memory(np.frombuffer(chunk, np.uint8), w)


@pytest.mark.parametrize("limit", [1, 7, 64, 1 << 20])
def test_slices_are_the_payload_in_order_and_bounded(limit: int) -> None:
    pieces = safetensors_pieces(tensors(), {"a": "b"})
    slices = list(pieces.slices(limit))
    assert all(0 < s.nbytes <= limit for s in slices)
    assert b"".join(slices) == pieces.joined()


def test_a_dtype_without_a_safetensors_name_is_refused() -> None:
    with pytest.raises(ValueError, match="complex64"):
        safetensors_pieces({"z": np.zeros(2, np.complex64)}, {})

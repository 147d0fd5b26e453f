"""Wire round trips and malformed payloads."""

from __future__ import annotations

import json

import numpy as np
import pytest
from diloco_trainer.wire import (
    PushHeader,
    WireError,
    decode_params,
    decode_push,
    encode_push,
    encode_tensors,
    params_pieces,
)


def delta() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "blocks.0.w": rng.normal(size=(17, 9)).astype(np.float32),
        "ln.scale": rng.normal(size=(9,)).astype(np.float32),
    }


def header(scheme: str = "none") -> PushHeader:
    return PushHeader(2, 7, 50, 6400, scheme, "unit-1", 3)  # type: ignore[arg-type]


def test_push_round_trip_unquantized_is_exact() -> None:
    d = delta()
    payload, err, _ = encode_push(header(), d)
    h, got = decode_push(payload)
    assert err == 0.0
    assert (h.fragment, h.base_version, h.c_steps, h.c_tokens, h.unit, h.attempt) == (
        2,
        7,
        50,
        6400,
        "unit-1",
        3,
    )
    for k in d:
        np.testing.assert_array_equal(got[k], d[k])


@pytest.mark.parametrize(("scheme", "ratio"), [("int8", 0.30), ("int4", 0.17), ("int2", 0.10)])
def test_push_round_trip_quantized_is_smaller_and_close(scheme: str, ratio: float) -> None:
    big = {"w": np.random.default_rng(1).normal(size=(64, 64)).astype(np.float32)}
    plain = encode_push(header(), big).body
    payload, err, applied = encode_push(header(scheme), big, block_size=64)
    h, got = decode_push(payload)
    np.testing.assert_array_equal(applied["w"], got["w"])  # what the pusher owes is exact
    assert h.scheme == scheme and h.block_size == 64
    assert got["w"].shape == (64, 64) and got["w"].dtype == np.float32
    assert len(payload) < ratio * len(plain)
    measured = np.linalg.norm(got["w"] - big["w"]) / np.linalg.norm(big["w"])
    assert err == pytest.approx(measured, rel=1e-4)


def test_params_round_trip() -> None:
    d = delta()
    got = decode_params(params_pieces(d, [3, 4], fragment=1).joined())
    assert got.versions == [3, 4] and got.fragment == 1
    np.testing.assert_array_equal(got.tensors["ln.scale"], d["ln.scale"])


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"short",
        (10**9).to_bytes(8, "little") + b"{}",
        (4).to_bytes(8, "little") + b"nope",
        (2).to_bytes(8, "little") + b"[]",
    ],
)
def test_garbage_is_rejected(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_push(payload)


def test_truncated_payload_is_rejected() -> None:
    payload = encode_push(header(), delta()).body
    with pytest.raises(WireError, match="malformed"):
        decode_push(payload[:-10])


def test_missing_metadata_and_wrong_kind_are_rejected() -> None:
    with pytest.raises(WireError, match="format"):
        decode_push(
            encode_tensors({"x": np.ones(2, np.float32)}, {}).replace(b"diloco/1", b"other/99")
        )
    no_base = encode_tensors(
        {"x": np.ones(2, np.float32)},
        {"kind": "push", "scheme": "none", "unit": "u", "fragment": "0"},
    )
    with pytest.raises(WireError, match="baseVersion"):
        decode_push(no_base)
    with pytest.raises(WireError, match="kind"):
        decode_push(params_pieces(delta(), [0]).joined())


def test_wrong_dtype_and_inconsistent_quantized_tensors_are_rejected() -> None:
    meta = {
        "kind": "push",
        "scheme": "none",
        "unit": "u",
        "fragment": "0",
        "baseVersion": "0",
        "cSteps": "1",
        "cTokens": "1",
        "attempt": "0",
    }
    with pytest.raises(WireError, match="float32"):
        decode_push(encode_tensors({"x": np.ones(2, np.float64)}, meta))
    q = {**meta, "scheme": "int8", "blockSize": "4", "shapes": json.dumps({"x": [8]})}
    with pytest.raises(WireError, match="inconsistent"):
        decode_push(encode_tensors({"q/x": np.ones(4, np.int8), "s/x": np.ones(2, np.float32)}, q))
    with pytest.raises(WireError, match="missing"):
        decode_push(encode_tensors({"q/x": np.ones(8, np.int8)}, q))


def test_quantized_push_carries_the_measured_error() -> None:
    payload, err, _ = encode_push(header("int4"), delta(), block_size=16)
    h, _ = decode_push(payload)
    assert h.quant_error == pytest.approx(err, rel=1e-5) and 0 < err < 0.2
    plain = encode_push(header(), delta()).body
    assert decode_push(plain)[0].quant_error is None

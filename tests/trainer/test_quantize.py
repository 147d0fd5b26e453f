"""Quantization round trips and their error bounds.

Bounds from the math: round-to-nearest with scale s = max|x_block|/qmax errs by at most s/2 per
element. For Gaussian values a block of 128 has max|x| ~ 2.8 sigma and the error is ~uniform on
[-s/2, s/2] (rms s/sqrt(12)), so the relative L2 error is ~ 2.8/(qmax*sqrt(12)): ~0.64% for int8
(qmax 127) and ~11.5% for int4 (qmax 7). The tests allow a margin: 1% and 15%.
"""

from __future__ import annotations

import numpy as np
import pytest
from diloco_trainer.quantize import (
    _pack,
    _unpack,
    dequantize,
    max_block_error_bound,
    quantize,
    relative_error,
)


@pytest.mark.parametrize(("scheme", "bound"), [("int8", 0.01), ("int4", 0.15)])
def test_gaussian_relative_error_within_derived_bound(scheme: str, bound: float) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1e-3, size=(257, 63)).astype(np.float32)  # not a multiple of the block
    qt = quantize(x, scheme, 128)  # type: ignore[arg-type]
    y = dequantize(qt)
    assert y.shape == x.shape and y.dtype == np.float32
    assert relative_error(x, y) < bound
    # A meaningful lower bound too: quantization is lossy, int4 clearly more than int8.
    assert relative_error(x, y) > bound / 20


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_every_element_within_half_a_step(scheme: str) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_cauchy(size=1000) * 1e-2).astype(np.float32)  # heavy tails, mixed scales
    y = dequantize(quantize(x, scheme, 64))  # type: ignore[arg-type]
    per_block = max_block_error_bound(x, scheme, 64)  # type: ignore[arg-type]
    padded_err = np.zeros(per_block.size * 64)
    padded_err[: x.size] = np.abs(y - x)
    assert np.all(padded_err.reshape(-1, 64).max(axis=1) <= per_block * (1 + 1e-5) + 1e-12)


def test_int4_packs_two_values_per_byte() -> None:
    x = np.linspace(-1, 1, 256, dtype=np.float32)
    q8, q4 = quantize(x, "int8", 128), quantize(x, "int4", 128)
    assert q8.data.nbytes == 256 and q4.data.nbytes == 128
    assert q4.scales.size == 2 and q4.scales.dtype == np.float32
    # Exactly representable values survive: the block max and zero.
    y = dequantize(q4)
    assert y[0] == pytest.approx(-1.0) and y[-1] == pytest.approx(1.0)


def test_zeros_and_odd_block_size() -> None:
    z = np.zeros((3, 5), np.float32)
    np.testing.assert_array_equal(dequantize(quantize(z, "int4", 8)), z)
    assert relative_error(z, z) == 0.0
    with pytest.raises(ValueError, match="blockSize"):
        quantize(z, "int4", 7)
    with pytest.raises(ValueError, match="scheme"):
        quantize(z, "none", 8)


def test_int2_spends_its_four_levels_around_the_blocks_rms() -> None:
    x = np.array([-3.0, -1.2, -0.7, -0.1, 0.0, 0.4, 1.1, 2.0], dtype=np.float32)
    qt = quantize(x, "int2", 8)
    rms = float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))
    assert qt.data.nbytes == 2 and qt.scales[0] == pytest.approx(rms, rel=1e-6)
    # Level below x / rms (clipped to -2..1), plus a half: +-rms/2 and +-3 rms/2.
    levels = np.clip(np.floor(x / rms), -2, 1) + 0.5
    np.testing.assert_allclose(dequantize(qt), levels * rms, rtol=1e-6)
    with pytest.raises(ValueError, match="multiple of 4"):
        quantize(x, "int2", 6)


def test_int2_error_on_normal_values_is_the_four_level_optimum() -> None:
    """About 35% relative L2 error on normal values (the optimum uniform four-level quantizer's
    mean squared error is 0.119 sigma^2); int4 about 12%."""
    x = np.random.default_rng(2).normal(0, 1e-3, size=(200, 128)).astype(np.float32)
    err = relative_error(x, dequantize(quantize(x, "int2", 128)))
    assert 0.30 < err < 0.40
    zeros = np.zeros(256, np.float32)  # an all-zero block has scale 0 and restores exactly
    np.testing.assert_array_equal(dequantize(quantize(zeros, "int2", 128)), zeros)


@pytest.mark.parametrize(("scheme", "codes"), [("int4", range(-7, 8)), ("int2", range(-2, 2))])
def test_packing_keeps_every_code_in_place(scheme: str, codes: range) -> None:
    """Every code of the scheme at every position of a byte decodes to itself."""
    q = np.tile(np.array(codes, dtype=np.int8), 8)
    per_byte = {"int4": 2, "int2": 4}[scheme]
    assert np.array_equal(_unpack(_pack(q, per_byte), per_byte), q.astype(np.float32))

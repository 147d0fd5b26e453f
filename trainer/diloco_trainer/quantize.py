"""Symmetric per-block quantization of deltas: int8, int4 packed two values per byte, and int2
packed four values per byte.

int8 and int4: each block of `block_size` consecutive values (of the flattened tensor) gets one
float32 scale s = max|x| / qmax (qmax = 127 for int8, 7 for int4) and values q = round(x / s) in
[-qmax, qmax]. Round-to-nearest bounds every element's error by s/2 = max|x_block| / (2*qmax):
0.39% of the block maximum for int8, 7.1% for int4. Symmetric (no zero point) because deltas
are centred on zero.

int2: two bits hold four levels, so int2 uses all four, (q + 1/2) * s for q in -2..1, that is
+-s/2 and +-3s/2, with s the block's root mean square: for normal values the best uniform
four-level quantizer has its step at 0.996 sigma. Values beyond 2s are clipped. The relative
L2 error of a normal block is about 35% (int4: 12%); a max-scaled ternary code (-1, 0, +1),
the other way to spend two bits, loses 77%, as most values round to zero. Either way the error
is too large to drop every round: int2 is meant to be sent with error feedback (feedback.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from diloco_trainer.config import PER_BYTE, Scheme

# The max-scaled schemes' largest code; int2 has codes -2..1 around its RMS scale instead.
QMAX: dict[str, int] = {"int8": 127, "int4": 7}


@dataclass(frozen=True)
class Quantized:
    """One quantized tensor. `data` is int8 values (int8) or packed codes (uint8: two 4-bit codes
    per byte for int4, four 2-bit codes for int2; the lowest bits hold the first value)."""

    scheme: Scheme
    shape: tuple[int, ...]
    block_size: int
    data: np.ndarray
    scales: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.scales.nbytes)


def _blocks(x: np.ndarray, block_size: int) -> np.ndarray:
    flat = np.asarray(x, dtype=np.float32).ravel()
    nblocks = max(1, math.ceil(flat.size / block_size))
    padded = np.zeros(nblocks * block_size, dtype=np.float32)
    padded[: flat.size] = flat
    return padded.reshape(nblocks, block_size)


def quantize(x: np.ndarray, scheme: Scheme, block_size: int) -> Quantized:
    if scheme not in PER_BYTE:
        raise ValueError(f"compression.scheme: cannot quantize with {scheme!r}")
    per_byte = PER_BYTE[scheme]
    if block_size < 1 or block_size % per_byte:
        raise ValueError(
            f"compression.blockSize: {block_size} ({scheme} needs a multiple of {per_byte})"
        )
    blocks = _blocks(x, block_size)
    if scheme == "int2":  # mid-rise: the level below x / s, four of them
        scales = np.sqrt(np.mean(np.square(blocks, dtype=np.float64), axis=1)).astype(np.float32)
        q = np.clip(np.floor(blocks / _nonzero(scales)[:, None]), -2, 1).astype(np.int8)
    else:
        qmax = QMAX[scheme]
        scales = (np.max(np.abs(blocks), axis=1) / qmax).astype(np.float32)
        q = np.clip(np.rint(blocks / _nonzero(scales)[:, None]), -qmax, qmax).astype(np.int8)
    data = q.ravel() if scheme == "int8" else _pack(q.ravel(), per_byte)
    return Quantized(scheme, tuple(int(d) for d in np.shape(x)), block_size, data, scales)


def _nonzero(scales: np.ndarray) -> np.ndarray:
    """Scales safe to divide by: an all-zero block (scale 0) is divided by 1 instead, and its
    codes dequantize to 0 through its zero scale."""
    return np.where(scales > 0, scales, 1.0).astype(np.float32)


def dequantize(qt: Quantized) -> np.ndarray:
    size = math.prod(qt.shape)
    nblocks = qt.scales.size
    if qt.scheme == "int8":
        q = qt.data.astype(np.int8).astype(np.float32)
    elif qt.scheme in PER_BYTE:
        q = _unpack(qt.data.astype(np.uint8), PER_BYTE[qt.scheme])
    else:
        raise ValueError(f"unknown quantization scheme {qt.scheme!r}")
    if q.size != nblocks * qt.block_size or size > q.size:
        raise ValueError(
            f"quantized tensor inconsistent: {q.size} values, {nblocks} scales of block "
            f"{qt.block_size}, shape {qt.shape}"
        )
    if qt.scheme == "int2":
        q += 0.5
    values = q.reshape(nblocks, qt.block_size) * qt.scales.astype(np.float32)[:, None]
    return values.ravel()[:size].reshape(qt.shape).astype(np.float32)


def _pack(q: np.ndarray, per_byte: int) -> np.ndarray:
    """Signed codes offset by half their range (8 for int4, 2 for int2) to unsigned and packed
    `per_byte` to a byte, first value in the lowest bits."""
    bits = 8 // per_byte
    u = (q.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8).reshape(-1, per_byte)
    packed = np.zeros(u.shape[0], dtype=np.uint8)
    for i in range(per_byte):
        packed |= u[:, i] << np.uint8(i * bits)
    return packed


def _unpack(data: np.ndarray, per_byte: int) -> np.ndarray:
    bits = 8 // per_byte
    mask, offset = (1 << bits) - 1, 1 << (bits - 1)
    q = np.empty((data.size, per_byte), dtype=np.float32)
    for i in range(per_byte):
        q[:, i] = ((data >> np.uint8(i * bits)) & mask).astype(np.float32) - offset
    return q.ravel()


def relative_error(original: np.ndarray, restored: np.ndarray) -> float:
    """||restored - original|| / ||original|| (0 for an all-zero original restored exactly)."""
    o = np.asarray(original, dtype=np.float64)
    r = np.asarray(restored, dtype=np.float64)
    denom = math.sqrt(float(np.sum(o * o)))
    err = math.sqrt(float(np.sum((r - o) ** 2)))
    if denom == 0:
        return 0.0 if err == 0 else math.inf
    return err / denom


def max_block_error_bound(x: np.ndarray, scheme: Scheme, block_size: int) -> np.ndarray:
    """Per-block bound on any element's absolute error: max|x_block| / (2*qmax) (int8, int4;
    int2 clips, so it has no such bound)."""
    if scheme not in QMAX:
        raise ValueError(f"{scheme} has no per-element error bound")
    blocks = _blocks(x, block_size)
    return np.asarray(np.max(np.abs(blocks), axis=1) / (2 * QMAX[scheme]))

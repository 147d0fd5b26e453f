"""Symmetric per-block quantization of deltas: int8, and int4 packed two values per byte.

Each block of `block_size` consecutive values (of the flattened tensor) gets one float32 scale
s = max|x| / qmax (qmax = 127 for int8, 7 for int4) and values q = round(x / s) in [-qmax, qmax].
Round-to-nearest bounds every element's error by s/2 = max|x_block| / (2*qmax): 0.39% of the block
maximum for int8, 7.1% for int4. The scheme is symmetric (no zero point) because deltas are
centred on zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from diloco_trainer.config import Scheme

QMAX: dict[str, int] = {"int8": 127, "int4": 7}


@dataclass(frozen=True)
class Quantized:
    """One quantized tensor. `data` is int8 values (int8) or packed nibbles (uint8, int4)."""

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
    if scheme not in QMAX:
        raise ValueError(f"compression.scheme: cannot quantize with {scheme!r}")
    if block_size < 1 or (scheme == "int4" and block_size % 2):
        raise ValueError(f"compression.blockSize: {block_size} (int4 needs an even size)")
    qmax = QMAX[scheme]
    blocks = _blocks(x, block_size)
    amax = np.max(np.abs(blocks), axis=1)
    scales = (amax / qmax).astype(np.float32)
    safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
    q = np.clip(np.rint(blocks / safe[:, None]), -qmax, qmax).astype(np.int8)
    if scheme == "int8":
        data = q.ravel()
    else:
        # Offset to 0..14 and pack: low nibble = even index, high nibble = odd index.
        u = (q.ravel() + 8).astype(np.uint8)
        data = (u[0::2] | (u[1::2] << 4)).astype(np.uint8)
    return Quantized(scheme, tuple(int(d) for d in np.shape(x)), block_size, data, scales)


def dequantize(qt: Quantized) -> np.ndarray:
    size = math.prod(qt.shape)
    nblocks = qt.scales.size
    if qt.scheme == "int8":
        q = qt.data.astype(np.int8).astype(np.float32)
    elif qt.scheme == "int4":
        u = qt.data.astype(np.uint8)
        q = np.empty(u.size * 2, dtype=np.float32)
        q[0::2] = (u & 0x0F).astype(np.float32) - 8
        q[1::2] = (u >> 4).astype(np.float32) - 8
    else:
        raise ValueError(f"unknown quantization scheme {qt.scheme!r}")
    if q.size != nblocks * qt.block_size or size > q.size:
        raise ValueError(
            f"quantized tensor inconsistent: {q.size} values, {nblocks} scales of block "
            f"{qt.block_size}, shape {qt.shape}"
        )
    values = q.reshape(nblocks, qt.block_size) * qt.scales.astype(np.float32)[:, None]
    return values.ravel()[:size].reshape(qt.shape).astype(np.float32)


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
    """Per-block bound on any element's absolute error: max|x_block| / (2*qmax)."""
    blocks = _blocks(x, block_size)
    return np.asarray(np.max(np.abs(blocks), axis=1) / (2 * QMAX[scheme]))

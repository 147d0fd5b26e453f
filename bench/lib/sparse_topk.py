"""Top-k sparse deltas with 2-bit values, for the bytes_sparse experiment (a SparseLoCo-style
scheme, in-process only: the learner-syncer wire does not carry it).

Each tensor is cut into chunks of `chunk` values; in each, only the `k` values of largest
magnitude are sent: their positions in the chunk and their values on the int2 scheme's four
levels, (q + 1/2) * s for q in -2..1 with s the kept values' RMS (diloco_trainer.quantize).
What is left out goes out later through error feedback (the learner's `PushFeedback` on the
uplink, the published copy's lag on the downlink), so a value too small to be sent now
accumulates until it is.

Bytes per chunk: k positions (one byte each up to chunks of 256, two up to 65,536), k 2-bit
codes, one float32 scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TopK:
    chunk: int = 4096
    k: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.k <= self.chunk <= 65_536:
            raise ValueError(
                f"top-k: need 1 <= k <= chunk <= 65536, got k={self.k} chunk={self.chunk}"
            )

    @property
    def label(self) -> str:
        return f"top-{self.k}/{self.chunk} int2"

    def roundtrip(self, x: np.ndarray) -> np.ndarray:
        """What the receiver rebuilds of `x`: its kept values dequantized, zeros elsewhere."""
        flat = np.asarray(x, dtype=np.float32).ravel()
        chunks = math.ceil(flat.size / self.chunk) if flat.size else 0
        padded = np.zeros(chunks * self.chunk, np.float32)
        padded[: flat.size] = flat
        rows = padded.reshape(chunks, self.chunk)
        k = min(self.k, self.chunk)
        kept = np.argpartition(np.abs(rows), -k, axis=1)[:, -k:]
        values = np.take_along_axis(rows, kept, axis=1)
        scale = np.sqrt(np.mean(np.square(values, dtype=np.float64), axis=1)).astype(np.float32)
        safe = np.where(scale > 0, scale, 1.0)[:, None]
        codes = np.clip(np.floor(values / safe), -2, 1)
        out = np.zeros_like(rows)
        np.put_along_axis(out, kept, ((codes + 0.5) * scale[:, None]).astype(np.float32), axis=1)
        return out.ravel()[: flat.size].reshape(np.shape(x))

    def nbytes(self, size: int) -> int:
        """Bytes on the wire for a tensor of `size` values (a short last chunk keeps at most
        its own size)."""
        position = 1 if self.chunk <= 256 else 2
        full, rest = divmod(size, self.chunk)
        kept = full * self.k + min(self.k, rest)
        chunks = full + (1 if rest else 0)
        return kept * position + math.ceil(kept * 2 / 8) + 4 * chunks

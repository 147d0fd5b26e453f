"""Compressed downlink: the syncer sends each new fragment version as a quantized step from the
previous one, with error feedback, instead of the whole fragment in float32.

The syncer keeps two copies of a fragment: the global parameters its outer optimizer owns, and
the *published* copy, which is exactly what every learner holds. A new version is published as

    step      = quantize(global - published)        (int8 or int4, per-block scales)
    published = apply_step(published, step)

and a learner that holds the previous version applies the same `apply_step` to its copy, so both
copies stay bitwise equal. Whatever the quantizer dropped is still in `global - published` and
goes out with the next step (error feedback): the learners' copy trails the global parameters by
one step's rounding, never by an accumulated drift. A learner that holds anything else (a new
learner, one that missed a version, one from before a syncer restart) gets the whole published
copy in float32.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from diloco_trainer.config import Scheme
from diloco_trainer.quantize import Quantized, dequantize, quantize, relative_error

Tensors = dict[str, np.ndarray]


def apply_step(published: Mapping[str, np.ndarray], step: Mapping[str, np.ndarray]) -> Tensors:
    """The next published copy. The one function both ends use, so their float32 sums agree."""
    return {name: (published[name] + step[name]).astype(np.float32) for name in published}


def checksum(tensors: Mapping[str, np.ndarray]) -> int:
    """CRC-32 of the tensors' float32 bytes in name order: a step carries the checksum of the copy
    it leads to, so a receiver whose rebuilt copy differs finds out and asks for the values."""
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(np.ascontiguousarray(tensors[name], dtype=np.float32).tobytes(), crc)
    return crc


def quantize_step(
    published: Mapping[str, np.ndarray],
    target: Mapping[str, np.ndarray],
    scheme: Scheme,
    block_size: int,
) -> dict[str, Quantized]:
    return {
        name: quantize(np.asarray(target[name] - published[name]), scheme, block_size)
        for name in published
    }


def dequantize_step(step: Mapping[str, Quantized]) -> Tensors:
    return {name: dequantize(q) for name, q in step.items()}


@dataclass(frozen=True)
class Publication:
    """One fragment as the learners hold it: the published copy at `version`, and the quantized
    step that led to it from `version - 1` (None after a full send: a restart or version 0)."""

    version: int
    tensors: Tensors
    step: dict[str, Quantized] | None = None
    checksum: int = 0  # of `tensors`, when `step` is set

    def advance(
        self, target: Mapping[str, np.ndarray], version: int, scheme: Scheme, block_size: int
    ) -> Publication:
        """Publish `target` (the new global fragment) as `version`, a step after this one."""
        if version != self.version + 1:
            raise ValueError(f"publication {self.version} cannot advance to {version}")
        step = quantize_step(self.tensors, target, scheme, block_size)
        tensors = apply_step(self.tensors, dequantize_step(step))
        return Publication(version, tensors, step, checksum(tensors))

    def lag(self, target: Mapping[str, np.ndarray]) -> float:
        """Relative L2 distance from the published copy to `target` (what error feedback owes)."""
        names = sorted(self.tensors)
        flat_target = np.concatenate([np.ravel(target[n]) for n in names])
        flat_published = np.concatenate([np.ravel(self.tensors[n]) for n in names])
        return relative_error(flat_target, flat_published)

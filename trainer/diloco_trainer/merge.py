"""Merging learner deltas of one fragment into one outer gradient.

Weights: w_m = c_tokens^2 / c_steps ("quantity x quality": more tokens and bigger batches per step
count more), normalised to sum 1; uniform when token weighting is off.

Radial-Directional Averaging (RDA): the merged delta has the weighted mean of the deltas' norms
(radius) and the direction of the weighted mean of their unit vectors. A plain mean of M
near-orthogonal deltas of equal norm r has norm ~ r/sqrt(M), so the outer step would shrink as more
learners join; RDA keeps the step length.

RDA is applied per leaf tensor, not to the fragment as one vector: leaves differ in scale by orders
of magnitude (layer-norm gains vs. weight matrices), and one fragment-wide norm would let the largest
matrices decide the radius of every small leaf bundled with them. Per leaf, each tensor keeps its own
typical step length, and the result does not depend on how leaves were packed into fragments.

Embedding leaves (names starting with "embed") are always plainly weighted-averaged: each learner
only moves the rows of tokens it saw, so their deltas are sparse and not comparable in direction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

MergeMethod = Literal["rda", "mean"]
EMBED_PREFIX = "embed"
BLOCK = 1 << 16  # float32 elements per block of the accumulation: 256 KiB, held in L2
ALIGN_FLOATS = 16  # 64 bytes


@dataclass(frozen=True)
class Contribution:
    """One learner's delta for one fragment (Theta_p(base) - theta_p) and its counters."""

    delta: Mapping[str, np.ndarray]
    c_steps: int
    c_tokens: int


def merge_weights(counters: Sequence[tuple[int, int]], token_weighting: bool = True) -> np.ndarray:
    """Normalised weights from (c_steps, c_tokens) pairs.

    A contribution with no steps has weight 0. If every weight is 0 (or weighting is off) the
    weights are uniform, so a merge never divides by zero.
    """
    if not counters:
        raise ValueError("merge_weights: no contributions")
    if token_weighting:
        raw = np.array(
            [(tok * tok / steps) if steps > 0 else 0.0 for steps, tok in counters], dtype=np.float64
        )
    else:
        raw = np.ones(len(counters), dtype=np.float64)
    total = raw.sum()
    if not math.isfinite(total) or total <= 0:
        raw = np.ones(len(counters), dtype=np.float64)
        total = raw.sum()
    return raw / total


def l2_norm(x: np.ndarray) -> float:
    # BLAS dot of the flat float32 view: no temporaries; its blocked accumulation keeps the
    # relative error near 1e-6 even for tens of millions of elements.
    flat = _flat32(x)
    return math.sqrt(max(0.0, float(np.dot(flat, flat))))


def _flat32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).ravel()


def aligned_empty(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialised float32 array whose data starts on a 64-byte boundary: the outer step
    hands such arrays to XLA without copying them (numpy only guarantees 16 bytes)."""
    size = math.prod(shape)
    raw = np.empty(size + ALIGN_FLOATS, dtype=np.float32)
    start = (-raw.ctypes.data % (4 * ALIGN_FLOATS)) // 4
    return raw[start : start + size].reshape(shape)


class _Accumulator:
    """sum_i coeff_i * delta_i in float32, one delta at a time, in blocks of BLOCK elements.

    Each block is scaled into a small scratch buffer and added to the accumulator there, so the
    work stays in the core's cache and no fragment-sized temporary is made. numpy ufuncs run on
    the calling thread: BLAS saxpy (the earlier kernel) splits large vectors across OpenBLAS
    threads, which on cores shared with other processes made whole merges 4-10x slower
    (docs/design.md, "Syncer merge speed").
    """

    def __init__(self, shape: tuple[int, ...], scratch: np.ndarray) -> None:
        self.acc = aligned_empty(shape)
        self.flat = self.acc.reshape(-1)
        self.scratch = scratch
        self.empty = True

    def add(self, flat: np.ndarray, coeff: float) -> None:
        c = np.float32(coeff)
        if self.empty:
            np.multiply(flat, c, out=self.flat)
            self.empty = False
            return
        size = self.flat.size
        for start in range(0, size, BLOCK):
            stop = min(start + BLOCK, size)
            part = self.scratch[: stop - start]
            np.multiply(flat[start:stop], c, out=part)
            acc = self.flat[start:stop]
            np.add(acc, part, out=acc)

    def result(self) -> np.ndarray:
        if self.empty:
            self.flat.fill(0.0)
        return self.acc


def _scratch(size: int) -> np.ndarray:
    return np.empty(min(size, BLOCK), dtype=np.float32)


def weighted_mean(
    deltas: Sequence[np.ndarray], weights: np.ndarray, scratch: np.ndarray | None = None
) -> np.ndarray:
    shape = tuple(deltas[0].shape)
    acc = _Accumulator(shape, _scratch(math.prod(shape)) if scratch is None else scratch)
    for w, d in zip(weights, deltas, strict=True):
        if w != 0.0:
            acc.add(_flat32(d), float(w))
    return acc.result()


def rda(
    deltas: Sequence[np.ndarray],
    weights: np.ndarray,
    eps: float = 1e-12,
    scratch: np.ndarray | None = None,
) -> np.ndarray:
    """Radial-directional average of same-shaped tensors with normalised weights.

    Zero deltas add nothing to the direction but count (as 0) in the radius. If the unit vectors
    cancel out, the direction is undefined and the result is zero: no confident step to take.

    Each delta's coefficient w/|d| needs only its own norm, so a delta is added to the direction
    right after its norm is taken: the second read of the leaf comes from cache when it fits.
    """
    shape = tuple(deltas[0].shape)
    acc = _Accumulator(shape, _scratch(math.prod(shape)) if scratch is None else scratch)
    radius = 0.0
    for w, d in zip(weights, deltas, strict=True):
        flat = _flat32(d)
        norm = l2_norm(flat)
        radius += float(w) * norm
        if norm > eps and w != 0.0:
            acc.add(flat, float(w / norm))
    direction = acc.result()
    dnorm = l2_norm(direction)
    if dnorm <= eps or radius <= eps:
        direction.fill(0.0)
        return direction
    direction *= np.float32(radius / dnorm)
    return direction


def is_embedding(name: str) -> bool:
    return name.startswith(EMBED_PREFIX)


def participation_share(contributing: int, online: int) -> float:
    """The share of the online learners that a merge contains, in (0, 1].

    With quorum K below the number of learners M, a round of H inner steps produces up to M
    separate merges of one fragment instead of one. Applying each at full outer learning rate
    (and through momentum) makes the round's step about M times that of synchronous DiLoCo, which
    diverges at the usual lr 0.7 / momentum 0.9. Scaling a merge by the share it represents makes
    the round add up to one averaged step, whatever the arrival pattern.
    """
    if contributing < 1:
        raise ValueError("participation_share: a merge has at least one contribution")
    return contributing / max(online, contributing)


def scale_delta(delta: Mapping[str, np.ndarray], factor: float) -> dict[str, np.ndarray]:
    # float32 * float32 scalar is already float32: no second copy of a fragment-sized array.
    return {
        name: np.multiply(leaf, np.float32(factor), out=aligned_empty(tuple(leaf.shape)))
        for name, leaf in delta.items()
    }


def merge_fragment(
    contributions: Sequence[Contribution],
    method: MergeMethod = "rda",
    token_weighting: bool = True,
) -> dict[str, np.ndarray]:
    """Merge the contributions of one fragment leaf by leaf into one outer gradient."""
    if not contributions:
        raise ValueError("merge_fragment: no contributions")
    names = sorted(contributions[0].delta)
    for c in contributions[1:]:
        if sorted(c.delta) != names:
            raise ValueError("merge_fragment: contributions carry different leaves")
    weights = merge_weights([(c.c_steps, c.c_tokens) for c in contributions], token_weighting)
    merged: dict[str, np.ndarray] = {}
    largest = max((math.prod(np.shape(contributions[0].delta[n])) for n in names), default=1)
    scratch = _scratch(largest)
    for name in names:
        leaves = [np.asarray(c.delta[name], dtype=np.float32) for c in contributions]
        if method == "rda" and not is_embedding(name):
            merged[name] = rda(leaves, weights, scratch=scratch)
        else:
            merged[name] = weighted_mean(leaves, weights, scratch)
    return merged

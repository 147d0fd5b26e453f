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

Speed (docs/design.md, "Syncer merge speed"): the merge is bound by reading M deltas from memory.
Each delta is read once when its leaf norms come with it (the syncer measures them when it decodes
the push), each output block is built from all deltas while it is in cache, and the per-leaf
factors (radius / direction norm, participation share) are left to the outer step, which reads
the merged leaves anyway (`OuterGradient`, `outer.merge_and_step`).
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
    """One learner's delta for one fragment (Theta_p(base) - theta_p) and its counters.

    `norms`: each leaf's L2 norm where it was already measured (the syncer measures every push
    when it decodes it); the merge then reads each delta once instead of twice."""

    delta: Mapping[str, np.ndarray]
    c_steps: int
    c_tokens: int
    norms: Mapping[str, float] | None = None


@dataclass(frozen=True)
class OuterGradient:
    """A fragment's merged outer gradient as one array and one factor per leaf: the gradient of
    leaf n is scales[n] * directions[n]. The factors (RDA radius over the direction's norm, times
    the participation share) are applied where the gradient is read next, in the outer step,
    rather than in passes of their own over the merged leaves."""

    directions: dict[str, np.ndarray]  # views into `packed`, in sorted name order
    scales: dict[str, float]
    packed: np.ndarray  # every leaf in one buffer (`pack_layout`): one transfer to the step

    def dense(self) -> dict[str, np.ndarray]:
        """The gradient as plain float32 arrays, 64-byte aligned (`directions` is not changed)."""
        return {
            name: leaf if self.scales[name] == 1.0 else scale_delta({name: leaf}, self.scales)[name]
            for name, leaf in self.directions.items()
        }


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


def pack_layout(shapes: Sequence[tuple[int, ...]]) -> tuple[list[int], int]:
    """Where each leaf starts in a packed buffer of all of them, every one on a 64-byte boundary
    (so each view is as aligned as the buffer), and the buffer's length in float32 elements."""
    starts, end = [], 0
    for shape in shapes:
        starts.append(end)
        end += -(-math.prod(shape) // ALIGN_FLOATS) * ALIGN_FLOATS
    return starts, end


def packed_empty(shapes: Sequence[tuple[int, ...]]) -> tuple[np.ndarray, list[np.ndarray]]:
    """A 64-byte-aligned buffer and a view of each shape into it, laid out by `pack_layout`."""
    starts, length = pack_layout(shapes)
    buffer = aligned_empty((length,))
    views = [
        buffer[start : start + math.prod(shape)].reshape(shape)
        for start, shape in zip(starts, shapes, strict=True)
    ]
    return buffer, views


def weighted_sum(
    flats: Sequence[np.ndarray],
    coeffs: Sequence[float],
    out: np.ndarray,
    scratch: np.ndarray,
    measure: bool = True,
) -> float:
    """out = sum_i coeffs_i * flats_i over flat float32 arrays; returns the sum of out's squares
    (0.0 unless `measure`).

    Block-major: each BLOCK of out is built from every delta in turn and its squares summed
    while it is still in the core's cache, so out is written to memory once and never read
    back, and no fragment-sized temporary is made. Each term is scaled into `scratch` and added
    (numpy has no fused multiply-add); the per-element order of the additions is that of
    `flats`, as in a plain loop over the deltas. numpy ufuncs run on the calling thread: BLAS
    saxpy splits large vectors across OpenBLAS threads, which on cores shared with other
    processes made whole merges 4-10x slower (docs/design.md, "Syncer merge speed").
    """
    size = out.size
    if not flats:
        out.fill(0.0)
        return 0.0
    factors = [np.float32(c) for c in coeffs]
    squares = 0.0
    for start in range(0, size, BLOCK):
        stop = min(start + BLOCK, size)
        part, term = out[start:stop], scratch[: stop - start]
        np.multiply(flats[0][start:stop], factors[0], out=part)
        for flat, factor in zip(flats[1:], factors[1:], strict=True):
            np.multiply(flat[start:stop], factor, out=term)
            np.add(part, term, out=part)
        if measure:
            squares += float(np.dot(part, part))
    return squares


def _scratch(size: int) -> np.ndarray:
    return np.empty(min(size, BLOCK), dtype=np.float32)


def _mean_leaf(
    flats: Sequence[np.ndarray], weights: np.ndarray, out: np.ndarray, scratch: np.ndarray
) -> float:
    """Writes sum_i w_i d_i into out; its factor is 1."""
    terms = [(flat, float(w)) for w, flat in zip(weights, flats, strict=True) if w != 0.0]
    weighted_sum([t[0] for t in terms], [t[1] for t in terms], out, scratch, measure=False)
    return 1.0


def _rda_leaf(
    flats: Sequence[np.ndarray],
    weights: np.ndarray,
    norms: Sequence[float],
    out: np.ndarray,
    scratch: np.ndarray,
    eps: float,
) -> float:
    """Writes the RDA direction sum_i (w_i / |d_i|) d_i into out and returns the factor that
    gives it the radius sum_i w_i |d_i|.

    Zero deltas add nothing to the direction but count (as 0) in the radius. If the unit vectors
    cancel out, the direction is undefined and the result is zero: no confident step to take.
    """
    radius = sum(float(w) * n for w, n in zip(weights, norms, strict=True))
    terms = [
        (flat, float(w) / n)
        for w, flat, n in zip(weights, flats, norms, strict=True)
        if n > eps and w != 0.0
    ]
    dnorm = math.sqrt(weighted_sum([t[0] for t in terms], [t[1] for t in terms], out, scratch))
    if dnorm <= eps or radius <= eps:
        out.fill(0.0)
        return 0.0
    return radius / dnorm


def weighted_mean(
    deltas: Sequence[np.ndarray], weights: np.ndarray, scratch: np.ndarray | None = None
) -> np.ndarray:
    shape = tuple(deltas[0].shape)
    out = aligned_empty(shape)
    scratch = _scratch(out.size) if scratch is None else scratch
    _mean_leaf([_flat32(d) for d in deltas], weights, out.reshape(-1), scratch)
    return out


def rda(
    deltas: Sequence[np.ndarray],
    weights: np.ndarray,
    eps: float = 1e-12,
    scratch: np.ndarray | None = None,
) -> np.ndarray:
    """Radial-directional average of same-shaped tensors with normalised weights (`_rda_leaf`)."""
    flats = [_flat32(d) for d in deltas]
    out = aligned_empty(tuple(deltas[0].shape))
    scratch = _scratch(out.size) if scratch is None else scratch
    factor = _rda_leaf(flats, weights, [l2_norm(f) for f in flats], out.reshape(-1), scratch, eps)
    out *= np.float32(factor)
    return out


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


def scale_delta(
    delta: Mapping[str, np.ndarray], factor: float | Mapping[str, float]
) -> dict[str, np.ndarray]:
    """Each leaf times its factor (one for all, or one per leaf), as new aligned arrays."""

    def factor_of(name: str) -> np.float32:
        return np.float32(factor[name] if isinstance(factor, Mapping) else factor)

    # float32 * float32 scalar is already float32: no second copy of a fragment-sized array.
    return {
        name: np.multiply(leaf, factor_of(name), out=aligned_empty(tuple(leaf.shape)))
        for name, leaf in delta.items()
    }


def merge_outer_gradient(
    contributions: Sequence[Contribution],
    method: MergeMethod = "rda",
    token_weighting: bool = True,
    share: float = 1.0,
) -> OuterGradient:
    """Merge the contributions of one fragment leaf by leaf into one outer gradient, scaled by
    `share` (`participation_share`); each delta is read once when its norms are given."""
    if not contributions:
        raise ValueError("merge_fragment: no contributions")
    names = sorted(contributions[0].delta)
    for c in contributions[1:]:
        if sorted(c.delta) != names:
            raise ValueError("merge_fragment: contributions carry different leaves")
    weights = merge_weights([(c.c_steps, c.c_tokens) for c in contributions], token_weighting)
    largest = max((math.prod(np.shape(contributions[0].delta[n])) for n in names), default=1)
    scratch = _scratch(largest)
    packed, outs = packed_empty([tuple(np.shape(contributions[0].delta[n])) for n in names])
    directions: dict[str, np.ndarray] = {}
    scales: dict[str, float] = {}
    for name, out in zip(names, outs, strict=True):
        flats = [_flat32(c.delta[name]) for c in contributions]
        if method == "rda" and not is_embedding(name):
            norms = [
                _leaf_norm(c, name, flat) for c, flat in zip(contributions, flats, strict=True)
            ]
            factor = _rda_leaf(flats, weights, norms, out.reshape(-1), scratch, eps=1e-12)
        else:
            factor = _mean_leaf(flats, weights, out.reshape(-1), scratch)
        directions[name], scales[name] = out, factor * share
    return OuterGradient(directions, scales, packed)


def _leaf_norm(contribution: Contribution, name: str, flat: np.ndarray) -> float:
    known = contribution.norms
    return float(known[name]) if known is not None else l2_norm(flat)


def merge_fragment(
    contributions: Sequence[Contribution],
    method: MergeMethod = "rda",
    token_weighting: bool = True,
    share: float = 1.0,
) -> dict[str, np.ndarray]:
    """Merge the contributions of one fragment leaf by leaf into one outer gradient, as plain
    arrays (the syncer hands `merge_outer_gradient`'s factors to the outer step instead)."""
    return merge_outer_gradient(contributions, method, token_weighting, share).dense()

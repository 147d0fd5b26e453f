"""Robust aggregation: what keeps one unit's outlying push from steering a merge.

Token-weighted RDA trusts every contribution it is given. A unit with a silent data corruption,
a bug or bad intent can send a delta many times the usual norm, plain noise, or its own delta
with the sign flipped; bounded counters (trust.py) cap its weight, and these screens cap what
its delta does. Each is a small transformation of a round's contributions, in the style of
optax: `screen(robust_config)` chains them.

- `clip_norms(ratio)`: a delta longer than `ratio` x the round's median delta norm is scaled
  down to it. With fewer than three contributions a median says nothing about who is off, so
  the reference is then the fragment's typical norm from earlier rounds (`typical`), if any.
- `drop_opposed(min_cosine)`: in a round of three or more, a delta whose cosine with the
  weighted mean direction of the others is below `min_cosine` is left out, in a round whose
  median cosine is at least twice that (noise has cosine about 0, a flipped delta a negative one; honest
  deltas of the demo run measured 0.33-0.96). At most a minority is ever left out, the lowest
  first, so a round can never be emptied by it.

Every contribution gets a verdict (kept, clipped, dropped) and whether it is an outlier (left
out, or clipped from more than twice the bound of its own round's median); the syncer counts
outliers per attempt and quarantines one that sends them again and again (rounds.py). Pure numpy; run in
the merge thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from diloco_trainer.config import RobustConfig
from diloco_trainer.merge import Contribution, l2_norm, merge_weights

Action = Literal["kept", "clipped", "dropped"]


@dataclass
class Verdict:
    """What the screens found of one unit's delta in one round."""

    unit: str
    action: Action = "kept"
    norm_ratio: float | None = None  # its norm over the reference norm (None: no reference)
    cosine: float | None = None  # with the others' mean direction (None: not measured)
    # Counts towards quarantine: left out, or more than twice the clip bound off its own
    # round's median. A clip against the fragment's history (rounds of one or two) only
    # scales: an honest push after an outage is longer than the ones before it.
    outlier: bool = False

    def mark(self, action: Action, outlier: bool = True) -> None:
        if action == "dropped" or self.action == "kept":
            self.action = action
        self.outlier = self.outlier or outlier

    def describe(self) -> str:
        ratio = "n/a" if self.norm_ratio is None else f"{self.norm_ratio:.2f}x"
        cos = "n/a" if self.cosine is None else f"{self.cosine:.3f}"
        return f"{self.action} (norm {ratio} the reference, cosine {cos} with the others)"


@dataclass(frozen=True)
class Round:
    """One merge's contributions, in the order of `units`, and a verdict per unit."""

    units: list[str]
    contributions: list[Contribution]
    verdicts: dict[str, Verdict]
    typical: float | None  # the fragment's typical delta norm from earlier rounds


Screen = Callable[[Round, bool], Round]  # (round, token weighting) -> round


def start(
    units: Sequence[str], contributions: Sequence[Contribution], typical: float | None
) -> Round:
    return Round(list(units), list(contributions), {u: Verdict(u) for u in units}, typical)


def delta_norm(c: Contribution) -> float:
    if c.norms is not None:
        return math.sqrt(sum(float(n) ** 2 for n in c.norms.values()))
    return math.sqrt(sum(l2_norm(np.asarray(v)) ** 2 for v in c.delta.values()))


def clip_norms(ratio: float) -> Screen:
    def apply(r: Round, token_weighting: bool) -> Round:
        norms = [delta_norm(c) for c in r.contributions]
        own = len(norms) >= 3
        reference = float(np.median(norms)) if own else r.typical
        if reference is None or reference <= 0:
            return r
        contributions = list(r.contributions)
        for i, (unit, norm) in enumerate(zip(r.units, norms, strict=True)):
            r.verdicts[unit].norm_ratio = norm / reference
            if norm > ratio * reference:
                contributions[i] = _scaled(contributions[i], ratio * reference / norm)
                r.verdicts[unit].mark("clipped", outlier=own and norm > 2 * ratio * reference)
        return replace(r, contributions=contributions)

    return apply


def _scaled(c: Contribution, factor: float) -> Contribution:
    f32 = np.float32(factor)
    delta = {name: np.multiply(v, f32) for name, v in c.delta.items()}
    norms = None if c.norms is None else {n: float(v) * factor for n, v in c.norms.items()}
    return replace(c, delta=delta, norms=norms)


def drop_opposed(min_cosine: float) -> Screen:
    def apply(r: Round, token_weighting: bool) -> Round:
        n = len(r.contributions)
        if n < 3:
            return r
        cosines = others_cosines(r.contributions, token_weighting)
        for unit, cos in zip(r.units, cosines, strict=True):
            r.verdicts[unit].cosine = cos
        # Only where the round agrees on a direction (median cosine at least twice the
        # threshold): where every delta is nearly orthogonal to the others (noisy small
        # batches) nobody stands out.
        if float(np.median(cosines)) < 2 * min_cosine:
            return r
        below = sorted((c, i) for i, c in enumerate(cosines) if c < min_cosine)
        dropped = {i for _, i in below[: (n - 1) // 2]}  # never a majority
        for i in dropped:
            r.verdicts[r.units[i]].mark("dropped")
        keep = [i for i in range(n) if i not in dropped]
        return replace(
            r,
            units=[r.units[i] for i in keep],
            contributions=[r.contributions[i] for i in keep],
        )

    return apply


def others_cosines(contributions: Sequence[Contribution], token_weighting: bool) -> list[float]:
    """For each delta, its cosine with the weighted mean direction of the other deltas (RDA's
    direction without it): from one sum S of weighted unit vectors, S - own term, by dot
    products alone (no fragment-sized array per contribution)."""
    weights = merge_weights([(c.c_steps, c.c_tokens) for c in contributions], token_weighting)
    norms = [delta_norm(c) for c in contributions]
    names = sorted(contributions[0].delta)
    total: dict[str, np.ndarray] = {}
    for c, w, norm in zip(contributions, weights, norms, strict=True):
        if norm <= 0:
            continue
        scale = np.float32(w / norm)
        for name in names:
            term = np.multiply(np.asarray(c.delta[name], np.float32).ravel(), scale)
            total[name] = term if name not in total else np.add(total[name], term)
    if not total:
        return [0.0] * len(contributions)
    total_sq = sum(float(np.dot(v, v)) for v in total.values())
    out = []
    for c, w, norm in zip(contributions, weights, norms, strict=True):
        if norm <= 0:
            out.append(0.0)
            continue
        dot = sum(
            float(np.dot(np.asarray(c.delta[n], np.float32).ravel(), total[n])) for n in names
        )
        own = float(w)  # the own term is w * unit vector: its norm is w
        rest_dot = dot / norm - own  # <u, S - w u>, u the unit vector
        rest_sq = max(0.0, total_sq - 2 * own * (dot / norm) + own * own)
        out.append(rest_dot / math.sqrt(rest_sq) if rest_sq > 0 else 0.0)
    return out


def chain(*screens: Screen) -> Screen:
    def apply(r: Round, token_weighting: bool) -> Round:
        for s in screens:
            r = s(r, token_weighting)
        return r

    return apply


def screen(cfg: RobustConfig) -> Screen:
    """The screens `cfg` turns on, clipping first (a long delta then cannot make the others'
    mean direction its own before the cosine check)."""
    parts: list[Screen] = []
    if cfg.clip_ratio is not None:
        parts.append(clip_norms(cfg.clip_ratio))
    if cfg.min_cosine is not None:
        parts.append(drop_opposed(cfg.min_cosine))
    return chain(*parts)

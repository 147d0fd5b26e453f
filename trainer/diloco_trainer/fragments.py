"""Parameter fragments: which leaves travel together, and when each fragment goes out.

Pure logic, no JAX: the learner and the syncer both call `pack_fragments` on the same shapes and
must get the same layout (the syncer's layout is authoritative; it is sent in the join reply).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field


def leaf_size(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def pack_fragments(shapes: Mapping[str, tuple[int, ...]], count: int) -> list[list[str]]:
    """Split leaves into `count` fragments of near-equal element count.

    Greedy longest-processing-time bin packing: leaves by size (largest first, ties by name) go to
    the currently lightest fragment (ties by lowest index). Deterministic for given shapes.
    `count` is clamped to [1, number of leaves] so no fragment is empty. Leaf names inside each
    fragment are sorted so the layout does not depend on dict order.
    """
    if count < 1:
        raise ValueError(f"fragments: must be >= 1, got {count}")
    if not shapes:
        raise ValueError("fragments: no parameter leaves to pack")
    count = min(count, len(shapes))
    order = sorted(shapes, key=lambda name: (-leaf_size(shapes[name]), name))
    bins: list[list[str]] = [[] for _ in range(count)]
    loads = [0] * count
    for name in order:
        target = min(range(count), key=lambda i: (loads[i], i))
        bins[target].append(name)
        loads[target] += leaf_size(shapes[name])
    return [sorted(b) for b in bins]


def fragment_sizes(shapes: Mapping[str, tuple[int, ...]], layout: list[list[str]]) -> list[int]:
    """Element count of each fragment."""
    return [sum(leaf_size(shapes[name]) for name in frag) for frag in layout]


def first_due_step(fragment: int, inner_steps: int, fragments: int) -> int:
    """The first inner step (1-based count of completed steps) at which `fragment` is sent.

    Fragment p goes out at steps offset + k*H with offset = p*H//P, shifted so the first send is
    after at least one step (offset 0 means step H). This spreads the P fragments evenly over
    each window of H steps, so bandwidth is flat instead of one burst every H steps.
    """
    _check_schedule(fragment, inner_steps, fragments)
    offset = fragment * inner_steps // fragments
    return offset if offset > 0 else inner_steps


def is_due(step: int, fragment: int, inner_steps: int, fragments: int) -> bool:
    """Whether `fragment` is sent after the `step`-th completed inner step (step >= 1)."""
    first = first_due_step(fragment, inner_steps, fragments)
    return step >= first and (step - first) % inner_steps == 0


@dataclass
class PushClock:
    """When each fragment's next push is due: every H steps from the staggered `first_due_step`,
    or, phase-locked, H steps after the learner's latest install of the fragment.

    Why lock: the syncer can only merge learners' deltas together if they arrive together.
    Learners that start at different moments, or drift apart in speed, push a fixed schedule at
    scattered times, and with quorum 1 nearly every merge then holds one delta. Every learner
    installs a new version of p at about the same moment, so restarting p's countdown there
    lines the learners' next pushes of p up, whatever their step counts. The countdown never
    runs past `max_period` steps after the learner's previous push of p, so a learner that
    keeps receiving p from faster peers still contributes.
    """

    inner_steps: int
    fragments: int
    lock: bool = False
    next_due: list[int] = field(init=False)
    last_push: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.next_due = [
            first_due_step(p, self.inner_steps, self.fragments) for p in range(self.fragments)
        ]
        self.last_push = [0] * self.fragments

    @property
    def max_period(self) -> int:
        return 2 * self.inner_steps

    def due(self, step: int, fragment: int) -> bool:
        """Whether `fragment` is pushed after the `step`-th completed inner step."""
        return step >= self.next_due[fragment]

    def pushed(self, step: int, fragment: int) -> None:
        self.last_push[fragment] = step
        self.next_due[fragment] = step + self.inner_steps

    def joined_running(self, fragment: int) -> None:
        """This learner joined after `fragment` had been merged (a replacement, or a unit added
        to a running run). Locked, its peers' phase on the fragment is unknown until the first
        install, so the countdown starts there (at `max_period` at the latest): a push on the
        staggered schedule would arrive alone, between the others' merges."""
        if self.lock:
            self.next_due[fragment] = self.max_period

    def installed(self, step: int, fragment: int) -> None:
        """A new global version of `fragment` was installed after the `step`-th step."""
        if self.lock:
            self.next_due[fragment] = min(
                step + self.inner_steps, self.last_push[fragment] + self.max_period
            )


def _check_schedule(fragment: int, inner_steps: int, fragments: int) -> None:
    if inner_steps < 1:
        raise ValueError(f"innerSteps: must be >= 1, got {inner_steps}")
    if fragments < 1:
        raise ValueError(f"fragments: must be >= 1, got {fragments}")
    if not 0 <= fragment < fragments:
        raise ValueError(f"fragment index {fragment} out of range 0..{fragments - 1}")


@dataclass
class FragmentCounters:
    """Per-fragment inner steps and tokens since the learner last pushed or received that
    fragment: what its next push carries.

    These are the c_steps / c_tokens sent with a push; the syncer weights contributions by
    c_tokens^2 / c_steps. Pushing fragment p, or installing a new global version of it, resets
    p's counters; an install also adds p's steps to `overwritten`: progress no push carried.
    """

    fragments: int
    steps: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    overwritten: int = 0  # fragment-steps replaced by an install before any push carried them

    def __post_init__(self) -> None:
        if self.fragments < 1:
            raise ValueError(f"fragments: must be >= 1, got {self.fragments}")
        if not self.steps:
            self.steps = [0] * self.fragments
        if not self.tokens:
            self.tokens = [0] * self.fragments

    def add_step(self, tokens: int) -> None:
        """Record one completed inner step of `tokens` tokens for every fragment."""
        for p in range(self.fragments):
            self.steps[p] += 1
            self.tokens[p] += tokens

    def reset(self, fragment: int) -> None:
        """`fragment` was pushed, or a new global version of it installed locally."""
        self.steps[fragment] = 0
        self.tokens[fragment] = 0

    def overwrite(self, fragment: int) -> None:
        """A new global version of `fragment` was installed over the steps since its last push."""
        self.overwritten += self.steps[fragment]
        self.reset(fragment)

    def overwritten_share(self, steps: int) -> float:
        """The share of this learner's fragment-steps (`steps` per fragment) that an install
        replaced: the work lost while merges were under way."""
        return self.overwritten / (steps * self.fragments) if steps > 0 else 0.0

    def get(self, fragment: int) -> tuple[int, int]:
        """(c_steps, c_tokens) of `fragment`."""
        return self.steps[fragment], self.tokens[fragment]

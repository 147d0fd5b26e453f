"""Fragment packing balance and the staggered send schedule."""

from __future__ import annotations

import itertools
import math

import pytest
from diloco_trainer.fragments import (
    FragmentCounters,
    PushClock,
    first_due_step,
    fragment_sizes,
    is_due,
    pack_fragments,
)


def transformer_shapes(
    layers: int = 4, d: int = 64, vocab: int = 256
) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, d), "ln_f.scale": (d,)}
    for i in range(layers):
        shapes[f"blocks.{i}.attn.wqkv"] = (d, 3 * d)
        shapes[f"blocks.{i}.attn.wo"] = (d, d)
        shapes[f"blocks.{i}.mlp.w1"] = (d, 4 * d)
        shapes[f"blocks.{i}.mlp.w2"] = (4 * d, d)
        shapes[f"blocks.{i}.ln1.scale"] = (d,)
        shapes[f"blocks.{i}.ln2.scale"] = (d,)
    return shapes


def test_every_leaf_in_exactly_one_fragment_and_balanced() -> None:
    shapes = transformer_shapes()
    layout = pack_fragments(shapes, 4)
    flat = [name for frag in layout for name in frag]
    assert sorted(flat) == sorted(shapes)
    sizes = fragment_sizes(shapes, layout)
    largest_leaf = max(math.prod(s) for s in shapes.values())
    # Greedy LPT: no fragment exceeds the mean by more than the largest leaf.
    assert max(sizes) - sum(sizes) / len(sizes) <= largest_leaf
    assert max(sizes) / min(sizes) < 1.5


def test_packing_is_deterministic_and_order_independent() -> None:
    shapes = transformer_shapes()
    reversed_shapes = dict(reversed(list(shapes.items())))
    assert pack_fragments(shapes, 3) == pack_fragments(reversed_shapes, 3)


def test_count_is_clamped_to_number_of_leaves() -> None:
    layout = pack_fragments({"a": (3,), "b": (2, 2)}, 8)
    assert len(layout) == 2
    assert all(layout)


def test_bad_counts_are_rejected() -> None:
    with pytest.raises(ValueError, match="fragments"):
        pack_fragments({"a": (3,)}, 0)
    with pytest.raises(ValueError, match="no parameter leaves"):
        pack_fragments({}, 2)


def test_schedule_staggers_fragments_within_each_window() -> None:
    h, p = 12, 4
    due_steps = {
        frag: [s for s in range(1, 3 * h + 1) if is_due(s, frag, h, p)] for frag in range(p)
    }
    # Each fragment goes out exactly once per window of H steps, every H steps.
    for steps in due_steps.values():
        assert len(steps) == 3
        assert all(b - a == h for a, b in itertools.pairwise(steps))
    firsts = [first_due_step(f, h, p) for f in range(p)]
    assert firsts == [12, 3, 6, 9]
    # No two fragments share a send step: bandwidth is spread out.
    all_steps = [s for steps in due_steps.values() for s in steps]
    assert len(all_steps) == len(set(all_steps))


def test_schedule_rejects_out_of_range_fragment() -> None:
    with pytest.raises(ValueError, match="out of range"):
        is_due(5, 4, 10, 4)


def test_counters_reset_only_the_received_fragment() -> None:
    c = FragmentCounters(3)
    for _ in range(5):
        c.add_step(100)
    c.reset(1)
    c.add_step(100)
    assert c.get(0) == (6, 600)
    assert c.get(1) == (1, 100)
    assert c.get(2) == (6, 600)


def test_installs_count_the_steps_no_push_carried_as_overwritten() -> None:
    c = FragmentCounters(2)
    for _ in range(30):
        c.add_step(10)
    c.reset(0)  # fragment 0 pushed after 30 steps: nothing lost
    for _ in range(4):
        c.add_step(10)
    c.overwrite(0)  # its merge arrives 4 steps later: those 4 are replaced
    c.overwrite(1)  # fragment 1 never pushed: all 34 replaced
    assert c.overwritten == 38
    assert c.get(0) == (0, 0) and c.get(1) == (0, 0)
    c.overwrite(0)  # a second install with no step in between loses nothing more
    assert c.overwritten == 38
    assert c.overwritten_share(34) == 38 / 68
    assert FragmentCounters(2).overwritten_share(0) == 0.0


def test_push_clock_unlocked_is_the_staggered_schedule_and_ignores_installs() -> None:
    h, p = 10, 4
    clock = PushClock(h, p)
    pushes: dict[int, list[int]] = {f: [] for f in range(p)}
    for step in range(1, 5 * h + 1):
        for f in range(p):
            if clock.due(step, f):
                clock.pushed(step, f)
                pushes[f].append(step)
            if step % 7 == 0:
                clock.installed(step, f)
    assert pushes == {f: [s for s in range(1, 5 * h + 1) if is_due(s, f, h, p)] for f in range(p)}


def _push_steps(clock: PushClock, fragment: int, steps: range, installs: set[int]) -> list[int]:
    out = []
    for step in steps:
        if clock.due(step, fragment):
            clock.pushed(step, fragment)
            out.append(step)
        if step in installs:
            clock.installed(step, fragment)
    return out


def test_push_clock_locked_lines_up_learners_after_a_shared_install() -> None:
    """Two learners 7 steps apart in their schedules (a late start): both install the version
    the first one's push produced, at the same moment, and push together from then on."""
    h = 10
    early, late = PushClock(h, 1, lock=True), PushClock(h, 1, lock=True)
    # The same wall-clock ticks; the late learner's step count lags by 7.
    early_steps = _push_steps(early, 0, range(1, 41), installs={11})
    late_steps = _push_steps(late, 0, range(-6, 34), installs={4})  # its step 4 = tick 11
    assert early_steps == [10, 21, 31]
    assert late_steps == [14, 24]
    # In ticks: early pushes at 10, 21, 31; late at 17 (its step 10 would have been), then 21, 31.
    assert [s + 7 for s in late_steps] == early_steps[1:]
    unlocked = _push_steps(PushClock(h, 1), 0, range(-6, 34), installs={4})
    assert [s + 7 for s in unlocked] != early_steps[1:]  # without the lock they stay apart


def test_push_clock_locked_slow_learner_still_pushes() -> None:
    """Installs every 5 steps (faster peers) never let the countdown reach H; the learner
    still pushes 2H steps after its previous push (or the start)."""
    h = 10
    clock = PushClock(h, 1, lock=True)
    steps = _push_steps(clock, 0, range(1, 61), installs=set(range(5, 61, 5)))
    assert steps == [20, 40, 60]


def test_push_clock_locked_joiner_waits_for_its_first_install() -> None:
    """A learner that joins a running run pushes a fragment H steps after its first install of
    it (in step with the peers who produced that version), not on the staggered schedule; with
    no install it still pushes at 2H. Unlocked, joining changes nothing."""
    h = 10
    installed = PushClock(h, 1, lock=True)
    installed.joined_running(0)
    assert _push_steps(installed, 0, range(1, 40), installs={6}) == [16, 26, 36]
    silent = PushClock(h, 1, lock=True)
    silent.joined_running(0)
    assert _push_steps(silent, 0, range(1, 50), installs=set()) == [20, 30, 40]
    unlocked = PushClock(h, 1)
    unlocked.joined_running(0)
    assert _push_steps(unlocked, 0, range(1, 40), installs={6}) == [10, 20, 30]

"""Fragment packing balance and the staggered send schedule."""

from __future__ import annotations

import itertools
import math

import pytest
from diloco_trainer.fragments import (
    FragmentCounters,
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

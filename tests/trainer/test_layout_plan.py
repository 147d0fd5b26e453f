"""The fragment plan a learner joins with (layout_plan.py): fingerprints and the words that
name how two plans differ."""

from __future__ import annotations

import json

import pytest
from diloco_trainer.layout_plan import (
    MAX_PLAN_BYTES,
    announce,
    difference,
    fingerprint,
    plan_of,
    read_announcement,
)

SHAPES = {"embed": (32, 8), "h0.w": (8, 8), "h0.b": (8,), "head": (8, 32)}
LAYOUT = [["embed"], ["h0.b", "h0.w", "head"]]


def test_equal_plans_have_equal_fingerprints_and_any_change_shows() -> None:
    plan = plan_of(LAYOUT, SHAPES)
    assert fingerprint(plan) == fingerprint(plan_of(LAYOUT, dict(SHAPES)))
    assert difference(plan, plan) is None
    changed = [
        plan_of(LAYOUT, {**SHAPES, "h0.w": (8, 16)}),
        plan_of(LAYOUT, SHAPES, {"head": "bfloat16"}),
        plan_of([["embed", "h0.b"], ["h0.w", "head"]], SHAPES),
    ]
    assert len({fingerprint(plan), *(fingerprint(p) for p in changed)}) == 4


def test_the_first_difference_is_named() -> None:
    run = plan_of(LAYOUT, SHAPES)
    wider = plan_of(LAYOUT, {**SHAPES, "h0.w": (8, 16)})
    assert difference(wider, run) == "leaf 'h0.w': learner shape [8, 16], run shape [8, 8]"
    extra = plan_of([*LAYOUT[:1], [*LAYOUT[1], "h1.w"]], {**SHAPES, "h1.w": (8, 8)})
    assert difference(extra, run) == (
        "leaf 'h1.w' is in the learner's model, not in the run's (learner 5 leaves, syncer 4)"
    )
    fewer = plan_of([["embed"], ["h0.w", "head"]], SHAPES)
    assert difference(fewer, run) is not None and "'h0.b' of the run's model is missing" in (
        difference(fewer, run) or ""
    )
    assert difference(plan_of(LAYOUT, SHAPES, {"head": "bfloat16"}), run) == (
        "leaf 'head': learner dtype bfloat16, run dtype float32"
    )
    one = plan_of([["embed", "h0.b", "h0.w", "head"]], SHAPES)
    assert difference(one, run) == "fragments: learner 1, run 2 (training.fragments)"
    repacked = plan_of([["embed", "h0.b"], ["h0.w", "head"]], SHAPES)
    assert (difference(repacked, run) or "").startswith(
        "fragment 0 holds other leaves: 'h0.b' is only in the learner's"
    )


def test_an_announcement_round_trips_and_a_huge_plan_goes_as_its_fingerprint() -> None:
    plan = plan_of(LAYOUT, SHAPES)
    sent = json.loads(json.dumps(announce(plan)))
    assert read_announcement(sent) == (fingerprint(plan), plan)
    many = {f"layer_{i:05d}.weight": (4, 4) for i in range(MAX_PLAN_BYTES // 30)}
    huge = plan_of([sorted(many)], many)
    assert announce(huge) == {"fingerprint": fingerprint(huge)}
    assert read_announcement(announce(huge)) == (fingerprint(huge), None)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("x", "layout: expected an object"),
        ({"fingerprint": "abc"}, "layout.fingerprint: expected 64 lowercase hex digits"),
        ({"fingerprint": "0" * 64, "fragments": "x"}, "layout.fragments: expected a list"),
        ({"fingerprint": "0" * 64, "fragments": [[["a", [-1], "float32"]]]}, r"fragments\[0\]"),
        ({"fingerprint": "0" * 64, "fragments": [[["a", [2]]]]}, r"\[name, \[dims\], dtype\]"),
    ],
)
def test_a_malformed_announcement_is_refused_naming_the_field(raw: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_announcement(raw)

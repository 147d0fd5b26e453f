"""A unit whose model or fragment layout is not the run's is refused at its join (409
layout_mismatch, naming what differs), before anything of it reaches the syncer; learners that
send no layout (older than the field) are still taken."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from diloco_trainer.config import TrainingConfig
from diloco_trainer.fragments import pack_fragments
from diloco_trainer.layout_plan import announce, fingerprint, plan_of
from diloco_trainer.learner.client import SyncerRejected
from diloco_trainer.syncer.core import Syncer
from diloco_trainer.workload.check import prepared
from test_syncer import TOKEN, LiveSyncer, fragment_delta, tiny_cfg

CFG = tiny_cfg()


@pytest.fixture
def live() -> Iterator[LiveSyncer]:
    server = LiveSyncer(Syncer(CFG, TOKEN, run="layout", eval_fn=None))
    yield server
    server.close()


def learner_plan(cfg: TrainingConfig = CFG, **shape_changes: tuple[int, ...]) -> dict[str, object]:
    """What a learner of `cfg` announces at join (as learner.loop does), with some leaves'
    shapes changed."""
    shapes = {**prepared(CFG).shapes, **shape_changes}
    fragments = cfg.fragments
    return announce(plan_of(pack_fragments(shapes, fragments), shapes))


def test_a_learner_of_the_runs_model_is_taken(live: LiveSyncer) -> None:
    learner = live.client()
    learner.layout_plan = learner_plan()
    learner.join()
    assert learner.push(0, 0, fragment_delta(live, 0), 1, 8).accepted


def test_a_learner_of_another_model_is_refused_naming_the_leaf(live: LiveSyncer) -> None:
    name = sorted(live.syncer.shapes)[-1]
    shape = live.syncer.shapes[name]
    before = {n: v.copy() for f in live.syncer.frags for n, v in f.params.items()}
    learner = live.client("odd")
    learner.layout_plan = learner_plan(**{name: (*shape, 2)})
    with pytest.raises(SyncerRejected) as refused:
        learner.join()
    assert (refused.value.status, refused.value.reason) == (409, "layout_mismatch")
    assert f"leaf {name!r}: learner shape {[*shape, 2]}, run shape {list(shape)}" in str(
        refused.value
    )
    assert "odd" not in live.syncer.learners.records  # nothing of it was recorded
    # Its push is not_joined; the client joins again first, and is refused the same way.
    with pytest.raises(SyncerRejected, match="layout_mismatch"):
        learner.push(0, 0, fragment_delta(live, 0), 1, 8)
    assert all(not f.pending for f in live.syncer.frags)
    for f in live.syncer.frags:
        for n, v in f.params.items():
            np.testing.assert_array_equal(v, before[n])


def test_another_fragment_count_is_refused_naming_both(live: LiveSyncer) -> None:
    learner = live.client()
    learner.layout_plan = learner_plan(tiny_cfg(fragments=2))
    with pytest.raises(SyncerRejected, match=r"fragments: learner 2, run 3"):
        learner.join()


def test_a_fingerprint_alone_is_compared_and_a_learner_without_one_is_taken(
    live: LiveSyncer,
) -> None:
    learner = live.client()
    plan = learner_plan()
    learner.layout_plan = {"fingerprint": plan["fingerprint"]}  # a plan too big to send
    learner.join()
    odd = live.client("odd")
    odd.layout_plan = {"fingerprint": fingerprint([])}
    with pytest.raises(SyncerRejected, match=r"layout_mismatch: .*fingerprint [0-9a-f]{12} is"):
        odd.join()
    old = live.client("old")  # a learner that predates the field
    assert old.layout_plan is None
    old.join()
    bad = live.client("bad")
    bad.layout_plan = {"fingerprint": "nope"}
    with pytest.raises(SyncerRejected, match=r"400 bad_request: layout\.fingerprint"):
        bad.join()

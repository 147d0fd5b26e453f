"""The leaf norms a push is measured with when decoded, as the merge receives them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from diloco_trainer.merge import Contribution
from diloco_trainer.syncer.core import Syncer
from diloco_trainer.syncer.fragment import Pending, decode_measured, l2_norm, leaf_norms
from diloco_trainer.wire import PushHeader, encode_push
from test_syncer import TOKEN, LiveSyncer, fragment_delta, tiny_cfg, wait_until


@pytest.fixture
def live() -> Iterator[LiveSyncer]:
    server = LiveSyncer(Syncer(tiny_cfg(), TOKEN, run="test-run", store=None, eval_fn=None))
    yield server
    server.close()


def test_decoded_push_carries_each_leafs_norm_and_the_whole_norm() -> None:
    rng = np.random.default_rng(0)
    delta = {
        "a": rng.standard_normal((30, 7)).astype(np.float32),
        "b": np.zeros(5, np.float32),
        "c": np.full(3, 1e30, np.float32),  # its float32 sum of squares would overflow
    }
    body = encode_push(PushHeader(0, 0, 4, 64, "none", "unit-0", 0), delta).body
    measured = decode_measured(body)
    assert sorted(measured.norms) == ["a", "b", "c"]
    for name, value in delta.items():
        want = float(np.linalg.norm(value.astype(np.float64)))
        assert measured.norms[name] == pytest.approx(want, rel=1e-12), name
    assert measured.norm == pytest.approx(l2_norm(delta), rel=1e-12)


def test_two_pushes_added_up_leave_their_norms_to_the_merge() -> None:
    # The norm of a sum is not known from the parts': the merge measures it itself.
    header = PushHeader(0, 0, 4, 64, "none", "unit-0", 0)
    one = {"w": np.array([3.0, 0.0], np.float32)}
    two = {"w": np.array([0.0, 4.0], np.float32)}
    summed = Pending(header, one, 1.0, leaf_norms(one)).plus(
        Pending(header, two, 2.0, leaf_norms(two))
    )
    assert summed.norms is None
    np.testing.assert_array_equal(summed.delta["w"], [3.0, 4.0])


def test_the_syncer_merges_with_the_norms_measured_at_decoding(
    live: LiveSyncer, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncer = live.syncer
    seen: list[list[Contribution]] = []
    real = syncer.merge_compute

    def recording(params: Any, state: Any, contributions: list[Contribution], *rest: Any) -> Any:
        seen.append(contributions)
        return real(params, state, contributions, *rest)

    monkeypatch.setattr(syncer, "merge_compute", recording)
    learner = live.client("unit-0")
    learner.join()
    delta = fragment_delta(live, 0)
    learner.push(0, 0, delta, 1, 8)
    wait_until(lambda: syncer.frags[0].version == 1)
    [contribution] = seen[-1]
    assert contribution.norms is not None and sorted(contribution.norms) == sorted(delta)
    for name, value in delta.items():
        want = float(np.linalg.norm(value.astype(np.float64)))
        assert contribution.norms[name] == pytest.approx(want, rel=1e-9), name

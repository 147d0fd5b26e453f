"""A learner whose syncer went back to older versions (a syncer restored from an older checkpoint
than the versions the learner holds, or one that took over from a syncer that served for a while
after it should have stopped) takes the versions the syncer serves: its pushes from later bases
are refused (409 future_base) until it does, so holding on to its own would stall it for good."""

from __future__ import annotations

import time
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np
import pytest
from diloco_trainer.learner.client import SyncerRejected
from diloco_trainer.learner.distributed import StepSignal
from diloco_trainer.learner.fragment_sync import FragmentBook
from diloco_trainer.learner.sync_link import Arrival, Progress, SyncLink
from diloco_trainer.syncer.core import Syncer

from tests.trainer.syncer.test_syncer import TOKEN, LiveSyncer, fragment_delta, tiny_cfg


@pytest.fixture
def syncer() -> Iterator[LiveSyncer]:
    server = LiveSyncer(Syncer(tiny_cfg(), TOKEN, run="rollback", store=None, eval_fn=None))
    yield server
    server.close()


def test_the_pollers_hand_over_versions_older_than_the_ones_held(syncer: LiveSyncer) -> None:
    client = syncer.client()
    client.join()
    held = [4, 4, 4]  # from a syncer since lost; this one serves version 0 of each fragment
    with pytest.raises(SyncerRejected, match="future_base"):
        client.push(0, held[0], fragment_delta(syncer, 0), 2, 64)
    link = SyncLink(client, held, 60.0, Progress())
    link.start()
    try:
        arrivals: dict[int, Arrival] = {}
        deadline = time.monotonic() + 20
        while len(arrivals) < 3 and time.monotonic() < deadline:
            arrivals.update((a.fragment, a) for a in link.drain())
            time.sleep(0.05)
    finally:
        link.stop()
    assert {p: a.version for p, a in arrivals.items()} == {0: 0, 1: 0, 2: 0}
    for p, arrival in arrivals.items():
        for name, value in arrival.tensors.items():
            np.testing.assert_array_equal(value, syncer.syncer.frags[p].params[name])
    # from the version it now holds, the learner's push is merged
    assert client.push(1, 0, fragment_delta(syncer, 1), 2, 64).accepted


class Arrived:
    """The sync link as FragmentBook sees it: arrivals to drain, nothing sent."""

    def __init__(self, arrivals: list[Arrival]) -> None:
        self.arrivals = arrivals
        self.complete = type("Flag", (), {"is_set": staticmethod(lambda: False)})()
        self.superseded = self.complete

    def drain(self) -> list[Arrival]:
        arrivals, self.arrivals = self.arrivals, []
        return arrivals

    def settled(self, fragment: int, base: object) -> object:
        return base


def test_an_older_version_is_installed_and_the_same_one_is_not() -> None:
    layout = [["a"], ["b"]]
    shapes: dict[str, tuple[int, ...]] = {"a": (2,), "b": (2,)}
    held = {0: {"a": np.full(2, 5.0, np.float32)}, 1: {"b": np.full(2, 5.0, np.float32)}}
    book = FragmentBook.starting(tiny_cfg(fragments=2), layout, shapes, [7, 7], held)
    params = {"a": jnp.full(2, 4.5, jnp.float32), "b": jnp.full(2, 4.5, jnp.float32)}
    older = {"a": np.full(2, 1.0, np.float32)}
    again = {"b": np.full(2, 9.0, np.float32)}  # a repeat of version 7: not installed
    link = Arrived([Arrival(0, 3, older), Arrival(1, 7, again)])
    signal = StepSignal(stop=False, schedule_floor=40)
    assert book.install_arrivals(12, params, link, signal) == signal  # type: ignore[arg-type]
    assert book.versions == [3, 7]
    np.testing.assert_array_equal(np.asarray(params["a"]), [1.0, 1.0])
    np.testing.assert_array_equal(np.asarray(params["b"]), [4.5, 4.5])  # the training kept
    assert book.base[0] is older

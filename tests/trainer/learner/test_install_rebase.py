"""`install: rebase`: a learner that installs a new global version of a fragment keeps the steps
it made on it since its last push, on top of the new version, and its next push carries them
(counted in cSteps); `replace` loses them, counted as overwritten."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from diloco_trainer.learner.distributed import StepSignal
from diloco_trainer.learner.fragment_sync import FragmentBook
from diloco_trainer.learner.sync_link import Arrival, PendingPush

from tests.trainer.learner.test_syncer_rollback import Arrived
from tests.trainer.syncer.test_syncer import tiny_cfg

TOKENS_PER_STEP = 16


class Link(Arrived):
    """Arrivals handed over on drain, pushes recorded."""

    def __init__(self) -> None:
        super().__init__([])
        self.pushes: list[PendingPush] = []

    def enqueue_push(self, push: PendingPush) -> None:
        self.pushes.append(push)


def train_to(
    book: FragmentBook,
    link: Link,
    params: dict[str, Any],
    steps: range,
    value: float,
) -> None:
    """Steps in which training moves the fragment to `value`, the push clock counting them."""
    for step in steps:
        params["w"] = jnp.full(2, value, jnp.float32)
        book.push_due(step, params, link, TOKENS_PER_STEP)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["replace", "rebase"])
def test_an_install_between_pushes(mode: str) -> None:
    cfg = tiny_cfg(fragments=1, innerSteps=4, install=mode)
    start = {0: {"w": np.full(2, 5.0, np.float32)}}
    book = FragmentBook.starting(cfg, [["w"]], {"w": (2,)}, [0], start)
    assert book.rebase is (mode == "rebase")
    link, params = Link(), {"w": jnp.full(2, 5.0, jnp.float32)}
    train_to(book, link, params, range(1, 5), 4.5)  # H=4: pushed after step 4, from 5.0 to 4.5
    assert [(p.c_steps, float(np.asarray(p.theta["w"])[0])) for p in link.pushes] == [(4, 4.5)]
    train_to(book, link, params, range(5, 7), 4.0)  # two more steps while that push merges
    link.arrivals = [Arrival(0, 1, {"w": np.full(2, 1.0, np.float32)})]
    book.install_arrivals(6, params, link, StepSignal(stop=False, schedule_floor=0))  # type: ignore[arg-type]
    installed = float(np.asarray(params["w"])[0])
    assert book.versions == [1]
    train_to(book, link, params, range(7, 11), installed - 0.25)  # locked: next push 4 steps on
    second = link.pushes[1]
    sent = float(np.asarray(second.base["w"])[0] - np.asarray(second.theta["w"])[0])
    if mode == "rebase":
        assert installed == pytest.approx(0.5)  # 1.0 and the -0.5 made since the push
        assert (second.c_steps, sent) == (6, pytest.approx(0.75))  # both steps and the 4 after
        assert book.counters.overwritten == 0
    else:
        assert installed == 1.0
        assert (second.c_steps, sent) == (4, pytest.approx(0.25))
        assert book.counters.overwritten == 2
    assert second.base_version == 1 and second.c_tokens == second.c_steps * TOKENS_PER_STEP


def test_install_is_checked() -> None:
    with pytest.raises(ValueError, match="install"):
        tiny_cfg(install="merge")

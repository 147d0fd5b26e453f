"""The learner's report: one hint at `install: rebase` when installs drop a large share of its
steps, only after the share has settled, and never under rebase."""

from __future__ import annotations

import logging
import re

import jax.numpy as jnp
import numpy as np
import pytest
from diloco_trainer.learner.fragment_sync import FragmentBook
from diloco_trainer.learner.loop import schedule_clock
from diloco_trainer.learner.options import LearnerOptions
from diloco_trainer.learner.report import REBASE_HINT_SHARE, Reporter

from tests.trainer.syncer.test_syncer import tiny_cfg

H = 4


@pytest.mark.parametrize(
    ("mode", "share", "hinted"),
    [("replace", 0.4, True), ("replace", REBASE_HINT_SHARE - 0.05, False), ("rebase", 0.4, False)],
)
def test_a_learner_dropping_many_steps_hints_at_rebase_once(
    mode: str, share: float, hinted: bool, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = tiny_cfg(fragments=1, innerSteps=H, install=mode)
    book = FragmentBook.starting(
        cfg, [["w"]], {"w": (2,)}, [0], {0: {"w": np.zeros(2, np.float32)}}
    )
    opts = LearnerOptions(syncer="http://127.0.0.1:9", token="t", unit=0, num_units=1, log_every=1)
    reporter = Reporter.starting(cfg, opts, None, [0], False, None, schedule_clock(cfg, 1, 0))  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="diloco_trainer.learner.report"):
        for step in range(1, 41):
            book.counters.overwritten = round(share * step)  # one fragment: share = dropped / steps
            reporter.step(step, jnp.float32(2.0), {}, step == 40, book)
    hints = re.findall(
        r"event=install_hint unit=unit-0 step=(\d+) overwritten_share=(\S+):", caplog.text
    )
    progress = re.findall(r"event=progress .* overwritten_share=(\S+)", caplog.text)
    assert len(progress) == 40 and float(progress[-1]) == pytest.approx(share, abs=0.02)
    if hinted:  # once, at the first logged step after four periods
        assert [(int(s), float(v)) for s, v in hints] == [(4 * H, pytest.approx(share, abs=0.05))]
    else:
        assert hints == []


class _LinkCounts:
    """What log_progress reads of a sync link: its counters and its outbox."""

    def __init__(self) -> None:
        self.stats = {"pushes": 3, "push_failures": 1, "push_combined": 0, "rejected": 1}

    def pending_pushes(self) -> int:
        return 2


def test_progress_lines_count_the_pushes_the_syncer_accepted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A partitioned learner logs the same accepted count until its link heals."""
    cfg = tiny_cfg(fragments=2, innerSteps=H)
    opts = LearnerOptions(syncer="http://127.0.0.1:9", token="t", unit=0, num_units=1, log_every=1)
    reporter = Reporter.starting(cfg, opts, None, [0, 0], False, None, schedule_clock(cfg, 1, 0))  # type: ignore[arg-type]
    reporter.link = _LinkCounts()  # type: ignore[assignment]
    with caplog.at_level(logging.INFO, logger="diloco_trainer.learner.report"):
        reporter.log_progress(5, [4, 3], 0.0)
    assert re.search(r"event=progress .* versions=4,3 pushes=3 pending_pushes=2 ", caplog.text)

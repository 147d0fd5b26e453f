"""The end of a complete local run, and the screen the run is drawn on.

Once the syncer reports the budget reached, the learners exit on their own; the syncer then
evaluates the global model once more (`finalLoss`), which the run waits for before stopping it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from diloco_operator.local.display import View, render
from diloco_operator.local.processes import ProcessTable
from diloco_operator.local.recorder import Recorder
from diloco_operator.planner import SyncerStatus
from rich.live import Live

# How long the learners get to exit on their own after the budget is reached.
LEARNER_EXIT_WAIT = 10.0
# How long a complete run waits for the syncer's final evaluation (finalLoss) before stopping it;
# the syncer settles in-flight merges for at most 2 s, then runs one eval (seconds on a CPU).
FINAL_EVAL_WAIT = 60.0


class Screen:
    """Where each tick's view goes: a rich Live display on a terminal (nothing otherwise: the
    events log and structured logs tell the story), and the `on_tick` callback if any."""

    def __init__(
        self, console: Any, live: bool, on_tick: Callable[[View], None] | None = None
    ) -> None:
        self.on_tick = on_tick
        self.live = (
            Live(console=console, refresh_per_second=4, transient=False, auto_refresh=False)
            if live
            else None
        )

    def __enter__(self) -> Screen:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.live is not None:
            self.live.__exit__(kind, exc, tb)

    def show(self, view: View) -> None:
        if self.live is not None:
            self.live.update(render(view), refresh=True)
        if self.on_tick is not None:
            self.on_tick(view)


def finish_learners(
    procs: ProcessTable, units: Sequence[str], syncer_status: Callable[[], SyncerStatus | None]
) -> SyncerStatus | None:
    """Learners exit 0 on their own once the syncer reports completion: give them a moment, then
    return the syncer's status (None when unreachable)."""
    deadline = time.time() + LEARNER_EXIT_WAIT
    while time.time() < deadline:
        procs.poll()
        if not any((p := procs.get(name)) is not None and p.alive() for name in units):
            break
        time.sleep(0.2)
    return syncer_status()


def await_final_eval(
    poll: Callable[[], SyncerStatus | None],
    syncer_alive: Callable[[], bool],
    recorder: Recorder,
    interrupted: Callable[[], bool],
    redraw: Callable[[], None],
    syncer: str,
) -> float | None:
    """Wait (at most FINAL_EVAL_WAIT) for the syncer's final evaluation and return its loss. A
    syncer without the field (older), without an eval function or whose evaluation failed is
    not waited for; the recorder gets a `final-eval` or a `final-eval-missing` event."""
    started = time.time()
    recorder.event(
        started, "final-eval-waiting", syncer, "waiting for the syncer's final evaluation"
    )
    outcome = f"no final evaluation within {FINAL_EVAL_WAIT:g}s"
    while not interrupted() and time.time() - started < FINAL_EVAL_WAIT:
        if not syncer_alive():
            outcome = "the syncer is gone"
            break
        status = poll()
        if status is not None:
            if status.final_loss is not None:
                loss = status.final_loss
                recorder.observe_status(time.time(), status)
                recorder.event(
                    time.time(),
                    "final-eval",
                    syncer,
                    f"final eval loss {loss:.4f} after {time.time() - started:.1f}s",
                    loss=loss,
                )
                return loss
            if status.final_eval not in ("waiting", "running"):
                outcome = f"the syncer reports finalEval={status.final_eval}"
                break
        redraw()
        time.sleep(0.2)
    recorder.event(time.time(), "final-eval-missing", syncer, outcome)
    return None

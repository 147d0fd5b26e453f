"""How a local run ended, as a value: the CLI picks its exit code from `RunOutcome.ending`, the
report records `RunOutcome.reason`."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Ending = Literal["complete", "stopped", "interrupted", "aborted"]


class RunAborted(Exception):
    """The run cannot go on (bad config seen by a program, syncer cannot start); the message is
    for the user."""


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the supervisor."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass(frozen=True)
class RunOutcome:
    """`complete`: the budget was reached; `stopped`: --max-seconds ran out; `interrupted`: by
    `signum`; `aborted`: the run could not go on. `reason` says it in words (summary.json's
    `exitReason`)."""

    ending: Ending
    reason: str
    signum: int | None = None

    @classmethod
    def complete(cls) -> RunOutcome:
        return cls("complete", "complete")

    @classmethod
    def stopped(cls, max_seconds: float) -> RunOutcome:
        return cls("stopped", f"stopped after --max-seconds {max_seconds:g}")

    @classmethod
    def interrupted(cls, signum: int) -> RunOutcome:
        return cls("interrupted", f"interrupted by {signal.Signals(signum).name}", signum)

    @classmethod
    def aborted(cls, message: str) -> RunOutcome:
        return cls("aborted", f"aborted: {message}")


@dataclass
class RunResult:
    outcome: RunOutcome
    report_dir: Path
    summary: dict[str, Any]

    @property
    def complete(self) -> bool:
        return self.outcome.ending == "complete"

"""Map the local run's learner processes to the planner's neutral ObservedUnit (pure).

The process counterpart of the Kubernetes backend's `diloco_operator.k8s.observe`: the runtime
summarises each unit's process (`UnitProcess`), and this module decides what the planner sees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from diloco_operator.local.programs import exit_description
from diloco_operator.planner import ObservedUnit, SyncerStatus, UnitSlot
from diloco_operator.planner.model import PROCESS_EXITED, UnitPhase


@dataclass(frozen=True)
class UnitProcess:
    """The current process of a unit: the attempt it was started as, when, how it exited (None:
    not reaped yet) and whether chaos sent it SIGKILL."""

    attempt: int
    started_at: float
    exit_code: int | None = None
    killed: bool = False


def _unit(
    slot: UnitSlot,
    proc: UnitProcess,
    phase: UnitPhase,
    *,
    ready: bool = False,
    failure: str | None = None,
    message: str = "",
    since: float = 0.0,
) -> ObservedUnit:
    return ObservedUnit(
        slot.name, slot.group, slot.index, proc.attempt, phase, ready, failure, message, since
    )


def observe_units(
    slots: Sequence[UnitSlot],
    processes: Mapping[str, UnitProcess],
    report: SyncerStatus | None,
    ready: Set[str],
) -> tuple[list[ObservedUnit], frozenset[str]]:
    """The units that have a process (the others are Missing), and the units ready from now on.

    A unit is ready once the syncer has heard from its current attempt, and it stays ready while
    the process lives (a restarting syncer forgets learners for a while); `ready` is the set the
    previous call returned, less the units stopped or started since."""
    observed: list[ObservedUnit] = []
    now_ready = set(ready)
    heard = report.learners if report else {}
    for slot in slots:
        proc = processes.get(slot.name)
        if proc is None:
            continue  # Missing
        if proc.exit_code is None and proc.killed:
            # We sent SIGKILL: a failure signal even if the process is not reaped yet (a
            # process can take a while to die, e.g. threads stuck in the kernel).
            message = "learner process killed by SIGKILL (chaos)"
            observed.append(
                _unit(
                    slot,
                    proc,
                    "Running",
                    failure=PROCESS_EXITED,
                    message=message,
                    since=proc.started_at,
                )
            )
        elif proc.exit_code is None:
            learner = heard.get(slot.name)
            if learner is not None and learner.attempt == proc.attempt:
                now_ready.add(slot.name)
            ready_now = slot.name in now_ready
            observed.append(_unit(slot, proc, "Running", ready=ready_now, since=proc.started_at))
        elif proc.exit_code == 0:
            observed.append(_unit(slot, proc, "Succeeded"))
        else:
            message = f"learner process {exit_description(proc.exit_code)}"
            observed.append(_unit(slot, proc, "Failed", failure=PROCESS_EXITED, message=message))
    return observed, frozenset(now_ready)

"""Restart a crashed learner inside its container, from a process that has imported JAX already.

A restart in place by the kubelet (in_place.py) still starts a new container: a new interpreter
that imports JAX and the trainer again, most of a learner's start. With `DILOCO_SUPERVISE` the
container's process imports them once and forks the learner; when the learner crashes it forks
the next one at once, which only initialises its devices, builds and compiles its step (from
the pod's compilation cache) and joins. What the supervisor cannot survive, its own death (the
OOM killer picking it, a SIGKILL of the container's main process), is the kubelet's rule again.

The child is an ordinary learner start: it counts itself in the pod's restart directory (a new
attempt at the syncer each time, and exit 3 once the restarts in place are spent), so the two
kinds of restart share one count and one limit. Exits that a restart cannot help end the
supervisor with the same code: 0 (complete), 2 (config error), 3 (restarts spent) and any exit
once the supervisor itself was asked to stop (SIGTERM, SIGINT), which it passes on to the child.
Forking is safe here because nothing in the parent has started a JAX backend or a thread: it
only imports (the local runtime's fork server does the same, learner/forked.py).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

from diloco_trainer.attempts import EXIT_GIVE_UP, EXIT_SUPERSEDED
from diloco_trainer.learner.lifetime import die_with_parent

if TYPE_CHECKING:
    from diloco_trainer.learner.unit_restart import UnitRestart

log = logging.getLogger("diloco_trainer.learner.supervisor")

FINAL_EXITS = frozenset({0, 2, EXIT_GIVE_UP, EXIT_SUPERSEDED})  # a restart cannot help these
# A warm spare (spare.py) goes back to waiting after its cover ends, superseded or crashed, and
# stops only when the run is complete (0), on a config error (2) or after this many crashes in
# a row (then EXIT_GIVE_UP: its pod is recreated).
SPARE_FINAL_EXITS = frozenset({0, 2})
SPARE_CRASHES = 5
# How long a learner told to stop has before it is SIGKILLed: a learner waits in its unit's
# collectives, and a host whose peers already left waits there for good.
STOP_GRACE_SECONDS = 10


def exit_code(status: int) -> int:
    """A wait status as a shell would report it: the exit code, or 128 + the killing signal."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def supervise(
    preload: Callable[[], None],
    learner: Callable[[], int],
    unit: UnitRestart | None = None,
    spare: bool = False,
) -> int:
    """Run `preload` once, then `learner` in a forked child until it ends with a final exit
    or the supervisor is stopped; the exit code to leave with. With `unit` (a multi-host unit,
    unit_restart.py) a crash restarts every host's learner, and a peer's crash restarts ours.
    `spare`: the child is a warm spare's life (spare.py), forked again when a cover ends."""
    if unit is not None and unit.restarted_container:
        log.warning("event=supervisor_restarted action=restart_unit")
        unit.restart_all()
    preload()
    if unit is not None and unit.restarted_container:
        unit.catch_up()  # restarts announced while it imported went unheard
    child = 0
    stopping = False
    crashes = 0
    final = SPARE_FINAL_EXITS if spare else FINAL_EXITS

    def pass_on(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if child:
            os.kill(child, signum)
            signal.alarm(STOP_GRACE_SECONDS)

    def stop_for_good(_signum: int, _frame: FrameType | None) -> None:
        if child:
            log.warning("event=learner_not_stopping action=sigkill after=%ds", STOP_GRACE_SECONDS)
            os.kill(child, signal.SIGKILL)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, pass_on)
    signal.signal(signal.SIGALRM, stop_for_good)
    while True:
        generation = unit.generation if unit is not None else 0
        sys.stdout.flush()
        sys.stderr.flush()
        child = os.fork()
        if child == 0:  # the learner: default signal handling, and it dies with its supervisor
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
                signal.signal(signum, signal.SIG_DFL)
            die_with_parent()
            if unit is not None:
                unit.enter_learner(generation)
            os._exit(_run(learner))
        code = _wait(child, unit, generation)
        child = 0
        if stopping or code in final:
            return code
        if spare:
            crashes = 0 if code == EXIT_SUPERSEDED else crashes + 1
            if crashes >= SPARE_CRASHES:
                log.error("event=spare_crashing exit=%d crashes=%d action=give_up", code, crashes)
                return EXIT_GIVE_UP
            log.info("event=spare_again exit=%d", code)
            continue
        if unit is not None and unit.generation > generation:
            log.warning(
                "event=learner_restarted_for_unit exit=%d generation=%d", code, unit.generation
            )
            continue
        log.warning("event=learner_crashed exit=%d action=restart_in_container", code)
        if unit is not None:
            log.warning("event=unit_restart generation=%d", unit.restart_all())


def _wait(child: int, unit: UnitRestart | None, generation: int) -> int:
    """The child's exit code. With `unit`, peers are served meanwhile, and a learner whose
    unit moved on to a newer generation is killed: its program is over."""
    if unit is None:
        return exit_code(os.waitpid(child, 0)[1])  # retried on EINTR by Python itself
    killed = False
    while True:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            return exit_code(status)
        if unit.generation > generation and not killed:
            os.kill(child, signal.SIGKILL)
            killed = True
        unit.serve_once(0.05)


def _run(learner: Callable[[], int]) -> int:
    try:
        code = learner()
    except BaseException:  # an uncaught error is a crash, as in a process of its own
        logging.getLogger("diloco_trainer.learner").exception("event=learner_error")
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    return code

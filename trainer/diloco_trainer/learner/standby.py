"""A warm spare learner (`diloco-learner --standby`): everything slow done before it has a unit.

Starting a learner costs seconds before its first step: the interpreter, `import jax`, building
the model and optimizer and compiling the train step. None of that depends on which unit the
learner will be, only on the run's config and size. A supervisor that restarts units on one
machine (the local runtime) keeps such a process waiting:

    warm_up(cfg, num_units)      build the step program, run one step on a real-shaped batch
    wait_for_identity(stdin)     block until the supervisor writes one JSON line:
        {"unit": 2, "unitName": "run-default-2", "numUnits": 4, "attempt": 1,
         "group": "default", "slowdown": 1.0, "token": "<unit token>",
         "log": "/path/run-default-2.log"}
    take_identity(args, ...)     from here on it IS that unit: its log, then join, pull, train

End of input (the supervisor no longer needs a spare) ends the process with exit 0. On
Kubernetes a pod is one unit and never runs in this mode.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import IO, Any

import jax

from diloco_trainer.config import TrainingConfig
from diloco_trainer.learner.loop import StepProgram, build_step_program
from diloco_trainer.learner.train import init_opt_state, shard_batch, step_key

log = logging.getLogger(__name__)

# Identity keys -> learner_main's argparse destinations.
IDENTITY_ARGS = {
    "unit": "unit",
    "unitName": "unit_name",
    "numUnits": "num_units",
    "attempt": "attempt",
    "group": "group",
    "slowdown": "slowdown",
    "token": "token",  # the unit's own token (auth.unit_token): a spare holds none before
    "compression": "compression",  # its group's own push compression (JSON), "" for the run's
}


class IdentityError(Exception):
    """The supervisor's identity line is not what it should be (a usage error: exit 2)."""


def warm_up(cfg: TrainingConfig, num_units: int) -> StepProgram:
    """Build the step program and run it once, so the unit's first real step finds it compiled
    (the jit cache is per process; the persistent XLA cache only saves the compile itself)."""
    started = time.monotonic()
    program = build_step_program(cfg, num_units)
    workload = program.workload
    params = program.place(workload.initial_params())
    opt_state = init_opt_state(program.optimizer, params, program.mesh)
    batches = workload.source(
        0, num_units, seed=cfg.seed, batch_size=cfg.data.batch_size, split="train", position=0
    )
    batch = shard_batch(next(iter(batches)), program.mesh)
    _, _, loss, _ = program.train_step(params, opt_state, batch, step_key(cfg.seed, 0))
    jax.block_until_ready(loss)
    log.info("event=standby_ready seconds=%.2f pid=%d", time.monotonic() - started, os.getpid())
    return program


def wait_for_identity(stream: IO[str]) -> dict[str, Any] | None:
    """The unit identity the supervisor hands over (one JSON object on one line), or None when
    the input ends first (the spare is not needed)."""
    line = stream.readline()
    if not line.strip():
        return None
    try:
        identity = json.loads(line)
    except json.JSONDecodeError as exc:
        raise IdentityError(f"standby: identity is not JSON: {exc}") from None
    if not isinstance(identity, dict) or "unit" not in identity:
        raise IdentityError(f"standby: identity needs at least a unit, got {line.strip()!r}")
    return identity


def take_identity(args: argparse.Namespace, identity: dict[str, Any]) -> None:
    """Become the unit: its flags from the identity (validated later like any flag), and its log
    file (appended, as a freshly started unit's would be) for stdout and stderr."""
    for key, dest in IDENTITY_ARGS.items():
        if key in identity:
            setattr(args, dest, str(identity[key]))
    path = identity.get("log")
    if path:
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(str(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    log.info(
        "event=standby_taken unit=%s attempt=%s pid=%d",
        identity.get("unitName") or identity["unit"],
        identity.get("attempt", 0),
        os.getpid(),
    )

"""Multi-host learner units: `jax.distributed` from the GKE TPU environment, leader broadcast.

A unit that spans several hosts (a TPU slice) runs one learner process per host; together they
form one SPMD program. Only process 0 (the *leader*) talks to the syncer. Everything that changes
the parameters from outside (an arriving global fragment) must reach every process at the same
step, so the leader broadcasts it at fixed step boundaries (`broadcast_from_leader`); pushes read
the replicated parameters from the leader's local copy. With one process all of this is identity.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np

log = logging.getLogger(__name__)

COORDINATOR_PORT = 8476
# The generation of a unit's learners (unit_restart.py): the supervisor sets it in each learner
# it forks. Consecutive generations get distinct coordinator ports (8476..8539), so a learner of
# the next generation never reaches a coordinator of the one before, which may still be exiting.
GENERATION_ENV = "DILOCO_UNIT_GENERATION"
PORT_SPAN = 64
# Set by the Job controller in every pod of an Indexed Job: the pod's completion index, which
# GKE's TPU webhook and the operator both turn into TPU_WORKER_ID.
COMPLETION_INDEX = "JOB_COMPLETION_INDEX"
T = TypeVar("T")


@dataclass(frozen=True)
class DistributedArgs:
    coordinator_address: str
    num_processes: int
    process_id: int


def _index(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def worker_id(env: Mapping[str, str]) -> int:
    """This host's index in its slice: TPU_WORKER_ID, which GKE injects into the pods of a TPU
    slice (and the operator sets to the same value), else the Job completion index it is made
    from. Where both are present they must agree: with two hosts claiming one process id and
    none claiming another, jax.distributed cannot form the unit, and says so only after its
    timeout."""
    tpu, completion = _index(env, "TPU_WORKER_ID"), _index(env, COMPLETION_INDEX)
    if tpu is not None and completion is not None and tpu != completion:
        raise ValueError(
            f"TPU_WORKER_ID {tpu} is not this pod's Job completion index {completion} "
            f"({COMPLETION_INDEX}): the hosts of the unit would not agree on who is who"
        )
    found = tpu if tpu is not None else completion
    if found is None:
        raise ValueError(
            f"TPU_WORKER_ID (or {COMPLETION_INDEX}) is not set: each host of a multi-host unit "
            "needs its index in the slice"
        )
    return found


def worker_hostnames(env: Mapping[str, str]) -> list[str]:
    """The unit's hosts in worker-id order (TPU_WORKER_HOSTNAMES, comma separated)."""
    return [h.strip() for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]


def coordinator_port(generation: int) -> int:
    return COORDINATOR_PORT + generation % PORT_SPAN


def generation_of(env: Mapping[str, str]) -> int:
    raw = env.get(GENERATION_ENV, "0")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{GENERATION_ENV} must be an integer, got {raw!r}") from None


def distributed_args(env: Mapping[str, str]) -> DistributedArgs | None:
    """Arguments for jax.distributed.initialize, or None for a single-host unit.

    The names are GKE's: its TPU webhook injects TPU_WORKER_HOSTNAMES (the slice's hosts, comma
    separated, in worker-id order) and TPU_WORKER_ID (from the completion index) into the pods
    of an Indexed Job with a subdomain that asks for TPU chips. The operator sets both itself to
    the same values (`{unit}-{i}.{unit}` and the completion index), so a pod has one identity
    whichever of the two it ends up with, and the operator's where GKE adds nothing (another
    cluster, the tests). A single host (GKE writes `localhost` there) has no peers. The first
    host coordinates.
    """
    hosts = worker_hostnames(env)
    if len(hosts) <= 1:
        return None
    worker = worker_id(env)
    if not 0 <= worker < len(hosts):
        raise ValueError(f"TPU_WORKER_ID {worker} outside 0..{len(hosts) - 1}")
    port = coordinator_port(generation_of(env))
    return DistributedArgs(f"{hosts[0]}:{port}", len(hosts), worker)


def init_distributed(env: Mapping[str, str] | None = None) -> int:
    """Initialise jax.distributed when the unit has several hosts; returns this process's index."""
    args = distributed_args(os.environ if env is None else env)
    if args is None:
        return 0
    log.info(
        "event=distributed_init coordinator=%s processes=%d process=%d",
        args.coordinator_address,
        args.num_processes,
        args.process_id,
    )
    jax.distributed.initialize(
        coordinator_address=args.coordinator_address,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )
    return args.process_id


def is_leader() -> bool:
    return jax.process_index() == 0


def broadcast_from_leader(tree: T) -> T:
    """The leader's value of a pytree of arrays on every process (identity on one process).

    Every process must call this at the same point with a tree of the same structure and shapes.
    """
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    result: Any = multihost_utils.broadcast_one_to_all(tree)
    return result


def broadcast_int(value: int) -> int:
    """The leader's `value` on every process of the unit (identity on a single process)."""
    if jax.process_count() == 1:
        return value
    return int(np.asarray(broadcast_from_leader(np.asarray(value, np.int64))))


class StepSignal(NamedTuple):
    """What the leader decides for the whole unit at a step boundary, besides arrivals."""

    stop: bool
    schedule_floor: int = 0  # the run's position on the LR schedule (`train.ScheduleClock`)


def exchange_arrivals(
    arrivals: dict[int, tuple[int, dict[str, np.ndarray]]],
    layout: list[list[str]],
    shapes: Mapping[str, tuple[int, ...]],
    signal: StepSignal,
) -> tuple[dict[int, tuple[int, dict[str, np.ndarray]]], StepSignal]:
    """The leader's newest fragment arrivals and step signal, on every process of the unit.

    Two broadcasts keep the structure identical everywhere: first a header (one version per
    fragment, -1 = nothing new, then the signal), then the arrays of exactly those fragments.
    Non-leaders pass empty `arrivals`. Identity on a single process.
    """
    if jax.process_count() == 1:
        return arrivals, signal
    n = len(layout)
    header = np.full(n + 2, -1, np.int64)
    for fragment, (version, _) in arrivals.items():
        header[fragment] = version
    header[n], header[n + 1] = int(signal.stop), signal.schedule_floor
    header = np.asarray(broadcast_from_leader(header))
    chosen = [p for p in range(n) if header[p] >= 0]
    payload = {
        f"{p}/{name}": (
            arrivals[p][1][name] if p in arrivals else np.zeros(shapes[name], np.float32)
        )
        for p in chosen
        for name in layout[p]
    }
    payload = broadcast_from_leader(payload)
    received = {
        p: (int(header[p]), {name: np.asarray(payload[f"{p}/{name}"]) for name in layout[p]})
        for p in chosen
    }
    return received, StepSignal(bool(header[n]), int(header[n + 1]))

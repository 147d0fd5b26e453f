"""A warm spare on Kubernetes (`diloco-learner --spare NAME`, or DILOCO_SPARE): a pod of a unit
group that is no unit yet, kept ready to take over a lost unit at once.

    supervisor        imports JAX and the trainer once, then forks one spare life after another
    a spare's life    warm up (build and compile the step: standby.py), wait at the syncer for a
                      unit to cover (POST /v1/spares/wait, with the spare's own token), become
                      that unit (its identity, its token, its data lease) and train
    end of a cover    the unit's recreated pod joins with a newer attempt; the syncer refuses the
                      cover's attempt (409 superseded), the learner exits EXIT_SUPERSEDED and the
                      supervisor forks the next life, which waits again

The syncer hands a cover only to a spare that is waiting, that is, warm: from the operator's
request to the cover's first step there is one long-poll reply, a join and a pull. The spare's
group decides its shapes and compression (the pod carries the group's env), the cover the rest.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from diloco_trainer.auth import SPARE_PREFIX, resolve_token
from diloco_trainer.config import ConfigError, load_training_config
from diloco_trainer.learner.client import SyncerClient, SyncerRejected, SyncerUnavailable
from diloco_trainer.shards import split_addresses
from diloco_trainer.tls import ClientTrust

if TYPE_CHECKING:
    from diloco_trainer.learner.loop import StepProgram

log = logging.getLogger("diloco_trainer.learner.spare")

# One long-poll; the syncer answers sooner when a cover comes.
WAIT_SECONDS = 20.0


def wait_for_cover(
    client: SyncerClient, name: str, stop: threading.Event, retry_cap: float = 5.0
) -> dict[str, Any] | None:
    """Long-poll the syncer until it hands spare `name` a unit to cover (its identity); None
    when `stop` is set first. An unreachable syncer is asked again with backoff; a refusal
    (a wrong token, an address that is not shard 0) is raised: asking again will not help."""
    from diloco_trainer.learner.sync_link import Backoff

    backoff = Backoff(cap=retry_cap)
    while not stop.is_set():
        try:
            identity = client.wait_for_cover(name, WAIT_SECONDS)
        except SyncerUnavailable as exc:
            delay = backoff.after(exc)
            log.warning("event=spare_wait_retry delay=%.2f error=%s", delay, exc)
            stop.wait(delay)
            continue
        backoff.reset()
        if identity is not None:
            return identity
    return None


def spare_client(args: argparse.Namespace, env: Mapping[str, str]) -> SyncerClient:
    """The spare's own client: shard 0 of the syncer, under the spare's token."""
    token = resolve_token(args.token, env, args.token_file)
    trust = ClientTrust(args.ca_file) if args.ca_file else None
    return SyncerClient(
        split_addresses(args.syncer)[0],
        token,
        SPARE_PREFIX + args.spare,
        0,
        args.group,
        trust=trust,
        join=args.join,
    )


def spare_life(
    args: argparse.Namespace, env: Mapping[str, str], become: Callable[[StepProgram], int]
) -> int:
    """One life of spare `args.spare`: warm up, wait for a cover, then `become` the covered
    unit (its identity in `args`: the learner's own start, with the compiled program); the exit
    code (EXIT_SUPERSEDED when the unit's recreated pod took over)."""
    from diloco_trainer.learner.standby import IdentityError, take_identity, warm_up
    from diloco_trainer.workload.compile_cache import enable_compilation_cache

    try:
        cfg = load_training_config(args.config)
        num_units = int(args.num_units or 1)
        client = spare_client(args, env)
    except (ConfigError, ValueError) as exc:
        print(f"diloco-learner: {exc}", file=sys.stderr)
        return 2
    enable_compilation_cache()
    started = time.monotonic()
    try:
        program = warm_up(cfg, num_units)
    except ValueError as exc:  # the same config errors a unit would hit at its start
        print(f"diloco-learner: {exc}", file=sys.stderr)
        return 2
    warm = time.monotonic() - started
    log.info("event=spare_waiting spare=%s warm_seconds=%.2f", args.spare, warm)
    try:
        identity = wait_for_cover(client, args.spare, threading.Event())
    except SyncerRejected as exc:
        print(f"diloco-learner: spare {args.spare}: {exc}", file=sys.stderr)
        return 2
    finally:
        client.close()
    assert identity is not None  # never stopped: SIGTERM ends the process
    try:
        take_identity(args, identity)
    except IdentityError as exc:
        print(f"diloco-learner: {exc}", file=sys.stderr)
        return 2
    # The cover's attempt is the syncer's word: the pod's count of restarts is the spare's.
    args.restart_dir = None
    return become(program)

"""`diloco-learner --config FILE --unit N`: one learner unit (flags or DILOCO_* env, see contracts).

`diloco-learner --config FILE --standby`: a warm spare for the local runtime (standby.py): it
imports JAX and compiles the train step first, then reads its unit identity on stdin.

`diloco-learner --config FILE --spare NAME`: a warm spare on Kubernetes (spare.py): the same,
but it waits at the syncer for a unit to cover, and again after each cover.

The start is logged phase by phase (phases.py; the list is in docs/local.md): imports, jax_init,
the workload check, initial_params, join, pull, first_batch, compile, first_step.

Exit codes: 0 when the syncer reports the run complete (or --max-steps was reached), 2 for a
config/usage error (the message names the field), 3 once the restarts in place are spent, 4 when
a newer attempt of the unit joined (superseded: another process is the unit now), 143 after
SIGTERM/SIGINT (stopped, not done), 1 for anything else (the supervisor restarts the unit).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from pydantic import ValidationError

from diloco_trainer.attempts import EXIT_GIVE_UP, EXIT_SUPERSEDED, wire_attempt
from diloco_trainer.auth import resolve_token
from diloco_trainer.config import (
    ConfigError,
    LinkCompression,
    TrainingConfig,
    format_validation_error,
    load_training_config,
)
from diloco_trainer.join_credentials import parse_join_public
from diloco_trainer.learner.in_place import RestartsSpent, count_start
from diloco_trainer.logfmt import FORMATS, LOG_FORMAT_ENV, configure_logging, resolve_log_format
from diloco_trainer.phases import phase
from diloco_trainer.shards import split_addresses
from diloco_trainer.tls import ClientTrust

if TYPE_CHECKING:
    from diloco_trainer.learner.loop import StepProgram

log = logging.getLogger("diloco_trainer.learner.main")
EXIT_STOPPED = 143


class UsageError(Exception):
    """A flag or environment variable with an unusable value; the message names it."""


def _env_default(env: Mapping[str, str], name: str, default: str | None = None) -> str | None:
    value = env.get(name)
    return value if value not in (None, "") else default


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diloco-learner", description=__doc__)
    add = parser.add_argument
    add("--config", required=True, help="DilocoRun manifest or bare training block (YAML/JSON)")
    add(
        "--syncer",
        default=_env_default(env, "DILOCO_SYNCER_ADDR"),
        help="syncer base URL; a sharded syncer: every shard's, shard 0's first, comma-separated",
    )
    add("--token", default=None, help="this unit's bearer token (else DILOCO_TOKEN)")
    add(
        "--token-file",
        default=None,
        help="file holding this unit's bearer token (else DILOCO_TOKEN, DILOCO_TOKEN_FILE)",
    )
    add("--unit", default=_env_default(env, "DILOCO_UNIT"), help="global unit index 0..N-1")
    add("--unit-name", default=_env_default(env, "DILOCO_UNIT_NAME", ""), help="name in status")
    add("--num-units", default=_env_default(env, "DILOCO_NUM_UNITS"), help="units in the run")
    add("--attempt", default=_env_default(env, "DILOCO_ATTEMPT", "0"), help="restart attempt")
    add("--group", default=_env_default(env, "DILOCO_GROUP", "default"), help="unit group")
    add(
        "--restart-dir",
        default=_env_default(env, "DILOCO_RESTART_DIR"),
        help="pod-local directory counting this pod's learner starts: each restart in place "
        "is a new attempt at the syncer (in_place.py; else DILOCO_RESTART_DIR; unset: off)",
    )
    add(
        "--supervise",
        action="store_true",
        default=_env_default(env, "DILOCO_SUPERVISE", "") == "1",
        help="import once, then run the learner in a forked child and fork a new one when it "
        "crashes (supervisor.py; else DILOCO_SUPERVISE=1)",
    )
    add(
        "--in-place-restarts",
        default=_env_default(env, "DILOCO_IN_PLACE_RESTARTS", "3"),
        help=f"restarts in place allowed with --restart-dir before exiting {EXIT_GIVE_UP} "
        "(else DILOCO_IN_PLACE_RESTARTS)",
    )
    add("--slowdown", default=_env_default(env, "DILOCO_SLOWDOWN", "1"), help="factor >= 1")
    add("--log-every", type=int, default=50, help="progress log period in steps")
    add("--max-steps", type=int, default=None, help="stop after this many local steps")
    add(
        "--metrics-port",
        default=_env_default(env, "DILOCO_METRICS_PORT", "0"),
        help="serve Prometheus /metrics on this port (leader host only; 0: off)",
    )
    add(
        "--ca-file",
        default=_env_default(env, "DILOCO_CA_FILE"),
        help="CA bundle to verify an https syncer against, read again when it changes "
        "(else DILOCO_CA_FILE; unset: the system trust store)",
    )
    add(
        "--join",
        default=_env_default(env, "DILOCO_JOIN", ""),
        help="public part of the run's join credential, for a unit of an away cluster "
        "(else DILOCO_JOIN)",
    )
    add(
        "--compression",
        default=_env_default(env, "DILOCO_COMPRESSION", ""),
        help="JSON of this unit group's own push compression over the config's, e.g. "
        '\'{"scheme": "int2", "errorFeedback": true}\' (else DILOCO_COMPRESSION)',
    )
    add("--log-level", default="INFO")
    add("--log-format", choices=FORMATS, default=None, help=f"text or json (else {LOG_FORMAT_ENV})")
    add(
        "--standby",
        action="store_true",
        help="warm spare (local runtime): import, build and compile first, then read the unit "
        "identity as one JSON line on stdin",
    )
    add(
        "--spare",
        default=_env_default(env, "DILOCO_SPARE", ""),
        help="warm spare NAME (Kubernetes): compile first, then wait at the syncer for a unit "
        "to cover, again after each cover (else DILOCO_SPARE)",
    )
    return parser


def _int(value: str | None, flag: str, env: str, minimum: int = 0) -> int:
    if value is None:
        raise UsageError(f"{flag} (or {env}) is required")
    try:
        number = int(value)
    except ValueError:
        raise UsageError(f"{flag} (or {env}) must be an integer, got {value!r}") from None
    if number < minimum:
        raise UsageError(f"{flag} (or {env}) must be >= {minimum}, got {number}")
    return number


def _port(value: str | None) -> int:
    port = _int(value or "0", "--metrics-port", "DILOCO_METRICS_PORT")
    if port > 65535:
        raise UsageError(f"--metrics-port (or DILOCO_METRICS_PORT) must be <= 65535, got {port}")
    return port


def with_link_compression(cfg: TrainingConfig, text: str) -> TrainingConfig:
    """`cfg` with its unit group's own push compression (JSON of LinkCompression), if any."""
    if not text:
        return cfg
    try:
        link = LinkCompression.model_validate_json(text)
        return cfg.model_copy(update={"compression": link.over(cfg.compression)})
    except ValidationError as exc:
        problems = format_validation_error(exc, "compression").replace("\n", "; ")
        raise ConfigError(f"--compression (DILOCO_COMPRESSION): {problems}") from exc


def resolve(
    args: argparse.Namespace, env: Mapping[str, str]
) -> tuple[TrainingConfig, dict[str, Any]]:
    """The training config and the LearnerOptions fields from flags/env; raises ConfigError or
    UsageError naming what is wrong."""
    cfg = with_link_compression(load_training_config(args.config), args.compression)
    unit = _int(args.unit, "--unit", "DILOCO_UNIT")
    num_units = _int(args.num_units or str(unit + 1), "--num-units", "DILOCO_NUM_UNITS", 1)
    if unit >= num_units:
        raise UsageError(f"--unit {unit} must be < --num-units {num_units}")
    attempt = _int(args.attempt, "--attempt", "DILOCO_ATTEMPT")
    if args.restart_dir:
        allowed = _int(args.in_place_restarts, "--in-place-restarts", "DILOCO_IN_PLACE_RESTARTS")
        restarts = count_start(args.restart_dir, allowed)  # RestartsSpent: exit EXIT_GIVE_UP
        attempt = wire_attempt(attempt, restarts)
        if restarts:
            log.info("event=restarted_in_place restarts=%d attempt=%d", restarts, attempt)
    try:
        slowdown = float(args.slowdown)
    except ValueError:
        raise UsageError(
            f"--slowdown (or DILOCO_SLOWDOWN) must be a number, got {args.slowdown!r}"
        ) from None
    if not slowdown >= 1.0:
        raise UsageError(f"--slowdown (or DILOCO_SLOWDOWN) must be >= 1, got {slowdown}")
    if not args.syncer:
        raise UsageError("--syncer (or DILOCO_SYNCER_ADDR) is required")
    try:
        split_addresses(args.syncer)
    except ValueError as exc:
        raise UsageError(f"--syncer (or DILOCO_SYNCER_ADDR): {exc}") from exc
    token = resolve_token(args.token, env, args.token_file)
    ca_file, join = _transport(args)
    options = {
        "syncer": args.syncer,
        "token": token,
        "unit": unit,
        "num_units": num_units,
        "unit_name": args.unit_name,
        "attempt": attempt,
        "group": args.group,
        "slowdown": slowdown,
        "log_every": args.log_every,
        "max_steps": args.max_steps,
        "metrics_port": _port(args.metrics_port),
        "ca_file": ca_file,
        "join": join,
    }
    return cfg, options


def _transport(args: argparse.Namespace) -> tuple[str | None, str]:
    """The CA file (loaded once here, so a bad one is a usage error, not a retry loop) and the
    join credential's public part (never the whole credential: its key stays with the away
    operator)."""
    if args.ca_file:
        try:
            ClientTrust(args.ca_file)
        except ValueError as exc:
            raise UsageError(f"--ca-file (or DILOCO_CA_FILE): {exc}") from None
        if not args.syncer.startswith("https://"):
            log.warning("event=ca_file_unused syncer=%s reason=not_https", args.syncer)
    join = ""
    if args.join:
        try:
            join = parse_join_public(args.join).public
        except ValueError as exc:
            raise UsageError(f"--join (or DILOCO_JOIN): {exc}") from None
    return args.ca_file or None, join


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    args = build_parser(env).parse_args(argv)
    try:
        log_format = resolve_log_format(args.log_format, env)
    except ValueError as exc:
        print(f"diloco-learner: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level.upper(), log_format)
    if args.standby:
        return standby_main(args, env)
    if args.spare:
        from diloco_trainer.learner.spare import spare_life
        from diloco_trainer.learner.supervisor import supervise

        def become(program: StepProgram) -> int:  # the covered unit, from the spare's args
            return learner_main(args, env, program)

        return supervise(
            _import_trainer, lambda: _leave_jax(spare_life(args, env, become)), spare=True
        )
    if args.supervise:
        from diloco_trainer.learner.supervisor import supervise
        from diloco_trainer.learner.unit_restart import from_env

        try:  # a multi-host unit's hosts restart together; a single host alone (None)
            unit = from_env(env, resolve_token(args.token, env, args.token_file), args.restart_dir)
        except (ConfigError, ValueError, OSError) as exc:
            print(f"diloco-learner: {exc}", file=sys.stderr)
            return 2
        return supervise(_import_trainer, lambda: _leave_jax(learner_main(args, env)), unit)
    return learner_main(args, env)


def learner_main(
    args: argparse.Namespace, env: Mapping[str, str], program: StepProgram | None = None
) -> int:
    """One learner start: its config and identity, the heavy imports, then training
    (`program`: built and compiled already, a warm spare's)."""
    try:
        cfg, options = resolve(args, env)
    except (ConfigError, UsageError) as exc:
        print(f"diloco-learner: {exc}", file=sys.stderr)
        return 2
    except RestartsSpent as exc:
        print(f"diloco-learner: {exc}", file=sys.stderr)
        return EXIT_GIVE_UP
    # Heavy imports (JAX) only after the config is known to be good: errors stay fast.
    _import_trainer()
    from diloco_trainer.workload.compile_cache import enable_compilation_cache

    enable_compilation_cache()
    return train(cfg, options, program)


def _import_trainer() -> None:
    """What train() imports: most of a cold start (a forked or supervised learner has them)."""
    if "diloco_trainer.learner.loop" in sys.modules:
        return
    with phase(log, "imports"):
        import diloco_trainer.learner.loop
        import diloco_trainer.workload.compile_cache  # noqa: F401


def standby_main(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    """--standby: a warm spare (standby.py). Warm up, wait for a unit identity on stdin, then
    run exactly as a learner started with those flags would."""
    try:
        cfg = load_training_config(args.config)
        num_units = _int(args.num_units, "--num-units", "DILOCO_NUM_UNITS", 1)
    except (ConfigError, UsageError) as exc:
        print(f"diloco-learner: {exc}", file=sys.stderr)
        return 2
    with phase(log, "imports"):
        from diloco_trainer.learner.distributed import distributed_args
        from diloco_trainer.learner.standby import (
            IdentityError,
            take_identity,
            wait_for_identity,
            warm_up,
        )
        from diloco_trainer.workload.compile_cache import enable_compilation_cache

    if distributed_args(env) is not None:
        print("diloco-learner: --standby runs single-host units only", file=sys.stderr)
        return 2
    enable_compilation_cache()
    try:
        with phase(log, "warm_up"):
            program = warm_up(cfg, num_units)
    except ValueError as exc:  # the same config errors a unit would hit at its start
        print(f"diloco-learner: {exc}", file=sys.stderr)
        return 2
    try:
        identity = wait_for_identity(sys.stdin)
        if identity is None:
            log.info("event=standby_released")
            return 0
        take_identity(args, identity)
        cfg, options = resolve(args, env)
    except (ConfigError, UsageError, IdentityError) as exc:
        print(f"diloco-learner: {exc}", file=sys.stderr)
        return 2
    return train(cfg, options, program)


def train(cfg: TrainingConfig, options: dict[str, Any], program: StepProgram | None = None) -> int:
    """Run the learner (JAX imported by now) until complete or stopped; the exit code."""
    import jax

    from diloco_trainer.learner.distributed import init_distributed
    from diloco_trainer.learner.loop import run_learner
    from diloco_trainer.learner.options import LearnerOptions

    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("event=signal signal=%s", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with phase(log, "jax_init"):  # a multi-host unit waits for its peers; a TPU opens its chips
        init_distributed()
        jax.devices()
    opts = LearnerOptions(**options)
    try:
        result = run_learner(cfg, opts, stop, program)
    except ValueError as exc:  # e.g. batch size vs devices, data that cannot be windowed
        print(f"diloco-learner: {exc}", file=sys.stderr)
        return 2
    log.info(
        "event=exit unit=%s steps=%d tokens=%d tokens_per_sec=%.0f complete=%s loss=%s "
        "versions=%s bytes_sent=%d bytes_received=%d bytes_joined=%d train_seconds=%.2f "
        "slowdown_seconds=%.2f other_seconds=%.2f overwritten_share=%.3f link=%s",
        opts.name,
        result.steps,
        result.tokens,
        result.tokens_per_sec,
        result.complete,
        result.final_loss,
        ",".join(map(str, result.versions)),
        result.bytes_sent,
        result.bytes_received,
        result.bytes_joined,
        result.loop_seconds.get("train", 0.0),
        result.loop_seconds.get("slowdown", 0.0),
        result.loop_seconds.get("other", 0.0),
        result.overwritten_share,
        ",".join(f"{k}:{v}" for k, v in result.link_stats.items()),
    )
    if result.superseded:
        return EXIT_SUPERSEDED
    if stop.is_set() and not result.complete:
        return EXIT_STOPPED
    return 0


def _leave_jax(code: int) -> int:
    """What JAX's own atexit hook would do for a multi-host unit; `code` passed through. Not
    for a learner that was stopped or superseded: its peers may be gone or stopping apart, and
    the shutdown barrier would hold it until they all arrive (a pod's whole grace period)."""
    jax = sys.modules.get("jax")
    if jax is not None and code not in (EXIT_STOPPED, EXIT_SUPERSEDED):
        with contextlib.suppress(Exception):
            jax.distributed.shutdown()
    return code


def run() -> NoReturn:
    """The console script: `main`, then leave without interpreter finalization.

    The sync link's long-poll threads are daemons that may still be inside a request when the
    learner is done. Finalizing the interpreter around them force-unwinds those threads, and a
    thread inside native code (XLA's, via a host copy) then aborts the process with SIGABRT
    ("FATAL: exception not rethrown", seen once in the three-learner test), turning a finished
    learner's exit 0 into a crash. Nothing is left to clean up by then, so flush and exit."""
    code = _leave_jax(main())
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()

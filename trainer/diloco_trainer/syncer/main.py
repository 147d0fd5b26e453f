"""`diloco-syncer`: run the syncer service.

    diloco-syncer --config run.yaml [--host 0.0.0.0] [--port 8470] [--token T] [--checkpoint-dir D]
                  [--max-units N] [--units-file F] [--tls-cert FILE --tls-key FILE]

Environment (docs/contracts.md): DILOCO_TOKEN / DILOCO_TOKEN_FILE (the run secret),
DILOCO_SYNCER_PORT, DILOCO_CHECKPOINT_PATH, DILOCO_MAX_UNITS, DILOCO_UNITS_FILE (the roster of
units admitted, roster.py), and DILOCO_RUN (run name; defaults
to the manifest's metadata.name or the config file's stem). The checkpoint path is a directory
or `gs://bucket/prefix` (Application Default Credentials: Workload Identity on GKE). Exit 2 on a
config error (the message names the field), `training.model.initFrom` weights that cannot be
read or do not fit the model and a checkpoint bucket this process cannot use (no credential,
access denied, no such bucket) included; exit 1 when the checkpoints (or `gs://` initFrom
weights, the storage failing) cannot be read.
SIGTERM/SIGINT stop serving, write a final checkpoint and exit 0; a standby told to stop exits 0
without serving, even when the lock it waited for comes free at that moment. Exit 3: another
syncer wrote the checkpoint path after this one claimed it (two syncers on one `gs://` path, gcs.py):
this one stopped serving without a final checkpoint.

`--lock PATH` (DILOCO_SYNCER_LOCK): a second syncer with the same lock, port and checkpoint
path is a warm standby (standby.py) that serves within a second of the first one's death.

`--tls-cert FILE --tls-key FILE` (DILOCO_TLS_CERT, DILOCO_TLS_KEY): serve HTTPS only, probes
and /metrics included, with a certificate taken again whenever the files change (tls.py); a
standby that takes over serves the same way.

The start is logged phase by phase (phases.py; the list is in docs/local.md): config,
checkpoint_load, init_from, imports, workload_check (model_build, data_index), initial_params or
placeholders, restore, journal_replay, then server_start with compile and first_checkpoint inside.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from diloco_trainer.auth import resolve_token
from diloco_trainer.config import (
    ConfigError,
    load_training_config,
    read_document,
)
from diloco_trainer.logfmt import FORMATS, LOG_FORMAT_ENV, configure_logging, resolve_log_format
from diloco_trainer.phases import phase
from diloco_trainer.shards import (
    Shard,
    foreign_shard_folders,
    shard_checkpoint_path,
    split_addresses,
)
from diloco_trainer.syncer.bucket_weights import read_weights_anywhere
from diloco_trainer.syncer.checkpoint import (
    CheckpointError,
    CheckpointStore,
    Snapshot,
    StorageAccessError,
    Superseded,
    open_location,
)
from diloco_trainer.syncer.fragment import InitFn, default_init
from diloco_trainer.syncer.memory import hold_less_memory
from diloco_trainer.syncer.roster import Roster
from diloco_trainer.syncer.standby import ServingLock, wait_as_standby
from diloco_trainer.tls import ServerTls
from diloco_trainer.workload.weights import WeightsError, WeightsUnavailable
from diloco_trainer.workload.weights import init_from as init_from_weights

if TYPE_CHECKING:
    from diloco_trainer.syncer.core import Syncer

log = logging.getLogger("diloco.syncer")
DEFAULT_PORT = 8470
EXIT_SUPERSEDED = 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="diloco-syncer", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="DilocoRun manifest or bare training block")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=None, help="listen port (0: any free port)")
    p.add_argument("--token", default=None, help="bearer token (else DILOCO_TOKEN[_FILE])")
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="a directory or gs://bucket/prefix; overrides training.checkpoint.path",
    )
    p.add_argument("--run", default=None, help="run name shown in status")
    p.add_argument(
        "--max-units",
        default=None,
        help="distinct learner units admitted (else DILOCO_MAX_UNITS; unset: any number)",
    )
    p.add_argument(
        "--units-file",
        default=os.environ.get("DILOCO_UNITS_FILE") or None,
        help="the run's unit roster, JSON {revision, units: {name: group}} (else "
        "DILOCO_UNITS_FILE): only those units are admitted; PUT /v1/units updates it",
    )
    p.add_argument(
        "--lock",
        default=os.environ.get("DILOCO_SYNCER_LOCK") or None,
        help="serve only while holding this local file's lock; a second syncer given the same "
        "lock waits as a warm standby and takes over when the first dies (standby.py)",
    )
    p.add_argument(
        "--shard",
        default=os.environ.get("DILOCO_SYNCER_SHARD") or "0/1",
        help="INDEX/COUNT: hold only this shard's fragments (else DILOCO_SYNCER_SHARD; "
        "default 0/1, the whole model); checkpoints go to PATH/shard-INDEX-of-COUNT",
    )
    p.add_argument(
        "--peers",
        default=os.environ.get("DILOCO_SYNCER_PEERS") or "",
        help="every shard's address, shard 0's first, comma-separated (else "
        "DILOCO_SYNCER_PEERS): shard 0 reads the model from them to evaluate it",
    )
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain (else DILOCO_TLS_CERT)")
    p.add_argument("--tls-key", default=None, help="PEM private key (else DILOCO_TLS_KEY)")
    p.add_argument("--log-level", default=os.environ.get("DILOCO_LOG_LEVEL", "INFO"))
    p.add_argument(
        "--log-format", choices=FORMATS, default=None, help=f"text or json (else {LOG_FORMAT_ENV})"
    )
    return p.parse_args(argv)


def resolve_port(flag: int | None) -> int:
    if flag is not None:
        return flag
    raw = os.environ.get("DILOCO_SYNCER_PORT")
    if not raw:
        return DEFAULT_PORT
    try:
        port = int(raw)
    except ValueError as exc:
        raise ConfigError(f"DILOCO_SYNCER_PORT: not an integer: {raw!r}") from exc
    if not 0 <= port < 65536:
        raise ConfigError(f"DILOCO_SYNCER_PORT: out of range: {port}")
    return port


def resolve_max_units(flag: str | None, env: Mapping[str, str]) -> int | None:
    raw = flag if flag is not None else env.get("DILOCO_MAX_UNITS")
    if raw is None or raw == "":
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise ConfigError(f"--max-units (or DILOCO_MAX_UNITS): not an integer >= 1: {raw!r}")
    return int(raw)


def resolve_tls(cert: str | None, key: str | None, env: Mapping[str, str]) -> ServerTls | None:
    """HTTPS with the certificate and key the flags (else the environment) name, both or
    neither; the pair is loaded now, so a bad one stops the syncer before it listens."""
    cert = cert or env.get("DILOCO_TLS_CERT") or None
    key = key or env.get("DILOCO_TLS_KEY") or None
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        given, missing = ("--tls-cert", "--tls-key") if cert else ("--tls-key", "--tls-cert")
        raise ConfigError(
            f"{given} needs {missing} (or DILOCO_TLS_{missing[6:].upper()}): a certificate "
            "and its key go together"
        )
    try:
        return ServerTls(cert, key)
    except ValueError as exc:
        raise ConfigError(f"--tls-cert/--tls-key (or DILOCO_TLS_CERT/KEY): {exc}") from exc


def resolve_shard(raw: str, peers: str) -> tuple[Shard, list[str]]:
    """The shard this process serves and its peers' addresses (needed by shard 0 only)."""
    try:
        shard = Shard.parse(raw)
        addresses = split_addresses(peers) if peers else []
    except ValueError as exc:
        raise ConfigError(f"--shard/--peers (or DILOCO_SYNCER_SHARD/PEERS): {exc}") from exc
    if shard.sharded and shard.leads and len(addresses) != shard.count:
        raise ConfigError(
            f"--peers (or DILOCO_SYNCER_PEERS): shard 0 of {shard.count} evaluates the model "
            f"from every shard's fragments and needs {shard.count} addresses, got "
            f"{len(addresses)}"
        )
    return shard, addresses


def open_store(path: str, field: str, shard: Shard, keep: int) -> CheckpointStore:
    """The checkpoint store of this shard (`shard_store_path`)."""
    return CheckpointStore(shard_store_path(path, shard, field), keep, field=field)


def shard_store_path(base: str, shard: Shard, field: str) -> str:
    """Where this shard checkpoints (shards.shard_checkpoint_path). The shard count of a run is
    fixed: checkpoints written under another count are refused, never ignored, since starting
    fresh beside them would silently drop the run's progress."""
    if not base:
        return base
    entries = open_location(base, field).entries()
    foreign = foreign_shard_folders(entries, shard.count)
    if shard.sharded and any(name.startswith("ckpt-") for name in entries):
        foreign.insert(0, "ckpt-* (an unsharded syncer's)")
    if foreign:
        raise CheckpointError(
            f"{field} {base} holds checkpoints written with another syncer shard count "
            f"({', '.join(foreign[:3])}), this syncer is shard {shard}: the shard count of a "
            "run cannot change; use a fresh path, or the count the run was started with"
        )
    return shard_checkpoint_path(base, shard)


def read_roster(path: str | None) -> Roster | None:
    if not path:
        return None
    try:
        return Roster.read(path)
    except ValueError as exc:
        raise ConfigError(f"--units-file (or DILOCO_UNITS_FILE): {exc}") from exc


def checkpoint_setting(flag: str | None, env: Mapping[str, str], config: str) -> tuple[str, str]:
    """The checkpoint path and the setting it came from (named in messages about it)."""
    if flag:
        return flag, "--checkpoint-dir"
    if env.get("DILOCO_CHECKPOINT_PATH"):
        return env["DILOCO_CHECKPOINT_PATH"], "DILOCO_CHECKPOINT_PATH (spec.syncer.checkpoint.path)"
    return config, "training.checkpoint.path"


def run_name(flag: str | None, config_path: str) -> str:
    if flag or os.environ.get("DILOCO_RUN"):
        return flag or os.environ["DILOCO_RUN"]
    doc = read_document(config_path)
    name = (doc.get("metadata") or {}).get("name") if doc.get("kind") == "DilocoRun" else None
    return str(name) if name else Path(config_path).stem


def note_termination() -> threading.Event:
    """An event set by SIGTERM or SIGINT, from now on. Until the server installs its own
    handlers, a signal is only noted, and each phase of the start looks at it: a syncer in a
    container is its PID 1, which the kernel spares the default action of SIGTERM, so without
    a handler the signal would be ignored."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


async def serve(
    syncer: object,
    host: str,
    port: int,
    terminated: threading.Event,
    tls: ServerTls | None = None,
) -> None:
    from diloco_trainer.syncer.core import Syncer
    from diloco_trainer.syncer.http_api import start_server

    assert isinstance(syncer, Syncer)
    with phase(log, "server_start"):  # compile and first checkpoint (start_background), bind
        runner, bound = await start_server(syncer, host, port, tls)
    log.info(
        "event=listening host=%s port=%s run=%s fragments=%d scheme=%s",
        host,
        bound,
        syncer.run,
        len(syncer.frags),
        "https" if tls else "http",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    syncer.on_superseded = stop.set
    if terminated.is_set() or syncer.superseded is not None:  # while the server started
        stop.set()
    await stop.wait()
    log.info("event=stopping reason=%s", "superseded" if syncer.superseded else "signal")
    await runner.cleanup()  # stops background tasks and writes the final checkpoint
    await syncer.save_checkpoint(force=False)


def starting_params(init_from: str | None, snapshot: Snapshot | None) -> InitFn:
    """The model's own init, or the initFrom weights (read now: a bad file fails before the
    port is bound) on a fresh run. A run resuming from its checkpoint keeps the checkpoint."""
    if not init_from:
        return default_init
    if snapshot is not None:
        log.info(
            "event=init_from_ignored reason=resuming_checkpoint seq=%d init_from=%s",
            snapshot.seq,
            init_from,
        )
        return default_init
    return init_from_weights(init_from, default_init, read_weights_anywhere)


def stand_by(
    syncer: Syncer, lock: ServingLock, store: CheckpointStore, stop: threading.Event
) -> bool:
    """Warm up, wait for the lock while following the journal, then take over: True. False
    when told to stop first."""
    with phase(log, "compile"):
        syncer.warm_up()
    log.info("event=standby_ready lock=%s versions=%s", lock.path, syncer.versions())
    if not wait_as_standby(syncer, lock, stop):
        log.info("event=standby_stopped reason=signal versions=%s", syncer.versions())
        return False
    started = time.perf_counter()
    store.remove_strays()  # the dead syncer's interrupted save
    syncer.take_over()
    log.info(
        "event=took_over seconds=%.3f versions=%s",
        time.perf_counter() - started,
        syncer.versions(),
    )
    return True


def set_up_process(args: argparse.Namespace) -> bool:
    """Logging as asked and the allocator tuned (memory.py); False (the reason printed) when
    the log format is not one there is."""
    try:
        log_format = resolve_log_format(args.log_format, os.environ)
    except ValueError as exc:
        print(f"diloco-syncer: {exc}", file=sys.stderr)
        return False
    configure_logging(args.log_level.upper(), log_format)
    hold_less_memory()
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not set_up_process(args):
        return 2
    try:
        with phase(log, "config"):
            cfg = load_training_config(args.config)
            token = resolve_token(args.token, os.environ)
            port = resolve_port(args.port)
            max_units = resolve_max_units(args.max_units, os.environ)
            roster = read_roster(args.units_file)
            tls = resolve_tls(args.tls_cert, args.tls_key, os.environ)
            name = run_name(args.run, args.config)
            ckpt_path, ckpt_field = checkpoint_setting(
                args.checkpoint_dir, os.environ, cfg.checkpoint.path
            )
            shard, peers = resolve_shard(args.shard, args.peers)
    except ConfigError as exc:
        print(f"diloco-syncer: config error: {exc}", file=sys.stderr)
        return 2
    terminated = note_termination()
    lock = ServingLock(Path(args.lock)) if args.lock else None
    serving = lock is None or lock.try_acquire()
    try:
        with phase(log, "checkpoint_load"):
            store = open_store(ckpt_path, ckpt_field, shard, cfg.checkpoint.keep)
            # Before importing JAX, so a bad path or bucket fails fast; a standby leaves strays.
            snapshot = store.load_latest(remove_stray=serving)
    except CheckpointError as exc:
        print(f"diloco-syncer: cannot start: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, StorageAccessError) else 1
    try:
        with phase(log, "init_from") if cfg.model.init_from else contextlib.nullcontext():
            init_fn = starting_params(cfg.model.init_from, snapshot)
    except WeightsError as exc:
        print(f"diloco-syncer: cannot start: {exc}", file=sys.stderr)
        # A bucket that failed to serve the weights may serve them to a restart; a wrong file won't.
        return 1 if isinstance(exc, WeightsUnavailable) else 2
    with phase(log, "imports"):  # JAX and the trainer: seconds of a cold start
        from diloco_trainer.syncer.core import Syncer
        from diloco_trainer.workload.compile_cache import enable_compilation_cache

        enable_compilation_cache()  # a restart or a standby skips compiling the merge and the eval
    try:
        syncer = Syncer(
            cfg,
            token,
            run=name,
            store=store,
            restore=snapshot,
            max_units=max_units,
            init_fn=init_fn,
            standby=not serving,
            roster=roster,
            shard=shard,
            peers=peers,
        )
        if lock is not None and not serving and not stand_by(syncer, lock, store, terminated):
            syncer.close()
            return 0
        if lock is not None:
            lock.announce()
    except ValueError as exc:  # a checkpoint or initFrom weights that do not fit this config
        print(f"diloco-syncer: cannot start: {exc}", file=sys.stderr)
        return 2
    except Superseded as exc:  # another syncer wrote the path while this one claimed it
        print(f"diloco-syncer: cannot start: {exc}", file=sys.stderr)
        return EXIT_SUPERSEDED
    except CheckpointError as exc:  # the version journal could not be read or written
        print(f"diloco-syncer: cannot start: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, StorageAccessError) else 1
    try:
        asyncio.run(serve(syncer, args.host, port, terminated, tls))
    finally:
        syncer.close()
    return EXIT_SUPERSEDED if syncer.superseded is not None else 0


if __name__ == "__main__":
    sys.exit(main())

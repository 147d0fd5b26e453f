"""The `diloco` command line.

    diloco local run FILE [--chaos] [--report-dir D] [--max-seconds S] [--seed N] [--spares N]
                         [--no-fork-server] [--start-timeout S]
                         [--resume-from DIR | --checkpoint-dir DIR]
    diloco simulate [--chips 150000,...] [--learners 1,2,...] [--plot FILE] [--json]
    diloco export RUN_OR_CHECKPOINT --out FILE.safetensors [--names pytree|hf]
    diloco export RUN_OR_CHECKPOINT --out DIR --format orbax
    diloco data tokenize FILES_OR_DIRS... --out DIR (--tokenizer FILE | --train-vocab N)
                         [--shard-tokens N] [--pattern GLOB] [--eod-token TEXT]
    diloco data inspect DIR [--tokens N]
    diloco join-credential RUN --group G [--expires-in 7d] [-n NS] [--run-secret-file F]

Subcommands hang off argparse subparsers; each registers itself in `build_parser` with a
`handler` default, so adding one (e.g. `simulate`) touches nothing else.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diloco_trainer.config import TrainingConfig

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


def _positive_seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {raw!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {raw}")
    return value


def _add_local(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    local = sub.add_parser("local", help="run a DilocoRun on this machine with processes")
    local_sub = local.add_subparsers(dest="local_command", required=True, metavar="COMMAND")
    run = local_sub.add_parser(
        "run",
        help="run a DilocoRun manifest: the syncer and every learner unit as local processes",
        description="Run a DilocoRun manifest (the file kubectl apply takes) on this machine.",
    )
    run.add_argument("manifest", type=Path, help="DilocoRun manifest (YAML or JSON)")
    run.add_argument(
        "--chaos",
        action="store_true",
        help="inject faults: the manifest's spec.chaos block, or a default schedule of unit "
        "kills, a straggler pause and a syncer kill",
    )
    run.add_argument("--seed", type=int, default=None, help="override the chaos seed")
    run.add_argument(
        "--report-dir",
        type=Path,
        default=None,
        help="where logs, checkpoints, plots and summary.json go (default runs/<name>-<time>)",
    )
    run.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop (and write the report) after this long even if the budget is not reached",
    )
    run.add_argument(
        "--start-timeout",
        type=_positive_seconds,
        default=120.0,
        help="give up on the syncer's start when its log shows no new start-up phase (model "
        "build, data index, compile, ...) for this many seconds (default 120); in all it may "
        "take 15 minutes, or 5 times this when that is longer",
    )
    where = run.add_mutually_exclusive_group()
    where.add_argument(
        "--resume-from",
        default=None,
        help="an existing syncer checkpoint directory (or gs://bucket/prefix) to continue from",
    )
    where.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="an empty or new directory for this run's checkpoints and journals, e.g. on a "
        "disk of its own (default: checkpoints/ in the report folder)",
    )
    run.add_argument(
        "--spares",
        type=int,
        default=None,
        help="warm spare learners kept waiting to take over a recreated unit (0: none; "
        "default: the manifest's unitGroups[].spares summed, else 1)",
    )
    run.add_argument(
        "--no-fork-server",
        action="store_true",
        help="start every learner as a fresh process instead of forking it from one process "
        "that imported JAX once (slower restarts; for comparison and debugging)",
    )
    run.add_argument(
        "--no-live", action="store_true", help="no live display (default when not a terminal)"
    )
    run.add_argument("-v", "--verbose", action="store_true", help="debug logs on stderr")
    run.set_defaults(handler=_local_run)


def _add_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from diloco_operator import simulator

    simulate = sub.add_parser(
        "simulate",
        help="goodput simulator: elastic DP vs non-elastic vs DiLoCo on a fleet of failing chips",
        description="Discrete-event goodput simulation of the Decoupled DiLoCo paper's setting.",
    )
    simulator.add_arguments(simulate)
    simulate.set_defaults(handler=simulator.run_from_args)


def _add_join_credential(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from diloco_operator.k8s import join_credential

    parser = sub.add_parser(
        "join-credential",
        help="mint a join credential for a unit group that runs in another cluster",
        description="Print a Secret manifest (for the away cluster) holding a credential for "
        "one unit group of a home run; its id (on stderr) revokes it.",
    )
    join_credential.add_arguments(parser)
    parser.set_defaults(handler=join_credential.run_from_args)


def _add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    export = sub.add_parser(
        "export",
        help="write a run's global model to a safetensors file or an orbax checkpoint",
        description="Write the global parameters of a syncer checkpoint to one safetensors "
        "file (leaf names = pytree paths, loadable with safetensors.flax.load_file; or Hugging "
        "Face GPT-2 names for the bundled GPT, with a config.json beside it) or to an orbax "
        "checkpoint directory (which training.model.initFrom reads back).",
    )
    export.add_argument(
        "source",
        metavar="RUN_OR_CHECKPOINT",
        help="a checkpoint (ckpt-*), a checkpoint directory or gs://bucket/prefix (its newest "
        "valid checkpoint; a sharded syncer's: every shard's joined) or a local run's report "
        "folder",
    )
    export.add_argument(
        "--out",
        type=Path,
        required=True,
        help="the .safetensors file to write (--format orbax: a new directory)",
    )
    export.add_argument(
        "--format",
        choices=["safetensors", "orbax"],
        default="safetensors",
        help="safetensors (default) or an orbax checkpoint (needs orbax-checkpoint)",
    )
    export.add_argument(
        "--names",
        choices=["pytree", "hf"],
        default="pytree",
        help="pytree paths (default) or Hugging Face GPT-2 names (the bundled GPT only; "
        "RMSNorm and no biases, so not transformers' GPT-2: see docs/library.md)",
    )
    export.set_defaults(handler=_export)


def _export(args: argparse.Namespace) -> int:
    # numpy + safetensors only: no JAX import for a safetensors export (orbax brings its own).
    from diloco_trainer.syncer.export import ExportError, export_checkpoint

    try:
        done = export_checkpoint(args.source, args.out, names=args.names, fmt=args.format)
    except ExportError as exc:
        print(f"diloco export: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(
        f"wrote {done.out}: {done.leaves} leaves, outer step {done.outer_step}, "
        f"from {done.checkpoint}"
    )
    return EXIT_OK


def _add_data(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    data = sub.add_parser("data", help="turn text into token shards for data.source memmap")
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    tok = data_sub.add_parser(
        "tokenize",
        help="tokenise text files into a directory of token shards",
        description='Tokenise text files (a file = a document; .jsonl: one {"text": ...} per '
        "line) into DIR: raw .bin token shards, manifest.json and tokenizer.json. Needs the "
        "`text` extra (the tokenizers package).",
    )
    tok.add_argument("inputs", nargs="+", type=Path, metavar="FILES_OR_DIRS")
    tok.add_argument("--out", type=Path, required=True, help="new or empty output directory")
    which = tok.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer", type=Path, help="an existing tokenizer.json to use")
    which.add_argument(
        "--train-vocab",
        type=int,
        metavar="N",
        help="train a byte-level BPE of at most N tokens on the inputs first",
    )
    tok.add_argument(
        "--shard-tokens", type=int, metavar="N", help="tokens per shard file (default 2^26)"
    )
    tok.add_argument(
        "--pattern", default="*", help="which files of a directory to read (glob, default all)"
    )
    tok.add_argument(
        "--eod-token", help="the end-of-document token between documents (<|endoftext|>)"
    )
    tok.set_defaults(handler=_data)
    ins = data_sub.add_parser(
        "inspect",
        help="summarise a token shard directory and decode its first tokens",
        description="Print a shard directory's manifest, check it, decode the first tokens.",
    )
    ins.add_argument("directory", type=Path, metavar="DIR")
    ins.add_argument("--tokens", type=int, default=64, help="how many tokens to decode")
    ins.set_defaults(handler=_data)


def _data(args: argparse.Namespace) -> int:
    try:
        from diloco_trainer.data import text_cli
    except ModuleNotFoundError as exc:
        if exc.name != "tokenizers":
            raise
        print(
            "error: diloco data needs the tokenizers package: pip install 'elastic-diloco[text]'",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    if args.data_command == "inspect":
        return text_cli.inspect_command(args.directory, args.tokens)
    return text_cli.tokenize_command(
        args.inputs,
        args.out,
        args.tokenizer,
        args.train_vocab,
        args.shard_tokens,
        pattern=args.pattern,
        eod_token=args.eod_token,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco", description="Elastic decoupled DiLoCo: local runs and tools."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_local(sub)
    _add_simulate(sub)
    _add_export(sub)
    _add_data(sub)
    _add_join_credential(sub)
    return parser


def _check_shards(training: TrainingConfig) -> None:
    """A tokenised data.path against the model's vocabulary, before anything starts (the
    learners check it too, but only once started and joined)."""
    if training.data.source == "memmap":
        from diloco_trainer.data.corpus import check_shard_manifest

        check_shard_manifest(training)


def _check_resume_dir(source: str) -> str | None:
    """Why `source` (a directory or gs://bucket/prefix) cannot be resumed from, or None."""
    # The syncer's own reader (numpy + safetensors, no JAX): a corrupt checkpoint is reported
    # now, before anything starts, with the reader's message.
    from diloco_trainer.syncer.checkpoint import CheckpointError, CheckpointStore
    from diloco_trainer.syncer.storage import is_bucket_url

    if is_bucket_url(source):
        try:
            # An observer here: the syncer it starts cleans up after itself at its own start.
            store = CheckpointStore(source, field="--resume-from")
            found = store.load_latest(remove_stray=False)
        except CheckpointError as exc:
            return f"--resume-from: {exc}"
        return None if found else f"--resume-from: {source} holds no checkpoint to resume"
    path = Path(source)
    if not path.exists():
        return f"--resume-from: checkpoint directory {path} does not exist"
    if not path.is_dir():
        return f"--resume-from: {path} is not a directory"
    if not any(path.iterdir()):
        return f"--resume-from: checkpoint directory {path} is empty (no checkpoint to resume)"
    try:
        CheckpointStore(path).load_latest()
    except CheckpointError as exc:
        return f"--resume-from: {exc}"
    return None


def _check_fresh_checkpoint_dir(path: Path) -> str | None:
    """Why `path` cannot hold a new run's checkpoints, or None. A directory with anything in
    it is refused: its checkpoints would be resumed silently (that is --resume-from's job)."""
    if not path.exists():
        return None
    if not path.is_dir():
        return f"--checkpoint-dir: {path} is not a directory"
    if any(path.iterdir()):
        return (
            f"--checkpoint-dir: {path} is not empty (to continue from its checkpoints, "
            "pass it as --resume-from)"
        )
    return None


def _check_checkpoint_args(resume_from: str | None, fresh: Path | None) -> str | None:
    """Why --resume-from or --checkpoint-dir (at most one is given) cannot be used, or None."""
    if resume_from is not None:
        return _check_resume_dir(resume_from)
    return None if fresh is None else _check_fresh_checkpoint_dir(fresh)


def checkpoint_location(resume_from: str | None, fresh: Path | None) -> Path | str | None:
    """Where the syncer keeps checkpoints: the resumed location, the fresh directory, or
    None (the runtime's default under the report folder)."""
    if fresh is not None:
        return fresh.resolve()
    if resume_from is None or resume_from.startswith("gs://"):
        return resume_from
    return Path(resume_from).resolve()


def check_entrypoints(training: TrainingConfig, say: Callable[[str], object] | None = None) -> None:
    """A user model or data source is checked here, before any process starts (ValueError naming
    the field), imported as each learner will: `python -m` puts the working directory first.
    `say` is told first: a slow model build or data index is then not a silent wait."""
    if training.model.entrypoint is None and training.data.entrypoint is None:
        return
    from diloco_trainer.workload.check import prepare

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if say is not None:
        say("checking the model and data entrypoints (model build, data index) ...")
    prepare(training)


def _local_run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from diloco_operator.local.manifest import (
        ManifestError,
        chaos_settings,
        check_chaos_units,
        load_manifest,
    )
    from diloco_operator.local.runtime import LocalRuntime, RunAborted, RunOptions
    from diloco_operator.local.spares import pool_size

    console = Console(stderr=True, soft_wrap=True)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        run = load_manifest(args.manifest)
        _check_shards(run.spec.training)
        chaos = chaos_settings(run.spec.chaos, args.chaos, args.seed)
        check_chaos_units(chaos, run.spec.total_units)
        check_entrypoints(run.spec.training, lambda line: console.print(line, highlight=False))
    except (ManifestError, ValueError) as exc:
        console.print(f"[bold red]invalid manifest {args.manifest}:[/]")
        console.print(str(exc), markup=False, highlight=False)
        return EXIT_BAD_INPUT
    problem = _check_checkpoint_args(args.resume_from, args.checkpoint_dir)
    if problem:
        console.print(f"[bold red]error:[/] {problem}", highlight=False)
        return EXIT_BAD_INPUT
    if run.spec.chaos is not None and run.spec.chaos.has_fault_settings and not args.chaos:
        console.print("[yellow]the manifest has a chaos block; pass --chaos to inject faults[/]")

    stamp = time.strftime("%Y%m%d-%H%M%S")
    report_dir = args.report_dir or Path("runs") / f"{run.name}-{stamp}"
    if report_dir.exists() and any(report_dir.iterdir()):
        console.print(f"[bold red]error:[/] --report-dir {report_dir} exists and is not empty")
        return EXIT_BAD_INPUT
    live = not args.no_live and console.is_terminal
    options = RunOptions(
        report_dir=report_dir,
        chaos=chaos,
        max_seconds=args.max_seconds,
        live=live,
        checkpoint_dir=checkpoint_location(args.resume_from, args.checkpoint_dir),
        spare_learners=max(0, pool_size(args.spares, run.spec)),
        fork_server=not args.no_fork_server,
        syncer_start_timeout=args.start_timeout,
    )
    console.print(
        f"run [bold]{run.name}[/]: {run.spec.total_units} units, chaos "
        f"{'on' if chaos.enabled else 'off'}, report in {report_dir}",
        highlight=False,
    )
    runtime = LocalRuntime(run, options, console=console)
    try:
        result = runtime.execute()
    except RunAborted as exc:
        console.print(f"[bold red]run aborted:[/] {exc}", highlight=False)
        console.print(f"logs: {report_dir / 'logs'}", highlight=False)
        return EXIT_FAILED
    s = result.summary
    outcome = result.outcome
    loss = s["finalEvalLoss"]
    which = "final eval loss" if s.get("finalEvalLossSource") == "final" else "last eval loss"
    console.print(
        f"{'complete' if result.complete else 'stopped'} ({outcome.reason}) after "
        f"{s['wallSeconds']:.0f}s: {which} {'-' if loss is None else f'{loss:.4f}'}, "
        f"tokens {s['tokens']}, goodput {100 * s['goodput']:.1f}%, unit kills {s['unitKills']}, "
        f"syncer kills {s['syncerKills']}, rejoins {s['rejoins']}",
        highlight=False,
    )
    console.print(f"report: {result.report_dir.resolve()}", highlight=False)
    if outcome.ending == "interrupted":
        # Shell convention: 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM).
        return 128 + (outcome.signum or signal.SIGINT)
    if outcome.ending in ("complete", "stopped"):
        return EXIT_OK
    return EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

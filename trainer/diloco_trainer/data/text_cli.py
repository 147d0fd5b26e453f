"""`diloco data tokenize` and `diloco data inspect`: text.py behind a progress bar and messages.

Exit codes as the rest of the CLI: 0 done, 1 failed (e.g. the disk filled up), 2 bad input.
Nothing is written unless the whole run succeeds (text.write_shards).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from diloco_trainer.data.shards import Manifest
from diloco_trainer.data.text import (
    DEFAULT_SHARD_TOKENS,
    EOD_TOKEN,
    ShardJob,
    TextDataError,
    check_out_dir,
    eod_id,
    find_inputs,
    inspect_shards,
    load_tokenizer,
    train_tokenizer,
    vocab_size_of,
    write_shards,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class RichProgress:
    """text.Progress on a rich progress bar, one bar per phase, in bytes of input."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task: TaskID | None = None
        self.total = 0

    def start(self, description: str, total: int) -> None:
        if self.task is not None:  # the previous phase is done even if the sizes changed
            self.progress.update(self.task, completed=self.total)
        self.task = self.progress.add_task(description, total=total)
        self.total = total

    def advance(self, amount: int) -> None:
        if self.task is not None:
            self.progress.advance(self.task, amount)


@contextmanager
def progress_bar(console: Console) -> Iterator[RichProgress]:
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        yield RichProgress(progress)


def _tokenizer_json(
    files: list[Path],
    tokenizer: Path | None,
    train_vocab: int | None,
    eod_token: str,
    bar: RichProgress,
) -> tuple[str, str]:
    """The tokenizer's JSON text, and a note on its vocabulary for the summary."""
    if tokenizer is not None:
        loaded = load_tokenizer(tokenizer)
        eod_id(loaded, eod_token)
        return tokenizer.read_bytes().decode("utf-8"), f"from {tokenizer}"
    assert train_vocab is not None
    trained = train_tokenizer(files, train_vocab, eod_token, bar)
    learned = vocab_size_of(trained)
    note = "trained here"
    if learned < train_vocab:
        note += f"; {train_vocab} asked for, the text supports only {learned}"
    return trained.to_str(), note


def tokenize_command(
    inputs: Sequence[Path],
    out: Path,
    tokenizer: Path | None,
    train_vocab: int | None,
    shard_tokens: int | None = None,
    pattern: str = "*",
    eod_token: str | None = None,
    console: Console | None = None,
) -> int:
    console = console or Console(stderr=True, soft_wrap=True)
    shard_tokens = DEFAULT_SHARD_TOKENS if shard_tokens is None else shard_tokens
    eod_token = eod_token or EOD_TOKEN
    try:
        files = find_inputs(list(inputs), pattern, exclude=out)
        check_out_dir(out)  # before any reading: a bad --out fails at once
        if shard_tokens < 1:
            raise TextDataError(f"--shard-tokens {shard_tokens}: must be at least 1")
        with progress_bar(console) as bar:
            tokenizer_json, note = _tokenizer_json(files, tokenizer, train_vocab, eod_token, bar)
            job = ShardJob(files, out, tokenizer_json, eod_token, shard_tokens)
            manifest = write_shards(job, bar)
    except TextDataError as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return EXIT_BAD_INPUT
    except OSError as exc:
        console.print(f"[bold red]failed:[/] {escape(str(exc))}; nothing written", highlight=False)
        return EXIT_FAILED
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; nothing written[/]")
        return EXIT_INTERRUPTED
    console.print(
        f"wrote {escape(str(out))}: {len(manifest.shards)} shard(s), {manifest.tokens:,} "
        f"{manifest.dtype} tokens, {manifest.documents:,} documents from {len(files)} file(s); "
        f"vocabulary {manifest.vocab_size:,} ({escape(note)})",
        highlight=False,
    )
    console.print(run_snippet(out, manifest), markup=False, highlight=False)
    return EXIT_OK


def run_snippet(out: Path, manifest: Manifest) -> str:
    return (
        "in a DilocoRun:\n"
        "  training:\n"
        f"    model: {{vocabSize: {manifest.vocab_size}}}\n"
        f"    data: {{source: memmap, path: {out.resolve()}, dtype: {manifest.dtype}}}"
    )


def inspect_command(directory: Path, count: int, console: Console | None = None) -> int:
    console = console or Console(soft_wrap=True)
    try:
        found = inspect_shards(directory, count)
    except TextDataError as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return EXIT_BAD_INPUT
    m = found.manifest
    lines = [
        f"{directory}: {m.tokens:,} tokens in {len(m.shards)} shard(s) of at most "
        f"{m.shard_tokens:,}, {m.dtype}",
        f"documents {m.documents:,} from {len(m.sources)} source file(s)",
        f"tokenizer {m.tokenizer.file} sha256 {m.tokenizer.sha256[:16]}..., vocabulary "
        f"{m.vocab_size:,}, end of document {m.tokenizer.eod_token!r} = id {m.tokenizer.eod_id}",
    ]
    lines += [f"  {s.file}: {s.tokens:,} tokens" for s in m.shards[:8]]
    if len(m.shards) > 8:
        lines.append(f"  ... {len(m.shards) - 8} more")
    console.print("\n".join(lines), markup=False, highlight=False)
    for problem in found.problems:
        console.print(f"[bold red]problem:[/] {escape(problem)}", highlight=False)
    if found.first_ids:
        console.print(f"first {len(found.first_ids)} token ids: {found.first_ids}", highlight=False)
        console.print("decoded:", highlight=False)
        console.print(found.first_text, markup=False, highlight=False)
    console.print(run_snippet(directory, m), markup=False, highlight=False)
    return EXIT_BAD_INPUT if found.problems else EXIT_OK

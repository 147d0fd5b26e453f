"""Shared pieces of the benchmark suite: machine description, timing, sections, markdown."""

from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
FRAGMENTS = DOCS / "bench"  # one markdown fragment and its PNGs per section
REPORT = DOCS / "benchmarks.md"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """One line naming the machine: CPU model, cores we may use, RAM, Python, OS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        ram = f", {pages / 2**30:.0f} GiB RAM"
    except (ValueError, OSError):
        ram = ""
    # The load average says how much the cores were shared while the section ran.
    load = (
        f", load average {os.getloadavg()[0]:.1f} at the end" if hasattr(os, "getloadavg") else ""
    )
    gpu = "GPU present" if has_gpu() else "no GPU"
    return (
        f"{cpu_model()}, {cores} cores{ram}, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}, {gpu}{load}"
    )


def has_gpu() -> bool:
    return Path("/dev/nvidia0").exists() or Path("/dev/accel0").exists()


def today() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


@dataclass
class BenchContext:
    quick: bool
    command: str
    out_dir: Path = FRAGMENTS

    def plot_path(self, name: str) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return self.out_dir / name

    def link(self, path: Path) -> str:
        """`path` (a plot) as the report links it: relative to the folder of docs/benchmarks.md."""
        return path.relative_to(self.out_dir.parent).as_posix()


@dataclass
class Section:
    """One benchmark's contribution to docs/benchmarks.md."""

    name: str
    title: str
    body: str  # markdown: tables, notes
    command: str
    config: str
    date: str = field(default_factory=today)
    machine: str = field(default_factory=machine)
    quick: bool = False

    def markdown(self) -> str:
        variant = " (quick variant)" if self.quick else ""
        return "\n".join(
            [
                f"## {self.title}",
                "",
                f"- command: `{self.command}`{variant}",
                f"- config: {self.config}",
                f"- machine: {self.machine}",
                f"- date: {self.date}",
                "",
                self.body.strip(),
                "",
            ]
        )


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Wall seconds of `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def interleaved(fns: Sequence[Callable[[], object]], rounds: int) -> list[list[float]]:
    """Time several candidates in alternation (A B A B ...) so that machine noise (other
    processes on shared cores) hits them alike; returns per-candidate wall seconds."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return times


K = TypeVar("K")
T = TypeVar("T")


def two_at_a_time(
    jobs: dict[K, Callable[[], T]], done: Callable[[K, T], None] | None = None
) -> dict[K, T]:
    """Run picklable jobs (module-level functions, or partials of them) in spawned processes, two
    at a time on the two cores, in the order given; `done` sees each result as it is collected."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    spawn = multiprocessing.get_context("spawn")  # a forked JAX runtime is not safe to use
    with ProcessPoolExecutor(max_workers=2, mp_context=spawn) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
        results = {}
        for key, future in futures.items():
            results[key] = future.result()
            if done is not None:
                done(key, results[key])
    return results


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def mean_interval(xs: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """The Student-t interval for the mean of independent runs: how far the mean of this few
    runs can be from the mean of many (len(xs) >= 2)."""
    from scipy import stats  # the only scipy use in the bench; keeps its import off the others

    mean = statistics.fmean(xs)
    half = stats.t.ppf((1 + level) / 2, len(xs) - 1) * statistics.stdev(xs) / len(xs) ** 0.5
    return float(mean - half), float(mean + half)


def interval_text(xs: Sequence[float]) -> str:
    """The 95% interval of `mean_interval` as a table prints it, or "one value"."""
    if len(xs) < 2:
        return "one value"
    low, high = mean_interval(xs)
    return f"{low:.3f} to {high:.3f}"


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.3g} GiB"


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def loss_cells(loss: float | None, reference: float | None) -> tuple[str, str]:
    """A final eval loss and its ratio to a reference run's, as a table prints them ("-" for
    what is missing)."""
    text = "-" if loss is None else f"{loss:.4f}"
    ratio = f"{loss / reference:.3f}" if loss and reference else "-"
    return text, ratio

"""The benchmark suite: `python -m bench.run [--quick] [--only NAME ...]`.

Each benchmark writes a markdown fragment (and its PNGs) under docs/bench/; docs/benchmarks.md is
then rebuilt from every fragment present, so `--only` refreshes one section and keeps the others.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable, Sequence

from bench.lib.common import FRAGMENTS, REPORT, BenchContext, Section, log

# (section name, module that runs it); order = order in the report. Each module is named after
# its section, in the package of its theme.
BENCHES: list[tuple[str, str]] = [
    ("simulator", "bench.faults.simulator"),
    ("syncer", "bench.speed.syncer"),
    ("sharded_syncer", "bench.speed.sharded_syncer"),
    ("communication", "bench.bytes.communication"),
    ("overhead", "bench.speed.overhead"),
    ("entrypoint", "bench.speed.entrypoint"),
    ("parity", "bench.quality.parity"),
    ("parity_chaos", "bench.quality.parity_chaos"),
    ("parity_trend", "bench.quality.parity_trend"),
    ("install", "bench.quality.install"),
    ("bytes_loss", "bench.bytes.bytes_loss"),
    ("bytes_loss_narrow", "bench.bytes.bytes_loss_narrow"),
    ("bytes_sparse", "bench.bytes.bytes_sparse"),
    ("ablations", "bench.quality.ablations"),
    ("bad_unit", "bench.faults.bad_unit"),
    ("goodput_real", "bench.faults.goodput_real"),
    ("chaos_loss", "bench.faults.chaos_loss"),
    ("syncer_failover", "bench.faults.syncer_failover"),
    ("wan", "bench.faults.wan"),
    ("mixed_speed", "bench.speed.mixed_speed"),
    ("gpu", "bench.speed.gpu"),
    ("sharding", "bench.speed.sharding"),
    ("operator", "bench.cluster.operator"),
    ("huge_units", "bench.cluster.huge_units"),
    ("huge_fleet", "bench.cluster.huge_fleet"),
    ("real_pods", "bench.cluster.real_pods"),
    ("soak", "bench.faults.soak"),
]

HEADER = """# Benchmarks

Written by `make bench` (`python -m bench.run`; `--quick` for the short variant, `--only NAME` for
one section). Every comparison is a ratio of two things measured side by side in the same run, on
the same machine; absolute times are context only. Sections: {names}.

| target | section |
|---|---|
| decoupled M=4 loss / data-parallel loss at equal tokens <= 1.02 (<= 1.03 under chaos) | parity, parity_chaos, ablations |
| parity <= 1.00: how the gap moves with M=8, model width and budget | parity_trend |
| parity <= 1.00: does keeping the steps made during a merge (`install: rebase`) close the decoupled runs' gap | install |
| bytes per token >= 400x below data-parallel with int4 | communication |
| >= 1000x fewer bytes per token than data-parallel, sent and received, at loss <= 1.02 of it: on the parity model; on the narrower model where the product reaches parity, over three seeds | bytes_loss, bytes_loss_narrow |
| experiment, time-boxed: top-k sparse deltas (SparseLoCo-style) at >= 4,000x fewer bytes per token than data-parallel, sent and received, at loss <= 1.02 of it, over three seeds | bytes_sparse |
| goodput >= 90% at one kill per unit per minute | goodput_real |
| chaos vs no chaos: final loss within 3% | chaos_loss |
| syncer SIGKILL: serving again within 3 s, no published version lost; harsh schedule within 5% of calm loss at goodput >= 90% | syncer_failover |
| two units behind an emulated WAN link: 1 Gbps / 50 ms RTT goodput >= 0.98 of LAN, loss within 1%; 100 Mbps / 200 ms / 1% resets goodput >= 0.95 of LAN; a 60 s cut: the rest keeps >= 95% goodput, the cut-off units push again <= 10 s after the heal | wan |
| simulator within 3 points of each published goodput figure | simulator |
| learner overhead <= 3% | overhead |
| model entrypoint path costs <= 2% tokens/s vs the built-in path | entrypoint |
| syncer merge + outer step >= 50% of memory-copy bandwidth at 10M, RDA | syncer |
| sharded syncer: memory per shard <= 1.1/S of one syncer's, <= 12 bytes per held parameter, the same parameters bit for bit; a shard SIGKILL loses 0 versions | sharded_syncer |
| pod failure -> Offline <= 2 s, -> replacement <= 5 s beyond backoff; RSS < 300 MiB at 50x16 | operator |
| a 2,304-host tpu7x unit on KWOK: recreated within 30 s; API requests per pass independent of the pods | huge_units |
| 4 units of 2,304 hosts in one run on KWOK: operator RSS < 1 GiB, API requests per pass independent of the pods, a failed host recreates its unit only | huge_fleet |
| real pods: learner killed -> replacement training again, median <= 15 s beyond backoff | real_pods |
| FSDP unit on 8 devices: same loss curve as replicated, ~1/8 the per-device parameter + optimizer bytes; an over-budget model trains sharded | sharding |
| one bad unit of four (9.9x deltas with huge counters, noise, flipped signs): loss within 2% of a calm run; the defences move a calm run by <= 0.5% | bad_unit |
| 100 random faults over one local run (unit and syncer SIGKILLs, pauses, a full checkpoint disk, a learner sending garbage): 0 published versions lost, 0 pushes of a superseded attempt, 0 garbage accepted, run completes with loss within 3% of a calm run | soak |
"""


def _runner(module: str) -> Callable[[BenchContext], Section]:
    import importlib

    mod = importlib.import_module(module)
    fn: Callable[[BenchContext], Section] = mod.run
    return fn


def rebuild_report() -> None:
    """docs/benchmarks.md = header + every section fragment present, in suite order."""
    parts = [HEADER.format(names=", ".join(n for n, _ in BENCHES))]
    for name, _ in BENCHES:
        frag = FRAGMENTS / f"{name}.md"
        if frag.exists():
            parts.append(frag.read_text())
        else:
            parts.append(f"## {name}\n\nNot run yet (`python -m bench.run --only {name}`).\n")
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text("\n".join(parts))


def main(argv: Sequence[str] | None = None) -> int:
    names = [n for n, _ in BENCHES]
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short variant (minutes, not hours)")
    parser.add_argument(
        "--only", action="append", choices=names, metavar="NAME", help=f"one of {names}"
    )
    args = parser.parse_args(argv)
    selected = args.only or names
    command = "python -m bench.run " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    ctx = BenchContext(quick=args.quick, command=command.strip())
    FRAGMENTS.mkdir(parents=True, exist_ok=True)
    failed: list[str] = []
    for name, module in BENCHES:
        if name not in selected:
            continue
        log(f"running {name}")
        start = time.perf_counter()
        try:
            section = _runner(module)(ctx)
        except Exception as exc:  # one broken bench must not lose the others' results
            log(f"{name} failed: {type(exc).__name__}: {exc}")
            failed.append(name)
            continue
        (FRAGMENTS / f"{name}.md").write_text(section.markdown())
        log(f"{name} done in {time.perf_counter() - start:.0f}s")
        rebuild_report()
    rebuild_report()
    log(f"wrote {REPORT}")
    if failed:
        log(f"failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

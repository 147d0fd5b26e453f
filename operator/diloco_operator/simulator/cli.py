"""`diloco simulate` (and `python -m diloco_operator.simulator`): flags, the sweep, the output."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from diloco_operator.simulator.model import (
    DEFAULT_CHIPS,
    DEFAULT_LEARNERS,
    Assumptions,
    SimResult,
    default_scenarios,
    paper_figure,
    sweep,
)
from diloco_operator.simulator.report import plot_goodput, print_table


def _int_list(text: str) -> list[int]:
    try:
        values = [int(float(v)) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco simulate` (also used by `python -m diloco_operator.simulator`)."""
    d = Assumptions()
    parser.add_argument("--chips", type=_int_list, default=list(DEFAULT_CHIPS), help="fleet sizes")
    parser.add_argument(
        "--learners", type=_int_list, default=list(DEFAULT_LEARNERS), help="M values"
    )
    parser.add_argument("--failures", type=int, default=10_000, help="interruptions per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mtbi-hours", type=float, default=d.chip_mtbi_hours)
    parser.add_argument("--slice-chips", type=int, default=d.slice_chips)
    parser.add_argument("--repair-hours", type=float, default=d.repair_hours)
    parser.add_argument("--reconfigure-seconds", type=float, default=d.reconfigure_seconds)
    parser.add_argument("--restart-seconds", type=float, default=d.restart_seconds)
    parser.add_argument("--step-seconds", type=float, default=d.step_seconds)
    parser.add_argument("--inner-steps", type=int, default=d.inner_steps)
    parser.add_argument("--fragments", type=int, default=d.fragments)
    parser.add_argument("--plot", type=Path, default=None, help="write a goodput PNG here")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def assumptions_from_args(args: argparse.Namespace) -> Assumptions:
    return replace(
        Assumptions(),
        chip_mtbi_hours=args.mtbi_hours,
        slice_chips=args.slice_chips,
        repair_hours=args.repair_hours,
        reconfigure_seconds=args.reconfigure_seconds,
        restart_seconds=args.restart_seconds,
        step_seconds=args.step_seconds,
        inner_steps=args.inner_steps,
        fragments=args.fragments,
    )


def result_to_json(r: SimResult) -> dict[str, Any]:
    out = asdict(r)
    out["scenario"] = asdict(r.scenario)
    out["paper"] = paper_figure(r.scenario)
    return out


def run_from_args(args: argparse.Namespace) -> int:
    """Run the sweep described by parsed `simulate` flags; print a table (or JSON)."""
    try:
        a = assumptions_from_args(args)
        scenarios = default_scenarios(args.chips, args.learners)
        if args.failures < 1:
            raise ValueError(f"--failures must be >= 1, got {args.failures}")
        results = sweep(scenarios, a, target_failures=args.failures, seed=args.seed)
    except ValueError as exc:
        print(f"diloco simulate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([result_to_json(r) for r in results], indent=2))
    else:
        print_table(results, a)
    if args.plot is not None:
        print(f"plot: {plot_goodput(results, args.plot)}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="diloco simulate", description="Goodput of elastic training on failing chips."
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))

"""Presenting simulation results: the assumptions in words, the markdown table of the benchmarks
report, a rich table for the terminal and the goodput plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from diloco_operator.simulator.model import (
    HOURS_PER_YEAR,
    Assumptions,
    SimResult,
    paper_figure,
)


def describe_assumptions(a: Assumptions) -> list[str]:
    """One line per assumption, for the table's caption."""
    fleet_floor = a.slice_chips * a.repair_hours / a.chip_mtbi_hours
    return [
        f"Chip mean time between interruptions: {a.chip_mtbi_hours:.0f} h of running "
        f"({a.chip_mtbi_hours / HOURS_PER_YEAR:.2g} year; the paper's setting). Interruptions are "
        "Poisson per running chip; idle chips (paused group, slice in repair) are not interrupted.",
        f"Failure domain: a slice of {a.slice_chips} chips (one chip down takes its slice down).",
        f"Repair: a failed slice is out of service {a.repair_hours:g} h, then rejoins its group "
        f"without a further pause. This alone idles {100 * fleet_floor:.1f}% of the fleet "
        "(slice_chips x repair / MTBI) in every strategy.",
        f"Reconfigure: the synchronous group that owns the failed slice pauses "
        f"{a.reconfigure_seconds:g} s (detect, drop the slice, re-form the mesh; a DiLoCo learner "
        "also pulls the global parameters). elastic-dp: the group is the whole job; diloco: one "
        "learner.",
        f"Non-elastic restart: every failure stops the whole job for {a.restart_seconds:g} s "
        f"(reschedule all hosts, reload) and rolls back to the last in-memory checkpoint "
        f"(every {a.checkpoint_steps} step(s)).",
        f"Step time {a.step_seconds:g} s. elastic-dp loses the step in flight; a DiLoCo learner "
        f"loses the progress not yet pushed: P={a.fragments} fragments, each pushed every "
        f"H={a.inner_steps} steps, staggered (on average H/2 steps = "
        f"{a.inner_steps * a.step_seconds / 2:g} s of a long-running learner).",
        "Goodput = useful chip-seconds / fleet chip-seconds. Uptime = share of wall time in which "
        "at least one group makes progress. Learners are equal shares of the slices; the ML "
        "efficiency of M learners vs data-parallel is not part of goodput (it is measured in the "
        "ML-parity rows).",
        "Calibration: these values were chosen once for all cells (reconfigure and repair against "
        "the paper's elastic-DP and DiLoCo figures, restart against its non-elastic figure); no "
        "per-cell factors.",
    ]


def results_table_markdown(results: Sequence[SimResult]) -> str:
    """Goodput (and uptime) per strategy row and fleet-size column, the paper's figure beside."""
    chips, rows = _grid(results)
    head = "| strategy | " + " | ".join(_fmt_chips(n) for n in chips) + " |"
    sep = "|---|" + "---|" * len(chips)
    lines = [head, sep]
    for label, by_chips in rows.items():
        cells = []
        for n in chips:
            cell_result = by_chips.get(n)
            if cell_result is None:
                cells.append("")
                continue
            cell = f"{100 * cell_result.goodput:.1f}% (up {100 * cell_result.uptime:.0f}%)"
            paper = paper_figure(cell_result.scenario)
            if paper is not None:
                delta = 100 * (cell_result.goodput - paper)
                cell += f" · paper {100 * paper:.0f}% (Δ {delta:+.1f})"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paper_deltas(results: Sequence[SimResult]) -> list[tuple[SimResult, float]]:
    """(result, ours - paper) for every cell where the paper publishes a figure."""
    out = []
    for r in results:
        paper = paper_figure(r.scenario)
        if paper is not None:
            out.append((r, r.goodput - paper))
    return out


def plot_goodput(results: Sequence[SimResult], path: str | Path) -> Path:
    """Goodput vs fleet size, one line per strategy, the paper's points as crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[SimResult]] = {}
    for r in results:
        series.setdefault(r.scenario.label, []).append(r)
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r.scenario.total_chips)
        xs = [r.scenario.total_chips for r in rs]
        (line,) = ax.plot(xs, [100 * r.goodput for r in rs], marker="o", label=label)
        paper = [(r.scenario.total_chips, paper_figure(r.scenario)) for r in rs]
        px = [x for x, p in paper if p is not None]
        py = [100 * p for _, p in paper if p is not None]
        if px:
            ax.scatter(px, py, marker="x", s=80, color=line.get_color(), zorder=5)
    ax.set_xscale("log")
    ax.set_xlabel("total chips")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Simulated goodput (lines) vs the paper's figures (crosses)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _grid(results: Sequence[SimResult]) -> tuple[list[int], dict[str, dict[int, SimResult]]]:
    """Fleet sizes (columns) and results by strategy label (rows) then fleet size."""
    chips = sorted({r.scenario.total_chips for r in results})
    rows: dict[str, dict[int, SimResult]] = {}
    for r in results:
        rows.setdefault(r.scenario.label, {})[r.scenario.total_chips] = r
    return chips, rows


def _fmt_chips(n: int) -> str:
    return f"{n / 1e6:g}M chips" if n >= 1_000_000 else f"{n / 1e3:g}k chips"


def print_table(results: Sequence[SimResult], a: Assumptions) -> None:
    from rich.console import Console
    from rich.table import Table

    chips, rows = _grid(results)
    table = Table(title="Simulated goodput (uptime); paper figure in brackets")
    table.add_column("strategy")
    for n in chips:
        table.add_column(_fmt_chips(n), justify="right")
    for label, by in rows.items():
        cells = []
        for n in chips:
            cell_result = by.get(n)
            if cell_result is None:
                cells.append("")
                continue
            paper = paper_figure(cell_result.scenario)
            extra = f" [{100 * paper:.0f}]" if paper is not None else ""
            cells.append(
                f"{100 * cell_result.goodput:.1f}% ({100 * cell_result.uptime:.0f}%){extra}"
            )
        table.add_row(label, *cells)
    console = Console()
    console.print(table)
    for line in describe_assumptions(a):
        console.print(f"- {line}", highlight=False)

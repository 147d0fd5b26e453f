"""The live view of a local run (rich): units, global progress, recent events.

`render` is a pure function of a `View` snapshot so it can be tested and reused for a final
printout; the runtime builds the snapshot each tick.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from diloco_operator.local.recorder import Event
from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

STATE_STYLES = {
    "online": "bold green",
    "pending": "dim",
    "starting": "cyan",
    "offline": "bold red",
    "restarting": "yellow",
    "paused": "magenta",
    "complete": "bold cyan",
    "stopped": "dim",
    "failed": "bold red",
}


@dataclass(frozen=True)
class UnitRow:
    name: str
    group: str
    state: str
    attempt: int
    restarts: int
    step: int | None
    tokens_per_sec: float | None
    loss: float | None
    slowdown: float


@dataclass(frozen=True)
class View:
    run: str
    elapsed: float
    syncer_state: str
    outer_step: int
    steps: int
    tokens: int
    token_budget: int | None
    step_budget: int | None
    loss: float | None
    train_loss: float | None
    units: Sequence[UnitRow]
    events: Sequence[Event]
    chaos: str
    report_dir: str


def _fmt_num(n: float | None, digits: int = 0) -> str:
    if n is None:
        return "-"
    if abs(n) >= 1e6:
        return f"{n / 1e6:.2f}M"
    if abs(n) >= 1e4:
        return f"{n / 1e3:.1f}k"
    return f"{n:.{digits}f}"


def _fmt_loss(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _progress(view: View) -> str:
    if view.token_budget:
        return f"{_fmt_num(view.tokens)} / {_fmt_num(view.token_budget)} tokens ({100 * view.tokens / view.token_budget:.0f}%)"
    if view.step_budget:
        return (
            f"{view.steps} / {view.step_budget} steps ({100 * view.steps / view.step_budget:.0f}%)"
        )
    return f"{_fmt_num(view.tokens)} tokens"


def render(view: View) -> RenderableType:
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_column(style="bold")
    head.add_column()
    m, s = divmod(int(view.elapsed), 60)
    syncer_style = STATE_STYLES.get(view.syncer_state, "")
    head.add_row("run", view.run, "elapsed", f"{m:d}:{s:02d}")
    head.add_row(
        "syncer", Text(view.syncer_state, style=syncer_style), "outer step", str(view.outer_step)
    )
    head.add_row("progress", _progress(view), "eval loss", _fmt_loss(view.loss))
    head.add_row("chaos", view.chaos, "train loss", _fmt_loss(view.train_loss))

    units = Table(
        box=box.SIMPLE_HEAD,
        expand=True,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
        caption="att: attempt, rst: restarts",
    )
    # Names and states never shrink (a narrow terminal squeezes the numbers instead).
    name_width = max([len("unit"), *(len(r.name) for r in view.units)])
    units.add_column("unit", no_wrap=True, min_width=name_width)
    units.add_column("group", no_wrap=True)
    units.add_column("speed", justify="right")
    units.add_column("state", no_wrap=True, min_width=len("restarting"))
    for col in ("att", "rst", "step", "tok/s", "loss"):
        units.add_column(col, justify="right")
    for row in view.units:
        units.add_row(
            row.name,
            row.group,
            f"1/{row.slowdown:g}" if row.slowdown != 1 else "1",
            Text(row.state, style=STATE_STYLES.get(row.state, "")),
            str(row.attempt),
            str(row.restarts),
            "-" if row.step is None else str(row.step),
            _fmt_num(row.tokens_per_sec),
            "-" if row.loss is None else f"{row.loss:.3f}",
        )

    log = Table.grid(padding=(0, 1))
    log.add_column(style="dim", no_wrap=True)
    log.add_column()
    for ev in list(view.events)[-8:]:
        when = time.strftime("%H:%M:%S", time.localtime(ev.time))
        style = "red" if "kill" in ev.kind or "failed" in ev.kind else ""
        who = f"{ev.unit} " if ev.unit and ev.unit not in ev.message else ""
        log.add_row(when, Text(f"{ev.kind}: {who}{ev.message}", style=style))

    return Group(
        Panel(head, title="decoupled DiLoCo, local", subtitle=f"report: {view.report_dir}"),
        Panel(units, title="learner units"),
        Panel(log, title="events"),
    )

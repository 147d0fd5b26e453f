"""The live view of a local run (rich): units, global progress, recent events.

`build_view` makes the snapshot (`View`) from what the runtime knows each tick, and `render` draws
it; both are pure, so they can be tested and reused for a final printout.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from diloco_operator.api import DilocoRunSpec, DilocoRunStatus
from diloco_operator.local.recorder import Event
from diloco_operator.planner import SyncerStatus, UnitSlot
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


def unit_state(planned: str, paused: bool) -> str:
    """A unit's state as shown and recorded: the planner's state, or `paused` while SIGSTOPped."""
    if paused:
        return "paused"
    return {"Recreating": "restarting", "Completed": "complete"}.get(planned, planned.lower())


def event_line(ev: Event, started_at: float) -> str:
    """Plain output (no terminal): one key=value line per event."""
    return (
        f"elapsed={ev.time - started_at:.1f} event={ev.kind} unit={ev.unit or '-'} "
        f"message={ev.message!r}"
    )


def chaos_line(enabled: bool, next_fault_at: float | None, elapsed: float) -> str:
    if not enabled:
        return "off"
    if not next_fault_at:
        return "on"
    return f"on, next fault in {max(0.0, next_fault_at - elapsed):.0f}s"


@dataclass(frozen=True)
class RunSnapshot:
    """What the runtime knows at one tick, for `build_view`. `syncer` is the last status the
    syncer served (kept while it is down, so progress stays on screen)."""

    run: str
    spec: DilocoRunSpec
    slots: Sequence[UnitSlot]
    status: DilocoRunStatus
    syncer: SyncerStatus | None
    syncer_online: bool
    paused: Set[str]
    slowdown: Mapping[str, float]
    events: Sequence[Event]
    chaos: str
    report_dir: str


def build_view(snap: RunSnapshot, elapsed: float) -> View:
    by_name = {u.name: u for u in snap.status.units}
    learners = snap.syncer.learners if snap.syncer else {}
    rows: list[UnitRow] = []
    for slot in snap.slots:
        unit = by_name.get(slot.name)
        learner = learners.get(slot.name)
        rows.append(
            UnitRow(
                name=slot.name,
                group=slot.group,
                state=unit_state(unit.state if unit else "Pending", slot.name in snap.paused),
                attempt=unit.attempt if unit else 0,
                restarts=unit.restarts if unit else 0,
                step=learner.step if learner else None,
                tokens_per_sec=learner.tokens_per_sec if learner else None,
                loss=learner.loss if learner else None,
                slowdown=snap.slowdown.get(slot.group, 1.0),
            )
        )
    st = snap.syncer or SyncerStatus()
    training = snap.spec.training
    return View(
        run=snap.run,
        elapsed=elapsed,
        syncer_state="online" if snap.syncer_online else "offline",
        outer_step=st.outer_step or 0,
        steps=st.steps or 0,
        tokens=st.tokens or 0,
        token_budget=training.total_tokens,
        step_budget=training.total_steps,
        loss=st.loss,
        train_loss=st.train_loss,
        units=rows,
        events=snap.events[-8:],
        chaos=snap.chaos,
        report_dir=snap.report_dir,
    )


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

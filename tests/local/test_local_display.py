"""The live view renders every unit with its state, and the global progress."""

from __future__ import annotations

import io

from diloco_operator.local.display import UnitRow, View, render
from diloco_operator.local.recorder import Event
from rich.console import Console


def test_render_shows_units_progress_and_events() -> None:
    view = View(
        run="demo",
        elapsed=75.0,
        syncer_state="offline",
        outer_step=12,
        steps=480,
        tokens=1_000_000,
        token_budget=2_000_000,
        step_budget=None,
        loss=3.25,
        train_loss=None,
        units=[
            UnitRow("demo-slow-0", "slow", "online", 0, 0, 120, 2100.0, 3.3, 2.0),
            UnitRow("demo-fast-0", "fast", "restarting", 2, 2, None, None, None, 1.0),
        ],
        events=[Event(0.0, "chaos-kill", "demo-fast-0", "SIGKILL")],
        chaos="on",
        report_dir="runs/x",
    )
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(render(view))
    text = console.export_text()
    assert "1:15" in text and "50%" in text and "3.2500" in text
    assert "syncer    offline" in text
    for needle in ("demo-slow-0", "1/2", "online", "demo-fast-0", "restarting", "2100"):
        assert needle in text
    assert "chaos-kill: demo-fast-0 SIGKILL" in text

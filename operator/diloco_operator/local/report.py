"""The report of a local run: goodput, summary.json and the PNG plots.

Goodput (docs/local.md has the prose): for each unit, learner-seconds are counted from the moment
it started training (the last heartbeat before its first reported inner step) until the end of the
run, which for a completed run is the moment the syncer was seen to report the budget reached
(later learner-seconds are not part of the run); its one-time start-up is reported separately. A
learner-second is *useful* when it lies between two consecutive heartbeats of the same attempt
whose step counter advanced, and the unit was not SIGSTOPped during it. Everything else (restart
backoff, process start and JIT compile after a kill, work since the last heartbeat before a kill,
pauses) is not. goodput = useful learner-seconds / total learner-seconds.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_operator.local.recorder import Event, GlobalSample, Heartbeat, Recorder, StateChange


@dataclass(frozen=True)
class Goodput:
    useful_seconds: float
    total_seconds: float
    startup_seconds: float
    per_unit: dict[str, float]

    @property
    def ratio(self) -> float:
        return self.useful_seconds / self.total_seconds if self.total_seconds > 0 else 0.0


def _overlap(a0: float, a1: float, spans: Sequence[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for b0, b1 in spans)


def compute_goodput(
    heartbeats: Sequence[Heartbeat],
    pauses: Sequence[tuple[str, float, float]],
    unit_started: dict[str, float],
    end: float,
) -> Goodput:
    """Goodput as defined in the module docstring. `unit_started` is when each unit's first
    process started (to report start-up time); `end` is when the run ended. A heartbeat interval
    that straddles `end` counts up to `end` only."""
    by_unit: dict[str, list[Heartbeat]] = defaultdict(list)
    for hb in sorted(heartbeats, key=lambda h: h.time):
        by_unit[hb.unit].append(hb)
    paused: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for unit, start, stop in pauses:
        paused[unit].append((start, stop))

    useful_total = 0.0
    total = 0.0
    startup = 0.0
    per_unit: dict[str, float] = {}
    for unit, beats in by_unit.items():
        pairs = list(itertools.pairwise(beats))
        advancing = [
            (prev, cur)
            for prev, cur in pairs
            if cur.attempt == prev.attempt and cur.step > prev.step and prev.time < end
        ]
        if not advancing:
            continue  # never trained: nothing to account (its start-up never ended)
        first = advancing[0][0].time
        unit_total = max(0.0, end - first)
        useful = 0.0
        for prev, cur in advancing:
            stop = min(cur.time, end)
            span = stop - prev.time
            useful += max(0.0, span - _overlap(prev.time, stop, paused[unit]))
        useful_total += useful
        total += unit_total
        if unit in unit_started:
            startup += max(0.0, first - unit_started[unit])
        per_unit[unit] = useful / unit_total if unit_total > 0 else 0.0
    return Goodput(useful_total, total, startup, per_unit)


def count_rejoins(heartbeats: Sequence[Heartbeat]) -> int:
    """Restarted attempts (attempt > 0, numbered by the planner from 0) that reached the syncer
    again, i.e. rejoined the run."""
    return len({(hb.unit, hb.attempt) for hb in heartbeats if hb.attempt > 0})


def final_loss(samples: Sequence[GlobalSample]) -> float | None:
    for sample in reversed(samples):
        if sample.loss is not None:
            return sample.loss
    return None


def build_summary(
    rec: Recorder,
    *,
    run_name: str,
    ended_at: float,
    complete: bool,
    unit_started: dict[str, float],
    exit_reason: str,
    budget_reached_at: float | None = None,
    final_eval_loss: float | None = None,
) -> dict[str, Any]:
    """summary.json. Goodput ends at `budget_reached_at` (when the supervisor saw the syncer
    report the budget reached) for a complete run, else at `ended_at`. `final_eval_loss` is the
    syncer's evaluation at the budget (its `finalLoss`); without it the final eval loss falls back
    to the last periodic evaluation, and `finalEvalLossSource` says which one it is."""
    end = budget_reached_at if budget_reached_at is not None else ended_at
    good = compute_goodput(rec.heartbeats, rec.pauses, unit_started, end)
    last = rec.samples[-1] if rec.samples else None
    kinds = [e.kind for e in rec.events]
    periodic = final_loss(rec.samples)
    final = final_eval_loss if final_eval_loss is not None else periodic
    source = (
        "final" if final_eval_loss is not None else "periodic" if periodic is not None else None
    )
    return {
        "run": run_name,
        "complete": complete,
        "exitReason": exit_reason,
        "wallSeconds": round(ended_at - rec.started_at, 3),
        "budgetReachedSeconds": None
        if budget_reached_at is None
        else round(budget_reached_at - rec.started_at, 3),
        "finalEvalLoss": final,
        "finalEvalLossSource": source,
        "lastPeriodicEvalLoss": periodic,
        "finalTrainLoss": last.train_loss if last else None,
        "outerSteps": last.outer_step if last else 0,
        "innerSteps": last.steps if last else 0,
        "tokens": last.tokens if last else 0,
        "bytesSent": last.bytes_sent if last else 0,
        "bytesReceived": last.bytes_received if last else 0,
        "goodput": round(good.ratio, 4),
        "usefulLearnerSeconds": round(good.useful_seconds, 3),
        "totalLearnerSeconds": round(good.total_seconds, 3),
        "startupLearnerSeconds": round(good.startup_seconds, 3),
        "goodputPerUnit": {u: round(v, 4) for u, v in sorted(good.per_unit.items())},
        "unitKills": kinds.count("chaos-kill"),
        "syncerKills": kinds.count("chaos-kill-syncer"),
        "pauses": kinds.count("chaos-pause"),
        "killsSurvived": (kinds.count("chaos-kill") + kinds.count("chaos-kill-syncer"))
        if complete
        else 0,
        "unitFailures": kinds.count("unit-failed"),
        "restarts": kinds.count("unit-restarted"),
        "syncerRestarts": kinds.count("syncer-restarted"),
        "rejoins": count_rejoins(rec.heartbeats),
    }


STATE_COLORS = {
    "online": "#2ca02c",
    "pending": "#c7c7c7",
    "starting": "#aec7e8",
    "offline": "#d62728",
    "restarting": "#ff7f0e",
    "recreating": "#ff7f0e",
    "paused": "#9467bd",
    "stopped": "#7f7f7f",
    "complete": "#17becf",
}


def state_spans(
    states: Sequence[StateChange], end: float, t0: float
) -> dict[str, list[tuple[float, float, str]]]:
    """Per unit: (start, duration, state) spans relative to t0, for a broken_barh timeline."""
    spans: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    by_unit: dict[str, list[StateChange]] = defaultdict(list)
    for change in states:
        by_unit[change.unit].append(change)
    for unit, changes in by_unit.items():
        for cur, nxt in zip(changes, [*changes[1:], None], strict=False):
            stop = nxt.time if nxt is not None else end
            if stop > cur.time:
                spans[unit].append((cur.time - t0, stop - cur.time, cur.state))
    return spans


FAULT_EVENTS = ("chaos-kill", "chaos-pause", "chaos-kill-syncer")


def eval_points(samples: Sequence[GlobalSample]) -> list[GlobalSample]:
    """Samples where a new eval loss appeared: the syncer evaluates every few seconds while the
    supervisor polls every tick, so repeated values are the same evaluation seen again."""
    points: list[GlobalSample] = []
    for sample in samples:
        if sample.loss is not None and (not points or sample.loss != points[-1].loss):
            points.append(sample)
    return points


def _fault_times(events: Sequence[Event], t0: float) -> list[tuple[float, str]]:
    return [(e.time - t0, e.kind) for e in events if e.kind in FAULT_EVENTS]


def _loss_plot(
    plt: Any,
    path: Path,
    axis: int,
    xlabel: str,
    trains: Sequence[tuple[float, float, float]],
    evals: Sequence[tuple[float, float, float]],
    faults: Sequence[tuple[float, str]],
) -> None:
    """Loss against time (axis 0, with the injected faults) or tokens (axis 1)."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if trains:
        ax.plot(
            [p[axis] for p in trains],
            [p[2] for p in trains],
            label="train loss (learners)",
            alpha=0.6,
        )
    if evals:
        ax.plot([p[axis] for p in evals], [p[2] for p in evals], "o-", label="eval loss (global)")
    if axis == 0:
        for i, (t, kind) in enumerate(faults):
            color = (
                "#d62728" if kind == "chaos-kill" else "#9467bd" if kind == "chaos-pause" else "k"
            )
            ax.axvline(
                t, color=color, lw=0.8, ls="--", alpha=0.6, label="fault" if i == 0 else None
            )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"loss vs {'time' if axis == 0 else 'tokens'}")
    ax.grid(alpha=0.3)
    if trains or evals:
        ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _timeline_plot(
    plt: Any, path: Path, rec: Recorder, ended_at: float, faults: Sequence[tuple[float, str]]
) -> None:
    """One row per unit (the syncer first): its states over time, the faults as dotted lines."""
    t0 = rec.started_at
    spans = state_spans(rec.states, ended_at, t0)
    units = sorted(spans, key=lambda u: (u != "syncer", u))
    fig, ax = plt.subplots(figsize=(9, 0.6 * max(2, len(units)) + 1.2))
    for row, unit in enumerate(units):
        for start, width, state in spans[unit]:
            ax.broken_barh(
                [(start, width)], (row - 0.4, 0.8), color=STATE_COLORS.get(state, "#000000")
            )
    for t, kind in faults:
        ax.axvline(t, color="k" if kind == "chaos-kill-syncer" else "#444444", lw=0.6, ls=":")
    ax.set_yticks(range(len(units)), units)
    ax.set_xlabel("wall-clock seconds")
    ax.set_title("unit states (dotted: injected faults)")
    used = sorted({s for u in units for _, _, s in spans[u]})
    handles = [plt.Rectangle((0, 0), 1, 1, color=STATE_COLORS.get(s, "#000000")) for s in used]
    if handles:
        ax.legend(
            handles,
            used,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.25),
            ncol=len(used),
            fontsize=8,
        )
    ax.set_xlim(0, max(1.0, ended_at - t0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(rec: Recorder, out_dir: Path, ended_at: float) -> list[Path]:
    """loss_vs_time.png, loss_vs_tokens.png and timeline.png in `out_dir`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = rec.started_at
    faults = _fault_times(rec.events, t0)
    evals: list[tuple[float, float, float]] = [
        (s.time - t0, float(s.tokens), s.loss)
        for s in eval_points(rec.samples)
        if s.loss is not None
    ]
    trains: list[tuple[float, float, float]] = [
        (s.time - t0, float(s.tokens), s.train_loss)
        for s in rec.samples
        if s.train_loss is not None
    ]
    written: list[Path] = []
    for name, axis, xlabel in (
        ("loss_vs_time.png", 0, "wall-clock seconds"),
        ("loss_vs_tokens.png", 1, "tokens (all learners)"),
    ):
        _loss_plot(plt, out_dir / name, axis, xlabel, trains, evals, faults)
        written.append(out_dir / name)
    _timeline_plot(plt, out_dir / "timeline.png", rec, ended_at, faults)
    written.append(out_dir / "timeline.png")
    return written


def write_report(
    rec: Recorder,
    out_dir: Path,
    *,
    run_name: str,
    ended_at: float,
    complete: bool,
    unit_started: dict[str, float],
    exit_reason: str,
    budget_reached_at: float | None = None,
    final_eval_loss: float | None = None,
) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = build_summary(
        rec,
        run_name=run_name,
        ended_at=ended_at,
        complete=complete,
        unit_started=unit_started,
        exit_reason=exit_reason,
        budget_reached_at=budget_reached_at,
        final_eval_loss=final_eval_loss,
    )
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_plots(rec, out_dir, ended_at)
    return summary

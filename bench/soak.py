"""Issue 18's soak: many faults drawn at random over one local run, against a calm run of the
same manifest.

Two `diloco local run`s (real processes: syncer, warm standby, learners, spares) of one manifest
(4 units, tiny model, the same token budget). The soak run gets FAULTS faults drawn with a
seeded RNG over the calm run's length: unit SIGKILLs, unit pauses (SIGSTOP, some longer than
`offlineAfterSeconds`) and syncer SIGKILLs from the manifest's `chaos.schedule`, plus two kinds
the bench delivers itself (bench/soak_faults.py): the checkpoint disk (a tmpfs) full for a
while, and a learner holding a real unit's token sending garbage. Operator restarts and
duplicate pods are Kubernetes matters, covered by the e2e suite, not here.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import BenchContext, Section, log, md_table, syncer_log_events
from bench.live import local_run
from bench.soak_faults import BenchFault, BenchFaults, Tally, alongside, checkpoint_disk
from bench.soak_logs import KillLoss, kill_loss, stale_pushes
from bench.syncer_failover import manifest as failover_manifest

UNITS = 4
SPARES = 2
OFFLINE_AFTER = 20.0
CHECKPOINT_EVERY = 10.0
DISK_MIB = 48  # room for the kept checkpoints and the journals of the tiny model (~15 MiB)
# Share of each kind among the drawn faults.
WEIGHTS = {"kill": 35, "pause": 20, "killSyncer": 10, "disk-full": 10, "garbage": 25}
CHAOS_KINDS = {"kill": "chaos-kill", "pause": "chaos-pause", "killSyncer": "chaos-kill-syncer"}


@dataclass(frozen=True)
class Plan:
    """The drawn faults: the manifest's schedule and the bench's own."""

    schedule: list[dict[str, Any]]
    bench: list[BenchFault]

    def counts(self) -> Counter[str]:
        return Counter([f["action"] for f in self.schedule] + [f.kind for f in self.bench])


def draw_faults(count: int, start: float, end: float, seed: int) -> Plan:
    """`count` faults at uniform random times in [start, end) seconds, kinds drawn by WEIGHTS;
    a unit fault names no unit (the runtime hits a random running one)."""
    rng = random.Random(seed)
    kinds = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()), k=count)
    schedule: list[dict[str, Any]] = []
    bench: list[BenchFault] = []
    for kind, at in zip(kinds, sorted(rng.uniform(start, end) for _ in kinds), strict=True):
        at = round(at, 1)
        if kind == "pause":
            pause = round(rng.uniform(2.0, OFFLINE_AFTER + 10.0), 1)
            schedule.append({"atSeconds": at, "action": "pause", "pauseSeconds": pause})
        elif kind in CHAOS_KINDS:
            schedule.append({"atSeconds": at, "action": kind})
        elif kind == "disk-full":
            bench.append(BenchFault(at, kind, round(rng.uniform(3.0, 10.0), 1)))
        else:
            bench.append(BenchFault(at, kind))
    return Plan(schedule, bench)


def manifest(tokens: int, schedule: list[dict[str, Any]] | None) -> dict[str, Any]:
    """syncer_failover's manifest (goodput_real's, evaluations every 5 s), standby on, with
    room for every restart a hundred faults can cause."""
    doc = failover_manifest(tokens, schedule, standby=True)
    doc["metadata"]["name"] = "bench-soak"
    doc["spec"]["failurePolicy"]["maxUnitRestarts"] = 1000
    return doc


@dataclass
class Outcome:
    summary: dict[str, Any]
    events: list[dict[str, Any]]
    kills: list[KillLoss]
    stale: list[str]
    exit_code: int


def read_outcome(report: Path, code: int) -> Outcome:
    summary: dict[str, Any] = json.loads((report / "summary.json").read_text())
    events = [json.loads(x) for x in (report / "events.jsonl").read_text().splitlines()]
    lines = syncer_log_events(report / "logs")
    kill_times = [float(e["time"]) for e in events if e["kind"] == "chaos-kill-syncer"]
    kills = [k for t in kill_times if (k := kill_loss(t, lines)) is not None]
    return Outcome(summary, events, kills, stale_pushes(lines), code)


def calm_run(tokens: int, max_seconds: float) -> Outcome:
    with local_run(manifest(tokens, None), max_seconds, SPARES) as (report, code):
        out = read_outcome(report, code)
    log(f"soak calm: loss {out.summary.get('finalEvalLoss')} wall {out.summary['wallSeconds']}")
    return out


def soak_run(tokens: int, plan: Plan, max_seconds: float) -> tuple[Outcome, Tally, bool]:
    """The run with every fault; also whether the checkpoint disk could be a tmpfs."""
    with checkpoint_disk(DISK_MIB) as disk:
        faults = BenchFaults(plan.bench, disk)
        extra = ["--checkpoint-dir", str(disk / "checkpoints")] if disk is not None else []
        doc = manifest(tokens, plan.schedule)
        hook = alongside(faults)
        with local_run(doc, max_seconds, SPARES, True, extra, hook) as (report, code):
            out = read_outcome(report, code)
    log(f"soak: loss {out.summary.get('finalEvalLoss')} wall {out.summary['wallSeconds']} "
        f"kills {[k.lost for k in out.kills]} stale {len(out.stale)} tally {faults.tally}")  # fmt: skip
    return out, faults.tally, disk is not None


def fault_window(calm: Outcome) -> tuple[float, float]:
    """Seconds after the start in which the soak's faults fall: from the calm run's last first
    `unit-online` (all units training) plus 10% of its time to its budget, to 75% of that
    time. The margins are for the load of a shared machine, which can make the soak run start
    slower (a syncer killed before it first served ends a local run) or, in spite of its
    faults, go faster (a fault after its end is counted as not delivered)."""
    online = [float(e["elapsed"]) for e in calm.events if e["kind"] == "unit-online"]
    length = float(calm.summary.get("budgetReachedSeconds") or calm.summary["wallSeconds"])
    start = max(online[:UNITS], default=30.0) + 0.1 * length
    return start, max(start + 10.0, 0.75 * length)


def delivered(out: Outcome, tally: Tally) -> Counter[str]:
    kinds = Counter(e["kind"] for e in out.events)
    found = Counter({k: kinds[v] for k, v in CHAOS_KINDS.items()})
    return found + Counter({k: tally.delivered[k] for k in ("disk-full", "garbage")})


def run(ctx: BenchContext) -> Section:
    # 4M tokens: on a lightly loaded 2-core machine a 2M-token calm run took 145 s, which
    # packed the 100 faults into 83 s (a fault every 0.8 s, the disk full the whole time).
    tokens = 600_000 if ctx.quick else 4_000_000
    count = 25 if ctx.quick else 100
    max_seconds = 1500 if ctx.quick else 3600
    calm = calm_run(tokens, max_seconds)
    start, end = fault_window(calm)
    plan = draw_faults(count, start, end, seed=18)
    soak, tally, tmpfs = soak_run(tokens, plan, max_seconds)
    body = report_body(calm, soak, tally, plan, (start, end), tmpfs)
    return Section(
        name="soak",
        title="Soak: many random faults over one local run",
        body=f"{UNITS} units, tiny model, {tokens:,} tokens, {count} faults.\n{body}",
        command=ctx.command,
        config=f"{UNITS} units, tiny preset, batch 8, H=20, P=4, totalTokens {tokens}, "
        f"{SPARES} warm spares, warm standby syncer, checkpoints every {CHECKPOINT_EVERY:g} s, "
        f"offlineAfterSeconds {OFFLINE_AFTER:g}, {count} faults (seed 18)",
        quick=ctx.quick,
    )


def _fault_rows(plan: Plan, got: Counter[str], tally: Tally, tmpfs: bool) -> list[list[object]]:
    notes = {
        "kill": "SIGKILL of a random running unit (runtime chaos)",
        "pause": "SIGSTOP of a random running unit for 2-30 s, then SIGCONT (runtime chaos)",
        "killSyncer": "SIGKILL of the serving syncer (runtime chaos; dropped while none runs)",
        "disk-full": "checkpoint tmpfs filled by a ballast file for 3-10 s (bench)"
        if tmpfs
        else "not delivered: no tmpfs could be mounted",
        "garbage": "a burst of 7 hostile pushes and 6 bad heartbeats under a real unit's token "
        "(bench)",
    }
    skipped = ", ".join(f"{k}: {n}" for k, n in sorted(tally.skipped.items()))
    rows: list[list[object]] = [
        [kind, plan.counts()[kind], got[kind], notes[kind]] for kind in WEIGHTS
    ]
    rows.append(["all", sum(plan.counts().values()), sum(got.values()), skipped or "-"])
    return rows


def _kill_rows(out: Outcome) -> list[list[object]]:
    t0 = float(out.events[0]["time"])
    rows: list[list[object]] = []
    for i, k in enumerate(out.kills, 1):
        rows.append(
            [
                i,
                f"{k.at - t0:.0f}",
                f"{k.killed_log} -> {k.successor_log or 'none'}",
                "yes" if k.successor_warm else "no",
                "-" if k.serving_after is None else f"{k.serving_after:.1f}",
                list(k.published),
                list(k.served) or "-",
                k.lost,
            ]
        )
    return rows


def _run_row(label: str, out: Outcome, calm_loss: float | None) -> list[object]:
    s = out.summary
    loss = s.get("finalEvalLoss")
    return [
        label,
        "-" if loss is None else f"{loss:.4f}",
        f"{loss / calm_loss:.3f}" if loss and calm_loss else "-",
        f"{100 * s['goodput']:.1f}%",
        f"{s['wallSeconds']:.0f}s",
        "yes" if s.get("complete") else "no",
        s.get("unitKills", 0),
        s.get("syncerKills", 0),
    ]


def report_body(
    calm: Outcome,
    soak: Outcome,
    tally: Tally,
    plan: Plan,
    window: tuple[float, float],
    tmpfs: bool,
) -> str:
    got = delivered(soak, tally)
    faults = md_table(["fault", "drawn", "delivered", "how"], _fault_rows(plan, got, tally, tmpfs))
    kills = md_table(
        ["kill", "at (s)", "killed -> successor log", "standby warm", "serving again (s)",
         "published", "successor serves", "versions lost"],
        _kill_rows(soak),
    )  # fmt: skip
    calm_loss = calm.summary.get("finalEvalLoss")
    runs = md_table(
        ["run", "final eval loss", "/ calm", "goodput", "wall", "budget reached", "unit kills",
         "syncer kills"],
        [_run_row("calm", calm, calm_loss), _run_row("soak", soak, calm_loss)],
    )  # fmt: skip
    answers = md_table(
        ["garbage request, answer", "count"], sorted(tally.answers.items())
    ) if tally.answers else "No garbage was sent."  # fmt: skip
    lost = sum(k.lost for k in soak.kills)
    ratio = (soak.summary.get("finalEvalLoss") or float("inf")) / (calm_loss or float("nan"))
    met = {
        "published versions lost over all syncer kills = 0": lost == 0
        and all(k.successor_log for k in soak.kills),
        "pushes of a superseded attempt = 0": not soak.stale,
        "garbage answered 2xx = 0": not tally.accepted_garbage,
        "run completed (token budget reached)": bool(soak.summary.get("complete")),
        "final eval loss / calm <= 1.03": ratio <= 1.03,
    }
    verdicts = "\n".join(f"- {k}: **{'met' if v else 'NOT met'}**" for k, v in met.items())
    stale = "; ".join(soak.stale[:5]) or "none"
    ending = str(soak.summary.get("exitReason") or "-").splitlines()[0][:300]
    return f"""
The soak's {sum(plan.counts().values())} faults were drawn (seed 18) at uniform random times
between {window[0]:.0f} s (all calm units training, plus 10% of the calm run's time to its
budget) and {window[1]:.0f} s (75% of that time; a fault drawn after the soak run's end is not
delivered). The soak run ended: {ending}. It runs on the local runtime (`diloco local run --chaos`, real processes, a warm standby
syncer); operator restarts and duplicate pods on Kubernetes are covered by the e2e suite
(test_03_chaos `test_operator_sigkilled_mid_change_no_duplicates`, test_04_ha_failover), not here.

{faults}

Per syncer kill, from the syncer logs: the versions the killed syncer had published (its last
`merged` per fragment, or what it stated at start or take-over) against those its successor
serves (`took_over`/`restored`/`journal_replayed`; a fragment it had to renumber, logged
`versions_lost`, counts with the version whose content it holds). Checkpoints are taken every
{CHECKPOINT_EVERY:g} s; the fragment journal should make every loss 0. "Standby warm": the
successor was a standby that had finished warming up (`standby_ready`) before the kill; a kill
soon after the previous one finds the new standby still importing and compiling, and serving
waits for it.

{kills if soak.kills else "No syncer kill was delivered."}

{runs}

Answers to the garbage (status 0: no answer, the syncer was being killed):

{answers}

Pushes of a superseded attempt (a unit's older attempt pushing after a newer one joined or
pushed; the syncer logs joins and pushes, not heartbeats): {len(soak.stale)} ({stale}).
Checkpoint disk full for {tally.disk_full_seconds:.0f} s in all.

Verdicts:
{verdicts}

Goodput (useful learner-seconds / all learner-seconds) is reported, with no target in this
section. One run per row: single runs of this size vary by a few percent in loss
(goodput_real).
"""

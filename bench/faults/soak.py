"""The soak: many faults drawn at random over one local run, against a calm run of the same
manifest. Checked: no published version lost, no push of a superseded attempt, no garbage
accepted, and the run completes with a loss near the calm run's.

Two `diloco local run`s (real processes: syncer, warm standby, learners, spares) of one manifest (4
units, tiny model, the same token budget). The soak run gets FAULTS faults drawn with a seeded RNG
over the calm run's length: unit SIGKILLs, unit pauses (SIGSTOP, some longer than
`offlineAfterSeconds`) and syncer SIGKILLs from the manifest's `chaos.schedule`, plus two kinds the
bench delivers itself (bench/faults/soak_faults.py): the checkpoint disk (a tmpfs) full for a
while, and a learner holding a real unit's token sending garbage. Operator restarts and duplicate
pods are Kubernetes matters, covered by the e2e suite, not here.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.faults.soak_faults import BenchFault, BenchFaults, Tally, alongside, checkpoint_disk
from bench.faults.soak_logs import KillLoss, kill_loss, stale_pushes
from bench.faults.syncer_failover import manifest as failover_manifest
from bench.lib.common import BenchContext, Section, log, loss_cells, md_table
from bench.lib.live import local_run, read_events, read_summary
from bench.lib.syncer_logs import syncer_log_events

UNITS = 4
SPARES = 2
OFFLINE_AFTER = 20.0
CHECKPOINT_EVERY = 10.0
DISK_MIB = 48  # room for the kept checkpoints and the journals of the tiny model (~15 MiB)
# Share of each kind among the drawn faults.
WEIGHTS = {"kill": 35, "pause": 20, "killSyncer": 10, "disk-full": 10, "garbage": 25}
CHAOS_KINDS = {"kill": "chaos-kill", "pause": "chaos-pause", "killSyncer": "chaos-kill-syncer"}
SEED = 18  # of the first round's faults; round n draws with SEED + n - 1


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
    summary = read_summary(report)
    events = read_events(report)
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
    log(
        f"soak: loss {out.summary.get('finalEvalLoss')} wall {out.summary['wallSeconds']} "
        f"kills {[k.lost for k in out.kills]} stale {len(out.stale)} tally {faults.tally}"
    )
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


@dataclass
class Round:
    """One calm run and one soak run of the same manifest, the soak's faults drawn by `seed`."""

    seed: int
    calm: Outcome
    soak: Outcome
    plan: Plan
    tally: Tally
    window: tuple[float, float]
    tmpfs: bool

    @property
    def ratio(self) -> float:
        calm = self.calm.summary.get("finalEvalLoss") or float("nan")
        return (self.soak.summary.get("finalEvalLoss") or float("inf")) / calm


def one_round(tokens: int, count: int, seed: int, max_seconds: float) -> Round:
    calm = calm_run(tokens, max_seconds)
    window = fault_window(calm)
    plan = draw_faults(count, *window, seed=seed)
    soak, tally, tmpfs = soak_run(tokens, plan, max_seconds)
    return Round(seed, calm, soak, plan, tally, window, tmpfs)


def run(ctx: BenchContext) -> Section:
    # 4M tokens: on a lightly loaded 2-core machine a 2M-token calm run took 145 s, which
    # packed the 100 faults into 83 s (a fault every 0.8 s, the disk full the whole time).
    tokens = 600_000 if ctx.quick else 4_000_000
    count = 25 if ctx.quick else 100
    max_seconds = 1500 if ctx.quick else 3600
    # Two rounds: one pair of runs of this size differs by several percent in final loss
    # (0.946 and 1.037 of calm in two runs of the same code), more than the 3% target.
    seeds = [SEED] if ctx.quick else [SEED, SEED + 1]
    rounds = [one_round(tokens, count, seed, max_seconds) for seed in seeds]
    return Section(
        name="soak",
        title="Soak: many random faults over one local run",
        body=f"{UNITS} units, tiny model, {tokens:,} tokens, {count} faults per soak run, "
        f"{len(rounds)} rounds.\n{report_body(rounds)}",
        command=ctx.command,
        config=f"{UNITS} units, tiny preset, batch 8, H=20, P=4, totalTokens {tokens}, "
        f"{SPARES} warm spares, warm standby syncer, checkpoints every {CHECKPOINT_EVERY:g} s, "
        f"offlineAfterSeconds {OFFLINE_AFTER:g}, {count} faults per run (seeds "
        f"{', '.join(map(str, seeds))})",
        quick=ctx.quick,
    )


NOTES = {
    "kill": "SIGKILL of a random running unit (runtime chaos)",
    "pause": "SIGSTOP of a random running unit for 2-30 s, then SIGCONT (runtime chaos)",
    "killSyncer": "SIGKILL of the serving syncer (runtime chaos; dropped while none runs)",
    "disk-full": "checkpoint tmpfs filled by a ballast file for 3-10 s (bench)",
    "garbage": "a burst of 7 hostile pushes and 6 bad heartbeats under a real unit's token (bench)",
}


def _fault_rows(rounds: list[Round]) -> list[list[object]]:
    """Per kind: drawn / delivered in each round."""
    got = [delivered(r.soak, r.tally) for r in rounds]

    def cells(kind: str | None) -> list[object]:
        return [
            f"{sum(r.plan.counts().values()) if kind is None else r.plan.counts()[kind]} / "
            f"{sum(g.values()) if kind is None else g[kind]}"
            for r, g in zip(rounds, got, strict=True)
        ]

    rows: list[list[object]] = []
    for kind in WEIGHTS:
        note = NOTES[kind]
        if kind == "disk-full" and not all(r.tmpfs for r in rounds):
            note = "not delivered where no tmpfs could be mounted"
        rows.append([kind, *cells(kind), note])
    skipped = "; ".join(
        ", ".join(f"{k}: {n}" for k, n in sorted(r.tally.skipped.items())) for r in rounds
    ).strip("; ")
    rows.append(["all", *cells(None), f"skipped: {skipped}" if skipped else "-"])
    return rows


def _kill_rows(rounds: list[Round]) -> list[list[object]]:
    rows: list[list[object]] = []
    for n, r in enumerate(rounds, 1):
        t0 = float(r.soak.events[0]["time"])
        for i, k in enumerate(r.soak.kills, 1):
            rows.append(
                [
                    f"{n}.{i}",
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
    return [
        label,
        *loss_cells(s.get("finalEvalLoss"), calm_loss),
        f"{100 * s['goodput']:.1f}%",
        f"{s['wallSeconds']:.0f}s",
        "yes" if s.get("complete") else "no",
        s.get("unitKills", 0),
        s.get("syncerKills", 0),
    ]


def _mean_loss(outs: list[Outcome]) -> float:
    losses = [o.summary.get("finalEvalLoss") for o in outs]
    return sum(x if x is not None else float("inf") for x in losses) / len(losses)


def report_body(rounds: list[Round]) -> str:
    faults = md_table(
        ["fault", *(f"round {n}: drawn / delivered" for n in range(1, len(rounds) + 1)), "how"],
        _fault_rows(rounds),
    )
    kills = md_table(
        [
            "kill",
            "at (s)",
            "killed -> successor log",
            "standby warm",
            "serving again (s)",
            "published",
            "successor serves",
            "versions lost",
        ],
        _kill_rows(rounds),
    )
    run_rows: list[list[object]] = []
    for n, r in enumerate(rounds, 1):
        calm_loss = r.calm.summary.get("finalEvalLoss")
        run_rows.append(_run_row(f"calm {n}", r.calm, calm_loss))
        run_rows.append(_run_row(f"soak {n} (seed {r.seed})", r.soak, calm_loss))
    calm_mean, soak_mean = (
        _mean_loss([r.calm for r in rounds]),
        _mean_loss([r.soak for r in rounds]),
    )
    ratio = soak_mean / calm_mean
    mean_row = ["mean of the soaks / mean of the calms", f"{soak_mean:.4f}", f"{ratio:.3f}"]
    run_rows.append([*mean_row, *[""] * 5])
    runs = md_table(
        [
            "run",
            "final eval loss",
            "/ calm",
            "goodput",
            "wall",
            "budget reached",
            "unit kills",
            "syncer kills",
        ],
        run_rows,
    )
    answers_count: Counter[str] = Counter()
    for r in rounds:
        answers_count.update(r.tally.answers)
    answers = (
        md_table(["garbage request, answer", "count"], sorted(answers_count.items()))
        if answers_count
        else "No garbage was sent."
    )
    all_kills = [k for r in rounds for k in r.soak.kills]
    stale = [line for r in rounds for line in r.soak.stale]
    met = {
        "published versions lost over all syncer kills = 0": sum(k.lost for k in all_kills) == 0
        and all(k.successor_log for k in all_kills),
        "pushes of a superseded attempt = 0": not stale,
        "garbage answered 2xx = 0": not any(r.tally.accepted_garbage for r in rounds),
        "every soak run completed (token budget reached)": all(
            r.soak.summary.get("complete") for r in rounds
        ),
        "final eval loss, mean of the soak runs / mean of the calm runs <= 1.03": ratio <= 1.03,
    }
    verdicts = "\n".join(f"- {k}: **{'met' if v else 'NOT met'}**" for k, v in met.items())
    windows = "; ".join(
        f"round {n}: seed {r.seed}, {r.window[0]:.0f} s to {r.window[1]:.0f} s, ended: "
        + str(r.soak.summary.get("exitReason") or "-").splitlines()[0][:200]
        for n, r in enumerate(rounds, 1)
    )
    disk = " and ".join(f"{r.tally.disk_full_seconds:.0f} s" for r in rounds)
    return f"""
Each round is a calm run and a soak run of one manifest. A soak run's faults are drawn with the
round's seed at uniform random times between the calm run's last first `unit-online` (all units
training) plus 10% of its time to its budget, and 75% of that time (a fault drawn after the soak
run's end is not delivered): {windows}. The runs are on the local runtime (`diloco local run --chaos`, real processes, a warm standby
syncer); operator restarts and duplicate pods on Kubernetes are covered by the e2e suite
(test_03_chaos `test_operator_sigkilled_mid_change_no_duplicates`, test_05_ha_failover), not here.

{faults}

Per syncer kill, from the syncer logs: the versions the killed syncer had published (its last
`merged` per fragment, or what it stated at start or take-over) against those its successor
serves (`took_over`/`restored`/`journal_replayed`; a fragment it had to renumber, logged
`versions_lost`, counts with the version whose content it holds). Checkpoints are taken every
{CHECKPOINT_EVERY:g} s; the fragment journal should make every loss 0. "Standby warm": the
successor was a standby that had finished warming up (`standby_ready`) before the kill; a kill
soon after the previous one finds the new standby still importing and compiling, and serving
waits for it.

{kills if all_kills else "No syncer kill was delivered."}

{runs}

Answers to the garbage, both rounds (status 0: no answer, the syncer was being killed):

{answers}

Pushes of a superseded attempt (a unit's older attempt pushing after a newer one joined or
pushed; the syncer logs joins and pushes, not heartbeats): {len(stale)} ({"; ".join(stale[:5]) or "none"}).
Checkpoint disk full for {disk} in all.

Verdicts:
{verdicts}

Goodput (useful learner-seconds / all learner-seconds) is reported, with no target in this
section. The loss verdict is on the means: one pair of runs of this size differs by several
percent in final loss (goodput_real; the rounds' own ratios are in the table).
"""

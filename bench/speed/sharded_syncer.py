"""Sharded syncer: memory and merge time per shard for S = 1, 2, 4, the same pushes bit for bit,
and a shard SIGKILL in a local run.

Part 1: one model of a few hundred million parameters (tens of millions with --quick) served by S
syncer processes (`--shard i/S`). Two learners (the bench's clients) push every fragment in turn,
one after the other, with quorum 2, so every configuration merges exactly the same contributions
in the same order; after the rounds the model is pulled back and hashed: the hashes must agree.
Memory is each serving process's resident set (VmRSS) and its peak (VmHWM); the process's fixed
part (Python, JAX, aiohttp) is a syncer of a two-parameter-tensor model started the same way, and
bytes per held parameter = (RSS - that baseline) / parameters the shard holds. Merge time is what
the shards log per merge (`event=merged ... seconds=`), summed per round per shard; the round's
merge time is the busiest shard's (the shards merge at the same time, in separate processes).

Part 2: a local run (`diloco local run`, real learner processes) with `syncer.shards: 2` and a
warm standby per shard; the chaos schedule SIGKILLs the serving syncer twice (kills alternate
over the shards: shard 0, then shard 1). Counted from the logs: versions lost
(`event=versions_lost`), and for every kill the versions the killed process had merged against
those its standby took over with.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from diloco_operator import simulator as sim
from diloco_operator.simulator.model import paper_figure
from diloco_trainer.auth import unit_token
from diloco_trainer.config import TrainingConfig
from diloco_trainer.fragments import fragment_sizes, pack_fragments
from diloco_trainer.learner.client import SyncerClient
from diloco_trainer.learner.shard_client import ShardedClient
from diloco_trainer.learner.syncer_api import SyncerApi
from diloco_trainer.models.gpt import param_shapes
from diloco_trainer.shards import shard_owners

from bench.faults.goodput_real import manifest as goodput_manifest
from bench.lib.common import FRAGMENTS as SECTIONS
from bench.lib.common import BenchContext, Section, log, md_table
from bench.lib.live import TOKEN, local_run, read_events, read_summary, syncer_shards
from bench.lib.syncer_logs import fields, syncer_log_events

SHARDS = (1, 2, 4)
LEARNERS = 2
FRAGMENTS = 8
_MERGED = re.compile(r"event=merged fragment=(\d+) version=(\d+) .*?seconds=(\S+)")


def training(quick: bool, tiny: bool = False) -> TrainingConfig:
    if tiny:
        model = {"preset": "tiny", "dModel": 8, "nLayers": 1, "nHeads": 1, "seqLen": 8}
    elif quick:
        model = {"preset": "small", "dModel": 512, "nLayers": 8, "nHeads": 8, "seqLen": 256}
    else:
        model = {"preset": "small", "dModel": 1280, "nLayers": 12, "nHeads": 10, "seqLen": 256}
    return TrainingConfig.model_validate(
        {
            "model": model,
            "fragments": FRAGMENTS,
            "quorum": LEARNERS,
            "maxStaleness": 4,
            "grace": {"mode": "none", "maxSeconds": 60},
            "totalSteps": 10**9,
            "eval": {"everySeconds": None},
            "checkpoint": {"everySeconds": 3600},
        }
    )


@dataclass
class ShardRow:
    shards: int
    index: int
    held: int  # parameters
    rss: int
    peak: int
    merge_s: float  # this shard's merge seconds per round (median over rounds)


def memory(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, bytes."""
    found = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return tuple(int(found[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))  # type: ignore[return-value]


def settled_memory(pid: int, window_s: float = 3.0) -> tuple[int, int]:
    """(RSS, peak) with the RSS the lowest of a few samples over `window_s`: the last merge's
    journal entry may still be on its way to disk when the last poll answers (seen once: one
    fragment's values, 107 MiB, on one shard of four), and what is measured is what stays."""
    samples = []
    for _ in range(4):
        samples.append(memory(pid))
        time.sleep(window_s / 3)
    return min(r for r, _ in samples), max(p for _, p in samples)


def baseline_rss() -> int:
    """A syncer process's resident set without a model to speak of."""
    with syncer_shards(training(False, tiny=True), 1) as (proc,):
        time.sleep(1.0)
        return memory(proc.proc.pid)[0]


def clients(urls: list[str]) -> list[SyncerApi]:
    out: list[SyncerApi] = []
    for m in range(LEARNERS):
        unit = f"bench-{m}"
        per_shard = [SyncerClient(url, unit_token(TOKEN, unit), unit, 0) for url in urls]
        out.append(per_shard[0] if len(urls) == 1 else ShardedClient(per_shard))
    return out


def delta(shapes: dict[str, tuple[int, ...]], names: list[str], seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(shapes[n], dtype=np.float32) * 1e-3 for n in names}


def one_config(cfg: TrainingConfig, count: int, rounds: int) -> tuple[list[ShardRow], str]:
    shapes = param_shapes(cfg.model)
    layout = pack_fragments(shapes, cfg.fragments)
    owners = shard_owners(fragment_sizes(shapes, layout), count)
    with syncer_shards(cfg, count, log_level="INFO") as procs:
        learners = clients([p.url for p in procs])
        for learner in learners:
            learner.join()
        for r in range(rounds):
            for p, names in enumerate(layout):
                for m, learner in enumerate(learners):  # one after the other: a fixed order
                    learner.push(p, r, delta(shapes, names, (r * 1000 + p) * 10 + m), 8, 8 * 256)
            for p in range(len(layout)):  # every fragment's round merged before the next
                got = learners[0].poll(p, r, 60.0)
                if got is None or got[0] != r + 1:
                    tail = (procs[0].workdir / "syncer.log").read_text()[-3000:]
                    raise RuntimeError(f"fragment {p} round {r}: no merge in 60 s ({got}): {tail}")
        params, versions = learners[0].pull_all()
        digest = hashlib.sha256()
        for name in sorted(params):
            digest.update(np.ascontiguousarray(params[name]).tobytes())
        assert versions == [rounds] * len(layout), versions
        rows = []
        for index, proc in enumerate(procs):
            rss, peak = settled_memory(proc.proc.pid)
            log_name = "syncer.log" if index == 0 else f"syncer-{index}.log"
            seconds: dict[int, float] = {}
            for _, version, secs in _MERGED.findall((proc.workdir / log_name).read_text()):
                seconds[int(version)] = seconds.get(int(version), 0.0) + float(secs)
            held = sum(
                int(np.prod(shapes[n]))
                for p, names in enumerate(layout)
                if owners[p] == index
                for n in names
            )
            per_round = sorted(seconds.values())
            merge = per_round[len(per_round) // 2] if per_round else float("nan")
            rows.append(ShardRow(count, index, held, rss, peak, merge))
        for learner in learners:
            learner.close()
    return rows, digest.hexdigest()


def kill_run(quick: bool) -> dict[str, Any]:
    doc = goodput_manifest(600_000 if quick else 1_200_000, None)
    doc["metadata"]["name"] = "bench-shards"
    spec = doc["spec"]
    spec["syncer"] = {"shards": 2, "standby": True}
    spec["training"]["fragments"] = 4
    spec["training"]["checkpoint"] = {"everySeconds": 600}  # the journal alone keeps versions
    spec["chaos"] = {
        "seed": 0,
        "schedule": [
            {"atSeconds": 40, "action": "killSyncer"},
            {"atSeconds": 70, "action": "killSyncer"},
        ],
    }
    with local_run(doc, 900, 0, True) as (report, code):
        summary = read_summary(report)
        kills = [e for e in read_events(report) if e["kind"] == "chaos-kill-syncer"]
        lines = syncer_log_events(report / "logs")
        lost = sum(1 for _, ev, _, _ in lines if ev == "versions_lost")
        checks = []
        for kill in kills:
            key, at = kill["unit"], float(kill["time"])
            # The shard's serving syncer and standbys: `<key>.log`, `<key>-standby-<n>.log`.
            mine = re.compile(rf"^{re.escape(key)}(-standby-\d+)?\.log$")
            merged_before: dict[int, int] = {}
            for t, ev, rest, name in lines:
                if ev == "merged" and t <= at and mine.match(name):
                    f = fields(rest)
                    frag, version = int(f["fragment"]), int(f["version"])
                    merged_before[frag] = max(merged_before.get(frag, 0), version)
            took = next(
                (
                    rest
                    for t, ev, rest, name in lines
                    if ev == "took_over" and t > at and mine.match(name)
                ),
                "",
            )
            m = re.search(r"versions=\[([\d, ]+)\]", took)
            taken = [int(v) for v in m.group(1).split(",")] if m else []
            kept = bool(taken) and all(
                v <= taken[f] <= v + 1 for f, v in merged_before.items() if f < len(taken)
            )
            checks.append({"shard": key, "merged": merged_before, "taken": taken, "kept": kept})
    return {"summary": summary, "exit": code, "lost": lost, "kills": checks}


# The paper's goodput study: a 5B-parameter model, H=24 inner steps of 0.25 s (simulator defaults).
PAPER_PARAMS = 5e9
SCALE_CELLS = ((8, 1_200_000), (16, 1_200_000), (8, 2_400_000), (16, 2_400_000))
_RECREATE = re.compile(r"one host Failed -> all \d+ pods of the new attempt Running \| ([\d.]+) s")


def measured_recreate() -> float | None:
    """The huge_units section's recreate time of a 2,304-host unit (KWOK), if it has run."""
    fragment = SECTIONS / "huge_units.md"
    found = _RECREATE.search(fragment.read_text()) if fragment.exists() else None
    return float(found.group(1)) if found else None


def at_scale(rows: list[ShardRow], quick: bool) -> str:
    """The simulator's goodput at the paper's fleet sizes with a learner's re-forming taking as
    long as the measured recreate of a huge unit, beside the paper's figure; and the sharded
    syncer's merge time for the paper's model per push period, from this run's merge rate."""
    recreate = measured_recreate()
    a = sim.Assumptions()
    lines = []
    if recreate is not None:
        slow = replace(a, reconfigure_seconds=recreate)
        cells = [sim.Scenario("diloco", chips, m) for m, chips in SCALE_CELLS]
        failures = 2_000 if quick else 10_000
        ours = sim.sweep(cells, slow, target_failures=failures, seed=0)
        base = sim.sweep(cells, a, target_failures=failures, seed=0)
        table = md_table(
            [
                "cell",
                "paper",
                f"simulator, re-form {a.reconfigure_seconds:g} s",
                f"simulator, re-form {recreate:g} s (measured)",
            ],
            [
                (
                    f"M={c.learners}, {c.total_chips / 1e6:g}M chips",
                    f"{100 * (paper_figure(c) or float('nan')):.0f}%",
                    f"{100 * b.goodput:.1f}%",
                    f"{100 * o.goodput:.1f}%",
                )
                for c, b, o in zip(cells, base, ours, strict=True)
            ],
        )
        lines.append(
            f"Goodput predicted by the simulator (bench section simulator) when a failed slice "
            f"costs its learner {recreate:g} s to re-form, the time the huge_units section "
            f"measured from a host's failure to all 2,304 pods of the replacement unit Running "
            f"on KWOK (scheduling only: no image pull, no compile), instead of the paper's "
            f"{a.reconfigure_seconds:g} s:\n\n{table}\n"
        )
    else:
        lines.append("(Run the huge_units section first for the goodput prediction.)\n")
    seconds_per_param = {s: max(r.merge_s / r.held for r in rows if r.shards == s) for s in SHARDS}
    period = a.inner_steps * a.step_seconds
    merge = {s: PAPER_PARAMS / s * seconds_per_param[s] for s in SHARDS}
    lines.append(
        f"The syncer's side at that scale: every learner pushes every fragment once per "
        f"H x step = {period:g} s, so the syncer merges the whole model once per {period:g} s "
        f"per learner that pushed. At this run's merge rate per held parameter (busiest shard, "
        f"{LEARNERS} contributions per merge), one round of a {PAPER_PARAMS / 1e9:g}B model takes "
        + ", ".join(f"S={s}: {merge[s]:.0f} s" for s in SHARDS)
        + f" on this 2-core machine's shares, against the {period:g} s period: the S processes "
        "there would be on separate hosts, and the paper's syncer is CPU-only and sharded for "
        "that reason."
    )
    return "\n".join(lines)


def run(ctx: BenchContext) -> Section:
    rounds = 2 if ctx.quick else 3
    cfg = training(ctx.quick)
    base = baseline_rss()
    rows: list[ShardRow] = []
    digests: dict[int, str] = {}
    for count in SHARDS:
        got, digests[count] = one_config(cfg, count, rounds)
        rows += got
        log(f"sharded_syncer S={count}: {[(r.rss >> 20, r.merge_s) for r in got]}")
    total = sum(r.held for r in rows if r.shards == 1)
    whole = next(r for r in rows if r.shards == 1)
    table_rows = []
    met_memory, met_bytes = True, True
    for r in rows:
        state = r.rss - base
        share = state / (whole.rss - base)
        per_param = state / r.held
        # 1.1/S of the unsharded syncer, for the share of the parameters this shard holds (the
        # fragments are whole tensors: a shard may hold a little more or less than 1/S).
        limit = 1.1 * r.held / total
        met_memory = met_memory and share <= limit
        met_bytes = met_bytes and per_param <= 12.0
        table_rows.append(
            (
                f"S={r.shards}",
                str(r.index),
                f"{r.held / 1e6:.1f}M",
                f"{r.rss / 2**20:,.0f} MiB",
                f"{r.peak / 2**20:,.0f} MiB",
                f"{state / 2**20:,.0f} MiB",
                f"{share:.3f}" + ("" if share <= limit else " **over**"),
                f"{limit:.3f}",
                f"{per_param:.1f}",
                f"{r.merge_s * 1e3:.0f} ms",
            )
        )
    busiest = {s: max(r.merge_s for r in rows if r.shards == s) for s in SHARDS}
    identical = len(set(digests.values())) == 1
    table = md_table(
        [
            "shards",
            "shard",
            "params held",
            "RSS",
            "peak RSS",
            "RSS - baseline",
            "of S=1's",
            "limit: 1.1 x its share of the params",
            "bytes / held param",
            "merge s / round",
        ],
        table_rows,
    )
    kill = kill_run(ctx.quick)
    kill_rows = [
        (
            k["shard"],
            str(k["merged"]),
            str(k["taken"]),
            "yes" if k["kept"] else "**no**",
        )
        for k in kill["kills"]
    ]
    kill_table = md_table(
        ["killed", "versions it had merged", "its standby took over with", "every version kept"],
        kill_rows,
    )
    summary = kill["summary"]
    kills_met = (
        kill["lost"] == 0 and all(k["kept"] for k in kill["kills"]) and summary.get("complete")
    )
    body = f"""
Model: {total / 1e6:.0f}M parameters in P={FRAGMENTS} fragments (dModel {cfg.model.width},
nLayers {cfg.model.depth}), {LEARNERS} learners pushing every fragment {rounds} times (quorum
{LEARNERS}, so every configuration merges the same contributions in the same order). Baseline
(a syncer process with a model of a few hundred parameters): {base / 2**20:,.0f} MiB.

{table}

Busiest shard's merge time per round: {", ".join(f"S={s}: {busiest[s] * 1e3:.0f} ms" for s in SHARDS)}
(this machine has 2 cores: beyond S=2 the shards take turns on them).
Parameters after the same pushes, hashed: {"**identical** for S = 1, 2, 4" if identical else "**DIFFERENT**: " + str(digests)}.

Targets: memory per shard (above the process baseline) <= 1.1/S of the unsharded syncer's, for
its share of the parameters: **{"met" if met_memory else "not met"}**; <= 12 bytes per held
parameter: **{"met" if met_bytes else "not met"}**; bit-for-bit the same parameters:
**{"met" if identical else "not met"}**.

What a shard holds per parameter: the float32 value (4 bytes) and the outer Nesterov momentum
(4 bytes); downloads are written from the arrays themselves (payload.py: no encoded copy is
kept between long-polls, as one was until 2026-12-06, 4 bytes more); pushes in flight add
4 bytes per parameter per pending push until their merge. The rest is the allocator's: blocks freed after a merge (decoded
pushes, merged delta, journal entry) that the process has not given back. The syncer maps blocks
of 1 MiB and more on their own and caps glibc at two arenas (syncer/memory.py); with glibc's
defaults a 25M-parameter model held 35.7 bytes per parameter, 17 with them. The peak column includes the
decode of the two learners' pushes of one fragment at a time.

{at_scale(rows, ctx.quick)}

Shard SIGKILL in a local run ({summary.get("tokens", 0):,} tokens, two kills, shards=2, a warm
standby each, checkpoints every 10 minutes so only the journal keeps versions):

{kill_table}

`event=versions_lost` lines: {kill["lost"]}. Run complete: {summary.get("complete")}, final loss
{summary.get("finalEvalLoss")}, goodput {summary.get("goodput")}. Target: 0 versions lost over a
shard SIGKILL: **{"met" if kills_met else "not met"}**.
"""
    return Section(
        name="sharded_syncer",
        title="Sharded syncer: memory and merge time per shard, a shard SIGKILL",
        body=body,
        command=ctx.command,
        config=f"S in {SHARDS}, {total / 1e6:.0f}M parameters, P={FRAGMENTS}, {rounds} rounds",
        quick=ctx.quick,
    )

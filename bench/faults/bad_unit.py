"""One bad unit among four: what it does to a run with and without the syncer's defences.

Four learners on the controlled clock (`bench.lib.decoupled_model.simulate`: the product's merge,
weights, outer step, counter checks, robust screens and quarantine; lock-step learners), phase
locked so that every merge holds all four, as the product's phase lock makes them. The last learner
is bad from the first push on: (a) its delta 9.9x long with cTokens 2^53-1 on cSteps 1, (a') 9.9x
long with honest counters, (b) noise of its delta's norm, (c) its delta with the sign flipped.
Every run is deterministic (same data, seeds and arrival order), so a ratio between two rows is the
setting's effect alone, not run-to-run noise.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.lib.common import BenchContext, Section, log, md_table
from bench.lib.decoupled_model import Bad, Result, Setting, simulate
from bench.lib.training import EVAL_BATCHES, parity_config

# (steps per learner, H)
FULL = (600, 30)
QUICK = (120, 20)
ATTACKS: list[tuple[Bad, str]] = [
    ("scaled", "(a) 9.9x long, cTokens 2^53-1 on cSteps 1"),
    ("long", "(a') 9.9x long, honest counters"),
    ("noise", "(b) noise of the usual norm"),
    ("flipped", "(c) sign flipped"),
]
ATTACK_BOUND = 1.02  # a run with one bad unit ends within 2% of the calm run's loss
CALM_BOUND = 0.005  # the defences move a calm run's loss by at most 0.5%


@dataclass(frozen=True)
class Row:
    name: str
    defended: bool
    result: Result
    ratio: float  # loss / the calm undefended run's


def run(ctx: BenchContext) -> Section:
    steps, h = QUICK if ctx.quick else FULL
    cfg = parity_config(steps, h)
    rows: list[Row] = []
    calm: float | None = None
    for bad, label in [("none", "calm"), *ATTACKS]:
        for defended in (False, True):
            setting = Setting(phases=[0] * 4, bad=bad, defended=defended)
            res = simulate(cfg, steps * 4, setting, EVAL_BATCHES)
            calm = res.loss if calm is None else calm
            row = Row(label, defended, res, res.loss / calm)
            log(
                f"bad_unit {label} defended={defended}: {res.loss:.4f} ({row.ratio:.3f}) {res.defences}"
            )
            rows.append(row)
    table = md_table(
        ["bad unit", "defences", "eval loss", "/ calm", "what the defences did"],
        [
            (
                r.name,
                "on" if r.defended else "off",
                f"{r.result.loss:.4f}",
                f"{r.ratio:.3f}",
                r.result.defences or "-",
            )
            for r in rows
        ],
    )
    calm_on = next(r for r in rows if r.name == "calm" and r.defended)
    attacked = [r for r in rows if r.name != "calm" and r.defended]
    worst = max(attacked, key=lambda r: r.ratio)
    calm_ok = abs(calm_on.ratio - 1) <= CALM_BOUND
    attack_ok = worst.ratio <= ATTACK_BOUND
    body = f"""
{__doc__.split(chr(10), 2)[2].strip() if __doc__ else ""}

Settings: tiny preset, seqLen {cfg.model.context}, batch {cfg.data.batch_size} per learner, H={h},
P={cfg.fragments}, {steps} steps per learner, outer Nesterov {cfg.outer_optimizer.lr}/{cfg.outer_optimizer.momentum};
defences at the product's defaults: counters bounded (`trust`), `merge.robust` clipRatio
{cfg.merge.robust.clip_ratio}, minCosine {cfg.merge.robust.min_cosine}, quarantine after
{cfg.merge.robust.quarantine_after} of {cfg.merge.robust.quarantine_window} merged pushes. A
quarantined learner's later pushes are refused (the product also recreates the unit; a bad unit
stays bad here, so that changes nothing).

{table}

Targets: a calm run with the defences within {CALM_BOUND:.1%} of one without
({calm_on.ratio:.4f}): **{"met" if calm_ok else "not met"}**; with one bad unit, every attack
ends within {ATTACK_BOUND - 1:.0%} of the calm run (worst: {worst.name}, {worst.ratio:.3f}):
**{"met" if attack_ok else "not met"}**.
"""
    return Section(
        name="bad_unit",
        title="One bad unit: counters bounded, outliers screened, quarantine",
        body=body,
        command=ctx.command,
        config=f"4 learners, phase-locked, tiny preset, H={h}, {steps} steps each",
        quick=ctx.quick,
    )

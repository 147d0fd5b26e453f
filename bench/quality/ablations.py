"""What each part of Decoupled DiLoCo is worth, under a controlled clock.

Every row runs `bench.lib.decoupled_model.simulate` (the product's merge, weights, quantization and
outer step; lock-step learners, simulated transport) against data-parallel at the same tokens.
"Spread" phases put the M learners' fragment schedules H/M steps apart, so no two contributions
ever meet in one merge: the arrival pattern of unaligned learners with quorum 1. "Aligned" phases
make every merge hold all M learners: synchronous (streaming) DiLoCo. RDA vs plain mean is ablated
on aligned merges and token weighting on near-aligned ones (with one contribution per merge, as in
the spread rows, both are no-ops); int8/int4 and installing arrivals on top of unsent progress
change one thing of the spread row each. Chaos and mixed speeds are the same model with kills and
half-speed learners.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.lib.common import BenchContext, Section, log, md_table
from bench.lib.decoupled_model import Kill, Result, Setting, simulate
from bench.lib.training import EVAL_BATCHES, data_parallel, parity_config


@dataclass(frozen=True)
class Row:
    name: str
    setting: Setting


def chaos_kills(learners: int, ticks: int, per_learner: int, down: int) -> list[Kill]:
    """`per_learner` kills of each learner, spread evenly over the run and staggered."""
    kills = []
    for m in range(learners):
        for k in range(per_learner):
            tick = int((k + 0.5 + m / learners) * ticks / (per_learner + 0.5))
            kills.append(Kill(m, max(1, tick), down))
    return kills


def rows_m4(steps: int, h: int) -> list[Row]:
    down = max(1, steps // 40)  # each kill costs 2.5% of a learner's run, twice per learner
    # Near-aligned: schedules 0-6 steps apart and a 3-tick grace window, so merges hold two or
    # three learners with different counters (RDA and token weighting only matter there).
    near = [0, 1, 3, 6]
    return [
        Row("aligned (synchronous streaming DiLoCo)", Setting(phases=[0] * 4)),
        Row("aligned, plain mean instead of RDA", Setting(phases=[0] * 4, method="mean")),
        Row("near-aligned + grace", Setting(phases=near, grace=3)),
        Row(
            "near-aligned + grace, token weighting off",
            Setting(phases=near, grace=3, token_weighting=False),
        ),
        Row("spread (decoupled, quorum 1): reference", Setting()),
        Row("spread, int8 deltas", Setting(scheme="int8")),
        Row("spread, int4 deltas", Setting(scheme="int4")),
        Row("spread, install on top of unsent progress", Setting(install="keep-unsent")),
        Row("spread, chaos: 2 kills per learner", Setting(kills=chaos_kills(4, steps, 2, down))),
        Row("spread, speeds 1, 1, 0.5, 0.5", Setting(speeds=[1.0, 1.0, 0.5, 0.5])),
    ]


# (steps per learner at M=4, H, steps per learner at M=8)
FULL = (500, 30, 300)
QUICK = (150, 25, 100)


def run(ctx: BenchContext) -> Section:
    steps, h, steps8 = QUICK if ctx.quick else FULL
    # The ablations were measured with the paper's outer momentum (docs/bench/ablations.md).
    cfg = parity_config(steps, h, outer_momentum=0.9, phase_lock=False)
    results: list[tuple[str, int, float, float, str]] = []

    def record(name: str, m: int, loss: float, ref: float, note: str) -> None:
        log(f"ablation M={m} {name}: eval loss {loss:.4f} ({loss / ref:.3f}) {note}")
        results.append((name, m, loss, loss / ref, note))

    dp4 = data_parallel(cfg, steps)
    record("data-parallel (batch 4 x B)", 4, dp4.loss, dp4.loss, "")
    by_name: dict[str, Result] = {}
    for row in rows_m4(steps, h) if not ctx.quick else rows_m4(steps, h)[::4]:
        res = simulate(cfg, steps * 4, row.setting, EVAL_BATCHES)
        by_name[row.name] = res
        record(row.name, 4, res.loss, dp4.loss, res.note)

    # Equal wall-clock with mixed speeds: the decoupled run's ticks, against synchronous DiLoCo
    # whose barrier makes every learner wait for the slowest (all at half speed).
    mixed = by_name.get("spread, speeds 1, 1, 0.5, 0.5")
    if mixed is not None:
        sync_slow = simulate(
            cfg, steps * 4, Setting(phases=[0] * 4, speeds=[0.5] * 4), EVAL_BATCHES, mixed.ticks
        )
        record(
            f"aligned, all wait for the slowest (same {mixed.ticks} ticks as the row above)",
            4,
            sync_slow.loss,
            dp4.loss,
            sync_slow.note,
        )

    cfg8 = parity_config(steps8, h, outer_momentum=0.9, phase_lock=False)
    dp8 = data_parallel(cfg8, steps8, learners=8)
    record("data-parallel (batch 8 x B)", 8, dp8.loss, dp8.loss, "")
    for row in [
        Row("aligned (synchronous streaming DiLoCo)", Setting(learners=8, phases=[0] * 8)),
        Row("spread (decoupled, quorum 1)", Setting(learners=8)),
    ]:
        res = simulate(cfg8, steps8 * 8, row.setting, EVAL_BATCHES)
        record(row.name, 8, res.loss, dp8.loss, res.note)

    losses = {(m, n): loss for n, m, loss, _, _ in results}
    reading = []
    spread = losses.get((4, "spread (decoupled, quorum 1): reference"))
    chaos = losses.get((4, "spread, chaos: 2 kills per learner"))
    if spread and chaos:
        reading.append(f"chaos / no chaos (spread): {chaos / spread:.3f}")
    slow = [v for (m, n), v in losses.items() if n.startswith("aligned, all wait")]
    if mixed is not None and slow:
        reading.append(
            f"mixed speeds at equal wall-clock, decoupled / synchronous waiting for the slowest: "
            f"{mixed.loss / slow[0]:.3f}"
        )
    table = md_table(
        ["M", "run", "eval loss", "loss / data-parallel", "note"],
        [(m, n, f"{loss:.4f}", f"{r:.3f}", note) for n, m, loss, r, note in results],
    )
    body = f"""
{__doc__.split(chr(10), 2)[2].strip() if __doc__ else ""}

Settings: tiny preset, seqLen {cfg.model.context}, batch {cfg.data.batch_size} per learner, H={h},
P={cfg.fragments}, inner AdamW lr {cfg.inner_optimizer.lr}, outer Nesterov
{cfg.outer_optimizer.lr}/{cfg.outer_optimizer.momentum}, participation scaling on; M=4 rows:
{steps} steps per learner, M=8 rows: {steps8} (shorter than the headline row to keep the suite
within an hour on 2 cores; ratios at short horizons favour data-parallel). Chaos: every learner
killed twice, each time down for {max(1, steps // 40)} ticks and restarted from the global
parameters with fresh AdamW moments (its LR schedule continues, re-warmed). Mixed speeds: two learners step every tick, two every other
tick; at equal tokens the fast ones simply do more of the steps.

{table}

{"; ".join(reading)}.
"""
    return Section(
        name="ablations",
        title="Decoupled DiLoCo ablations (controlled clock)",
        body=body,
        command=ctx.command,
        config=f"tiny preset, M=4 and 8, B={cfg.data.batch_size}, H={h}, P={cfg.fragments}, "
        f"S={steps}/{steps8}, seed {cfg.seed}",
        quick=ctx.quick,
    )

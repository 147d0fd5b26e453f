"""ML parity at equal tokens: decoupled DiLoCo against data-parallel and synchronous DiLoCo on
the same model, data, seed and tokens per learner-step (the three runs of `bench.lib.training`),
at several seeds, with repeated decoupled runs per seed and one on the fixed push schedule.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from diloco_trainer.config import TrainingConfig

from bench.lib.common import BenchContext, Section, interval_text, log, md_table
from bench.lib.plots import axes, finish
from bench.lib.training import (
    EVAL_BATCHES,
    SEEDS,
    M,
    Outcome,
    data_parallel,
    decoupled,
    parity_config,
    sync_diloco,
)


def plot_curves(runs: list[Outcome], path: Path) -> Path:
    """Eval loss against tokens, one line per run."""
    fig, ax = axes((8, 4.5))
    for run in runs:
        if run.curve:
            xs, ys = zip(*sorted(run.curve), strict=True)
            ax.plot(xs, ys, marker="o", markersize=3, label=f"{run.name}: {run.loss:.3f}")
    return finish(
        fig, ax, path, "tokens (all learners)", "held-out eval loss", "ML parity at equal tokens"
    )


@dataclass
class SeedRuns:
    """Every run at one seed: the reference, synchronous DiLoCo and the phase-locked repeats."""

    seed: int
    dp: Outcome
    sync: Outcome
    locked: list[Outcome]

    def ratios(self) -> list[float]:
        return [o.loss / self.dp.loss for o in self.locked]

    def locked_mean(self) -> float:
        return statistics.fmean(self.ratios())


def _logged(out: Outcome, seed: int) -> Outcome:
    log(f"parity seed {seed} {out.name}: eval loss {out.loss:.4f} ({out.seconds:.0f}s) {out.note}")
    log(f"parity seed {seed} {out.name} curve: {out.curve}")
    return out


def runs_at_seed(cfg: TrainingConfig, steps: int, repeats: int) -> SeedRuns:
    # The real-process runs first: they are the most fragile and the ones the section is about.
    locked = [
        _logged(decoupled(cfg, steps, f"decoupled DiLoCo, run {k + 1}"), cfg.seed)
        for k in range(repeats)
    ]
    dp = _logged(data_parallel(cfg, steps), cfg.seed)
    sync = _logged(sync_diloco(cfg, steps, name="synchronous DiLoCo"), cfg.seed)
    return SeedRuns(cfg.seed, dp, sync, locked)


def _joined(xs: list[float]) -> str:
    return ", ".join(f"{x:.3f}" for x in xs)


def run(ctx: BenchContext) -> Section:
    # 4,000 steps per learner: at 2,000, synchronous DiLoCo itself was 1.034 of data-parallel
    # on this model, at 4,000 1.013 (docs/design.md, "How long a horizon").
    steps, h = (300, 25) if ctx.quick else (4000, 30)
    # Several seeds, each with repeated phase-locked runs: a seed moves the init and the data
    # order, a repeat only the timing of merges; a tuning has held on seed 0 and not on another
    # before, and single runs of one seed spread over about 2% (docs/design.md).
    seeds, repeats = ((0, 1), 1) if ctx.quick else (SEEDS, 2)
    results = [runs_at_seed(parity_config(steps, h, seed=seed), steps, repeats) for seed in seeds]
    first = results[0]
    unlocked = _logged(
        decoupled(
            parity_config(steps, h, seed=first.seed, phase_lock=False),
            steps,
            "decoupled DiLoCo, fixed push schedule (phaseLock off)",
        ),
        first.seed,
    )
    png = plot_curves(
        [first.dp, first.sync, *first.locked, unlocked], ctx.plot_path("parity_curves.png")
    )
    rows = []
    for r in results:
        for o in [r.dp, r.sync, *r.locked, *([unlocked] if r is first else [])]:
            rows.append(
                (
                    r.seed,
                    o.name,
                    f"{o.loss:.4f}",
                    f"{o.loss / r.dp.loss:.3f}",
                    f"{o.loss / r.sync.loss:.3f}",
                    f"{o.seconds:.0f}s",
                    o.note,
                )
            )
    table = md_table(
        ["seed", "run", "eval loss", "/ data-parallel", "/ synchronous DiLoCo", "wall", "note"],
        rows,
    )
    locked_means = [r.locked_mean() for r in results]
    sync_ratios = [r.sync.loss / r.dp.loss for r in results]
    vs_sync = [r.locked_mean() * r.dp.loss / r.sync.loss for r in results]
    spreads = [max(r.ratios()) - min(r.ratios()) for r in results]
    ratios = {
        "synchronous DiLoCo / data-parallel": sync_ratios,
        f"decoupled (mean of {repeats} per seed) / data-parallel": locked_means,
        "decoupled / synchronous DiLoCo": vs_sync,
    }
    summary = md_table(
        ["ratio", f"mean over {len(seeds)} seeds", "95% interval (seeds)", "per seed"],
        [
            (name, f"**{statistics.fmean(xs):.3f}**", interval_text(xs), _joined(xs))
            for name, xs in ratios.items()
        ],
    )
    dec = statistics.fmean(locked_means)
    verdict = "met" if dec <= 1.02 else "NOT met"
    horizon = "the quick variant's short horizon" if ctx.quick else "this horizon"
    cfg = parity_config(steps, h)
    outer = cfg.outer_optimizer
    spread_line = ", ".join(
        f"seed {r.seed}: {s:.3f}" for r, s in zip(results, spreads, strict=True)
    )
    body = f"""
M={M} learners, batch B={cfg.data.batch_size} x seqLen {cfg.model.context} each; data-parallel
uses batch {M * cfg.data.batch_size}. {steps} steps per learner (= {steps} data-parallel steps,
equal tokens: {steps * M * cfg.tokens_per_step:,}), H={h}, P={cfg.fragments}, quorum
{cfg.quorum}, grace {cfg.grace.mode} (max {cfg.grace.max_seconds:g} s), inner AdamW lr
{cfg.inner_optimizer.lr} (warmup {cfg.inner_optimizer.warmup_steps}, cosine), outer Nesterov
{outer.lr}/{outer.momentum} (the paper's momentum is 0.9; 0.8 did better here, docs/design.md).
Seeds {", ".join(str(s) for s in seeds)}: a seed sets the initial parameters, the data order and
the held-out batches, so each run is compared with data-parallel at its own seed. The decoupled
runs are real `diloco-syncer` and `diloco-learner` processes with `phaseLock: true`, {repeats}
per seed (they differ in the timing of merges); the fixed staggered schedule runs once, at seed
{first.seed}. Eval: {EVAL_BATCHES} held-out batches. The ablations (RDA vs plain mean, token
weighting, int8/int4, chaos, mixed speeds, M=8) are the next section, under a controlled clock.

{summary}

{table}

![loss curves, seed {first.seed}]({ctx.link(png)})

Target: decoupled M=4 loss / data-parallel <= 1.02: **{verdict}** ({dec:.3f}, the mean over
{len(seeds)} seeds of each seed's mean; 95% interval over the seeds {interval_text(locked_means)})
over {horizon} ({steps} inner steps per learner; short horizons favour data-parallel: the same
settings at 2,000 steps gave synchronous DiLoCo 1.034, docs/design.md). The goal beyond it is
<= 1.00, decoupling at no cost in loss: the sections parity_trend and install look for what
closes the gap.
Data: an 8 MB slice of the corpus, about one pass of it at 4,000 steps. Data-parallel draws its
windows at random from the whole train split; the DiLoCo learners, synchronous and decoupled,
read the syncer's leased shards (interleaved windows, each read once per epoch: docs/design.md,
"Interleaved shards"), the synchronous ones in the order the lease book hands them to learners
of one pace.

Reading: on the fixed schedule the learners' pushes scatter in time, so nearly every merge holds
one learner's delta (see the fragment versions: about one merge per push) and each learner's
progress on a fragment since the previous merge is overwritten by the next. Phase-locked, the
learners push each fragment together and merges hold all of them (about a quarter as many
versions): the decoupled runs then train like synchronous DiLoCo, and what remains is DiLoCo's
own gap at this model size, plus the steps a learner makes on a fragment between its push and
the install of the merge (it waits for the slowest of four processes sharing two cores: "steps
overwritten" in the notes). Spread between the repeats of one seed (largest minus smallest
ratio): {spread_line}.
"""
    return Section(
        name="parity",
        title="ML parity at equal tokens",
        body=body,
        command=ctx.command,
        config=f"tiny preset, M={M}, B={cfg.data.batch_size}, H={h}, P={cfg.fragments}, "
        f"S={steps}, outer {outer.lr}/{outer.momentum}, phaseLock, seeds "
        + ", ".join(str(s) for s in seeds),
        quick=ctx.quick,
    )

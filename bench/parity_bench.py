"""Row 1: ML parity at equal tokens. Same model, data, seed, and tokens per learner-step:

- data-parallel: one model, batch M x B, S steps (synchronous; the reference);
- synchronous DiLoCo: M learners in this process, batch B each, every H inner steps all
  fragments are merged (`merge_fragment`) and stepped by the outer Nesterov SGD (`OuterOptimizer`);
  also the ablations: plain mean vs RDA, int8/int4 quantized deltas vs none;
- decoupled DiLoCo: a real `diloco-syncer` process and M `diloco-learner` processes (fragments
  staggered, quorum, grace, RDA, token weighting), S steps each; the final global parameters are
  pulled from the syncer.

All are evaluated by `eval_loss` on the same held-out batches.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from diloco_trainer.auth import unit_token
from diloco_trainer.config import CompressionConfig, TrainingConfig
from diloco_trainer.data.corpus import train_batches
from diloco_trainer.downlink import Publication
from diloco_trainer.feedback import push_feedback
from diloco_trainer.fragments import pack_fragments
from diloco_trainer.learner.client import SyncerClient
from diloco_trainer.learner.train import (
    init_opt_state,
    make_mesh,
    make_optimizer,
    make_train_step,
    place_params,
    shard_batch,
    step_key,
)
from diloco_trainer.merge import Contribution, merge_fragment
from diloco_trainer.models.gpt import init_params, param_shapes
from diloco_trainer.outer import OuterOptimizer
from diloco_trainer.workload.evaluate import eval_loss

from bench.common import BenchContext, Section, interval_text, log, md_table
from bench.decoupled_model import leased_batches, roundtrip
from bench.live import TOKEN, syncer
from bench.soak_logs import fields

KEY = step_key(0, 0)  # the built-in model's loss draws nothing from its rng

M = 4
EVAL_BATCHES = 16
PARITY_SLICE_BYTES = 8_000_000  # of the corpus: about one pass at 4,000 steps x M learners


def parity_config(
    steps: int,
    inner_steps: int,
    batch: int = 8,
    seq_len: int = 64,
    outer_momentum: float = 0.8,
    phase_lock: bool = True,
    seed: int = 0,
    learners: int = M,
) -> TrainingConfig:
    # Short sequences and small batches keep 4,000 steps x 4 learners within ~10 CPU-minutes per
    # run on 2 cores; the comparison is between schedules, so the absolute size matters less.
    # Outer momentum 0.8 and phase-locked pushes: the settings that came closest to
    # data-parallel (docs/design.md, "Phase-locked pushes"); the paper's momentum is 0.9.
    return TrainingConfig.model_validate(
        {
            "model": {"preset": "tiny", "seqLen": seq_len},
            "data": {"batchSize": batch, "maxBytes": PARITY_SLICE_BYTES},
            "innerSteps": inner_steps,
            "fragments": 4,
            "quorum": 1,
            "phaseLock": phase_lock,
            "innerOptimizer": {"lr": 2e-3, "warmupSteps": 50},
            "outerOptimizer": {"lr": 0.7, "momentum": outer_momentum, "nesterov": True},
            "totalSteps": steps * learners,
            "eval": {"everySeconds": None, "batches": EVAL_BATCHES},
            "checkpoint": {"everySeconds": 600},
            "heartbeatSeconds": 1.0,
            "seed": seed,
        }
    )


CURVE_POINTS = 8  # evaluations along each run for the loss-vs-tokens plot


@dataclass
class Outcome:
    name: str
    loss: float
    seconds: float
    note: str = ""
    curve: list[tuple[int, float]] = field(default_factory=list)  # (tokens, eval loss)
    traffic: Traffic | None = None  # the learners' bytes, for runs with real processes
    # Runs with real processes: the learners' mean share of fragment-steps an install replaced.
    overwritten: float | None = None


@dataclass(frozen=True)
class Traffic:
    """What the learners of a real run sent and received, from their exit lines; received
    leaves out each attempt's join (one full pull of the parameters)."""

    sent: int
    received: int
    tokens: int

    @classmethod
    def of_logs(cls, exits: list[dict[str, str]]) -> Traffic:
        def total(key: str) -> int:
            return sum(int(e[key]) for e in exits)

        received = total("bytes_received") - total("bytes_joined")
        return cls(total("bytes_sent"), received, total("tokens"))


def _curve_due(step: int, steps: int) -> bool:
    return step % max(1, steps // CURVE_POINTS) == 0 and step != steps


_REFERENCES: dict[tuple[str, int, int], Outcome] = {}


def data_parallel(cfg: TrainingConfig, steps: int, learners: int = M) -> Outcome:
    """The reference run. It is deterministic, so one run per config serves every section of
    one bench process (parity, parity_chaos and bytes_loss share their seeds' runs)."""
    key = (cfg.model_dump_json(), steps, learners)
    if key not in _REFERENCES:
        _REFERENCES[key] = _train_data_parallel(cfg, steps, learners)
    return _REFERENCES[key]


def _train_data_parallel(cfg: TrainingConfig, steps: int, learners: int) -> Outcome:
    start = time.perf_counter()
    dp = cfg.model_copy(
        update={"data": cfg.data.model_copy(update={"batch_size": learners * cfg.data.batch_size})}
    )
    mesh = make_mesh()
    opt = make_optimizer(dp.inner_optimizer, steps)
    params = place_params(init_params(dp.model, dp.seed), mesh)
    state = init_opt_state(opt, params, mesh)
    step = make_train_step(opt, mesh)
    batches = train_batches(dp, 0, 1)
    curve = []
    for s in range(1, steps + 1):
        params, state, _, _ = step(params, state, shard_batch(next(batches), mesh), KEY)
        if _curve_due(s, steps):
            host = {k: np.asarray(v) for k, v in params.items()}
            curve.append((s * dp.tokens_per_step, eval_loss(host, cfg, EVAL_BATCHES)))
    loss = eval_loss({k: np.asarray(v) for k, v in params.items()}, cfg, EVAL_BATCHES)
    curve.append((steps * dp.tokens_per_step, loss))
    return Outcome("data-parallel (batch M x B)", loss, time.perf_counter() - start, curve=curve)


def sync_diloco(
    cfg: TrainingConfig,
    steps: int,
    method: str = "rda",
    scheme: str = "none",
    name: str = "",
    downlink: str = "none",
    learners: int = M,
) -> Outcome:
    """Synchronous DiLoCo in this process: pushes quantized with `scheme` (with the config's
    error feedback, `feedback.py`); with a `downlink` scheme the learners install the syncer's
    published copy (compressed steps with error feedback, `downlink.py`) instead of the global
    parameters themselves."""
    start = time.perf_counter()
    mesh = make_mesh()
    opt = make_optimizer(cfg.inner_optimizer, steps)
    step = make_train_step(opt, mesh)
    shapes = param_shapes(cfg.model)
    layout = pack_fragments(shapes, cfg.fragments)
    global_params = init_params(cfg.model, cfg.seed)
    # What the learners hold of each fragment: the copy the syncer publishes (downlink.py).
    published = [Publication(0, {n: global_params[n] for n in frag}) for frag in layout]
    outer = OuterOptimizer(cfg.outer_optimizer.lr, cfg.outer_optimizer.momentum, True)
    outer_states = [outer.init({n: global_params[n] for n in frag}) for frag in layout]
    pushes = [Pusher(scheme, cfg.compression) for _ in range(learners)]
    units: list[list[Any]] = []
    for m in range(learners):
        p = place_params(global_params, mesh)
        units.append([p, init_opt_state(opt, p, mesh), leased_batches(cfg, m, learners)])
    tokens = cfg.tokens_per_step * cfg.inner_steps
    curve = []
    for s in range(1, steps + 1):
        for lr in units:
            lr[0], lr[1], _, _ = step(lr[0], lr[1], shard_batch(next(lr[2]), mesh), KEY)
        if _curve_due(s, steps):
            curve.append(
                (s * learners * cfg.tokens_per_step, eval_loss(global_params, cfg, EVAL_BATCHES))
            )
        if s % cfg.inner_steps and s != steps:
            continue
        hosts = [{k: np.asarray(v) for k, v in lr[0].items()} for lr in units]
        for i, frag in enumerate(layout):
            contribs = [
                Contribution(
                    push(i, {n: published[i].tensors[n] - h[n] for n in frag}),
                    c_steps=cfg.inner_steps,
                    c_tokens=tokens,
                )
                for h, push in zip(hosts, pushes, strict=True)
            ]
            merged = merge_fragment(contribs, method=method)  # type: ignore[arg-type]
            new, outer_states[i] = outer.step(
                {n: global_params[n] for n in frag}, outer_states[i], merged
            )
            global_params.update(new)
            published[i] = _next_publication(
                published[i], new, downlink, cfg.compression.block_size
            )
        held = {n: v for pub in published for n, v in pub.tensors.items()}
        for lr in units:  # overwrite local parameters, keep the inner optimizer state
            lr[0] = place_params(held, mesh)
    loss = eval_loss(global_params, cfg, EVAL_BATCHES)
    curve.append((steps * learners * cfg.tokens_per_step, loss))
    label = name or f"synchronous DiLoCo ({method}, {scheme})"
    return Outcome(label, loss, time.perf_counter() - start, curve=curve)


class Pusher:
    """One learner's pushes as the syncer decodes them: quantized with `scheme` at the config's
    block size, with error feedback when the config asks for it (as `SyncerClient.push`)."""

    def __init__(self, scheme: str, compression: CompressionConfig) -> None:
        self.scheme, self.block = scheme, compression.block_size
        self.feedback = push_feedback(scheme, compression.error_feedback)

    def __call__(self, fragment: int, delta: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        sent = self.feedback.compensated(fragment, delta) if self.feedback else delta
        applied = roundtrip(sent, self.scheme, self.block)
        if self.feedback:
            self.feedback.settle(fragment, sent, applied)
        return applied


def _next_publication(
    pub: Publication, target: dict[str, np.ndarray], scheme: str, block_size: int
) -> Publication:
    """What the learners install next: `target` itself (a float32 downlink), or one compressed
    step towards it with error feedback, as the syncer publishes it."""
    if scheme == "none":
        return Publication(pub.version + 1, dict(target))
    return pub.advance(target, pub.version + 1, scheme, block_size)  # type: ignore[arg-type]


def decoupled(
    cfg: TrainingConfig,
    steps: int,
    name: str = "decoupled DiLoCo (processes, async)",
    learners: int = M,
) -> Outcome:
    start = time.perf_counter()
    with syncer(cfg) as sy:
        config = sy.workdir / "run.yaml"
        logs = [sy.workdir / f"learner-{m}.log" for m in range(learners)]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "diloco_trainer.learner.main",
                    "--config",
                    str(config),
                    "--syncer",
                    sy.url,
                    "--token",
                    unit_token(TOKEN, f"unit-{m}"),
                    "--unit",
                    str(m),
                    "--num-units",
                    str(learners),
                    "--max-steps",
                    str(steps),
                    "--log-level",
                    "INFO",  # ~100 lines a run; the exit line has the overwritten share
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=path.open("wb"),
            )
            for m, path in enumerate(logs)
        ]
        curve = _follow(sy, procs, steps * learners * cfg.tokens_per_step, cfg)
        codes = [p.wait() for p in procs]
        if any(codes):
            tails = [path.read_text()[-500:] for path in logs]
            raise RuntimeError(f"learners exited {codes}: {tails}")
        time.sleep(2.0)  # let the last pushes merge
        client = SyncerClient(sy.url, TOKEN, "bench-eval", 0, "bench")
        try:
            params, versions = client.pull_all()
        finally:
            client.close()
        status = sy.status()
        exits = [_exit_line(path.read_text()) for path in logs]
    loss = eval_loss(params, cfg, EVAL_BATCHES)
    curve.append((status.tokens or 0, loss))
    # The share of each learner's fragment-steps that installs replaced before a push.
    overwritten = statistics.fmean(float(e["overwritten_share"]) for e in exits)
    note = (
        f"fragment versions {versions}, outer step {status.outer_step}, "
        f"steps overwritten {overwritten:.1%}"
    )
    seconds = time.perf_counter() - start
    return Outcome(name, loss, seconds, note, curve, Traffic.of_logs(exits), overwritten)


def _exit_line(learner_log: str) -> dict[str, str]:
    """The key=value fields of a learner's `event=exit` line."""
    found = re.search(r"event=exit (.*)$", learner_log, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"no exit line in the learner log: {learner_log[-500:]}")
    return fields(found.group(1))


def _follow(
    sy: Any, procs: list[subprocess.Popen[bytes]], total_tokens: int, cfg: TrainingConfig
) -> list[tuple[int, float]]:
    """While the learners run: each time the syncer's token count passes the next curve point,
    pull the global parameters and evaluate them here (the learners are not slowed)."""
    curve: list[tuple[int, float]] = []
    step = max(1, total_tokens // CURVE_POINTS)
    client = SyncerClient(sy.url, TOKEN, "bench-curve", 0, "bench")
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(2.0)
            tokens = sy.status().tokens or 0
            if tokens >= step * (len(curve) + 1) and tokens < total_tokens:
                params, _ = client.pull_all()
                curve.append((tokens, eval_loss(params, cfg, EVAL_BATCHES)))
    finally:
        client.close()
    return curve


def plot_curves(runs: list[Outcome], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in runs:
        if run.curve:
            xs, ys = zip(*sorted(run.curve), strict=True)
            ax.plot(xs, ys, marker="o", markersize=3, label=f"{run.name}: {run.loss:.3f}")
    ax.set_xlabel("tokens (all learners)")
    ax.set_ylabel("held-out eval loss")
    ax.set_title("ML parity at equal tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


SEEDS = (0, 1, 2)  # init and data order; every seed is its own data-parallel reference


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
    # order, a repeat only the timing of merges; issue 21 found a tuning that held on seed 0 and
    # not on another, and single runs of one seed spread over about 2% (docs/design.md).
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
                (r.seed, o.name, f"{o.loss:.4f}", f"{o.loss / r.dp.loss:.3f}",
                 f"{o.loss / r.sync.loss:.3f}", f"{o.seconds:.0f}s", o.note)
            )  # fmt: skip
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

![loss curves, seed {first.seed}]({png.relative_to(ctx.out_dir.parent).as_posix()})

Target: decoupled M=4 loss / data-parallel <= 1.02: **{verdict}** ({dec:.3f}, the mean over
{len(seeds)} seeds of each seed's mean; 95% interval over the seeds {interval_text(locked_means)})
over {horizon} ({steps} inner steps per learner; short horizons favour data-parallel: the same
settings at 2,000 steps gave synchronous DiLoCo 1.034, docs/design.md). Issue 21 asks for <= 1.00.
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

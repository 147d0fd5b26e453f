"""The parity model's training runs, at equal tokens, which every loss section reads against:

- data-parallel: one model, batch M x B, S steps (synchronous; the reference);
- synchronous DiLoCo: M learners in this process, batch B each, every H inner steps all
  fragments are merged (`merge_fragment`) and stepped by the outer Nesterov SGD (`OuterOptimizer`);
- decoupled DiLoCo: a real `diloco-syncer` process and M `diloco-learner` processes (fragments
  staggered, quorum, grace, RDA, token weighting), S steps each; the final global parameters are
  pulled from the syncer.

All are evaluated by `eval_loss` on the same held-out batches. `Variant` is the parity setting
with one thing changed (width, learners, budget, seed).
"""

from __future__ import annotations

import statistics
import subprocess
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
from diloco_trainer.config import CompressionConfig, TrainingConfig
from diloco_trainer.data.corpus import train_batches
from diloco_trainer.downlink import Publication, apply_step
from diloco_trainer.feedback import PushFeedback, push_feedback
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

from bench.lib.common import log, two_at_a_time
from bench.lib.decoupled_model import leased_batches, roundtrip
from bench.lib.live import TOKEN, exit_fields, learner_process, syncer
from bench.lib.sparse_topk import TopK

KEY = step_key(0, 0)  # the built-in model's loss draws nothing from its rng

M = 4
EVAL_BATCHES = 16
SEEDS = (0, 1, 2)  # init and data order; every seed is its own data-parallel reference
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
    sparse: TopK | None = None,
    sparse_down: TopK | None = None,
) -> Outcome:
    """Synchronous DiLoCo in this process: pushes quantized with `scheme` (with the config's
    error feedback, `feedback.py`); with a `downlink` scheme the learners install the syncer's
    published copy (compressed steps with error feedback, `downlink.py`) instead of the global
    parameters themselves. `sparse`: top-k pushes instead (bench/lib/sparse_topk.py) with error
    feedback; `sparse_down`: top-k published steps, the published copy's lag their error
    feedback (else the `downlink` scheme's)."""
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
    pushes = [Pusher(scheme, cfg.compression, sparse) for _ in range(learners)]
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
                published[i], new, downlink, cfg.compression.block_size, sparse_down
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

    def __init__(
        self, scheme: str, compression: CompressionConfig, sparse: TopK | None = None
    ) -> None:
        self.scheme, self.block, self.sparse = scheme, compression.block_size, sparse
        self.feedback = (
            PushFeedback() if sparse else push_feedback(scheme, compression.error_feedback)
        )

    def __call__(self, fragment: int, delta: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        sent = self.feedback.compensated(fragment, delta) if self.feedback else delta
        if self.sparse is not None:
            applied = {name: self.sparse.roundtrip(v) for name, v in sent.items()}
        else:
            applied = roundtrip(sent, self.scheme, self.block)
        if self.feedback:
            self.feedback.settle(fragment, sent, applied)
        return applied


def _next_publication(
    pub: Publication,
    target: dict[str, np.ndarray],
    scheme: str,
    block_size: int,
    sparse: TopK | None = None,
) -> Publication:
    """What the learners install next: `target` itself (a float32 downlink), or one compressed
    step towards it with error feedback, as the syncer publishes it."""
    if sparse is not None:
        step = {n: sparse.roundtrip(target[n] - v) for n, v in pub.tensors.items()}
        return Publication(pub.version + 1, apply_step(pub.tensors, step))
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
        procs = [
            learner_process(config, sy.url, m, learners, path, max_steps=steps)
            for m, path in enumerate(logs)
        ]
        curve = _follow(sy, procs, steps * learners * cfg.tokens_per_step, cfg)
        codes = [p.wait() for p in procs]
        if any(codes):
            tails = [path.read_text()[-500:] for path in logs]
            raise RuntimeError(f"learners exited {codes}: {tails}")
        time.sleep(2.0)  # let the last pushes merge
        loss, versions = global_loss(sy.url, cfg)
        status = sy.status()
        exits = [exit_fields(path.read_text()) for path in logs]
    curve.append((status.tokens or 0, loss))
    # The share of each learner's fragment-steps that installs replaced before a push.
    overwritten = statistics.fmean(float(e["overwritten_share"]) for e in exits)
    note = (
        f"fragment versions {versions}, outer step {status.outer_step}, "
        f"steps overwritten {overwritten:.1%}"
    )
    seconds = time.perf_counter() - start
    return Outcome(name, loss, seconds, note, curve, Traffic.of_logs(exits), overwritten)


def global_loss(url: str, cfg: TrainingConfig) -> tuple[float, list[int]]:
    """The eval loss of the global parameters the syncer at `url` holds now (pulled whole, as
    a learner's join does), on the held-out batches every loss section uses; and their
    fragment versions."""
    client = SyncerClient(url, TOKEN, "bench-eval", 0, "bench")
    try:
        params, versions = client.pull_all()
    finally:
        client.close()
    return eval_loss(params, cfg, EVAL_BATCHES), versions


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


BASE_STEPS = 4000
WIDTHS = (32, 64, 128)  # dModel; 128 is the tiny preset's, the parity section's model


@dataclass(frozen=True)
class Variant:
    """The parity setting with one thing changed: learners, budget, width or seed."""

    label: str
    learners: int = M
    steps: int = BASE_STEPS
    d_model: int | None = None  # None: the preset's width
    seed: int = 0

    @property
    def width(self) -> int:
        """dModel as the model resolves it (the preset's where `d_model` is None)."""
        return self.config(1).model.width  # any H: the period does not touch the model

    def config(self, h: int) -> TrainingConfig:
        base = parity_config(self.steps, h, seed=self.seed, learners=self.learners)
        if self.d_model is None:
            return base
        raw = base.model_dump(by_alias=True)
        raw["model"]["dModel"] = self.d_model
        return TrainingConfig.model_validate(raw)


def width_variants(widths: tuple[int, ...], seeds: tuple[int, ...], steps: int) -> list[Variant]:
    return [Variant(f"dModel {d}", steps=steps, d_model=d, seed=s) for d in widths for s in seeds]


def _reference(v: Variant, h: int) -> Outcome:
    return data_parallel(v.config(h), v.steps, v.learners)


def _synchronous(v: Variant, h: int) -> Outcome:
    return sync_diloco(v.config(h), v.steps, name="synchronous DiLoCo", learners=v.learners)


def in_process_runs(
    vs: list[Variant], h: int, section: str, kinds: tuple[str, ...] = ("dp", "sync")
) -> dict[tuple[Variant, str], Outcome]:
    """The in-process runs of every variant (data-parallel, synchronous DiLoCo), two at a time,
    the longest first; each logged under the `section` asking for them."""
    jobs = sorted(
        [(v, kind) for v in dict.fromkeys(vs) for kind in kinds],
        key=lambda j: -j[0].steps * j[0].learners * (2 if j[1] == "dp" else 1),
    )

    def done(key: tuple[Variant, str], out: Outcome) -> None:
        v, kind = key
        log(f"{section} {v.label} seed {v.seed} {kind}: {out.loss:.4f} ({out.seconds:.0f}s)")

    return two_at_a_time(
        {
            (v, kind): partial(_reference if kind == "dp" else _synchronous, v, h)
            for v, kind in jobs
        },
        done,
    )


def with_install(cfg: TrainingConfig, mode: str) -> TrainingConfig:
    """`cfg` with `install: mode` (replace or rebase)."""
    raw = cfg.model_dump(by_alias=True)
    raw["install"] = mode
    return TrainingConfig.model_validate(raw)

"""GPU: learner step MFU on one GPU for the largest preset, and the learner overhead there.

Run it on a machine with a GPU through `bench/speed/gpu.sh`. Without a GPU the section says so.
"""

from __future__ import annotations

import subprocess
import time

import jax
import jax.numpy as jnp
from diloco_trainer.config import ModelConfig, TrainingConfig
from diloco_trainer.data.corpus import train_batches
from diloco_trainer.learner.train import (
    init_opt_state,
    make_mesh,
    make_optimizer,
    make_train_step,
    place_params,
    shard_batch,
)
from diloco_trainer.models.gpt import init_params

from bench.lib.common import BenchContext, Section, md_table
from bench.lib.training import KEY

# Dense bf16 peak FLOP/s by GPU name fragment (vendor data sheets, SXM parts, no sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


def gpu_name() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def flops_per_token(model: ModelConfig, params: int) -> float:
    """Training FLOPs per token: 6 N (forward + backward matmuls over the weights) plus the
    attention score/value matmuls, 12 x layers x context x width (the usual estimate)."""
    return 6.0 * params + 12.0 * model.depth * model.context * model.width


def measure_mfu(batch: int, steps: int) -> tuple[float, float, int]:
    """(tokens/s, MFU, params) of the bare bf16 train step on one GPU, 100m preset."""
    cfg = TrainingConfig.model_validate(
        {"model": {"preset": "100m"}, "data": {"batchSize": batch}, "totalSteps": 100_000}
    )
    mesh = make_mesh(jax.devices()[:1])
    opt = make_optimizer(cfg.inner_optimizer, 100_000)
    host = init_params(cfg.model, 0)
    params = place_params(host, mesh)
    state = init_opt_state(opt, params, mesh)
    step = make_train_step(opt, mesh, compute_dtype=jnp.bfloat16)
    batches = train_batches(cfg, 0, 1)
    for _ in range(3):
        params, state, loss, _ = step(params, state, shard_batch(next(batches), mesh), KEY)
    loss.block_until_ready()
    start = time.perf_counter()
    for _ in range(steps):
        params, state, loss, _ = step(params, state, shard_batch(next(batches), mesh), KEY)
    loss.block_until_ready()
    tps = steps * cfg.tokens_per_step / (time.perf_counter() - start)
    n = sum(v.size for v in host.values())
    name = gpu_name() or ""
    peak = next((p for k, p in PEAK_BF16.items() if k in name), float("nan"))
    return tps, tps * flops_per_token(cfg.model, n) / peak, n


def run(ctx: BenchContext) -> Section:
    platform = jax.devices()[0].platform
    if platform != "gpu":
        body = f"""
**No GPU available in this run** (JAX platform: `{platform}`). The GPU rows come from one
prepared script on a machine with a GPU and CUDA JAX installed:

    bench/speed/gpu.sh      # MFU of the learner step (100m preset, bf16) + learner overhead

It measures the bare train step's tokens/s and MFU (6N + attention FLOPs per token over the
GPU's dense bf16 peak) on one GPU, then the learner / bare-loop ratio as in the overhead section,
and rewrites this section.
"""
        return _section(ctx, body, "-")
    rows = []
    for batch in (8, 16, 32):
        try:
            tps, mfu, n = measure_mfu(batch, 10 if ctx.quick else 30)
        except Exception as exc:  # out of memory at the larger batches ends the sweep
            rows.append((batch, "-", f"failed: {type(exc).__name__}", "-"))
            break
        rows.append((batch, f"{tps:,.0f}", f"{100 * mfu:.1f}%", f"{n / 1e6:.0f}M"))
    from bench.speed import overhead as overhead_section

    overhead = overhead_section.run(ctx)
    body = f"""
GPU: {gpu_name()}. Bare bf16 train step, 100m preset (seqLen 1024), one GPU:

{md_table(["batch", "tokens/s", "MFU", "params"], rows)}

Learner overhead on this machine (tiny preset, as in the overhead section):

{overhead.body}
"""
    return _section(ctx, body, "100m preset, bf16 matmuls, AdamW")


def _section(ctx: BenchContext, body: str, config: str) -> Section:
    return Section(
        name="gpu", title="GPU rows", body=body, command=ctx.command, config=config, quick=ctx.quick
    )

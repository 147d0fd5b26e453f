"""Issue 17 item 5: FSDP inside a unit, on 8 CPU devices (XLA's host-platform device count).

Three runs of the learner's own step program (`build_step_program`, `StepProgram.place`,
`init_opt_state`), each in a subprocess started with 8 fake CPU devices:
- the same GPT, seed and batches, replicated and FSDP: the bytes each device holds of parameters
  and AdamW state (summed over `addressable_shards`), the compiled step's per-device memory
  (XLA's memory analysis: arguments, outputs, temporaries), both loss curves and tokens/s;
- a GPT whose parameters and AdamW state need more than `BUDGET` bytes per device replicated,
  trained FSDP: its measured per-device bytes and its compiled step's per-device memory against
  the budget, and its losses; its replicated step is compiled (from shapes, not run) for the
  same memory analysis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from bench.common import REPO, BenchContext, Section, fmt_bytes, log, md_table

DEVICES = 8
BUDGET = 192 * 2**20  # per-device bytes the "big" model must fit in (state, and the whole step)
SMALL = {"dModel": 256, "nLayers": 4, "nHeads": 4, "seqLen": 128}
BIG = {"dModel": 512, "nLayers": 8, "nHeads": 8, "seqLen": 128}


def _config(model: dict[str, int], mode: str) -> Any:
    from diloco_trainer.config import TrainingConfig

    return TrainingConfig.model_validate(
        {
            "totalSteps": 100_000, "seed": 5, "model": {**model, "vocabSize": 256},
            "data": {"batchSize": DEVICES, "maxBytes": 4_000_000},
            "innerOptimizer": {"lr": 1e-3, "warmupSteps": 5}, "sharding": {"mode": mode},
        }
    )  # fmt: skip


def step_memory(program: Any, cfg: Any) -> dict[str, int] | None:
    """XLA's per-device memory analysis of the compiled train step, compiled from shapes and
    shardings alone (nothing allocated): arguments, outputs and temporaries."""
    import jax
    import numpy as np
    from diloco_trainer.learner.sharding import opt_state_shardings
    from diloco_trainer.learner.train import batch_sharding

    like = program.params_like
    state = jax.eval_shape(program.optimizer.init, like)
    where = opt_state_shardings(program.optimizer, like, program.mesh)
    state_like = jax.tree_util.tree_map(
        lambda s, w: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=w), state, where
    )
    window = (cfg.data.batch_size, cfg.model.context + 1)
    batch = jax.ShapeDtypeStruct(window, np.int32, sharding=batch_sharding(program.mesh))
    analysis = program.train_step.lower(like, state_like, batch).compile().memory_analysis()
    if analysis is None:
        return None
    return {
        "arguments": int(analysis.argument_size_in_bytes),
        "outputs": int(analysis.output_size_in_bytes),
        "temporaries": int(analysis.temp_size_in_bytes),
    }


def compile_only(model: dict[str, int], mode: str) -> dict[str, Any]:
    """The step's per-device memory for a layout, without running it (or allocating it)."""
    from diloco_trainer.learner.loop import build_step_program

    cfg = _config(model, mode)
    return {"mode": mode, "xla_bytes": step_memory(build_step_program(cfg, 1), cfg)}


def measure(model: dict[str, int], mode: str, steps: int) -> dict[str, Any]:
    """Train `steps` steps in this process (8 devices); bytes, memory analysis, losses, tokens/s."""
    import jax
    from diloco_trainer.data.corpus import train_batches
    from diloco_trainer.learner.loop import build_step_program
    from diloco_trainer.learner.sharding import bytes_per_device
    from diloco_trainer.learner.train import init_opt_state, shard_batch
    from diloco_trainer.models.gpt import count_params, init_params

    cfg = _config(model, mode)
    program = build_step_program(cfg, 1)
    host = init_params(cfg.model, cfg.seed)
    params = program.place(host)
    state = init_opt_state(program.optimizer, params, program.mesh)
    held = bytes_per_device(params, state)
    batches = train_batches(cfg, 0, 1)
    batch = shard_batch(next(batches), program.mesh)
    losses, started, timed_from = [], 0.0, min(2, steps - 1)
    for step in range(steps):
        if step == timed_from:
            jax.block_until_ready(params)
            started = time.perf_counter()
        params, state, loss = program.train_step(params, state, batch)
        losses.append(float(loss))  # waits for the step: one in flight, like the bare loop
        batch = shard_batch(next(batches), program.mesh)
    seconds = time.perf_counter() - started
    held_after = bytes_per_device(params, state)
    return {
        "mode": mode,
        "params": count_params(host),
        "devices": jax.device_count(),
        "held_max": max(max(held.values()), max(held_after.values())),
        "held_min": min(min(held.values()), min(held_after.values())),
        "memory_stats": jax.local_devices()[0].memory_stats(),
        "xla_bytes": step_memory(program, cfg),
        "losses": losses,
        "tokens_per_sec": (steps - timed_from) * cfg.tokens_per_step / seconds,
        "replicated_bytes_needed": 3 * sum(a.nbytes for a in host.values()),
    }


def _run_worker(model: str, mode: str, steps: int) -> dict[str, Any]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    out = subprocess.run(
        [sys.executable, "-m", "bench.sharding_bench", model, mode, str(steps)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3600,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _xla(run: dict[str, Any]) -> str:
    x = run["xla_bytes"]
    if x is None:
        return "n/a"
    parts = (x["arguments"], x["outputs"], x["temporaries"])
    return " / ".join(fmt_bytes(n) for n in parts) + f" (sum {fmt_bytes(sum(parts))})"


def _step_total(run: dict[str, Any]) -> float:
    x = run["xla_bytes"]
    return float("nan") if x is None else float(sum(x.values()))


def run(ctx: BenchContext) -> Section:
    steps, big_steps = (10, 4) if ctx.quick else (30, 12)
    log(f"sharding: GPT {SMALL} replicated and fsdp, {steps} steps on {DEVICES} CPU devices")
    rep = _run_worker("small", "replicated", steps)
    fsdp = _run_worker("small", "fsdp", steps)
    log(f"sharding: GPT {BIG} fsdp, {big_steps} steps, budget {fmt_bytes(BUDGET)} per device")
    big = _run_worker("big", "fsdp", big_steps)
    big_replicated = _run_worker("big", "replicated", 0)  # compiled for its memory, not run
    diff = max(abs(a - b) for a, b in zip(rep["losses"], fsdp["losses"], strict=True))
    rows = [
        [
            r["mode"], fmt_bytes(r["held_max"]), f"{r['held_max'] / rep['held_max']:.3f}",
            _xla(r), f"{r['tokens_per_sec']:.0f}", f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}",
        ]
        for r in (rep, fsdp)
    ]  # fmt: skip
    fits = max(big["held_max"], _step_total(big)) <= BUDGET < big["replicated_bytes_needed"]
    body = f"""
Target (issue 17 item 5): an FSDP unit over {DEVICES} CPU devices trains like the replicated unit
at the same seed (the same loss curve within float tolerance) on ~1/{DEVICES} of the per-device
parameter + optimizer bytes, and a model that does not fit a per-device budget replicated trains
sharded.

GPT {SMALL} ({rep["params"]:,} parameters), batch {DEVICES} x {SMALL["seqLen"]} tokens, {steps}
steps, seed 5, default `minShardBytes` (64 KiB: the norm scales stay replicated). Bytes per
device = the largest sum over a device's `addressable_shards` of parameters + AdamW state.
XLA per device = the compiled step's memory analysis (arguments / outputs / temporaries).

{md_table(["mode", "params + opt state per device", "vs replicated", "XLA per device (args / out / temp)", "tokens/s", "loss first -> last"], rows)}

- loss curves: max |replicated - fsdp| over {steps} steps = {diff:.2e}
- jax per-device memory stats on the CPU backend: `{rep["memory_stats"]}` (the CPU client
  keeps none), hence the byte sums above.
- tokens/s: {DEVICES} fake devices share this machine's cores. FSDP is not slower here because
  the replicated unit applies the AdamW update to every parameter on each of the {DEVICES}
  devices, FSDP to an eighth on each; on accelerators the gathers' cost shows instead.
- XLA's temporaries are larger under FSDP: the CPU compiler gathers many layers' weights ahead
  of their use rather than one at a time. Parameters + optimizer state still shrink ~{DEVICES}x;
  the whole step's per-device sum is {_step_total(fsdp) / _step_total(rep):.2f} of the
  replicated one.

Over budget, {fmt_bytes(BUDGET)} per device: GPT {BIG} ({big["params"]:,} parameters).

| | params + opt state per device | XLA per device (args / out / temp) |
|---|---|---|
| replicated (compiled from shapes, not run) | {fmt_bytes(big["replicated_bytes_needed"])} (3 x the parameters) | {_xla(big_replicated)} |
| fsdp (trained {big_steps} steps) | {fmt_bytes(big["held_max"])} (measured) | {_xla(big)} |

FSDP losses over its {big_steps} steps: {", ".join(f"{x:.2f}" for x in big["losses"])}
({big["tokens_per_sec"]:.0f} tokens/s). Fits the budget sharded (state and whole step) and not
replicated: {"yes" if fits else "NO"}.
"""
    return Section(
        name="sharding",
        title="Sharding inside a unit (FSDP on 8 CPU devices)",
        body=body,
        command=ctx.command,
        config=f"GPT {SMALL} and {BIG}, vocab 256, batch {DEVICES}, {DEVICES} host devices",
        quick=ctx.quick,
    )


if __name__ == "__main__":
    name, mode, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sizes = SMALL if name == "small" else BIG
    result = measure(sizes, mode, count) if count > 0 else compile_only(sizes, mode)
    print(json.dumps(result))

"""FSDP inside a unit, on 8 CPU devices (XLA's host-platform device count).

The learner's own step program (`build_step_program`, `StepProgram.place`, `init_opt_state`),
in subprocesses started with 8 fake CPU devices:
- the same GPT, seed and batches, replicated and FSDP, trained side by side in one process: the
  bytes each device holds of parameters and AdamW state (summed over `addressable_shards`), the
  compiled step's per-device memory (XLA's memory analysis: arguments, outputs, temporaries),
  both loss curves and tokens/s;
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

from bench.lib.common import REPO, BenchContext, Section, fmt_bytes, log, md_table

DEVICES = 8
BUDGET = 192 * 2**20  # per-device bytes the "big" model must fit in (state, and the whole step)
SMALL = {"dModel": 256, "nLayers": 4, "nHeads": 4, "seqLen": 128}
BIG = {"dModel": 512, "nLayers": 8, "nHeads": 8, "seqLen": 128}


def _config(model: dict[str, int], mode: str) -> Any:
    from diloco_trainer.config import TrainingConfig

    return TrainingConfig.model_validate(
        {
            "totalSteps": 100_000,
            "seed": 5,
            "model": {**model, "vocabSize": 256},
            "data": {"batchSize": DEVICES, "maxBytes": 4_000_000},
            "innerOptimizer": {"lr": 1e-3, "warmupSteps": 5},
            "sharding": {"mode": mode},
        }
    )


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
    key = jax.eval_shape(lambda: jax.random.key(0))
    lowered = program.train_step.lower(like, state_like, batch, key)
    analysis = lowered.compile().memory_analysis()
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


class _Unit:
    """One layout of the model, trained a step at a time on batches it is given."""

    def __init__(self, model: dict[str, int], mode: str) -> None:
        from diloco_trainer.learner.loop import build_step_program
        from diloco_trainer.learner.sharding import bytes_per_device
        from diloco_trainer.learner.train import init_opt_state
        from diloco_trainer.models.gpt import init_params

        self.mode, self.cfg = mode, _config(model, mode)
        self.program = build_step_program(self.cfg, 1)
        self.host = init_params(self.cfg.model, self.cfg.seed)
        self.params = self.program.place(self.host)
        self.state = init_opt_state(self.program.optimizer, self.params, self.program.mesh)
        self.held = bytes_per_device(self.params, self.state)
        self.losses: list[float] = []
        self.seconds, self.timed_steps = 0.0, 0

    def step(self, batch: Any, timed: bool) -> None:
        from diloco_trainer.learner.train import shard_batch, step_key

        start = time.perf_counter()
        sharded = shard_batch(batch, self.program.mesh)
        key = step_key(self.cfg.seed, len(self.losses))
        self.params, self.state, loss, _ = self.program.train_step(
            self.params, self.state, sharded, key
        )
        self.losses.append(float(loss))  # waits for the step
        if timed:
            self.seconds += time.perf_counter() - start
            self.timed_steps += 1

    def result(self) -> dict[str, Any]:
        import jax
        from diloco_trainer.learner.sharding import bytes_per_device
        from diloco_trainer.models.gpt import count_params

        held_after = bytes_per_device(self.params, self.state)
        return {
            "mode": self.mode,
            "params": count_params(self.host),
            "devices": jax.device_count(),
            "held_max": max(max(self.held.values()), max(held_after.values())),
            "memory_stats": jax.local_devices()[0].memory_stats(),
            "xla_bytes": step_memory(self.program, self.cfg),
            "losses": self.losses,
            "tokens_per_sec": self.timed_steps * self.cfg.tokens_per_step / self.seconds,
            "replicated_bytes_needed": 3 * sum(a.nbytes for a in self.host.values()),
        }


def measure(model: dict[str, int], modes: list[str], steps: int) -> list[dict[str, Any]]:
    """Train each layout `steps` steps in this process (8 devices) on the same batches, step by
    step in alternation (the order flipping every step) so machine noise hits them alike; the
    first two steps (compiling) are not timed."""
    from diloco_trainer.data.corpus import train_batches

    units = [_Unit(model, mode) for mode in modes]
    batches = train_batches(units[0].cfg, 0, 1)
    for step in range(steps):
        batch = next(batches)
        for unit in units if step % 2 == 0 else units[::-1]:
            unit.step(batch, timed=step >= min(2, steps - 1))
    return [unit.result() for unit in units]


def _run_worker(model: str, modes: str, steps: int) -> list[dict[str, Any]]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    out = subprocess.run(
        [sys.executable, "-m", "bench.speed.sharding", model, modes, str(steps)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3600,
        check=True,
    )
    result: list[dict[str, Any]] = json.loads(out.stdout.strip().splitlines()[-1])
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
    rep, fsdp = _run_worker("small", "replicated,fsdp", steps)
    log(f"sharding: GPT {BIG} fsdp, {big_steps} steps, budget {fmt_bytes(BUDGET)} per device")
    (big,) = _run_worker("big", "fsdp", big_steps)
    (big_replicated,) = _run_worker("big", "replicated", 0)  # compiled for its memory, not run
    diff = max(abs(a - b) for a, b in zip(rep["losses"], fsdp["losses"], strict=True))
    rows = [
        [
            r["mode"],
            fmt_bytes(r["held_max"]),
            f"{r['held_max'] / rep['held_max']:.3f}",
            _xla(r),
            f"{r['tokens_per_sec']:.0f}",
            f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}",
        ]
        for r in (rep, fsdp)
    ]
    fits = max(big["held_max"], _step_total(big)) <= BUDGET < big["replicated_bytes_needed"]
    body = f"""
Target: an FSDP unit over {DEVICES} CPU devices trains like the replicated unit
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
- tokens/s: both layouts trained in one process, step by step in alternation on the same
  batches (fsdp / replicated = {fsdp["tokens_per_sec"] / rep["tokens_per_sec"]:.2f}). The {DEVICES}
  fake devices share this machine's cores: FSDP adds gathers and reduce-scatters, while the
  replicated unit runs the AdamW update for every parameter on each device; what this ratio
  would be on accelerators is not measured here.
- XLA's temporaries are larger under FSDP: gathered weights and gradients before their
  reduce-scatter live inside the step, and how many at once is up to XLA's scheduler (not
  inspected here). Parameters + optimizer state shrink ~{DEVICES}x; the whole step's per-device
  sum is {_step_total(fsdp) / _step_total(rep):.2f} of the replicated one.

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
    name, modes, count = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
    sizes = SMALL if name == "small" else BIG
    if count > 0:
        print(json.dumps(measure(sizes, modes, count)))
    else:
        print(json.dumps([compile_only(sizes, mode) for mode in modes]))

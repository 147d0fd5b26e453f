"""Lock-step streaming DiLoCo for any checked workload: M learners (vmapped), P staggered
fragments every H steps, every merge holding all M deltas (what the local runtime's merges held),
the product's merge + Nesterov outer step, installs (overwrite) `delay` steps after the push."""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from diloco_trainer.config import TrainingConfig
from diloco_trainer.fragments import first_due_step, pack_fragments
from diloco_trainer.learner.train import make_optimizer
from diloco_trainer.merge import Contribution
from diloco_trainer.outer import OuterOptimizer, merge_and_step
from diloco_trainer.workload.check import Workload, prepare
from diloco_trainer.workload.evaluate import Evaluator


def run(
    cfg: TrainingConfig,
    units: int,
    steps_per_unit: int,
    delay: int,
    log_every: int,
    clip: float | None = None,
) -> dict[str, Any]:
    w = prepare(cfg)
    loss_fn = w.flat_loss()
    opt = make_optimizer(cfg.inner_optimizer, steps_per_unit)
    init = w.initial_params()
    layout = pack_fragments(w.shapes, cfg.fragments)
    h, P = cfg.inner_steps, len(layout)
    params = {k: jnp.stack([jnp.asarray(v)] * units) for k, v in init.items()}
    state = jax.vmap(opt.init)(params)

    def one(p: Any, st: Any, batch: Any, key: jax.Array) -> tuple[Any, Any, jax.Array]:
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, batch, key)
        updates, st = opt.update(grads, st, p)
        return optax.apply_updates(p, updates), st, loss

    step_all = jax.jit(jax.vmap(one))
    feeds = [iter_shards(w, cfg, u, units) for u in range(units)]
    oc = cfg.outer_optimizer
    outer = OuterOptimizer(oc.lr, oc.momentum, oc.nesterov, oc.momentum_per == "round")
    glob = {k: np.array(v) for k, v in init.items()}
    ostate = [outer.init({n: glob[n] for n in f}) for f in layout]
    evaluator = Evaluator(w, cfg)
    curve, ratios, pending = [], [], []
    key = jax.random.key(cfg.seed)
    losses = None
    for step in range(1, steps_per_unit + 1):
        batch = jax.tree.map(lambda *xs: np.stack(xs), *[next(f) for f in feeds])
        keys = jax.random.split(jax.random.fold_in(key, step), units)
        params, state, losses = step_all(params, state, batch, keys)
        for p, frag in enumerate(layout):
            first = first_due_step(p, h, P)
            if step >= first and (step - first) % h == 0:
                contribs = []
                for u in range(units):
                    delta = {n: glob[n] - np.asarray(params[n][u]) for n in frag}
                    contribs.append(Contribution(delta, h, h * w.tokens_per_step))
                before = {n: glob[n] for n in frag}
                new, ostate[p] = merge_and_step(
                    outer,
                    before,
                    ostate[p],
                    contribs,
                    cfg.merge.method,
                    cfg.merge.token_weighting,
                    1.0,
                )
                moved = math.sqrt(sum(float(np.sum((new[n] - before[n]) ** 2)) for n in frag))
                size = math.sqrt(sum(float(np.sum(before[n] ** 2)) for n in frag))
                push = np.mean(
                    [math.sqrt(sum(float(np.sum(c.delta[n] ** 2)) for n in frag)) for c in contribs]
                )
                ratios.append((step, p, moved / max(size, 1e-12), push / max(size, 1e-12)))
                glob.update({k: np.array(v) for k, v in new.items()})
                pending.append((step + delay, p, {n: glob[n] for n in frag}))
        for item in [x for x in pending if x[0] <= step]:
            pending.remove(item)
            for n, v in item[2].items():
                params[n] = params[n].at[:].set(jnp.asarray(v))
        if step % log_every == 0 or step == steps_per_unit:
            curve.append((step, round(evaluator(glob, 8), 3), round(float(jnp.mean(losses)), 3)))
    return {
        "final": curve[-1][1],
        "curve": curve,
        "max_step_ratio": max(r[2] for r in ratios),
        "max_push_ratio": max(r[3] for r in ratios),
        "ratios_tail": [tuple(round(x, 3) for x in r) for r in ratios[-4:]],
    }


def iter_shards(w: Workload, cfg: TrainingConfig, unit: int, units: int) -> Iterator[Any]:
    epoch = 0
    while True:
        for shard in range(unit, cfg.data.shards, units):
            yield from w.source(
                shard,
                cfg.data.shards,
                seed=cfg.seed * 1000 + epoch,
                batch_size=cfg.data.batch_size,
                split="train",
                position=0,
            )
        epoch += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--units", type=int, default=3)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--delay", type=int, default=2)
    ap.add_argument("--model", default="build")
    ap.add_argument("--data", default="batches")
    ap.add_argument("--model-args", default="{}")
    ap.add_argument("--data-args", default="{}")
    ap.add_argument("--set", default="{}")
    ap.add_argument("--every", type=int, default=50)
    a = ap.parse_args()
    training: dict[str, Any] = {
        "seed": a.seed,
        "totalSteps": a.steps * a.units,
        "model": {"entrypoint": f"outside_lm:{a.model}", "args": json.loads(a.model_args)},
        "data": {
            "entrypoint": f"outside_lm:{a.data}",
            "args": json.loads(a.data_args),
            "batchSize": 32,
        },
    }
    for k, v in json.loads(a.set).items():
        training[k] = (
            {**training[k], **v} if isinstance(v, dict) and isinstance(training.get(k), dict) else v
        )
    cfg = TrainingConfig.model_validate(training)
    t = time.time()
    out = run(cfg, a.units, a.steps, a.delay, a.every)
    out["seconds"] = round(time.time() - t, 1)
    print(
        "SIM "
        + json.dumps(
            {
                "seed": a.seed,
                "model": a.model,
                "margs": a.model_args,
                "dargs": a.data_args,
                "set": a.set,
                **out,
            }
        )
    )


if __name__ == "__main__":
    main()

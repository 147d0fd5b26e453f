"""One in-process run: a syncer on a loopback port and M learner threads, the run's defaults
except the outside model and data; prints the global model's held-out loss over time.

    PYTHONPATH=docs/experiments/2026-12-04-outside-model-divergence JAX_PLATFORMS=cpu \
        .venv/bin/python docs/experiments/2026-12-04-outside-model-divergence/run_inprocess.py \
        --seed 0 --tokens 1536000

Run from the repository root (it borrows the tests' in-process syncer, `LiveSyncer`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

from diloco_trainer.auth import unit_token
from diloco_trainer.config import TrainingConfig
from diloco_trainer.learner.loop import LearnerOptions, run_learner
from diloco_trainer.syncer.core import Syncer
from diloco_trainer.workload.evaluate import eval_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.trainer.syncer.test_syncer import TOKEN, LiveSyncer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--units", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1_536_000)
    ap.add_argument("--set", default="{}", help="JSON merged into the training block")
    ap.add_argument("--model-args", default="{}")
    ap.add_argument("--every", type=float, default=3.0)
    ap.add_argument("--model", default="build")
    ap.add_argument("--data", default="batches")
    args = ap.parse_args()
    training: dict[str, Any] = {
        "seed": args.seed,
        "totalTokens": args.tokens,
        "model": {"entrypoint": "outside_lm:" + args.model, "args": json.loads(args.model_args)},
        "data": {"entrypoint": "outside_lm:" + args.data, "batchSize": 32},
        "eval": {"everySeconds": None},
    }
    for key, value in json.loads(args.set).items():
        if isinstance(value, dict) and isinstance(training.get(key), dict):
            training[key] = {**training[key], **value}
        else:
            training[key] = value
    cfg = TrainingConfig.model_validate(training)
    logging.basicConfig(level=logging.WARNING)
    live = LiveSyncer(Syncer(cfg, TOKEN, run="outside", store=None, eval_fn=None))
    curve: list[tuple[float, int, float]] = []
    done = threading.Event()
    started = time.monotonic()

    def watch() -> None:
        while not done.wait(args.every):
            params, versions = live.client("observer").pull_all()
            curve.append((time.monotonic() - started, sum(versions), eval_loss(params, cfg, 8)))
            print(f"t={curve[-1][0]:.0f}s versions={versions} loss={curve[-1][2]:.3f}", flush=True)

    results: list[Any] = [None] * args.units

    def learner(u: int) -> None:
        opts = LearnerOptions(
            syncer=live.url,
            token=unit_token(TOKEN, f"unit-{u}"),
            unit=u,
            num_units=args.units,
            unit_name=f"unit-{u}",
            log_every=10_000,
        )
        results[u] = run_learner(cfg, opts)

    threading.Thread(target=watch, daemon=True).start()
    threads = [threading.Thread(target=learner, args=(u,)) for u in range(args.units)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    params, versions = live.client("observer").pull_all()
    final = eval_loss(params, cfg, 16)
    live.close()
    out = {
        "seed": args.seed,
        "set": args.set,
        "model_args": args.model_args,
        "final": final,
        "min": min((c[2] for c in curve), default=final),
        "versions": versions,
        "steps": [r.steps for r in results],
        "learner_loss": [r.final_loss for r in results],
        "seconds": time.monotonic() - started,
        "curve": [round(c[2], 3) for c in curve],
    }
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

"""The syncer's merge + outer step vs a numpy memory copy of the same bytes.

The merge of one fragment must at least read every learner's delta once; a numpy copy of those
bytes is the fastest way this machine can touch them, so copy time / merge time is the share of
the physical limit the syncer reaches. Both are timed in alternation in the same process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from diloco_trainer.config import ModelConfig
from diloco_trainer.fragments import fragment_sizes, pack_fragments
from diloco_trainer.merge import Contribution, merge_outer_gradient
from diloco_trainer.models.gpt import param_shapes
from diloco_trainer.outer import OuterOptimizer
from diloco_trainer.syncer.fragment import leaf_norms

from bench.lib.common import BenchContext, Section, interleaved, log, md_table, median

LEARNERS = 8
FRAGMENTS = 4
# Transformer shapes of about 10M and 100M parameters (byte vocabulary, the repo's model).
SIZES: dict[str, ModelConfig] = {
    "10M": ModelConfig(preset="small", d_model=384, n_layers=6, n_heads=6, seq_len=256),
    "100M": ModelConfig(preset="100m", d_model=768, n_layers=14, n_heads=12, seq_len=1024),
}


@dataclass
class Measured:
    label: str
    params: int
    method: str
    merge_s: float
    copy_s: float
    outer_share: float  # fraction of merge_s spent in the outer optimizer step

    @property
    def bytes_in(self) -> int:
        return LEARNERS * self.params * 4

    @property
    def ratio(self) -> float:
        return self.copy_s / self.merge_s


def _bench_size(label: str, model: ModelConfig, rounds: int) -> list[Measured]:
    shapes = param_shapes(model)
    layout = pack_fragments(shapes, FRAGMENTS)
    total = sum(fragment_sizes(shapes, layout))
    biggest = max(fragment_sizes(shapes, layout))
    rng = np.random.default_rng(0)
    # One pool of random deltas per learner, as large as the biggest fragment; every fragment's
    # leaves are views into it (the merge reads them exactly as it would fresh arrays).
    pools = [rng.standard_normal(biggest, dtype=np.float32) * 1e-3 for _ in range(LEARNERS)]
    sink = np.empty(biggest, dtype=np.float32)

    def views(pool: np.ndarray, names: list[str]) -> dict[str, np.ndarray]:
        out, off = {}, 0
        for n in names:
            size = int(np.prod(shapes[n]))
            out[n] = pool[off : off + size].reshape(shapes[n])
            off += size
        return out

    frags = []
    for names in layout:
        # Each delta's leaf norms as the syncer has them: measured when the push was decoded.
        contribs = [
            Contribution(
                delta,
                c_steps=50,
                c_tokens=50 * 4096 * (1 + m % 3),
                norms=leaf_norms(delta),
            )
            for m, delta in enumerate(views(pool, names) for pool in pools)
        ]
        params = {n: v.copy() for n, v in views(pools[0], names).items()}
        frags.append((names, contribs, params))
    outer = OuterOptimizer(0.7, 0.9, True)
    states = [outer.init(p) for _, _, p in frags]

    split: dict[str, list[float]] = {"merge": [], "outer": []}

    def merge_round(method: str) -> Callable[[], None]:
        def go() -> None:
            for i, (names, contribs, params) in enumerate(frags):
                t0 = time.perf_counter()
                # The syncer's `merge_and_step`, in its two parts to time them apart.
                grad = merge_outer_gradient(contribs, method)  # type: ignore[arg-type]
                t1 = time.perf_counter()
                # The new params replace the old, as in the syncer: the next step reads the
                # previous step's output buffers, not the numpy arrays of the first round.
                new_params, states[i] = outer.step_gradient(params, states[i], grad)
                frags[i] = (names, contribs, new_params)
                split["merge"].append(t1 - t0)
                split["outer"].append(time.perf_counter() - t1)

        return go

    def copy_round() -> None:
        for names, _, _ in frags:
            size = sum(int(np.prod(shapes[n])) for n in names)
            for pool in pools:
                np.copyto(sink[:size], pool[:size])

    out = []
    for method in ("rda", "mean"):
        merge = merge_round(method)
        merge()  # compile the outer step's jit for every fragment shape
        split["merge"].clear()
        split["outer"].clear()
        times = interleaved([copy_round, merge], rounds)
        outer_share = sum(split["outer"]) / (sum(split["outer"]) + sum(split["merge"]))
        m = Measured(label, total, method, median(times[1]), median(times[0]), outer_share)
        log(f"syncer {label} {method}: merge {m.merge_s:.3f}s copy {m.copy_s:.3f}s")
        out.append(m)
    return out


def run(ctx: BenchContext) -> Section:
    rounds = 3 if ctx.quick else 7
    results: list[Measured] = []
    for label, model in SIZES.items():
        results += _bench_size(label, model, rounds)
    rows = [
        (
            m.label,
            f"{m.params / 1e6:.1f}M",
            m.method,
            f"{m.merge_s * 1e3:.0f} ms",
            f"{m.copy_s * 1e3:.0f} ms",
            f"{m.bytes_in / m.merge_s / 1e9:.2f} GB/s",
            f"{m.bytes_in / m.copy_s / 1e9:.2f} GB/s",
            f"**{100 * m.ratio:.0f}%**",
            f"{100 * m.outer_share:.0f}%",
        )
        for m in results
    ]
    table = md_table(
        [
            "model",
            "params",
            "merge",
            "merge + outer (all fragments)",
            "numpy copy of the same bytes",
            "merge bandwidth",
            "copy bandwidth",
            "merge / copy bandwidth",
            "time in outer step",
        ],
        rows,
    )
    rda_10m = [m for m in results if m.method == "rda" and m.label == "10M"]
    verdict = "met" if all(m.ratio >= 0.50 for m in rda_10m) else "NOT met"
    body = f"""
One outer round = every fragment merged from {LEARNERS} learners' float32 deltas
(`merge_outer_gradient`: weights c_tokens²/c_steps, RDA per leaf, embeddings plainly averaged)
and stepped by the outer Nesterov SGD (`OuterOptimizer.step_gradient`, jitted), for
P={FRAGMENTS} fragments: the syncer's `merge_and_step`, timed in its two parts. The limit:
`np.copyto` of the same {LEARNERS} x params x 4 bytes. Median of {rounds} rounds, copy and merge
alternating. Bandwidth = learner bytes read / time.

{table}

Target: merge + outer step >= 50% of memory-copy bandwidth at 10M with RDA, the
default: **{verdict}**.
Each delta is read once: its leaf norms come with it, as the syncer measures them when it
decodes the push (here: `leaf_norms`, before timing), and each block of the merged leaf is built
from all deltas (a scale and an add each, on the calling thread) while it is in cache. The RDA
radius and the participation share are applied in the step, which reads the merged leaves anyway.
"time in outer step" is the share spent in the jitted Nesterov step (one transfer of the packed
merged leaves, the params it returned last round reused as they are); the rest is the merge.
The copy reads each byte once and writes it once. This machine's cores are shared with other
jobs, so absolute times swing between runs; the ratio is the figure to read.
"""
    return Section(
        name="syncer",
        title="Syncer: merge + outer step vs memory copy",
        body=body,
        command=ctx.command,
        config=f"{LEARNERS} learners, P={FRAGMENTS}, models "
        + ", ".join(
            f"{k} (dModel {v.width}, nLayers {v.depth}, seqLen {v.context})"
            for k, v in SIZES.items()
        ),
        quick=ctx.quick,
    )
